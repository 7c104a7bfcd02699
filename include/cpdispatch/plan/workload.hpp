#pragma once
// Realistic batches for load-balancing experiments: documents drawn, seeded,
// from a sample of real document lengths (e.g. ../shared/data/doc-lengths/)
// and packed rank after rank up to a token budget.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/generate.hpp"

namespace cpdispatch {

/// [world_size] lists of document lengths, each rank holding exactly
/// `tokens_per_rank` tokens: documents are drawn uniformly, with replacement,
/// from `sample` (lengths > 0) and laid rank after rank; a document longer
/// than the space left on a rank is cut there and its rest starts the next
/// rank as a new document (cut again if it is still too long). What is left
/// after the last rank is dropped. The same rng state gives the same batch.
inline std::vector<std::vector<std::int64_t>> draw_workload(std::span<const std::int64_t> sample, std::int64_t world_size,
                                                            std::int64_t tokens_per_rank, Rng& rng) {
  using detail::fail;
  if (sample.empty()) fail("draw_workload: the length sample is empty");
  for (std::size_t i = 0; i < sample.size(); ++i)
    if (sample[i] <= 0) fail("draw_workload: sample[", i, "] = ", sample[i], " is not a positive length");
  if (world_size <= 0) fail("draw_workload: world_size = ", world_size, " must be at least 1");
  if (tokens_per_rank <= 0) fail("draw_workload: tokens_per_rank = ", tokens_per_rank, " must be at least 1");
  std::vector<std::vector<std::int64_t>> ranks(static_cast<std::size_t>(world_size));
  std::int64_t carry = 0;  // the rest of a document cut at the previous rank's end
  for (auto& docs : ranks) {
    std::int64_t left = tokens_per_rank;
    while (left > 0) {
      std::int64_t len = carry;
      carry = 0;
      if (len == 0) len = sample[static_cast<std::size_t>(rng.below(sample.size()))];
      if (len > left) {
        carry = len - left;
        len = left;
      }
      docs.push_back(len);
      left -= len;
    }
  }
  return ranks;
}

/// The same from a seed.
inline std::vector<std::vector<std::int64_t>> draw_workload(std::span<const std::int64_t> sample, std::int64_t world_size,
                                                            std::int64_t tokens_per_rank, std::uint64_t seed) {
  Rng rng(seed);
  return draw_workload(sample, world_size, tokens_per_rank, rng);
}

}  // namespace cpdispatch
