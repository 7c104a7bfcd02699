#pragma once
// The zig-zag plan of equal documents that several benchmarks use as their
// reference layout (Megatron-LM / Transformer Engine causal load balancing).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cpdispatch/plan/plan.hpp"

namespace bench {

/// `docs_per_rank` documents of `doc_len` tokens a rank, each cut into 2W
/// chunks, chunk i attended on rank min(i, 2W-1-i).
inline cpdispatch::QkvPlan zigzag_plan(std::int64_t W, std::int64_t docs_per_rank, std::int64_t doc_len) {
  cpdispatch::QkvPlan plan;
  plan.world_size = W;
  plan.ranks.resize(static_cast<std::size_t>(W));
  for (auto& rank : plan.ranks) {
    for (std::int64_t k = 0; k < docs_per_rank; ++k) {
      cpdispatch::Document d;
      for (std::int64_t i = 0; i < 2 * W; ++i) {
        d.shard_len.push_back(doc_len / (2 * W));
        d.dst.push_back(std::min(i, 2 * W - 1 - i));
      }
      rank.docs.push_back(d);
    }
  }
  return plan;
}

}  // namespace bench
