// Bands and slices (docs/plan-format.md, section 2e): the closed-form pair
// count and the meets test against brute force, the four slice shapes, the
// 2d masks as bands, and band shifts that keep open ends open.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cpdispatch/plan/mask.hpp"

namespace {

using cpdispatch::AttentionMask;
using cpdispatch::AttentionSlice;
using cpdispatch::Band;
using cpdispatch::SliceType;
using I = std::int64_t;

I brute_pairs(I p0, I p1, I k0, I k1, const Band& band) {
  I n = 0;
  for (I p = p0; p < p1; ++p) {
    for (I t = k0; t < k1; ++t) n += band.contains(t - p) ? 1 : 0;
  }
  return n;
}

TEST(Bands, PairCountAndMeetsEqualBruteForce) {
  std::mt19937 rng(7);
  auto pick = [&](int a, int b) { return static_cast<I>(std::uniform_int_distribution<int>(a, b)(rng)); };
  for (int it = 0; it < 50000; ++it) {
    const I p0 = pick(-5, 10), p1 = p0 + pick(-1, 9), k0 = pick(-5, 10), k1 = k0 + pick(-1, 9);
    Band band;
    const I ends = pick(0, 3);
    if (ends & 1) band.lo = pick(-14, 14);
    if (ends & 2) band.hi = pick(-14, 14);
    const I want = brute_pairs(p0, p1, k0, k1, band);
    ASSERT_EQ(cpdispatch::band_pairs(p0, p1, k0, k1, band), want)
        << "[" << p0 << ", " << p1 << ") x [" << k0 << ", " << k1 << ") band [" << band.lo << ", " << band.hi << "]";
    ASSERT_EQ(cpdispatch::band_meets(p0, p1, k0, k1, band), want > 0);
  }
}

TEST(Bands, PairCountIsClosedFormAtLargeSizes) {
  const I n = I{1} << 30;  // 2^60 pairs: brute force is out of the question
  EXPECT_EQ(cpdispatch::band_pairs(0, n, 0, n, Band{}), n * n);
  EXPECT_EQ(cpdispatch::band_pairs(0, n, 0, n, AttentionMask::causal().band()), n * (n + 1) / 2);
  EXPECT_EQ(cpdispatch::band_pairs(0, n, 0, n, AttentionMask::sliding_window(4).band()), 4 * n - 6);
  const I big = I{1} << 32;
  EXPECT_THROW(cpdispatch::band_pairs(0, big, 0, big, Band{}), cpdispatch::invalid_input);
}

TEST(Bands, SliceShapesAreTheirBands) {
  // A 3 x 5 rectangle at queries [2, 5), keys [4, 9).
  auto band_of = [](SliceType type) { return AttentionSlice{2, 5, 4, 9, type}.band(); };
  EXPECT_EQ(band_of(SliceType::full), Band{});
  EXPECT_EQ(band_of(SliceType::causal), (Band{Band::unbounded_lo, 4}));    // kb - qb: bottom-right
  EXPECT_EQ(band_of(SliceType::inv_causal), (Band{2, Band::unbounded_hi}));  // ka - qa: top-left
  EXPECT_EQ(band_of(SliceType::bi_causal), (Band{2, 4}));
  // causal bottom-right: the last query sees every key, the first the keys up to kb - qb + 2.
  EXPECT_EQ(cpdispatch::band_pairs(2, 5, 4, 9, band_of(SliceType::causal)), 3 + 4 + 5);
  EXPECT_EQ(cpdispatch::band_pairs(2, 5, 4, 9, band_of(SliceType::inv_causal)), 5 + 4 + 3);
  EXPECT_EQ(cpdispatch::band_pairs(2, 5, 4, 9, band_of(SliceType::bi_causal)), 3 * 3);
  EXPECT_STREQ(cpdispatch::to_string(SliceType::bi_causal), "bi_causal");
}

TEST(Bands, TwoDMasksAreBandsOverTheDocument) {
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(3)}) {
    const Band band = mask.band();
    for (I p = 0; p < 9; ++p) {
      for (I t = 0; t < 9; ++t) EXPECT_EQ(band.contains(t - p), mask.sees(p, t)) << to_string(mask) << " p " << p << " t " << t;
    }
  }
}

TEST(Bands, ShiftsKeepOpenEndsOpenAndRefuseOverflow) {
  EXPECT_EQ((Band{Band::unbounded_lo, 3}.shifted(5)), (Band{Band::unbounded_lo, 8}));
  EXPECT_EQ((Band{-2, Band::unbounded_hi}.shifted(-5)), (Band{-7, Band::unbounded_hi}));
  EXPECT_EQ(Band{}.shifted(std::numeric_limits<I>::max()), Band{});
  EXPECT_THROW((Band{0, std::numeric_limits<I>::max() - 1}.shifted(1)), cpdispatch::invalid_input);
  EXPECT_THROW((Band{-5, 0}.shifted(std::numeric_limits<I>::min())), cpdispatch::invalid_input);
}

TEST(Bands, SlicePairsAndNeedsEqualBruteForce) {
  // A shared prompt [0, 3) and responses [3, 5), [5, 8), with a bi-causal and an inverse-causal slice on the side.
  const std::vector<AttentionSlice> slices = {{0, 3, 0, 3, SliceType::causal},    {3, 5, 0, 3, SliceType::full},
                                              {3, 5, 3, 5, SliceType::causal},    {5, 8, 0, 3, SliceType::full},
                                              {5, 8, 5, 8, SliceType::causal},    {8, 10, 2, 9, SliceType::bi_causal},
                                              {10, 12, 0, 12, SliceType::inv_causal}};
  auto allowed = [&](I p, I t) {
    int n = 0;
    for (const AttentionSlice& s : slices) {
      n += p >= s.q_begin && p < s.q_end && t >= s.k_begin && t < s.k_end && s.band().contains(t - p) ? 1 : 0;
    }
    return n;
  };
  for (I p0 = 0; p0 < 12; ++p0) {
    for (I p1 = p0; p1 <= 12; ++p1) {
      for (I k0 = 0; k0 < 12; k0 += 2) {
        for (I k1 = k0; k1 <= 12; ++k1) {
          I want = 0;
          for (I p = p0; p < p1; ++p) {
            for (I t = k0; t < k1; ++t) want += allowed(p, t);
          }
          ASSERT_EQ(cpdispatch::slice_pairs(slices, p0, p1, k0, k1), want) << p0 << " " << p1 << " " << k0 << " " << k1;
          ASSERT_EQ(cpdispatch::slices_meet(slices, p0, p1, k0, k1), want > 0);
        }
      }
    }
  }
}

}  // namespace
