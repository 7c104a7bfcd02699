#pragma once
// Seeded generators (gen_seq_lens, create_qkv_dispatch, random_documents_plan). The
// output depends only on the arguments: std::mt19937_64 (its output sequence
// is fixed by the standard) and our own integer arithmetic for ranges, never
// std::uniform_*_distribution (implementation-defined).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <unordered_set>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// A reproducible source of integers: the same seed gives the same sequence
/// on every compiler and platform.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}

  std::uint64_t next() { return engine_(); }

  /// Uniform in [0, n), unbiased (rejection of the short last bucket).
  std::uint64_t below(std::uint64_t n) {
    if (n == 0) detail::fail("Rng::below: empty range");
    const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % n;
    std::uint64_t x = 0;
    do x = engine_(); while (x >= limit);
    return x % n;
  }

  /// Uniform in [lo, hi] (inclusive).
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(hi - lo) + 1));
  }

 private:
  std::mt19937_64 engine_;
};

/// `num_seqs` positive lengths summing exactly to `total_len`, drawn
/// uniformly among all such compositions (distinct cut points).
inline std::vector<std::int64_t> random_composition(Rng& rng, std::int64_t num_seqs, std::int64_t total_len,
                                                    const char* who = "random_composition") {
  if (num_seqs <= 0) detail::fail(who, ": num_seqs = ", num_seqs, " must be at least 1");
  if (total_len < num_seqs) {
    detail::fail(who, ": total_len = ", total_len, " cannot be split into ", num_seqs, " positive lengths");
  }
  // Floyd's sampling of num_seqs-1 distinct cut points in [1, total_len-1].
  std::unordered_set<std::int64_t> chosen;
  std::vector<std::int64_t> cuts;
  const std::int64_t n = total_len - 1, k = num_seqs - 1;
  for (std::int64_t j = n - k + 1; j <= n; ++j) {
    const std::int64_t t = rng.between(1, j);
    const std::int64_t pick = chosen.count(t) ? j : t;
    chosen.insert(pick);
    cuts.push_back(pick);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::int64_t> lens;
  lens.reserve(static_cast<std::size_t>(num_seqs));
  std::int64_t prev = 0;
  for (std::int64_t c : cuts) {
    lens.push_back(c - prev);
    prev = c;
  }
  lens.push_back(total_len - prev);
  return lens;
}

/// Sequence lengths [world_size][num_seqs]: each row has positive lengths
/// summing exactly to `total_len`.
inline Tensor<std::int64_t> gen_seq_lens(std::int64_t world_size, std::int64_t num_seqs, std::int64_t total_len,
                                         std::uint64_t seed) {
  if (world_size <= 0) detail::fail("gen_seq_lens: world_size = ", world_size, " must be at least 1");
  Rng rng(seed);
  Tensor<std::int64_t> out({static_cast<std::size_t>(world_size), static_cast<std::size_t>(std::max<std::int64_t>(num_seqs, 0))});
  for (std::size_t r = 0; r < static_cast<std::size_t>(world_size); ++r) {
    const auto lens = random_composition(rng, num_seqs, total_len, "gen_seq_lens");
    std::copy(lens.begin(), lens.end(), out.row(r).begin());
  }
  return out;
}

/// A random QKV plan (create_qkv_dispatch of the reference system): each rank holds
/// `num_seqs` documents of `total_seq_len` tokens together; every document
/// gets a power-of-two CP degree in [1, max_cp_degree], is cut into that many
/// equal shards (lengths are multiples of max_cp_degree, so they divide), and
/// its shards attend on distinct random ranks.
inline QkvPlan create_qkv_dispatch(std::int64_t world_size, std::int64_t total_seq_len, std::int64_t num_seqs,
                                   std::int64_t max_cp_degree, std::uint64_t seed) {
  using detail::fail;
  if (world_size <= 0) fail("create_qkv_dispatch: world_size = ", world_size, " must be at least 1");
  if (max_cp_degree <= 0 || (max_cp_degree & (max_cp_degree - 1)) != 0) {
    fail("create_qkv_dispatch: max_cp_degree = ", max_cp_degree, " must be a power of two");
  }
  if (max_cp_degree > world_size) {
    fail("create_qkv_dispatch: max_cp_degree = ", max_cp_degree, " exceeds world_size = ", world_size,
         " (a document's shards go to distinct ranks)");
  }
  if (total_seq_len % max_cp_degree != 0) {
    fail("create_qkv_dispatch: total_seq_len = ", total_seq_len, " is not divisible by max_cp_degree = ", max_cp_degree);
  }
  Rng rng(seed);
  int log_c = 0;
  while ((std::int64_t{1} << log_c) < max_cp_degree) ++log_c;
  QkvPlan plan;
  plan.world_size = world_size;
  plan.max_cp_degree = max_cp_degree;
  plan.ranks.resize(static_cast<std::size_t>(world_size));
  for (auto& rank : plan.ranks) {
    for (std::int64_t len : random_composition(rng, num_seqs, total_seq_len / max_cp_degree, "create_qkv_dispatch")) {
      const std::int64_t doc_len = len * max_cp_degree;
      const std::int64_t degree = std::int64_t{1} << rng.below(static_cast<std::uint64_t>(log_c) + 1);
      Document doc;
      doc.shard_len.assign(static_cast<std::size_t>(degree), doc_len / degree);
      while (doc.dst.size() < static_cast<std::size_t>(degree)) {  // distinct destinations, degree <= 8 or so
        const auto d = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(world_size)));
        if (std::find(doc.dst.begin(), doc.dst.end(), d) == doc.dst.end()) doc.dst.push_back(d);
      }
      rank.docs.push_back(std::move(doc));
    }
  }
  return plan;
}

/// The shape of random documents-form plans (random_documents_plan).
struct RandomDocumentsOptions {
  std::int64_t world_size = 4;
  std::int64_t num_documents = 8;
  std::int64_t max_shards = 4;                ///< shards per document, drawn in [1, max_shards]
  std::int64_t max_len = 16;                  ///< tokens per shard, drawn in [1, max_len]
  std::optional<std::int64_t> max_cp_degree;  ///< copied into the plan as given
};

/// A random documents-form plan for tests and benchmarks: each document
/// starts on a random home rank and its next shard stays there, continues on
/// the next rank (a document packed across ranks) or jumps to any rank, so a
/// document may span up to min(shards, W) ranks; a shard's destination is
/// often its predecessor's (repeated destinations), else any rank. Ranks no
/// document lands on stay empty.
inline QkvDocumentsPlan random_documents_plan(const RandomDocumentsOptions& o, std::uint64_t seed) {
  using detail::fail;
  if (o.world_size <= 0) fail("random_documents_plan: world_size = ", o.world_size, " must be at least 1");
  if (o.num_documents < 0) fail("random_documents_plan: num_documents = ", o.num_documents, " is negative");
  if (o.max_shards <= 0) fail("random_documents_plan: max_shards = ", o.max_shards, " must be at least 1");
  if (o.max_len <= 0) fail("random_documents_plan: max_len = ", o.max_len, " must be at least 1");
  Rng rng(seed);
  const auto W = static_cast<std::uint64_t>(o.world_size);
  QkvDocumentsPlan plan;
  plan.world_size = o.world_size;
  plan.max_cp_degree = o.max_cp_degree;
  plan.documents.resize(static_cast<std::size_t>(o.num_documents));
  for (PackedDocument& doc : plan.documents) {
    const std::int64_t n = rng.between(1, o.max_shards);
    auto home = static_cast<std::int64_t>(rng.below(W));
    std::int64_t dst = static_cast<std::int64_t>(rng.below(W));
    for (std::int64_t k = 0; k < n; ++k) {
      if (k > 0) {
        const std::uint64_t move = rng.below(4);  // 0, 1: stay; 2: next rank; 3: anywhere
        if (move == 2) home = (home + 1) % o.world_size;
        if (move == 3) home = static_cast<std::int64_t>(rng.below(W));
        if (rng.below(4) != 0) dst = static_cast<std::int64_t>(rng.below(W));
      }
      doc.shards.push_back({home, rng.between(1, o.max_len), dst});
    }
  }
  return plan;
}

}  // namespace cpdispatch
