#pragma once
// 16-bit floating-point storage types (bfloat16 and IEEE binary16) for the
// KV-gradient combine, which accumulates them in fp32. Conversions round to
// nearest even; NaN stays NaN, overflow becomes infinity.
//
// The bit conversions (from_float, to_float) are the single definition the
// host combine, the host sim and the CUDA kernels (cuda/kernels.hpp) all use:
// under nvcc they are __host__ __device__, so device results round exactly
// as host results do.

#include <bit>
#include <cstdint>

#include "cpdispatch/host_device.hpp"

namespace cpdispatch {

namespace detail {

// std::bit_cast is a host function to nvcc; the device pass uses CUDA's intrinsics.
CPDISPATCH_HOST_DEVICE inline std::uint32_t bits_of_float(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

CPDISPATCH_HOST_DEVICE inline float float_of_bits(std::uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

}  // namespace detail

struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  explicit bfloat16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  friend bool operator==(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }

  CPDISPATCH_HOST_DEVICE static float to_float(std::uint16_t h) { return detail::float_of_bits(static_cast<std::uint32_t>(h) << 16); }

  CPDISPATCH_HOST_DEVICE static std::uint16_t from_float(float f) {
    const std::uint32_t x = detail::bits_of_float(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
    const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
    return static_cast<std::uint16_t>((x + rounding) >> 16);
  }
};

struct float16 {
  std::uint16_t bits = 0;

  float16() = default;
  explicit float16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  friend bool operator==(float16 a, float16 b) { return a.bits == b.bits; }

  CPDISPATCH_HOST_DEVICE static std::uint16_t from_float(float f) {
    const std::uint32_t x = detail::bits_of_float(f);
    const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
    const std::uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x0200u : 0u));
    if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (a < 0x38800000u) {                                                     // below 2^-14: subnormal half
      if (a < 0x33000000u) return sign;                                        // at most 2^-25: rounds to zero
      const std::uint32_t e = a >> 23;
      const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
      const std::uint32_t shift = 126u - e;
      std::uint32_t h = m >> shift;
      const std::uint32_t rem = m & ((1u << shift) - 1u);
      const std::uint32_t half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (h & 1u))) ++h;
      return static_cast<std::uint16_t>(sign | h);
    }
    std::uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
    const std::uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
    return static_cast<std::uint16_t>(sign | h);
  }

  CPDISPATCH_HOST_DEVICE static float to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t e = (h >> 10) & 0x1fu;
    const std::uint32_t m = h & 0x3ffu;
    if (e == 0) {  // subnormal (or zero): m * 2^-24, exact in fp32
      const float v = static_cast<float>(m) * detail::float_of_bits(0x33800000u);
      return sign ? -v : v;
    }
    if (e == 31) return detail::float_of_bits(sign | 0x7f800000u | (m << 13));
    return detail::float_of_bits(sign | ((e + 112u) << 23) | (m << 13));
  }
};

/// The type a combine accumulates `T` in: fp32 for 16-bit types.
template <class T>
struct accumulator {
  using type = T;
};
template <>
struct accumulator<bfloat16> {
  using type = float;
};
template <>
struct accumulator<float16> {
  using type = float;
};
template <class T>
using accumulator_t = typename accumulator<T>::type;

}  // namespace cpdispatch
