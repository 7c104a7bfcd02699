#pragma once
// Shared-prefix documents for the benchmarks (docs/plan-format.md, section
// 2e): a prompt, then responses that each see the whole prompt and
// themselves causally, not the responses before them (RL's shared prefix).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpdispatch/plan/mask.hpp"

namespace bench {

/// The slices of a document of `length` tokens: a prompt of a third of it
/// (at least one token), then `responses` equal responses (the last takes
/// the remainder; fewer where the rest has fewer tokens than responses).
inline std::vector<cpdispatch::AttentionSlice> shared_prefix_slices(std::int64_t length, std::int64_t responses) {
  using cpdispatch::SliceType;
  const std::int64_t prompt = std::max<std::int64_t>(1, length / 3), rest = length - prompt;
  std::vector<cpdispatch::AttentionSlice> out{{0, prompt, 0, prompt, SliceType::causal}};
  const std::int64_t n = std::min(responses, rest);
  for (std::int64_t r = 0, start = prompt; r < n; ++r) {
    const std::int64_t end = r + 1 == n ? length : start + rest / n;
    out.push_back({start, end, 0, prompt, SliceType::full});
    out.push_back({start, end, start, end, SliceType::causal});
    start = end;
  }
  return out;
}

}  // namespace bench
