#pragma once
// Exact sums for the invariant mode: a value is an integer times a power of
// two (fixed point), so that sums of such values are integer sums, which no
// order, split or thread count can change. Each term is rounded once, to the
// nearest multiple of 2^exponent (ties to even, the default rounding mode),
// and the sum is rounded once, when it leaves the fixed point. The device
// kernels (cuda/attention.hpp) use the same functions: their math calls are
// the C library's, which nvcc also has on the device.

#include <math.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "cpdispatch/host_device.hpp"

namespace cpdispatch::detail::attention {

/// Integers stay below 2^62 in magnitude, so a sum of two never leaves 64 bits
/// unnoticed and a bound that is off by a rounding still fits.
inline constexpr int exact_bits = 62;

/// The smallest b with 2^b >= n (0 for n <= 1).
CPDISPATCH_HOST_DEVICE inline int ceil_log2(std::uint64_t n) noexcept {
  if (n <= 1) return 0;
#ifdef __CUDA_ARCH__
  return 64 - __clzll(static_cast<long long>(n - 1));
#else
  return static_cast<int>(std::bit_width(n - 1));
#endif
}

/// The exponent at which `terms` values, each of magnitude at most max_abs,
/// sum within exact_bits: 2^exponent is the unit of the fixed point. 0 when
/// max_abs is 0 (every term is then 0 as well).
CPDISPATCH_HOST_DEVICE inline int exact_exponent(double max_abs, std::uint64_t terms) noexcept {
  if (!(max_abs > 0)) return 0;
  int e = 0;
  ::frexp(max_abs, &e);  // max_abs < 2^e
  return e + ceil_log2(terms) - exact_bits;
}

/// x * 2^-exponent: one multiplication by an exact power of two where that
/// power is a normal double (the same value as std::ldexp, which is a library
/// call: a tenth of the invariant kernel's time), else std::ldexp.
CPDISPATCH_HOST_DEVICE inline double scale_by_power_of_two(double x, int exponent) noexcept {
  if (exponent < -1023 || exponent > 1022) return ::ldexp(x, -exponent);
  const auto bits = static_cast<std::uint64_t>(1023 - exponent) << 52;
#ifdef __CUDA_ARCH__
  return x * __longlong_as_double(static_cast<long long>(bits));
#else
  return x * std::bit_cast<double>(bits);
#endif
}

/// y rounded to the nearest integer, ties to even (std::nearbyint in the
/// default rounding mode, without its library call): below 2^52, adding
/// 2^52 of y's sign leaves no fraction bits, and subtracting it is exact;
/// from 2^52 on, y is an integer.
CPDISPATCH_HOST_DEVICE inline double round_to_integer(double y) noexcept {
  if (!(::fabs(y) < 0x1p52)) return y;
  const double c = ::copysign(0x1p52, y);
  return (y + c) - c;
}

/// x in units of 2^exponent, rounded to the nearest integer; false when x is
/// not finite or does not fit (never a wrap).
CPDISPATCH_HOST_DEVICE inline bool to_fixed(double x, int exponent, std::int64_t& out) noexcept {
  const double y = scale_by_power_of_two(x, exponent);
  if (!(::fabs(y) < 0x1p62)) return false;  // NaN fails here too
  out = static_cast<std::int64_t>(round_to_integer(y));
  return true;
}

/// acc += x; false on overflow (acc unchanged then).
CPDISPATCH_HOST_DEVICE inline bool add_fixed(std::int64_t& acc, std::int64_t x) noexcept {
  if (x > 0 ? acc > INT64_MAX - x : acc < INT64_MIN - x) return false;
  acc += x;
  return true;
}

/// acc += x in units of 2^exponent; false when x is not finite, does not fit or the sum overflows.
CPDISPATCH_HOST_DEVICE inline bool add_exact(std::int64_t& acc, double x, int exponent) noexcept {
  std::int64_t f = 0;
  return to_fixed(x, exponent, f) && add_fixed(acc, f);
}

/// The larger of m and a, where a NaN met once stays: a when a > m or a is
/// NaN (the invariant mode's bounds refuse a NaN in the inputs on every rank).
template <class X>
CPDISPATCH_HOST_DEVICE inline X max_keeping_nan(X m, X a) noexcept {
  return a > m || ::isnan(a) ? a : m;
}

/// The value of an exact sum (one rounding, to double).
CPDISPATCH_HOST_DEVICE inline double from_fixed(std::int64_t v, int exponent) noexcept { return ::ldexp(static_cast<double>(v), exponent); }

}  // namespace cpdispatch::detail::attention
