#pragma once
// What load-balanced planning starts from (balance/balance.hpp): the documents
// as pieces on their home ranks (with their slices, where a document has its
// own mask), the planner's options, and the problem a plan was made from.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
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
  /// The planning grid G (docs/planning.md, "Cutting on a grid"): every cut
  /// the balancer makes inside a document (a shard boundary inside a piece)
  /// falls on a multiple of G in the packed coordinate, a token's position in
  /// the batch's packed sequence (rank 0's MLP tokens, then rank 1's, ...).
  /// Document starts and ends are not cuts; a piece with no multiple of G
  /// inside it is never cut. The cuts the MLP layout already has (piece
  /// boundaries) are the input's: check_grid checks them. 1 (the default):
  /// no constraint, the plan as without the option. The op's invariant mode
  /// needs a grid: its default is invariant_grid (64). In [1, max_grid].
  std::int64_t grid = 1;
};

/// The grid of the op's invariant mode by default (BalanceOptions::grid).
inline constexpr std::int64_t invariant_grid = 64;

/// The largest BalanceOptions::grid (and check_grid's grid): 2^40 tokens.
inline constexpr std::int64_t max_grid = std::int64_t{1} << 40;

namespace detail {

/// Refuses a grid outside [1, max_grid]; `who` and `field` name the caller and the field.
inline void check_grid_size(std::int64_t grid, const char* who, const char* field) {
  if (grid < 1 || grid > max_grid) {
    fail(who, ": ", field, " = ", grid, " must be in [1, 2^40] (1: no grid; the invariant mode's default is ", invariant_grid, ")");
  }
}

}  // namespace detail

/// A cut of a document that is not on the grid (first_off_grid).
struct GridCut {
  std::size_t document = 0;  ///< the document's index (a plan's documents; a problem's `documents`)
  std::size_t after = 0;     ///< the cut follows shards[after] (a plan) or pieces[after] (a problem) of the document
  std::int64_t offset = 0;   ///< the cut's position in its document: the tokens before it
  std::int64_t packed = 0;   ///< the position off the grid, in the packed coordinate
  friend bool operator==(const GridCut&, const GridCut&) = default;
};

namespace detail {

/// The first cut off the grid of documents given as runs (home rank,
/// length) in causal order: the boundary after run k of a document, unless
/// it ends the document, where the run's end or the next run's start, in
/// the packed coordinate, is not a multiple of `grid`. Rank r's MLP layout
/// holds the runs whose home is r in (document, run) order. Document d's
/// runs are docs[d].*runs_of (each with a rank and a len); `what` names them
/// in messages ("pieces" or "shards"). The ranks and lengths are checked.
template <class Doc, class Run>
std::optional<GridCut> first_off_grid(std::int64_t world_size, const std::vector<Doc>& docs, std::int64_t grid, std::vector<Run> Doc::*runs_of,
                                      const char* what) {
  check_grid_size(grid, "check_grid", "grid");
  if (world_size < 1) fail("check_grid: world_size = ", world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(world_size);
  std::vector<std::int64_t> at(W + 1, 0);  // first: each rank's tokens; then where its next run starts
  for (std::size_t d = 0; d < docs.size(); ++d) {
    const std::vector<Run>& runs = docs[d].*runs_of;
    for (std::size_t k = 0; k < runs.size(); ++k) {
      const std::int64_t r = runs[k].rank, len = runs[k].len;
      if (r < 0 || r >= world_size) fail("check_grid: documents[", d, "].", what, "[", k, "].rank = ", r, " is outside [0, ", W, ")");
      if (len < 0) fail("check_grid: documents[", d, "].", what, "[", k, "].len = ", len, " is negative");
      at[static_cast<std::size_t>(r) + 1] = add_tokens(at[static_cast<std::size_t>(r) + 1], len, "check_grid");
    }
  }
  for (std::size_t r = 0; r < W; ++r) at[r + 1] = add_tokens(at[r + 1], at[r], "check_grid");
  for (std::size_t d = 0; d < docs.size(); ++d) {
    std::int64_t offset = 0;
    const std::vector<Run>& runs = docs[d].*runs_of;
    const std::size_t n = runs.size();
    for (std::size_t k = 0; k < n; ++k) {
      std::int64_t& start = at[static_cast<std::size_t>(runs[k].rank)];
      const std::int64_t len = runs[k].len;
      if (k > 0 && start % grid != 0) return GridCut{d, k - 1, offset, start};
      start += len;
      offset += len;
      if (k + 1 < n && start % grid != 0) return GridCut{d, k, offset, start};
    }
  }
  return std::nullopt;
}

/// check_grid's refusal of `cut` (`what`: "pieces" or "shards"; `note`
/// follows the two runs' names).
[[noreturn]] inline void off_grid(const GridCut& cut, std::int64_t grid, const char* what, const char* note) {
  fail("check_grid: documents[", cut.document, "] is cut at offset ", cut.offset, " (between ", what, "[", cut.after, "] and ", what, "[",
       cut.after + 1, "]", note, ") at packed position ", cut.packed, ", which is not a multiple of the grid ", grid);
}

}  // namespace detail

/// The first cut of a packed batch's MLP layout off the grid: a boundary
/// between two pieces of a document (the loader's rank boundaries) whose
/// packed position is not a multiple of `grid` (documents in order, then
/// offsets). A per-rank problem (`docs`) holds whole documents: no cuts.
/// Throws invalid_input for a grid outside [1, max_grid], a piece's rank
/// outside [0, W) or a negative length.
inline std::optional<GridCut> first_off_grid(const BalanceProblem& problem, std::int64_t grid) {
  return detail::first_off_grid(problem.world_size, problem.documents, grid, &BalanceDocument::pieces, "pieces");
}

/// The first cut of a documents-form plan off the grid: a boundary between
/// two shards of a document, the balancer's cuts and the MLP layout's
/// (head-parallel documents included), whose packed position is not a
/// multiple of `grid`. Throws invalid_input as the problem's form does.
inline std::optional<GridCut> first_off_grid(const QkvDocumentsPlan& plan, std::int64_t grid) {
  return detail::first_off_grid(plan.world_size, plan.documents, grid, &PackedDocument::shards, "shards");
}

/// The same for a per-rank plan, its documents numbered as to_documents
/// numbers them (rank 0's, then rank 1's, ...).
inline std::optional<GridCut> first_off_grid(const QkvPlan& plan, std::int64_t grid) { return first_off_grid(to_documents(plan), grid); }

/// Refuses (invalid_input) a packed batch whose MLP layout cuts a document
/// off the grid, naming the document, the offset in it, the pieces on both
/// sides and the packed position: `check_grid: documents[3] is cut at
/// offset 100 (between pieces[0] and pieces[1], a boundary of the MLP
/// layout) at packed position 1124, which is not a multiple of the grid 64`.
/// A loader that cuts T packed tokens evenly over W ranks passes when G
/// divides T / W.
inline void check_grid(const BalanceProblem& problem, std::int64_t grid) {
  if (const auto cut = first_off_grid(problem, grid)) detail::off_grid(*cut, grid, "pieces", ", a boundary of the MLP layout");
}

/// Refuses a plan with a cut off the grid (its shards' boundaries), as above.
inline void check_grid(const QkvDocumentsPlan& plan, std::int64_t grid) {
  if (const auto cut = first_off_grid(plan, grid)) detail::off_grid(*cut, grid, "shards", "");
}
inline void check_grid(const QkvPlan& plan, std::int64_t grid) {
  if (const auto cut = first_off_grid(plan, grid)) detail::off_grid(*cut, grid, "shards", "");
}

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
