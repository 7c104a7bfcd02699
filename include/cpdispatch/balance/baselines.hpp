#pragma once
// Plans to compare the balanced plan with (balance/balance.hpp): every piece
// on its home rank, a greedy balancer, and the per-document zig-zag of
// Megatron-LM and Transformer Engine.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/balance/detail/balance_cuts.hpp"
#include "cpdispatch/balance/detail/balance_planner.hpp"
#include "cpdispatch/balance/detail/mask_balance.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// Baseline: every piece whole, attended on its own home rank (moves nothing).
inline QkvDocumentsPlan plan_unbalanced(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  detail::balance::check_footprint(problem, limits);
  detail::balance::check_masked_problem(problem);
  detail::balance::Planner planner(problem);
  return detail::balance::masked_plan(planner, planner.unbalanced(), problem.mask);
}

namespace detail::balance {

/// One greedy move: the costliest whole shard on rank `hi` within `amount`,
/// else a cut off the end of its costliest shard that can still be cut
/// (within the document's C), moved to rank `lo`. The cost moved, 0 for none.
inline std::int64_t greedy_move(std::vector<std::vector<Shard>>& shards, std::vector<std::int64_t>& count, const std::vector<Piece>& pieces,
                                std::size_t hi, std::size_t lo, std::int64_t amount, std::int64_t C) {
  Shard* whole = nullptr;
  std::vector<Shard>* cut_piece = nullptr;
  std::size_t cut_i = 0;
  std::int64_t whole_cost = 0, cut_cost = 0;
  for (auto& ps : shards) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].dst != hi) continue;
      const std::int64_t c = pairs(ps[i].begin, ps[i].end);
      if (c <= amount && c > whole_cost) whole = &ps[i], whole_cost = c;
      if (c > amount && c > cut_cost && count[pieces[ps[i].piece].document] < C && ps[i].end - ps[i].begin > 1) {
        cut_piece = &ps, cut_i = i, cut_cost = c;
      }
    }
  }
  if (whole) {
    whole->dst = lo;
    return whole_cost;
  }
  if (!cut_piece) return 0;
  const Shard s = (*cut_piece)[cut_i];
  const std::int64_t m = std::clamp(min_begin(s.begin, s.end, amount), s.begin + 1, s.end - 1);
  (*cut_piece)[cut_i].end = m;
  cut_piece->insert(cut_piece->begin() + static_cast<std::ptrdiff_t>(cut_i) + 1, Shard{s.piece, m, s.end, lo});
  ++count[pieces[s.piece].document];
  return pairs(m, s.end);
}

}  // namespace detail::balance

/// Baseline: repeatedly move work from the most loaded rank to the least
/// loaded one, either the costliest whole shard that fits the least loaded
/// rank's deficit or, when none does, a shard cut off the end of the
/// costliest shard sized to that deficit (inside its piece, at most C shards
/// per document), until the largest cost is within `within` of the level any
/// plan could reach (balance_lower_bound) or no move is left. Ignores
/// receive capacities.
inline QkvDocumentsPlan plan_greedy(const BalanceProblem& problem, double within = 0.10, const PlanLimits& limits = {}) {
  using namespace detail::balance;
  check_footprint(problem, limits);
  Planner planner(problem);
  const auto& pieces = planner.pieces();
  const std::size_t W = planner.world();
  std::vector<std::vector<Shard>> shards(pieces.size());  // per piece, in order
  std::vector<std::int64_t> load(W, 0), count(planner.num_documents(), 0);
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    shards[id].push_back({id, pieces[id].begin, pieces[id].end, pieces[id].home});
    load[pieces[id].home] += pieces[id].cost;
    ++count[pieces[id].document];
  }
  const auto level = static_cast<std::int64_t>(std::ceil(planner.lower_bound()));
  const auto stop = static_cast<std::int64_t>(static_cast<double>(level) * (1.0 + within));
  const std::size_t max_moves = 64 * W + 4 * pieces.size();
  for (std::size_t move = 0; move < max_moves && !pieces.empty(); ++move) {
    const auto hi = static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto lo = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (load[hi] <= stop) break;
    const std::int64_t amount = std::min(load[hi] - level, level - load[lo]);
    if (amount <= 0) break;
    const std::int64_t moved = greedy_move(shards, count, pieces, hi, lo, amount, planner.cp_degree());
    if (moved == 0) break;
    load[hi] -= moved;
    load[lo] += moved;
  }
  std::vector<Shard> all;
  for (const auto& ps : shards) all.insert(all.end(), ps.begin(), ps.end());
  return planner.to_plan(make_layout(all, pieces, problem.q_bytes, problem.kv_bytes));
}

/// Baseline: per-document zig-zag, the causal load balancing of Megatron-LM
/// and Transformer Engine. Every document is cut into 2W chunks of (nearly)
/// equal length, chunk i attended on rank min(i, 2W-1-i), so each rank gets
/// one early and one late chunk of every document; chunks are further cut at
/// piece boundaries (a shard keeps its piece's home). Ignores C and receive
/// capacities: the plan's max_cp_degree is the most shards it gives a
/// document (up to 2W - 1 plus the piece boundaries).
inline QkvDocumentsPlan plan_zigzag(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  using namespace detail::balance;
  check_footprint(problem, limits, 2 * static_cast<std::uint64_t>(std::max<std::int64_t>(problem.world_size, 0)));  // 2W chunks a document
  BalanceProblem wide = problem;  // C does not limit zig-zag: only every piece's own shard
  for (const auto& doc : problem.documents) wide.max_cp_degree = std::max(wide.max_cp_degree, static_cast<std::int64_t>(doc.pieces.size()));
  Planner planner(wide);  // validates, and lists the pieces
  const auto& pieces = planner.pieces();
  const auto W = static_cast<std::int64_t>(planner.world());
  std::vector<std::int64_t> doc_len(planner.num_documents(), 0);
  for (const Piece& pc : pieces) doc_len[pc.document] = pc.end;
  std::vector<Shard> shards;
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    const Piece& pc = pieces[id];
    const std::int64_t L = doc_len[pc.document];
    auto chunk_start = [&](std::int64_t i) { return L / (2 * W) * i + L % (2 * W) * i / (2 * W); };
    // The chunk holding position pc.begin, then every chunk up to pc.end.
    std::int64_t i = std::min(2 * W - 1, pc.begin / std::max<std::int64_t>(1, L / (2 * W)));
    while (i > 0 && chunk_start(i) > pc.begin) --i;
    while (i + 1 < 2 * W && chunk_start(i + 1) <= pc.begin) ++i;
    for (std::int64_t a = pc.begin; a < pc.end; ++i) {
      const std::int64_t b = i + 1 < 2 * W ? std::min(pc.end, chunk_start(i + 1)) : pc.end;
      if (b > a) shards.push_back({id, a, b, static_cast<std::size_t>(std::min(i, 2 * W - 1 - i))});
      a = b;
    }
  }
  QkvDocumentsPlan out = planner.to_plan(make_layout(shards, pieces, problem.q_bytes, problem.kv_bytes));
  out.mask = problem.mask;
  std::int64_t most = 1;
  for (const PackedDocument& d : out.documents) most = std::max(most, static_cast<std::int64_t>(d.shards.size()));
  out.max_cp_degree = most;
  return out;
}

}  // namespace cpdispatch
