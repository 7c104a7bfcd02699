#pragma once
// What load-balanced planning starts from (plan/balance.hpp): the documents
// as pieces on their home ranks (with their slices, where a document has its
// own mask), the planner's options, and the problem a plan was made from.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// A contiguous run of a document's tokens on one rank (its home in the MLP
/// layout). A document packed across ranks is a list of pieces in causal order.
struct DocumentPiece {
  std::int64_t rank = 0;  ///< home rank
  std::int64_t len = 0;   ///< tokens, > 0
  friend bool operator==(const DocumentPiece&, const DocumentPiece&) = default;
};

/// One document of a packed batch: its pieces in causal order and, where it
/// has its own mask (docs/plan-format.md, section 2e), its slices in its own
/// positions. Without slices the problem's mask holds for it. Slices do not
/// depend on where the document is cut, so the balanced plan carries them
/// unchanged.
struct BalanceDocument {
  std::vector<DocumentPiece> pieces;
  std::vector<AttentionSlice> slices{};
  friend bool operator==(const BalanceDocument&, const BalanceDocument&) = default;
};

/// What load-balanced planning starts from. Give the documents either as a
/// packed batch (`documents`) or per rank (`docs`), not both; a document
/// with slices is given in the packed form.
struct BalanceProblem {
  std::int64_t world_size = 0;
  std::int64_t max_cp_degree = 1;  ///< C: the most shards one document may be cut into
  /// Packed batch: every document's pieces in causal order (and its slices).
  /// Rank r's MLP layout holds the pieces whose home is r, ordered by
  /// (document, piece).
  std::vector<BalanceDocument> documents;
  /// Per-rank form, [W] (or empty when `documents` is used): the lengths of
  /// the whole documents each rank holds, in MLP-layout order. The same as
  /// listing rank 0's documents, then rank 1's, ... as one-piece documents.
  std::vector<std::vector<std::int64_t>> docs;
  /// Empty, or [W]: the most tokens each rank's attention layout may hold,
  /// counted as its KV groups (context + own length of every query shard it
  /// attends; for a document with slices, the KV shards it needs), which
  /// also bounds its query tokens.
  std::vector<std::int64_t> recv_capacity;
  std::int64_t q_bytes = 1;   ///< bytes of one query token (weighs communication)
  std::int64_t kv_bytes = 1;  ///< bytes of one key-value token
  /// The attention mask (docs/plan-format.md, section 2d) of the documents
  /// without slices: it decides the attention cost of a shard and the
  /// key-values it needs. The balanced plan carries it, and leaves
  /// max_cp_degree to planning unless causal and no document has slices.
  AttentionMask mask;
};

/// Whether the balancer may make documents head-parallel (docs/plan-format.md,
/// section 2f). JSON and the CLI spell it "off" and "auto".
enum class HeadParallel {
  off,        ///< every document is dispatched (the plan as without the option)
  automatic,  ///< a document spanning ranks inside one group goes head-parallel when that moves fewer link-weighted bytes
};

/// "off" or "auto".
inline const char* to_string(HeadParallel h) noexcept { return h == HeadParallel::off ? "off" : "auto"; }

/// Whether groups of `u` ranks can hold documents head-parallel for this
/// layer: u divides W and the query heads, and u divides the key-value
/// heads or they divide u (each rank then holds one key-value head).
inline bool head_parallel_degree_allowed(std::int64_t u, std::int64_t world_size, std::int64_t heads_q, std::int64_t heads_kv) noexcept {
  if (u < 1 || world_size % u != 0 || heads_q % u != 0 || heads_kv < 1) return false;
  return heads_kv % u == 0 || u % heads_kv == 0;
}

struct BalanceOptions {
  /// Plans whose largest rank cost is within this fraction of the best found
  /// count as equal; among them the one moving the fewest bytes wins.
  double cost_slack = 0.01;
  /// When positive, replaces the slack: plans whose largest rank cost is at
  /// most this count as equal (e.g. to compare bytes with another plan at
  /// its level of balance).
  std::int64_t cost_limit = 0;
  /// Count key-value bytes as the deduplicated exchange sends them (once per
  /// document and destination rank; with slices, each needed key-value shard
  /// once per destination rank), for plans run with dedup switched on.
  bool dedup = false;
  /// Head-parallel documents (section 2f): with `automatic`, a document
  /// whose pieces span ranks of one group of head_parallel_degree ranks goes
  /// head-parallel when its dispatch in the plan balanced without it costs
  /// more than its share of the head-parallel exchange. Dispatched, it
  /// costs its link-weighted bytes (queries and outputs, q_bytes each, and
  /// its key-value copies) plus pair_weight times its largest shard's pairs;
  /// head-parallel, the bytes of its pieces to every other rank of its group
  /// (1/u of its query, output and key-value bytes; 1/heads_kv of the
  /// key-values when the heads replicate) plus pair_weight times 1/u of its
  /// pairs. Its work then counts 1/u on each rank of its group and the other
  /// documents are balanced around it. Causal batches without slices only.
  HeadParallel head_parallel = HeadParallel::off;
  std::int64_t head_parallel_degree = 0;  ///< u: groups of u consecutive ranks; 0 means W
  std::int64_t heads_q = 0;               ///< query heads (needed with `automatic`)
  std::int64_t heads_kv = 0;              ///< key-value heads; 0: as many as heads_q
  /// Link weights of the choice: a byte between nodes of `ranks_per_node`
  /// consecutive ranks weighs `inter_node_ratio`, one inside a node 1
  /// (0: all ranks in one node).
  std::int64_t ranks_per_node = 0;
  double inter_node_ratio = 9.0;
  /// What one (query, key) pair of work on a rank weighs against one byte
  /// (q_bytes / kv_bytes units) inside a node in the choice: the step
  /// model's attention time of a pair over a byte's link time. 0: bytes only.
  double pair_weight = 0;
};

/// The documents of a documents-form plan as a packed batch: consecutive
/// shards with one home rank form a piece, the slices as they are; C from
/// the plan (its largest shard count when unset).
inline BalanceProblem balance_problem_of(const QkvDocumentsPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  BalanceProblem p;
  p.world_size = plan.world_size;
  p.q_bytes = q_bytes;
  p.kv_bytes = kv_bytes;
  p.max_cp_degree = plan.max_cp_degree.value_or(1);
  for (const PackedDocument& doc : plan.documents) {
    BalanceDocument& packed = p.documents.emplace_back();
    packed.slices = doc.slices;
    auto& pieces = packed.pieces;
    for (const DocumentShard& s : doc.shards) {
      if (!pieces.empty() && pieces.back().rank == s.rank) pieces.back().len = detail::add_tokens(pieces.back().len, s.len, "balance_problem_of");
      else pieces.push_back({s.rank, s.len});
    }
    if (!plan.max_cp_degree) p.max_cp_degree = std::max(p.max_cp_degree, static_cast<std::int64_t>(doc.shards.size()));
  }
  return p;
}

/// The documents of a per-rank plan as a balancing problem: each rank's
/// document lengths in order, C from the plan (its largest shard count when unset).
inline BalanceProblem balance_problem_of(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  BalanceProblem p = balance_problem_of(to_documents(plan), q_bytes, kv_bytes);
  // to_documents lists rank 0's documents, then rank 1's, ...; each is one piece on its rank.
  auto piece = p.documents.begin();
  for (const RankDocuments& rank : plan.ranks) {
    auto& lengths = p.docs.emplace_back();
    for (std::size_t i = 0; i < rank.docs.size(); ++i, ++piece) lengths.push_back(piece->pieces.empty() ? 0 : piece->pieces.front().len);
  }
  p.documents.clear();
  return p;
}

/// How many documents of a packed batch span more than one rank.
inline std::size_t spanning_documents(const std::vector<BalanceDocument>& documents) {
  std::size_t n = 0;
  for (const BalanceDocument& doc : documents) {
    const auto& pieces = doc.pieces;
    n += std::any_of(pieces.begin(), pieces.end(), [&](const DocumentPiece& pc) { return pc.rank != pieces.front().rank; }) ? 1u : 0u;
  }
  return n;
}

/// The most ranks any document of a packed batch spans.
inline std::size_t widest_span(const std::vector<BalanceDocument>& documents) {
  std::size_t widest = 0;
  for (const BalanceDocument& doc : documents) {
    std::vector<std::int64_t> ranks;
    for (const DocumentPiece& pc : doc.pieces) ranks.push_back(pc.rank);
    std::sort(ranks.begin(), ranks.end());
    widest = std::max(widest, static_cast<std::size_t>(std::unique(ranks.begin(), ranks.end()) - ranks.begin()));
  }
  return widest;
}

/// Whether some document of the problem has its own mask (section 2e).
inline bool has_slices(const BalanceProblem& problem) {
  return std::any_of(problem.documents.begin(), problem.documents.end(), [](const BalanceDocument& d) { return !d.slices.empty(); });
}

}  // namespace cpdispatch
