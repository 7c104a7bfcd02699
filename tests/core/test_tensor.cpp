// Tensor: rows of tensors with a zero extent, zero-filled storage that copies
// and compares by value.
#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"

namespace {

using cpdispatch::Tensor;

TEST(Tensor, RowOfATensorWithNoRowsIsAnErrorNotADivisionByZero) {
  const Tensor<std::int64_t> none({0, 5});
  EXPECT_EQ(none.row_size(), 5u);
  EXPECT_THROW((void)none.row(0), cpdispatch::invalid_input);
  Tensor<std::int64_t> none3({0, 2, 3});
  EXPECT_THROW((void)none3.row(0), cpdispatch::invalid_input);
}

TEST(Tensor, RowsWithAZeroInnerExtentAreEmpty) {
  Tensor<std::int64_t> t({3, 0});
  EXPECT_EQ(t.numel(), 0u);
  EXPECT_TRUE(t.row(2).empty());
  EXPECT_THROW((void)t.row(3), cpdispatch::invalid_input);
}

TEST(Tensor, RowsSpanEveryElementWithTheirFirstIndex) {
  Tensor<int> t({2, 2, 3});
  for (std::size_t i = 0; i < t.numel(); ++i) t.flat()[i] = static_cast<int>(i);
  EXPECT_EQ(std::vector<int>(t.row(1).begin(), t.row(1).end()), (std::vector<int>{6, 7, 8, 9, 10, 11}));
}

TEST(Tensor, StorageStartsZeroAndCopiesByValue) {
  Tensor<double> a({4, 3});
  for (double v : a.flat()) EXPECT_EQ(v, 0.0);
  a(1, 2) = 5.0;
  Tensor<double> b = a;  // a deep copy
  EXPECT_EQ(a, b);
  b(1, 2) = 6.0;
  EXPECT_EQ(a(1, 2), 5.0);
  EXPECT_FALSE(a == b);
  Tensor<double> c = std::move(b);
  EXPECT_EQ(c(1, 2), 6.0);
  c = a;
  EXPECT_EQ(c, a);
  const Tensor<int> filled({2, 2}, 7);
  EXPECT_EQ(filled.values(), (std::vector<int>{7, 7, 7, 7}));
}

}  // namespace
