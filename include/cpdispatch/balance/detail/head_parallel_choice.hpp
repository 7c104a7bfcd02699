#pragma once
// The balancer's choice of head-parallel documents (BalanceOptions::
// head_parallel, docs/plan-format.md section 2f). Starting from the plan
// balanced with every document dispatched, a document whose pieces span
// ranks of one group of u goes head-parallel when its dispatch there costs
// more than its share of the head-parallel exchange, each cost being its
// link-weighted bytes plus pair_weight times the work it puts on one rank
// (dispatched: its largest shard; head-parallel: 1/u of its pairs). The
// other documents are then balanced again around the work the
// head-parallel ones leave on each rank of their group (1/u each).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/model/cost.hpp"
#include "cpdispatch/balance/detail/balance_planner.hpp"
#include "cpdispatch/balance/detail/mask_balance.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch::detail::balance {

/// Options' u, checked against the problem and the heads (messages name the
/// BalanceOptions field). Call once the problem itself is known to be valid.
inline std::int64_t check_head_parallel(const BalanceProblem& problem, const BalanceOptions& o) {
  const std::int64_t W = problem.world_size;
  if (problem.mask != AttentionMask::causal() || has_slices(problem)) {
    fail("plan_balanced: head_parallel = auto balances causal batches without slices; this one has the ", to_string(problem.mask),
         has_slices(problem) ? " mask and slices" : " mask");
  }
  if (o.heads_q < 1) fail("plan_balanced: BalanceOptions::heads_q = ", o.heads_q, ": head_parallel = auto needs the query heads (at least 1)");
  const std::int64_t kv = o.heads_kv == 0 ? o.heads_q : o.heads_kv;
  if (kv < 1 || o.heads_q % kv != 0) {
    fail("plan_balanced: BalanceOptions::heads_kv = ", o.heads_kv, " must be 0 (as many as heads_q) or divide heads_q = ", o.heads_q);
  }
  const std::int64_t u = o.head_parallel_degree == 0 ? W : o.head_parallel_degree;
  if (u < 1 || u > W || W % u != 0) {
    fail("plan_balanced: BalanceOptions::head_parallel_degree = ", o.head_parallel_degree, " must divide world_size = ", W, " (0 means W)");
  }
  if (!head_parallel_degree_allowed(u, W, o.heads_q, kv)) {
    fail("plan_balanced: BalanceOptions::head_parallel_degree = ", u, " does not fit heads_q = ", o.heads_q, ", heads_kv = ", kv,
         ": it must divide heads_q, and divide heads_kv or be a multiple of it");
  }
  if (o.ranks_per_node < 0) fail("plan_balanced: BalanceOptions::ranks_per_node = ", o.ranks_per_node, " must be at least 0");
  if (!(o.inter_node_ratio > 0) || o.inter_node_ratio > 1e12) {
    fail("plan_balanced: BalanceOptions::inter_node_ratio = ", o.inter_node_ratio, " must be a positive number (at most 1e12)");
  }
  if (!(o.pair_weight >= 0) || o.pair_weight > 1e12) {
    fail("plan_balanced: BalanceOptions::pair_weight = ", o.pair_weight, " must be a number in [0, 1e12]");
  }
  return u;
}

/// What a byte weighs on the link from rank a to rank b.
inline double link_weight(const BalanceOptions& o, std::int64_t a, std::int64_t b) noexcept {
  const bool same_node = o.ranks_per_node == 0 || a / o.ranks_per_node == b / o.ranks_per_node;
  return same_node ? 1.0 : o.inter_node_ratio;
}

/// Link-weighted bytes of one dispatched document (causal): its queries out
/// and outputs back, and its key-value copies, as plan_cost counts them.
/// `scratch` is an empty cost of the plan's world size; the cells this
/// document fills are read and cleared again.
inline double dispatch_link_bytes(PlanCost& scratch, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                                  const BalanceOptions& o, std::vector<std::pair<std::size_t, std::int64_t>>& held) {
  const auto W = static_cast<std::size_t>(scratch.world_size);
  cost::add_document(scratch, shards, 2 * q_bytes, kv_bytes, held);  // queries out, outputs back
  double total = 0;
  for (const DocumentShard& from : shards) {
    for (const DocumentShard& to : shards) {
      std::int64_t& cell = scratch.bytes[static_cast<std::size_t>(from.rank) * W + static_cast<std::size_t>(to.dst)];
      total += static_cast<double>(cell) * link_weight(o, from.rank, to.dst);
      cell = 0;
    }
  }
  return total;
}

/// Link-weighted bytes of a document's head-parallel exchange in groups of
/// u: each piece sends every other rank of its group 1/u of its queries
/// (out, and outputs back) and of its key-values (1/heads_kv when the
/// key-value heads replicate, u a multiple of heads_kv).
inline double head_parallel_link_bytes(const BalanceDocument& doc, std::int64_t u, std::int64_t q_bytes, std::int64_t kv_bytes,
                                       const BalanceOptions& o) {
  const std::int64_t kv_heads = o.heads_kv == 0 ? o.heads_q : o.heads_kv;
  const double per_token = 2.0 * static_cast<double>(q_bytes) / static_cast<double>(u) +
                           static_cast<double>(kv_bytes) / static_cast<double>(kv_heads % u == 0 ? u : kv_heads);
  double total = 0;
  for (const DocumentPiece& pc : doc.pieces) {
    const std::int64_t first = pc.rank / u * u;
    for (std::int64_t g = first; g < first + u; ++g)
      if (g != pc.rank) total += static_cast<double>(pc.len) * per_token * link_weight(o, pc.rank, g);
  }
  return total;
}

/// The costliest shard of a dispatched (causal) document: the work it puts on one rank.
inline std::int64_t largest_shard_pairs(const std::vector<DocumentShard>& shards) {
  std::int64_t context = 0, most = 0;
  for (const DocumentShard& s : shards) {
    most = std::max(most, attention_cost(context, s.len));
    context += s.len;
  }
  return most;
}

/// Whether a document's pieces span ranks, all inside one group of u.
inline bool head_parallel_candidate(const BalanceDocument& doc, std::int64_t u) {
  bool spans = false;
  for (const DocumentPiece& pc : doc.pieces) {
    if (pc.rank / u != doc.pieces.front().rank / u) return false;
    spans = spans || pc.rank != doc.pieces.front().rank;
  }
  return spans;
}

/// Which documents go head-parallel, judged on `dispatched` (the problem's
/// plan with every document dispatched, documents in input order).
inline std::vector<bool> head_parallel_documents(const BalanceProblem& problem, const BalanceOptions& o, std::int64_t u,
                                                 const QkvDocumentsPlan& dispatched) {
  std::vector<bool> out(problem.documents.size(), false);
  PlanCost scratch = cost::empty_cost(problem.world_size, {});
  std::vector<std::pair<std::size_t, std::int64_t>> held;
  for (std::size_t i = 0; i < problem.documents.size(); ++i) {
    const BalanceDocument& doc = problem.documents[i];
    if (!head_parallel_candidate(doc, u)) continue;
    const auto& shards = dispatched.documents[i].shards;
    std::int64_t len = 0;
    for (const DocumentShard& s : shards) len += s.len;
    const double dispatch = dispatch_link_bytes(scratch, shards, problem.q_bytes, problem.kv_bytes, o, held) +
                            o.pair_weight * static_cast<double>(largest_shard_pairs(shards));
    const double head_parallel = head_parallel_link_bytes(doc, u, problem.q_bytes, problem.kv_bytes, o) +
                                 o.pair_weight * static_cast<double>(cost::head_parallel_share(attention_cost(0, len), u, 0));
    out[i] = dispatch > head_parallel;
  }
  return out;
}

/// The problem without its head-parallel documents, each rank's receive
/// capacity less the head-parallel tokens its group holds, and in `fixed`
/// the work they leave on each rank (1/u of each one's pairs).
inline BalanceProblem dispatched_rest(const BalanceProblem& problem, const std::vector<bool>& hp, std::int64_t u, std::vector<std::int64_t>& fixed) {
  BalanceProblem rest = problem;
  rest.documents.clear();
  const auto W = static_cast<std::size_t>(problem.world_size);
  fixed.assign(W, 0);
  std::vector<std::int64_t> held(W, 0);
  for (std::size_t i = 0; i < problem.documents.size(); ++i) {
    const BalanceDocument& doc = problem.documents[i];
    if (!hp[i]) {
      rest.documents.push_back(doc);
      continue;
    }
    std::int64_t len = 0;
    for (const DocumentPiece& pc : doc.pieces) len += pc.len;  // the dispatched plan checked the totals
    const std::int64_t first = doc.pieces.front().rank / u * u, pairs = attention_cost(0, len);
    for (std::int64_t c = 0; c < u; ++c) {
      fixed[static_cast<std::size_t>(first + c)] += cost::head_parallel_share(pairs, u, c);
      held[static_cast<std::size_t>(first + c)] += len;
    }
  }
  for (std::size_t r = 0; r < rest.recv_capacity.size(); ++r) {
    if (rest.recv_capacity[r] < held[r]) {
      fail<capacity_error>("plan_balanced: rank ", r, " holds ", held[r], " head-parallel tokens, more than its recv_capacity ", rest.recv_capacity[r]);
    }
    rest.recv_capacity[r] -= held[r];
  }
  return rest;
}

/// The documents in input order: the head-parallel ones whole on their
/// pieces (dst = home, ignored), the others from `part` (the rest's plan).
inline QkvDocumentsPlan merge_head_parallel(const BalanceProblem& problem, const std::vector<bool>& hp, std::int64_t u, QkvDocumentsPlan part) {
  QkvDocumentsPlan out = std::move(part);
  std::vector<PackedDocument> rest = std::move(out.documents);
  out.documents.clear();
  out.head_parallel_degree = u;
  std::size_t next = 0;
  for (std::size_t i = 0; i < problem.documents.size(); ++i) {
    if (!hp[i]) {
      out.documents.push_back(std::move(rest[next++]));
      continue;
    }
    PackedDocument& doc = out.documents.emplace_back();
    doc.head_parallel = true;
    for (const DocumentPiece& pc : problem.documents[i].pieces) doc.shards.push_back({pc.rank, pc.len, pc.rank});
  }
  return out;
}

/// Where the grid lets the rest (the documents not in `hp`) be cut: at
/// BalanceOptions::grid in the packed coordinate of the whole batch, the
/// head-parallel documents' pieces included (the rest's pieces in order).
inline GridPlacement rest_grid(const BalanceProblem& problem, const std::vector<bool>& hp, std::int64_t grid) {
  GridPlacement out{grid, {}};
  if (grid == 1) return out;
  const auto W = static_cast<std::size_t>(problem.world_size);
  std::vector<std::int64_t> at(W + 1, 0);  // each rank's tokens, then where its next piece starts
  for (const BalanceDocument& doc : problem.documents)
    for (const DocumentPiece& pc : doc.pieces) at[static_cast<std::size_t>(pc.rank) + 1] += pc.len;  // the dispatched plan checked the totals
  for (std::size_t r = 0; r < W; ++r) at[r + 1] += at[r];
  for (std::size_t i = 0; i < problem.documents.size(); ++i) {
    for (const DocumentPiece& pc : problem.documents[i].pieces) {
      std::int64_t& start = at[static_cast<std::size_t>(pc.rank)];
      if (!hp[i]) out.starts.push_back(start);
      start += pc.len;
    }
  }
  return out;
}

/// The plan with head-parallel documents in groups of u (checked by
/// check_head_parallel), chosen on `dispatched`; `dispatched` itself when
/// no document goes head-parallel.
inline QkvDocumentsPlan with_head_parallel(const BalanceProblem& problem, const BalanceOptions& o, std::int64_t u, QkvDocumentsPlan dispatched) {
  const std::vector<bool> hp = head_parallel_documents(problem, o, u, dispatched);
  if (std::find(hp.begin(), hp.end(), true) == hp.end()) return dispatched;
  std::vector<std::int64_t> fixed;
  const BalanceProblem rest = dispatched_rest(problem, hp, u, fixed);
  Planner planner(rest, std::move(fixed), rest_grid(problem, hp, o.grid));
  return merge_head_parallel(problem, hp, u, masked_plan(planner, planner.plan(o), rest.mask));
}

/// Every document head-parallel in groups of u (with u = W, Ulysses'
/// layout: each rank attends every token on 1/W of the heads), on
/// `dispatched`'s plan fields; capacity_error where a rank cannot hold the
/// head-parallel tokens of its group.
inline QkvDocumentsPlan all_head_parallel(const BalanceProblem& problem, std::int64_t u, QkvDocumentsPlan dispatched) {
  const std::vector<bool> hp(problem.documents.size(), true);
  std::vector<std::int64_t> fixed;
  (void)dispatched_rest(problem, hp, u, fixed);  // checks each rank's receive capacity
  dispatched.documents.clear();
  return merge_head_parallel(problem, hp, u, std::move(dispatched));
}

}  // namespace cpdispatch::detail::balance
