#pragma once
// Load-balanced dispatch planning: the library chooses the QKV plan.
//
// Input: a packed batch -- every document as its pieces in causal order, each
// piece a contiguous run of the document on its home rank (a data loader
// packs documents end to end into the ranks' token budgets, so a long
// document starts on one rank and continues on the next ones) -- or, the
// special case, the lengths of the whole documents each rank holds. Also the
// most shards per document C, optionally a receive capacity per rank, and
// the bytes per token of queries and of key-values. Output: a documents-form
// plan (QkvDocumentsPlan) whose shards tile every piece in order (a shard
// never crosses a piece boundary and keeps its piece's home rank), at most C
// shards per document, each shard with an attention rank, that
//   1. minimises the largest attention cost of any rank, where a query shard
//      of q tokens after p tokens of its document costs q*p + q*(q+1)/2
//      (causal token pairs), and
//   2. among plans whose largest cost is within `cost_slack` of the best found,
//      moves the fewest bytes, counted exactly as the layout of
//      docs/plan-format.md sends them: q_bytes per query token attended off
//      its home rank, kv_bytes per token of every key-value copy whose home
//      is not the attention rank (query shard i attends to key-value shards
//      0..i of its document, wherever they live, each copied to it; two
//      query shards of one document on one rank get their own copies).
//
// The algorithm (detail::balance::Planner) searches the target T on the
// largest rank cost upward from the lower bound (balance_lower_bound), and
// builds a plan for one T in three steps:
//   1. a piece that costs more than T is cut into the fewest equal-cost
//      shards under T (later shards are shorter); its home keeps the shard
//      that would cost the most bytes to send, the others go to the ranks
//      with the most room left after their own pieces;
//   2. everything else stays home, except that a rank over T sends work away
//      one shard at a time, each time the choice moving the fewest bytes per
//      unit of cost: a piece's whole rest, its front (the head alone moves,
//      with its context) or its back (the tail moves, and its context with
//      it), sized to what the rank must shed or to the receiving rank's room,
//      into the tightest room that takes all it must shed, else the roomiest;
//      a document never exceeds C shards;
//   3. a rank with room left takes back its own shards that fit.
// Step 1 is also tried with one shard more, and not at all (step 2 then cuts
// those pieces too); the cheapest construction that reaches T wins. The
// smallest T reached (within 0.1%) is then relaxed by up to `cost_slack` when
// that moves fewer bytes. Deterministic: integer arithmetic and fixed
// tie-breaks throughout (a floating square root only seeds cut positions,
// which are then fixed exactly in integers).
//
// With BalanceOptions::dedup the bytes are counted as the deduplicated
// exchange (docs/plan-format.md, section 2c) sends them: a key-value token
// crosses to a rank once however many of its document's query shards attend
// there. The balanced plan above is built first; then constructions that may
// send a shard to a rank already attending its document (charged only the
// key-values that rank lacks) compete with it, each followed by a pass that
// moves single shards onto ranks attending or holding their document where
// that sends fewer bytes; one wins only by moving fewer bytes with a largest
// rank cost no higher than the first plan's. So dedup never costs balance,
// and may put several shards of one document on one rank.
//
// With BalanceProblem::mask other than causal (docs/plan-format.md, section
// 2d) a shard costs the (query, key) pairs the mask lets through, and
// detail::balance::MaskPlanner builds the plan (see there); the plan carries
// the mask and leaves max_cp_degree out, so planning derives C from it.
//
// Documents with slices (BalanceDocument::slices, section 2e) are balanced
// by the same MaskPlanner, together with the other documents of the batch
// (under the mask): a query shard of a document with slices costs its
// allowed pairs, and it needs the key-value shards some slice pairs it with,
// a set rather than a range. A plan counts only when every rank's KV groups
// (those needed sets) fit its recv_capacity; then single shards move to
// ranks attending or holding their document where that sends fewer bytes
// (with dedup, wire bytes), no rank's cost passing the largest by more than
// `cost_slack` (or `cost_limit`). The plan
// carries every document's slices unchanged (cuts do not move them) and
// leaves max_cp_degree to planning. A batch without slices is planned
// exactly as before.
//
// With BalanceOptions::head_parallel = automatic (causal batches without
// slices), documents spanning ranks of one group of head_parallel_degree
// ranks go head-parallel (section 2f) where their dispatch in the plan above
// moves more link-weighted bytes than their share of the head-parallel
// exchange; the rest are balanced again around the work those leave, 1/u of
// each one's pairs on each rank of its group (detail/head_parallel_choice.hpp).
// With `off` (the default) the plan is the one above.
//
// With BalanceOptions::grid = G > 1 every cut the balancer makes inside a
// piece falls on a multiple of G in the packed coordinate (rank 0's MLP
// tokens, then rank 1's, ...): each piece knows the phase of its packed
// start (detail::balance::Grid), and every search above moves the cut it
// finds onto the grid (up where a shard must cover a cost, down where it must
// fit a room); the lower bound cuts on the grid too. A piece with no
// multiple of G inside it is not cut. Head-parallel documents keep their
// pieces, and the rest is balanced on the batch's own packed coordinate.
//
// This header includes the rest of planning by balance: the problem
// (balance/balance_problem.hpp), what a plan costs (model/cost.hpp) and the
// baselines (balance/baselines.hpp).

#include <cstdint>
#include <utility>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/balance/baselines.hpp"
#include "cpdispatch/model/cost.hpp"
#include "cpdispatch/balance/detail/balance_planner.hpp"
#include "cpdispatch/balance/detail/head_parallel_choice.hpp"
#include "cpdispatch/balance/detail/mask_balance.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// No plan's largest rank cost is below this: the larger of the mean rank
/// cost and, for each document, the cheapest possible largest shard when it
/// is cut into at most C shards inside its pieces (costs under the mask, or
/// a document's slices). For plans made with `options`: with a grid
/// (BalanceOptions::grid) every document's cheapest largest shard is cut on
/// the grid, so the bound may rise (the other options do not change it).
inline double balance_lower_bound(const BalanceProblem& problem, const BalanceOptions& options, const PlanLimits& limits = {}) {
  detail::balance::check_footprint(problem, limits);
  detail::balance::check_masked_problem(problem);
  const detail::balance::Planner planner(problem, {}, detail::balance::GridPlacement{options.grid});
  if (problem.mask == AttentionMask::causal() && !has_slices(problem)) return planner.lower_bound();
  return detail::balance::MaskPlanner(planner, problem.mask).lower_bound();
}

/// The same with the default options (no grid): a bound for any plan.
inline double balance_lower_bound(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  return balance_lower_bound(problem, BalanceOptions{}, limits);
}

namespace detail::balance {

/// plan_balanced with every document dispatched (head_parallel ignored).
inline QkvDocumentsPlan plan_dispatched(const BalanceProblem& problem, const BalanceOptions& options, const PlanLimits& limits) {
  check_footprint(problem, limits);
  check_masked_problem(problem);
  Planner planner(problem, {}, GridPlacement{options.grid});
  if (problem.mask == AttentionMask::causal() && !has_slices(problem)) return masked_plan(planner, planner.plan(options), problem.mask);
  return masked_plan(planner, MaskPlanner(planner, problem.mask).plan(options), problem.mask);
}

}  // namespace detail::balance

/// The load-balanced plan (see the top of this header), in documents form:
/// documents in input order (for the per-rank form: rank 0's documents,
/// then rank 1's, ...), each piece tiled by its shards in order, each
/// document with its slices; head-parallel documents (with
/// options.head_parallel = automatic) as their pieces, marked. Throws
/// invalid_input for a malformed problem (naming `documents[i].pieces[k]`,
/// `documents[i].slices[j]` -- refused as planning refuses them -- or
/// `docs[r][i]`) or head-parallel option (naming the BalanceOptions field),
/// and capacity_error (naming ranks and token counts) when the receive
/// capacities cannot hold the documents. With options.grid, every cut the
/// plan makes inside a piece is on the grid (the pieces' own boundaries are
/// the input's: check_grid checks them); a grid outside [1, 2^40] is an
/// invalid_input naming BalanceOptions::grid.
inline QkvDocumentsPlan plan_balanced(const BalanceProblem& problem, const BalanceOptions& options = {}, const PlanLimits& limits = {}) {
  QkvDocumentsPlan dispatched = detail::balance::plan_dispatched(problem, options, limits);
  if (options.head_parallel == HeadParallel::off) return dispatched;
  const std::int64_t u = detail::balance::check_head_parallel(problem, options);
  return detail::balance::with_head_parallel(problem, options, u, std::move(dispatched));
}

}  // namespace cpdispatch
