#pragma once
// FLOPs of attention as flash-attention counts them, shared by the kernel
// benchmarks: forward 4 * pairs * head_dim * heads_q over the (query, key)
// pairs the mask lets through in one document of L tokens; backward 2.5x.

#include <algorithm>
#include <cstdint>

#include "cpdispatch/plan/mask.hpp"

namespace bench {

/// The (query, key) pairs of one document of L tokens that the mask lets through.
inline double visible_pairs(const cpdispatch::AttentionMask& mask, std::int64_t L) {
  double pairs = 0;
  for (std::int64_t p = 0; p < L; ++p) {
    std::int64_t lo = 0;
    if (mask.type == cpdispatch::MaskType::sliding_window) lo = std::max<std::int64_t>(0, p - mask.window + 1);
    pairs += static_cast<double>(mask.type == cpdispatch::MaskType::full ? L : p + 1 - lo);
  }
  return pairs;
}

/// Forward FLOPs of one document; the backward's are 2.5 times these.
inline double forward_flop(const cpdispatch::AttentionMask& mask, std::int64_t L, std::int64_t heads_q, std::int64_t head_dim) {
  return 4.0 * visible_pairs(mask, L) * static_cast<double>(head_dim * heads_q);
}

}  // namespace bench
