#pragma once
// Shared pieces of the host attention kernel tests: random THD inputs rounded
// to the element type, documents laid out back to back, and the error measure
// (largest absolute difference over the largest reference magnitude).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/float16.hpp"
#include "../common/max_error.hpp"
#include "../common/reference_attention.hpp"

namespace cpdispatch::testing {

template <class E>
E to_element(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return E(x);
  }
}

template <class E>
double to_double(E x) {
  return static_cast<double>(static_cast<float>(x));
}

/// n values uniform in [-1, 1), rounded to E.
template <class E>
std::vector<E> random_elements(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<E> x(n);
  for (auto& e : x) e = to_element<E>(dist(rng));
  return x;
}

template <class E>
std::vector<double> as_doubles(std::span<const E> x) {
  std::vector<double> d(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) d[i] = to_double(x[i]);
  return d;
}

/// Rows [first, first + count) of a THD buffer with `width` values per row.
inline std::vector<double> rows_of(const std::vector<double>& x, std::int64_t first, std::int64_t count,
                                   std::int64_t width) {
  return {x.begin() + first * width, x.begin() + (first + count) * width};
}

/// Largest |got - want| over the largest |want| (1 when want is all zero);
/// infinite on a NaN, an unmatched infinity or a length mismatch (max_error.hpp).
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  return max_error(got, want).relative();
}

inline ReferenceShape reference_shape(const AttentionShape& s) {
  return {s.heads_q, s.heads_kv, s.head_dim, static_cast<double>(s.softmax_scale)};
}

inline AttentionShape make_shape(std::int64_t heads_q, std::int64_t heads_kv, std::int64_t head_dim) {
  return {heads_q, heads_kv, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim))};
}

/// The masks every test walks through.
inline std::vector<AttentionMask> all_masks() {
  return {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(1),
          AttentionMask::sliding_window(3), AttentionMask::sliding_window(6)};
}

/// Prefix sums of document lengths, leading 0.
inline std::vector<std::int64_t> prefix_sums(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

}  // namespace cpdispatch::testing
