#pragma once
// Element conversions and the log-sum-exp merge of partial attention outputs
// (ring attention's rescaling): two softmax-weighted averages over disjoint
// key sets combine into the average over their union.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>

#include "cpdispatch/float16.hpp"

namespace cpdispatch::detail {

template <class E>
inline float to_f32(E x) noexcept {
  if constexpr (std::is_same_v<E, float>) return x; else return static_cast<float>(x);
}

template <class E>
inline E from_f32(float x) noexcept {
  if constexpr (std::is_same_v<E, float>) return x; else return E(x);
}

/// Folds a part (out_part, lse_part) into the running fp32 output `acc` and
/// its log-sum-exp `lse` for query rows [row_begin, row_end) of a layout of
/// `tokens` rows: [tokens][heads][head_dim] outputs, [heads][tokens] lse.
/// A part whose lse is -infinity (the row saw no key in it) changes nothing.
template <class E>
void merge_partial(std::span<float> acc, std::span<float> lse, std::span<const E> out_part, std::span<const float> lse_part,
                   std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, std::int64_t row_begin, std::int64_t row_end) {
  const auto D = static_cast<std::size_t>(head_dim);
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t j = row_begin; j < row_end; ++j) {
      const auto l = static_cast<std::size_t>(h * tokens + j);
      const float part = lse_part[l];
      if (part == -std::numeric_limits<float>::infinity()) continue;
      const float run = lse[l];
      const float m = std::fmax(run, part);
      const float merged = m + std::log(std::exp(run - m) + std::exp(part - m));
      const float keep = std::exp(run - merged), take = std::exp(part - merged);
      const std::size_t at = static_cast<std::size_t>(j * heads + h) * D;
      for (std::size_t d = 0; d < D; ++d) acc[at + d] = keep * acc[at + d] + take * to_f32(out_part[at + d]);
      lse[l] = merged;
    }
  }
}

}  // namespace cpdispatch::detail
