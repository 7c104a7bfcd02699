// float16 (IEEE binary16) and bfloat16 conversions: round to nearest even,
// subnormals, infinities, NaN, and an exhaustive round trip of every 16-bit
// pattern through float. The reference values are computed independently
// (double arithmetic, std::ldexp / std::nearbyint), not with the library.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpdispatch/float16.hpp"

namespace {

using cpdispatch::bfloat16;
using cpdispatch::float16;

std::uint16_t h_of(float f) { return float16::from_float(f); }
std::uint16_t b_of(float f) { return bfloat16::from_float(f); }
float f_of_bits(std::uint32_t x) { return std::bit_cast<float>(x); }
std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }

/// The value of a binary16 bit pattern, from the format's definition.
double half_value(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = 0;
  if (e == 0) v = std::ldexp(m, -24);
  else if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

/// The binary16 value nearest to finite `f` (ties to even), as a double;
/// infinity past the largest finite half.
double nearest_half(float f) {
  const double a = std::fabs(static_cast<double>(f));
  double r = 0;
  if (a >= 65520.0) {
    r = std::numeric_limits<double>::infinity();  // 65504 + half its spacing and above
  } else if (a != 0) {
    const int e = std::max(std::ilogb(a), -14);  // subnormals share 2^-14's spacing
    const double ulp = std::ldexp(1.0, e - 10);
    r = std::nearbyint(a / ulp) * ulp;  // a / ulp is exact; nearbyint rounds half to even
  }
  return std::signbit(f) ? -r : r;
}

// ------------------------------------------------------------------- float16

TEST(CoreFloat16, ToFloatMatchesTheFormatDefinitionForAllPatterns) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = float16::to_float(static_cast<std::uint16_t>(h));
    const double want = half_value(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(CoreFloat16, ExhaustiveRoundTripThroughFloat) {
  int checked = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    float16 x;
    x.bits = bits;
    const float f = static_cast<float>(x);
    if (std::isnan(f)) {
      // NaN stays NaN (exponent all ones, mantissa non-zero), sign kept
      const std::uint16_t back = h_of(f);
      ASSERT_EQ(back & 0x7c00, 0x7c00) << std::hex << h;
      ASSERT_NE(back & 0x03ff, 0) << std::hex << h;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
      continue;
    }
    ASSERT_EQ(float16(f).bits, bits) << std::hex << h;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);  // all but the NaN patterns
}

TEST(CoreFloat16, RoundsHalfwayCasesToEven) {
  // Every pair of neighbouring positive halves, subnormal, normal and the
  // last finite one (whose upper neighbour is infinity at 65536).
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double lo = half_value(static_cast<std::uint16_t>(h));
    const double hi = h == 0x7bff ? 65536.0 : half_value(static_cast<std::uint16_t>(h + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);  // 12 significant bits: exact in float
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const std::uint16_t even = (h & 1) ? static_cast<std::uint16_t>(h + 1) : static_cast<std::uint16_t>(h);
    ASSERT_EQ(h_of(mid), even) << "midpoint above " << std::hex << h;
    ASSERT_EQ(h_of(std::nextafter(mid, 1e9f)), h + 1) << "just above the midpoint above " << std::hex << h;
    ASSERT_EQ(h_of(std::nextafter(mid, 0.0f)), h) << "just below the midpoint above " << std::hex << h;
    ASSERT_EQ(h_of(-mid), 0x8000 | even) << "negative midpoint above " << std::hex << h;
  }
}

TEST(CoreFloat16, NamedValues) {
  EXPECT_EQ(h_of(0.0f), 0x0000);
  EXPECT_EQ(h_of(-0.0f), 0x8000);
  EXPECT_EQ(h_of(1.0f), 0x3c00);
  EXPECT_EQ(h_of(-2.0f), 0xc000);
  EXPECT_EQ(h_of(0.1f), 0x2e66);
  EXPECT_EQ(h_of(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(h_of(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(h_of(65519.99f), 0x7bff);
  EXPECT_EQ(h_of(65520.0f), 0x7c00);  // halfway to 2^16: ties to even = infinity
  EXPECT_EQ(h_of(1e10f), 0x7c00);
  EXPECT_EQ(h_of(-1e10f), 0xfc00);
  EXPECT_EQ(h_of(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(h_of(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(h_of(-std::numeric_limits<float>::infinity()), 0xfc00);
  // ties in the normal range: 1 + 2^-11 lies between 0x3c00 (even) and 0x3c01
  EXPECT_EQ(h_of(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(h_of(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // subnormals
  EXPECT_EQ(h_of(std::ldexp(1.0f, -14)), 0x0400);      // smallest normal
  EXPECT_EQ(h_of(std::ldexp(1023.0f, -24)), 0x03ff);   // largest subnormal
  EXPECT_EQ(h_of(std::ldexp(1.0f, -24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(h_of(std::ldexp(1.0f, -25)), 0x0000);      // halfway to it: even is 0
  EXPECT_EQ(h_of(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(h_of(std::ldexp(3.0f, -25)), 0x0002);      // 1.5 ulp: tie between 1 and 2
  EXPECT_EQ(h_of(std::ldexp(5.0f, -25)), 0x0002);      // 2.5 ulp: tie between 2 and 3
  EXPECT_EQ(h_of(std::ldexp(2047.0f, -25)), 0x0400);   // between 0x03ff and 0x0400: rounds up into the normals
  EXPECT_EQ(h_of(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(h_of(1e-30f), 0x0000);
  EXPECT_EQ(h_of(-1e-30f), 0x8000);
  EXPECT_EQ(h_of(f_of_bits(0x00000001)), 0x0000);      // float subnormals vanish
  EXPECT_EQ(float16::to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(float16::to_float(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(float16::to_float(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(CoreFloat16, NaNStaysNaN) {
  for (std::uint32_t x : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f802000u, 0x7f801fffu}) {
    const std::uint16_t h = h_of(f_of_bits(x));
    EXPECT_EQ(h & 0x7c00, 0x7c00) << std::hex << x;
    EXPECT_NE(h & 0x03ff, 0) << std::hex << x << " became infinity";
    EXPECT_EQ(h & 0x8000, (x >> 16) & 0x8000) << std::hex << x;
    EXPECT_TRUE(std::isnan(float16::to_float(h)));
  }
}

TEST(CoreFloat16, SweepOfFloatsAgainstAnIndependentReference) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  // About a million float patterns spread over the whole range, plus every
  // pattern near the half/float boundaries of interest.
  auto check = [](std::uint32_t x) {
    const float f = f_of_bits(x);
    if (std::isnan(f)) return ::testing::AssertionSuccess();
    const float got = float16::to_float(h_of(f));
    const double want = nearest_half(f);
    if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      return ::testing::AssertionFailure() << "float bits 0x" << std::hex << x << " (" << f << ") -> " << got << ", expected " << want;
    }
    return ::testing::AssertionSuccess();
  };
  for (std::uint64_t x = 0; x < 0x100000000ull; x += 4093) ASSERT_TRUE(check(static_cast<std::uint32_t>(x)));
  for (std::uint32_t base : {0x33000000u, 0x33800000u, 0x38800000u, 0x477fe000u, 0x477ff000u, 0x3f800000u}) {
    for (std::uint32_t d = 0; d < 0x4000; ++d) {
      ASSERT_TRUE(check(base + d));
      ASSERT_TRUE(check(base - d));
      ASSERT_TRUE(check((base + d) | 0x80000000u));
    }
  }
}

// ------------------------------------------------------------------ bfloat16

TEST(CoreBfloat16, ToFloatIsTheUpperHalfForAllPatterns) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    bfloat16 x;
    x.bits = static_cast<std::uint16_t>(b);
    ASSERT_EQ(bits_of(static_cast<float>(x)), b << 16) << std::hex << b;
  }
}

TEST(CoreBfloat16, ExhaustiveRoundTripThroughFloat) {
  int checked = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    bfloat16 x;
    x.bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(x);
    if (std::isnan(f)) {
      const std::uint16_t back = b_of(f);
      ASSERT_EQ(back & 0x7f80, 0x7f80) << std::hex << b;
      ASSERT_NE(back & 0x007f, 0) << std::hex << b;
      ASSERT_EQ(back & 0x8000, b & 0x8000) << std::hex << b;
      continue;
    }
    ASSERT_EQ(bfloat16(f), x) << std::hex << b;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 127);
}

TEST(CoreBfloat16, RoundsHalfwayCasesToEven) {
  // Neighbours h, h+1 (positive finite, subnormals included; 0x7f7f's upper
  // neighbour is infinity): the float halfway between is h<<16 | 0x8000.
  for (std::uint32_t h = 0; h < 0x7f80; ++h) {
    const std::uint32_t mid = (h << 16) | 0x8000u;
    const std::uint32_t even = (h & 1) ? h + 1 : h;
    ASSERT_EQ(b_of(f_of_bits(mid)), even) << std::hex << h;
    ASSERT_EQ(b_of(f_of_bits(mid + 1)), h + 1) << std::hex << h;
    ASSERT_EQ(b_of(f_of_bits(mid - 1)), h) << std::hex << h;
    ASSERT_EQ(b_of(f_of_bits(mid | 0x80000000u)), 0x8000u | even) << std::hex << h;
  }
}

TEST(CoreBfloat16, NamedValues) {
  EXPECT_EQ(b_of(0.0f), 0x0000);
  EXPECT_EQ(b_of(-0.0f), 0x8000);
  EXPECT_EQ(b_of(1.0f), 0x3f80);
  EXPECT_EQ(b_of(3.0f), 0x4040);
  EXPECT_EQ(b_of(-2.0f), 0xc000);
  EXPECT_EQ(b_of(257.0f), 0x4380);  // 256 + 1: tie between 256 (even) and 258
  EXPECT_EQ(b_of(259.0f), 0x4382);  // 258 + 1: tie between 258 and 260 (even)
  EXPECT_EQ(b_of(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the largest bf16
  EXPECT_EQ(b_of(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(b_of(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(b_of(f_of_bits(0x00000001)), 0x0000);  // float subnormals: round to the bf16 subnormal grid
  EXPECT_EQ(b_of(f_of_bits(0x00008000)), 0x0000);  // tie: even
  EXPECT_EQ(b_of(f_of_bits(0x00018000)), 0x0002);  // tie: even
  EXPECT_EQ(b_of(f_of_bits(0x00010000)), 0x0001);  // smallest bf16 subnormal survives
  EXPECT_EQ(b_of(f_of_bits(0x007fffff)), 0x0080);  // largest float subnormal rounds up to the smallest normal
}

TEST(CoreBfloat16, NaNStaysNaN) {
  for (std::uint32_t x : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu, 0x7f80ffffu}) {
    const std::uint16_t b = b_of(f_of_bits(x));
    EXPECT_EQ(b & 0x7f80, 0x7f80) << std::hex << x;
    EXPECT_NE(b & 0x007f, 0) << std::hex << x << " became infinity";
    EXPECT_EQ(b & 0x8000, (x >> 16) & 0x8000) << std::hex << x;
  }
}

// The combine's accumulator: fp32 for the 16-bit types, the type itself otherwise.
TEST(CoreFloat16, AccumulatorTypes) {
  static_assert(std::is_same_v<cpdispatch::accumulator_t<bfloat16>, float>);
  static_assert(std::is_same_v<cpdispatch::accumulator_t<float16>, float>);
  static_assert(std::is_same_v<cpdispatch::accumulator_t<float>, float>);
  static_assert(std::is_same_v<cpdispatch::accumulator_t<double>, double>);
  static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2);
  SUCCEED();
}

}  // namespace
