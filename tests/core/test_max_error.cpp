// The numeric tests' error measure (tests/common/max_error.hpp): a NaN, an
// unmatched infinity and a length mismatch must all read as failures, where
// a running std::max of |got - want| would keep a NaN out of the maximum.

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "cpdispatch/float16.hpp"
#include "../common/max_error.hpp"

namespace {

using cpdispatch::testing::max_error;
using cpdispatch::testing::MaxError;
using cpdispatch::testing::within_twice;

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double nan = std::numeric_limits<double>::quiet_NaN();

TEST(MaxError, LargestDifferenceAndLargestReference) {
  const std::vector<float> got{1.0f, 2.5f, -3.0f};
  const std::vector<double> want{1.0, 2.0, -4.0};
  const MaxError e = max_error(got, want);
  EXPECT_EQ(e.diff, 1.0);
  EXPECT_EQ(e.scale, 4.0);
  EXPECT_EQ(e.relative(), 0.25);
  EXPECT_EQ(max_error(std::vector<double>{0.5}, std::vector<double>{0.0}).relative(), 0.5);  // all-zero reference: the difference itself
  EXPECT_EQ(max_error(std::vector<double>{}, std::vector<double>{}).relative(), 0.0);
}

TEST(MaxError, NanOnEitherSideIsAnInfiniteError) {
  // The NaN first, then a finite difference: a running std::max would end at 2.
  EXPECT_EQ(max_error(std::vector<double>{nan, 3.0}, std::vector<double>{1.0, 1.0}).diff, inf);
  EXPECT_EQ(max_error(std::vector<double>{1.0, 3.0}, std::vector<double>{nan, 1.0}).diff, inf);
  EXPECT_EQ(max_error(std::vector<double>{nan}, std::vector<double>{nan}).diff, inf);
  EXPECT_EQ(max_error(std::vector<double>{nan}, std::vector<double>{1.0}).relative(), inf);
}

TEST(MaxError, OnlyMatchingInfinitiesAgree) {
  EXPECT_EQ(max_error(std::vector<double>{-inf, 1.0}, std::vector<double>{-inf, 1.0}).diff, 0.0);
  EXPECT_EQ(max_error(std::vector<double>{-inf, 1.0}, std::vector<double>{-inf, 1.0}).scale, 1.0);  // the infinity is no magnitude
  EXPECT_EQ(max_error(std::vector<double>{inf}, std::vector<double>{1.0}).diff, inf);
  EXPECT_EQ(max_error(std::vector<double>{1.0}, std::vector<double>{-inf}).diff, inf);
  EXPECT_EQ(max_error(std::vector<double>{inf}, std::vector<double>{-inf}).diff, inf);
}

TEST(MaxError, LengthMismatchFailsWithBothLengths) {
  const std::vector<double> two{1.0, 2.0}, three{1.0, 2.0, 3.0};
  MaxError e;
  EXPECT_NONFATAL_FAILURE(e = max_error(two, three), "got 2 values, want 3");
  EXPECT_EQ(e.diff, inf);
}

TEST(MaxError, SixteenBitElementsAndPointerSpans) {
  const std::vector<cpdispatch::bfloat16> got{cpdispatch::bfloat16(1.5f), cpdispatch::bfloat16(std::nanf(""))};
  const double want[2] = {1.0, 1.0};
  EXPECT_EQ(max_error(std::span(got.data(), 1), std::span(want, 1)).diff, 0.5);
  EXPECT_EQ(max_error(got, std::span(want, 2)).diff, inf);
  EXPECT_EQ(max_error(std::vector<cpdispatch::float16>{cpdispatch::float16(-2.0f)}, std::span(want, 1)).diff, 3.0);
}

TEST(MaxError, PartsCombineWithoutLosingAnInfinity) {
  MaxError total = max_error(std::vector<double>{nan}, std::vector<double>{1.0});
  total.add(max_error(std::vector<double>{5.0}, std::vector<double>{1.0}));
  EXPECT_EQ(total.diff, inf);
  EXPECT_EQ(total.scale, 1.0);
}

TEST(MaxError, WithinTwiceNeedsAFiniteBaseline) {
  EXPECT_TRUE(within_twice(1e-3, 1e-3));
  EXPECT_TRUE(within_twice(1e-7, 0.0));  // the slack covers a baseline that happens to be exact
  EXPECT_FALSE(within_twice(3e-3, 1e-3));
  EXPECT_FALSE(within_twice(inf, 1e-3));
  EXPECT_FALSE(within_twice(nan, 1e-3));
  EXPECT_FALSE(within_twice(inf, inf));  // a NaN in both runs
}

}  // namespace
