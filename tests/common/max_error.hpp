#pragma once
// The one error measure of the numeric tests: the largest |got - want| of two
// equally long sequences, beside the largest |want|. A running
// std::max(err, |got - want|) keeps err when the difference is NaN, so a NaN
// output would pass any tolerance; here a NaN, or an infinity the other side
// does not match exactly, makes the error infinite, and sequences of
// different lengths are a test failure as well as an infinite error.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <ranges>
#include <type_traits>

namespace cpdispatch::testing {

/// x as a double: arithmetic types directly, bf16/fp16 through float (their
/// only conversion).
template <class T>
double as_double(T x) {
  if constexpr (std::is_arithmetic_v<T>) {
    return static_cast<double>(x);
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

/// A running comparison, one (got, want) pair at a time.
struct MaxError {
  double diff = 0;   ///< largest |got - want|; infinite after a NaN or an unmatched infinity
  double scale = 0;  ///< largest finite |want|

  void add(double got, double want) {
    if (std::isfinite(want)) scale = std::max(scale, std::abs(want));
    if (got == want) return;  // also equal infinities, e.g. the -inf log-sum-exp of an empty row
    const double d = std::abs(got - want);
    // NaN < inf is false, so NaN (from either side) lands here too.
    diff = d < std::numeric_limits<double>::infinity() ? std::max(diff, d) : std::numeric_limits<double>::infinity();
  }

  /// Both comparisons together (e.g. the pieces of one tensor).
  void add(const MaxError& other) {
    diff = std::max(diff, other.diff);
    scale = std::max(scale, other.scale);
  }

  /// diff over scale; diff itself when every want is 0.
  double relative() const { return diff / (scale > 0 ? scale : 1.0); }
};

/// Compares got with want element by element (any sized ranges: vectors,
/// spans, std::span(pointer, n)). Different lengths add a test failure naming
/// both and give an infinite error.
template <std::ranges::sized_range G, std::ranges::sized_range W>
MaxError max_error(const G& got, const W& want) {
  MaxError e;
  const auto n = static_cast<std::size_t>(std::ranges::size(got));
  if (n != static_cast<std::size_t>(std::ranges::size(want))) {
    ADD_FAILURE() << "compared sequences differ in length: got " << n << " values, want " << std::ranges::size(want);
    e.diff = std::numeric_limits<double>::infinity();
    return e;
  }
  auto w = std::ranges::begin(want);
  for (const auto& x : got) e.add(as_double(x), as_double(*w++));
  return e;
}

/// got <= 2 * base + slack, the "within twice a baseline's error" rule. base
/// must be finite: a NaN baseline run gives an infinite base, under which
/// anything, the NaN under test included, would pass.
inline ::testing::AssertionResult within_twice(double got, double base, double slack = 1e-6) {
  if (!std::isfinite(base)) return ::testing::AssertionFailure() << "the baseline's error is " << base;
  if (got <= 2 * base + slack) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "error " << got << " > 2 x the baseline's " << base << " + " << slack;
}

}  // namespace cpdispatch::testing
