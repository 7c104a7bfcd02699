// HostAttentionKernel's invariant mode: out, lse, dq and the exact sums of
// dk and dv bitwise the same for every split of a document on the grid (query
// shards attended in separate calls, as context parallelism does; key groups
// cut into several entries; rows at other buffer offsets; documents at other
// grid phases), every thread count and block size; accurate against the
// double-precision reference; refusals of bad grids and non-finite inputs.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "invariant_splits.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/error.hpp"

#ifdef CPDISPATCH_ATTENTION_CBLAS
#define INVARIANT_SUITE InvariantHostKernelCblas
#else
#define INVARIANT_SUITE InvariantHostKernel
#endif

namespace cpdispatch::testing {
namespace {

constexpr double tolerance = 1e-5;

/// HostAttentionKernel's invariant calls, as run_split takes them.
auto host_calls(HostAttentionKernel& kernel) {
  return [&kernel]<class E>(const AttentionShape& s, const InvariantGrid& g, const std::vector<AttentionEntry>& entries, const std::vector<E>& q,
                            const std::vector<E>& k, const std::vector<E>& v, const std::vector<E>& dout, std::vector<E>& out, std::vector<float>& lse,
                            std::vector<E>& dq, std::vector<std::int64_t>& dk, std::vector<std::int64_t>& dv, KvGradientExponents ex) {
    kernel.forward_invariant<E>(s, g, entries, q, k, v, out, lse);
    kernel.backward_invariant<E>(s, g, entries, q, k, v, out, lse, dout, dq, {dk, dv, ex.dk, ex.dv});
  };
}

template <class E>
SplitRun<E> run_split(HostAttentionKernel& kernel, const Document<E>& doc, const AttentionMask& mask, std::int64_t grid, std::int64_t packed,
                      const Split& split, KvGradientExponents ex) {
  return run_split_with(host_calls(kernel), doc, mask, grid, packed, split, ex);
}

/// Every split of check_splits_with, on the host kernel.
template <class E>
void check_splits(const AttentionShape& s, std::int64_t L, std::int64_t grid, std::int64_t packed) {
  HostAttentionKernel kernel({2, 4, 8});
  check_splits_with<E>([&](const Document<E>& doc, const AttentionMask& mask, std::int64_t g, std::int64_t at, const Split& split,
                           KvGradientExponents ex) { return run_split(kernel, doc, mask, g, at, split, ex); },
                       s, L, grid, packed);
}

TEST(INVARIANT_SUITE, TheSplitOnTheGridChangesNoBit) {
  check_splits<float>(make_shape(2, 2, 8), 61, 8, 0);
  check_splits<float>(make_shape(2, 2, 8), 61, 8, 3);   // a document starting inside a block
  check_splits<float>(make_shape(4, 2, 5), 45, 4, 6);   // GQA, odd head_dim
  check_splits<bfloat16>(make_shape(2, 1, 8), 40, 8, 5);
  check_splits<float>(make_shape(2, 1, 4), 150, 16, 5);  // entries longer than a tile of the kernel's lanes
}

TEST(INVARIANT_SUITE, ThreadsAndBlockSizesChangeNoBit) {
  const Document<float> doc(make_shape(4, 2, 8), 70, 9);
  const auto ex = exponents_of(doc);
  const Split split{{0, 16, 48, 70}, 16, 0, 0};
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    HostAttentionKernel one({1, 128, 256});
    const SplitRun<float> want = run_split(one, doc, mask, 16, 0, split, ex);
    for (const HostAttentionOptions o : {HostAttentionOptions{2, 1, 1}, HostAttentionOptions{3, 7, 5}, HostAttentionOptions{3, 16, 64}}) {
      HostAttentionKernel kernel(o);
      expect_same_bits(run_split(kernel, doc, mask, 16, 0, split, ex), want,
                       "threads " + std::to_string(o.threads) + ", blocks " + std::to_string(o.block_q) + "/" + std::to_string(o.block_kv));
    }
  }
}

/// Accuracy: the whole document in one call against the double reference,
/// within the default mode's tolerance and never worse than twice its error.
template <class E>
void check_accuracy(const AttentionShape& s, std::int64_t L, std::int64_t grid, double tol) {
  const Document<E> doc(s, L, 13);
  const auto ex = exponents_of(doc);
  HostAttentionKernel kernel({2, 8, 8});
  const auto q = as_doubles<E>(doc.q), k = as_doubles<E>(doc.k), v = as_doubles<E>(doc.v), dout = as_doubles<E>(doc.dout);
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(s), mask);
    const auto grad = reference_attention_backward(q, k, v, dout, L, reference_shape(s), mask);
    const SplitRun<E> r = run_split(kernel, doc, mask, grid, 0, {grid_cuts(0, L, 0, 2 * grid), grid, 0, 0}, ex);
    // The default mode on the same document, one call.
    struct {
      std::vector<E> out, dq, dk, dv;
      std::vector<float> lse;
    } d{std::vector<E>(doc.q.size()), std::vector<E>(doc.q.size()), std::vector<E>(doc.k.size()), std::vector<E>(doc.k.size()),
        std::vector<float>(r.lse.size())};
    const auto entries = layout_entries(std::vector<std::int64_t>{0, L}, std::vector<std::int64_t>{0, L}, mask);
    kernel.forward<E>(s, entries, doc.q, doc.k, doc.v, d.out, d.lse);
    kernel.backward<E>(s, entries, doc.q, doc.k, doc.v, d.out, d.lse, doc.dout, d.dq, d.dk, d.dv);
    expect_as_accurate_as_the_default(r, ex, d, fwd, grad, tol);
  }
}

TEST(INVARIANT_SUITE, MatchesTheReferenceAsTheDefaultModeDoes) {
  check_accuracy<float>(make_shape(2, 2, 8), 53, 8, tolerance);
  check_accuracy<float>(make_shape(6, 3, 16), 40, 16, tolerance);
  check_accuracy<bfloat16>(make_shape(2, 1, 8), 37, 8, 2e-2);
}

TEST(INVARIANT_SUITE, RefusesBadGridsAndNonFiniteInputs) {
  const Document<float> doc(make_shape(2, 1, 4), 9, 3);
  const auto entries = layout_entries(std::vector<std::int64_t>{0, 9}, std::vector<std::int64_t>{0, 9}, AttentionMask::causal());
  HostAttentionKernel kernel({1, 4, 4});
  std::vector<float> out(doc.q.size()), lse(18), dq(doc.q.size());
  std::vector<std::int64_t> dk(doc.k.size()), dv(doc.k.size());
  const auto forward = [&](const InvariantGrid& g, const std::vector<float>& q) { kernel.forward_invariant<float>(doc.shape, g, entries, q, doc.k, doc.v, out, lse); };
  const UnitPhase two[] = {{0, 0}, {0, 0}}, outside[] = {{0, 8}};
  EXPECT_THAT([&] { forward({0, {}}, doc.q); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("grid.size is 0")));
  EXPECT_THAT([&] { forward({8, two}, doc.q); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("grid.phases has 2 phases for 1 entries")));
  EXPECT_THAT([&] { forward({8, outside}, doc.q); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("grid.phases[0] is (q 0, kv 8)")));
  std::vector<float> bad = doc.q;
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT([&] { forward({8, {}}, bad); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("is not finite")));
  bad[5] = std::numeric_limits<float>::infinity();
  EXPECT_THAT([&] { forward({8, {}}, bad); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("is not finite")));
  // Key-value gradients beyond their exact sums' scale: an error, never a wrap.
  forward({8, {}}, doc.q);
  const auto ex = exponents_of(doc);
  EXPECT_THAT([&] { kernel.backward_invariant<float>(doc.shape, {8, {}}, entries, doc.q, doc.k, doc.v, out, lse, doc.dout, dq, {dk, dv, ex.dk - 40, ex.dv}); },
              ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("dk of row")));
  EXPECT_THAT([] { kv_gradient_exponents(make_shape(2, 1, 4), {1.0, std::nan(""), 1.0, 4}); },
              ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("bounds.max_abs_v is nan")));
  EXPECT_THAT([] { kv_gradient_exponents(make_shape(2, 1, 4), {1.0, 1.0, 1.0, -1}); },
              ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("bounds.queries is -1")));
}

TEST(INVARIANT_SUITE, ExactSumsRoundOnceAndRefuseOverflow) {
  using namespace cpdispatch::detail::attention;
  EXPECT_EQ(ceil_log2(1), 0);
  EXPECT_EQ(ceil_log2(2), 1);
  EXPECT_EQ(ceil_log2(5), 3);
  // 1000 terms of 0.1 at the exponent for their bound: the sum is 1000 x the rounded term, exactly.
  const int e = exact_exponent(0.1, 1000);
  std::int64_t acc = 0, term = 0;
  ASSERT_TRUE(to_fixed(0.1, e, term));
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(add_exact(acc, 0.1, e));
  EXPECT_EQ(acc, 1000 * term);
  EXPECT_NEAR(from_fixed(acc, e), 100.0, 1e-12);
  std::int64_t big = std::numeric_limits<std::int64_t>::max() - 1;
  EXPECT_FALSE(add_fixed(big, 2));
  EXPECT_EQ(big, std::numeric_limits<std::int64_t>::max() - 1);
  EXPECT_FALSE(to_fixed(std::numeric_limits<double>::infinity(), 0, term));
  EXPECT_FALSE(to_fixed(0x1p70, 0, term));
}

// The kernel's pairs in 256-bit lanes where the CPU has AVX2 must be the bits of its 128-bit lanes: else two
// machines of one job (or a build with other flags) would disagree. Every width of a row, every tail.
TEST(INVARIANT_SUITE, TheWideLanesGiveTheBitsOfTheNarrowOnes) {
  namespace a = cpdispatch::detail::attention;
#ifdef CPDISPATCH_WIDE_LANES
  if (!a::wide_lanes()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const auto draw = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng);
    return x;
  };
  const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (const std::int64_t D : {1, 3, 16, 31, 32, 33, 64, 80, 128}) {
    for (const std::int64_t n32 : {32, 64}) {
      const std::vector<float> q = draw(static_cast<std::size_t>(D)), t = draw(static_cast<std::size_t>(D * a::tile));
      std::vector<float> narrow(static_cast<std::size_t>(n32)), wide(static_cast<std::size_t>(n32));
      a::dot_lanes_narrow(q.data(), t.data(), D, n32, 0.17f, narrow.data());
      a::dot_lanes_wide(q.data(), t.data(), D, n32, 0.17f, wide.data());
      EXPECT_TRUE(same(narrow, wide)) << "dot_lanes, D " << D << ", lanes " << n32;
    }
    for (const std::int64_t n : {1, 2, 7, 64, 70}) {
      const std::int64_t stride = D + 5;
      const std::vector<float> w = draw(static_cast<std::size_t>(n)), rows = draw(static_cast<std::size_t>(n * stride));
      std::vector<float> narrow = draw(static_cast<std::size_t>(D)), wide = narrow;
      a::axpy_rows_narrow(w.data(), rows.data(), stride, n, narrow.data(), D);
      a::axpy_rows_wide(w.data(), rows.data(), stride, n, wide.data(), D);
      EXPECT_TRUE(same(narrow, wide)) << "axpy_rows, D " << D << ", rows " << n;
    }
  }
#else
  EXPECT_FALSE(a::wide_lanes());
#endif
}

TEST(INVARIANT_SUITE, RoundingToAnIntegerIsNearbyint) {
  using cpdispatch::detail::attention::round_to_integer;
  std::vector<double> ys = {0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999999999999994, 0x1p52 - 0.5, -(0x1p52 - 0.5),
                            0x1p52, 0x1p52 + 1, 0x1p61 + 3, -0x1p61, 0x1p-1074, 4503599627370495.5};
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const double y = std::ldexp(std::uniform_real_distribution<double>(-1.0, 1.0)(rng), static_cast<int>(rng() % 64));
    ys.push_back(y);
    ys.push_back(std::floor(y) + 0.5);  // a tie
  }
  for (const double y : ys) {
    ASSERT_EQ(round_to_integer(y), std::nearbyint(y)) << "y " << y;
  }
}

TEST(INVARIANT_SUITE, ThePowerOfTwoScaleIsLdexpAtEveryExponent) {
  using cpdispatch::detail::attention::scale_by_power_of_two;
  // Normal, subnormal and overflowing results, both signs, and exponents beyond a normal power of two.
  const double xs[] = {0.1, -3.75, 0x1.fffffep127, 0x1p-149, -0x1.8p-140, 1.0 / 3.0, 0.0};
  for (const double x : xs) {
    for (int e = -1100; e <= 1100; ++e) {
      const double want = std::ldexp(x, -e), got = scale_by_power_of_two(x, e);
      ASSERT_EQ(std::bit_cast<std::uint64_t>(got), std::bit_cast<std::uint64_t>(want)) << "x " << x << ", exponent " << e;
    }
  }
}

}  // namespace
}  // namespace cpdispatch::testing
