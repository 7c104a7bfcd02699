#pragma once
// Realistic batches for load-balancing experiments: documents drawn, seeded,
// from a sample of real document lengths (e.g. the doc-lengths samples) and
// packed end to end into the ranks' token budgets, as a data loader does.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace cpdispatch {

/// A packed batch: `world_size` ranks of exactly `tokens_per_rank` tokens
/// each, filled rank after rank with documents (without slices) drawn
/// uniformly, with replacement, from `sample` (lengths > 0). A document longer than the space
/// left on a rank continues on the next rank(s): it stays one document whose
/// pieces (in causal order) lie on consecutive ranks. The last document is
/// shortened to end with the last rank. The same rng state gives the same batch.
inline std::vector<BalanceDocument> draw_workload(std::span<const std::int64_t> sample, std::int64_t world_size,
                                                  std::int64_t tokens_per_rank, Rng& rng) {
  using detail::fail;
  if (sample.empty()) fail("draw_workload: the length sample is empty");
  for (std::size_t i = 0; i < sample.size(); ++i)
    if (sample[i] <= 0) fail("draw_workload: sample[", i, "] = ", sample[i], " is not a positive length");
  if (world_size <= 0) fail("draw_workload: world_size = ", world_size, " must be at least 1");
  if (tokens_per_rank <= 0) fail("draw_workload: tokens_per_rank = ", tokens_per_rank, " must be at least 1");
  std::vector<BalanceDocument> documents;
  std::int64_t rest = 0;  // tokens of the current document not yet laid
  for (std::int64_t r = 0; r < world_size; ++r) {
    for (std::int64_t left = tokens_per_rank; left > 0;) {
      if (rest == 0) {
        rest = sample[static_cast<std::size_t>(rng.below(sample.size()))];
        documents.emplace_back();
      }
      const std::int64_t len = std::min(rest, left);
      documents.back().pieces.push_back({r, len});
      rest -= len;
      left -= len;
    }
  }
  return documents;
}

/// The same from a seed.
inline std::vector<BalanceDocument> draw_workload(std::span<const std::int64_t> sample, std::int64_t world_size,
                                                  std::int64_t tokens_per_rank, std::uint64_t seed) {
  Rng rng(seed);
  return draw_workload(sample, world_size, tokens_per_rank, rng);
}

}  // namespace cpdispatch
