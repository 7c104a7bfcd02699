#pragma once
// Plans with head-parallel documents (docs/plan-format.md, section 2f) for
// the op's tests: a random plan's documents that lie within one group of u
// ranks go head-parallel by chance, and each group gets one more, some with
// a shared prefix.

#include <cstdint>
#include <random>

#include "cpdispatch/plan/plan.hpp"

namespace attention_test {

/// One head-parallel document on the ranks of group `group` (u ranks): 1 to
/// 4 shards of 1 to 5 tokens; with `prefix`, a shared prompt seen by two
/// responses, each causal in itself.
inline cpdispatch::PackedDocument head_parallel_document(std::mt19937_64& rng, std::int64_t group, std::int64_t u, bool prefix) {
  const auto draw = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  cpdispatch::PackedDocument doc;
  doc.head_parallel = true;
  std::int64_t length = 0;
  for (std::int64_t k = 0, shards = draw(1, 4); k < shards; ++k) {
    const std::int64_t home = group * u + draw(0, u - 1), len = draw(1, 5);
    doc.shards.push_back({home, len, home});
    length += len;
  }
  if (prefix && length >= 3) {
    using cpdispatch::SliceType;
    const std::int64_t a = draw(1, length - 2), b = draw(a + 1, length - 1);
    doc.slices = {{0, a, 0, a, SliceType::causal}, {a, b, 0, a, SliceType::full}, {a, b, a, b, SliceType::causal},
                  {b, length, 0, a, SliceType::full}, {b, length, b, length, SliceType::causal}};
  }
  return doc;
}

/// `plan` with head_parallel_degree u: each document whose shards all lie in
/// one group goes head-parallel with probability 1/2, and every group gets
/// one more head-parallel document (with `prefix`, shared-prefix slices on
/// every other one).
inline cpdispatch::QkvDocumentsPlan with_head_parallel(cpdispatch::QkvDocumentsPlan plan, std::int64_t u, std::uint64_t seed, bool prefix = false) {
  std::mt19937_64 rng(seed);
  plan.head_parallel_degree = u;
  for (cpdispatch::PackedDocument& doc : plan.documents) {
    bool one_group = true;
    for (const cpdispatch::DocumentShard& s : doc.shards) one_group = one_group && s.rank / u == doc.shards.front().rank / u;
    if (one_group && rng() % 2 == 0) doc.head_parallel = true;
  }
  for (std::int64_t g = 0; g < plan.world_size / u; ++g) plan.documents.push_back(head_parallel_document(rng, g, u, prefix && g % 2 == 0));
  return plan;
}

}  // namespace attention_test
