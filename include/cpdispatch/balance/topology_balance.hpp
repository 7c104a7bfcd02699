#pragma once
// Topology-aware balancing (docs/node-exchange.md, "Balancing on a topology").
//
// plan_balanced chooses how documents are cut and how much attention work each
// rank gets without knowing the network. Which rank takes which rank's share
// of the work is free: giving rank x everything that rank a attends (all
// query shards whose destination is a) permutes the ranks' attention costs,
// so every measure of balance stays exactly the same, while the bytes move
// with the work. place_on_topology picks the permutation that minimises the
// bytes weighted by where they travel: 0 to the same rank, 1 inside a node,
// `inter_node_ratio` between nodes (the NVLink / InfiniBand bandwidth ratio,
// 450 / 50 = 9 by default). The cost of placing a share on a rank is a sum
// over its tokens, so the best permutation is a linear assignment, solved
// exactly (Hungarian method, O(W^3)); the unchanged placement is one of the
// candidates, so the weighted bytes never rise. Then (causal plans without
// slices), query shards move to a rank of a node holding their key-values
// where that saves weighted bytes, a full rank making room by sending as
// many of its shards away as it takes (to the rank the shard leaves or the
// roomiest ranks, the fewest weighted bytes per unit of work first); no
// rank's attention cost passes the plan's largest, so the largest, and
// max / mean, never rises, and no move adds key-value tokens between nodes
// in the node-level exchange.
//
//   const Topology topology = Topology::uniform(W, 8);
//   const QkvDocumentsPlan plan = plan_balanced(problem, options, topology);

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/topology.hpp"

namespace cpdispatch {

/// The default weight of a byte between nodes against one inside a node:
/// NVLink (450 GB/s) over InfiniBand at 400 Gb/s (50 GB/s).
inline constexpr double default_inter_node_ratio = 9.0;

namespace detail {

/// Exact minimum-cost assignment of rows to columns of a square matrix
/// (Hungarian method with potentials); returns the column of each row.
inline std::vector<std::size_t> min_cost_assignment(const std::vector<long double>& cost, std::size_t n) {
  const long double inf = std::numeric_limits<long double>::infinity();
  std::vector<long double> u(n + 1, 0), v(n + 1, 0), min_v(n + 1);
  std::vector<std::size_t> row_of(n + 1, 0), way(n + 1, 0);
  std::vector<bool> used(n + 1);
  for (std::size_t i = 1; i <= n; ++i) {
    row_of[0] = i;
    std::size_t j0 = 0;
    std::fill(min_v.begin(), min_v.end(), inf);
    std::fill(used.begin(), used.end(), false);
    do {
      used[j0] = true;
      const std::size_t i0 = row_of[j0];
      long double delta = inf;
      std::size_t j1 = 0;
      for (std::size_t j = 1; j <= n; ++j) {
        if (used[j]) continue;
        const long double cur = cost[(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
        if (cur < min_v[j]) min_v[j] = cur, way[j] = j0;
        if (min_v[j] < delta) delta = min_v[j], j1 = j;
      }
      for (std::size_t j = 0; j <= n; ++j) {
        if (used[j]) u[row_of[j]] += delta, v[j] -= delta;
        else min_v[j] -= delta;
      }
      j0 = j1;
    } while (row_of[j0] != 0);
    do {
      const std::size_t j1 = way[j0];
      row_of[j0] = row_of[j1];
      j0 = j1;
    } while (j0 != 0);
  }
  std::vector<std::size_t> col(n);
  for (std::size_t j = 1; j <= n; ++j) col[row_of[j] - 1] = j - 1;
  return col;
}

/// tokens[a * W + h]: bytes of rank a's attention share whose home is h
/// (its query shards, and the key-value copies it receives, counted as
/// kv_fwd sends them, or once per rank with dedup).
inline std::vector<long double> share_bytes_by_home(const QkvMetadata& meta, std::int64_t q_bytes, std::int64_t kv_bytes, bool dedup) {
  const auto W = static_cast<std::size_t>(meta.q_fwd.world_size);
  std::vector<long double> out(W * W, 0);
  auto add = [&](const Metadata& m, std::int64_t bytes) {
    for (std::size_t h = 0; h < W; ++h)
      for (std::size_t g = 0; g < m.max_seqs(); ++g)
        for (std::size_t c = 0; c < m.num_copies(); ++c) {
          const std::int64_t d = m.has_copies() ? m.dst_rank(h, g, c) : m.dst_rank(h, g);
          if (d >= 0) out[static_cast<std::size_t>(d) * W + h] += static_cast<long double>(m.seq_len(h, g)) * static_cast<long double>(bytes);
        }
  };
  add(meta.q_fwd, q_bytes);
  if (dedup) {
    const KvWireMetadata wire = plan_kv_wire(meta);
    add(wire.fwd, kv_bytes);
  } else {
    add(meta.kv_fwd, kv_bytes);
  }
  return out;
}

/// Weight of a byte from rank h to rank x: 0 when x == h, 1 inside a node, `ratio` between nodes.
inline long double byte_weight(const Topology& t, std::size_t h, std::size_t x, long double ratio) {
  if (h == x) return 0;
  return t.same_node(static_cast<std::int64_t>(h), static_cast<std::int64_t>(x)) ? 1 : ratio;
}

/// Causal plans: moves query shards to a rank of a node that holds their
/// key-values (their own or an earlier shard's home node) where that saves
/// weighted bytes, every rank's attention cost staying at or under the plan's
/// largest (so balance is no worse). Where the rank has no room, shards
/// attending there make room by moving away (see evict). Bytes count as
/// section 2 sends them (each query shard its own copies), so a shard's bytes
/// depend only on its own rank and a trade's saving is the sum of its moves;
/// a move that adds node-level key-value copies between nodes is refused.
class ShardMover {
 public:
  ShardMover(QkvDocumentsPlan& plan, const BalanceProblem& problem, const Topology& t, long double ratio)
      : plan_(plan), p_(problem), t_(t), ratio_(ratio), ranks_of_(static_cast<std::size_t>(t.num_nodes())) {
    const PlanCost cost = plan_cost(plan);
    load_ = cost.attention, kv_ = cost.kv_tokens, ceiling_ = cost.max_attention();
    on_rank_.resize(static_cast<std::size_t>(plan.world_size));
    for (std::size_t r = 0; r < on_rank_.size(); ++r) ranks_of_[node(r)].push_back(r);
    for (std::size_t d = 0; d < plan.documents.size(); ++d) {
      std::int64_t context = 0;
      for (std::size_t i = 0; i < plan.documents[d].shards.size(); ++i) {
        const DocumentShard& s = plan.documents[d].shards[i];
        on_rank_[static_cast<std::size_t>(s.dst)].push_back(refs_.size());
        refs_.push_back({d, i, attention_cost(context, s.len), context + s.len});
        context += s.len;
      }
    }
  }

  /// Passes over the shards in document order until one changes nothing (at most `passes`).
  void run(int passes) {
    for (int k = 0; k < passes; ++k) {
      bool moved = false;
      for (std::size_t s = 0; s < refs_.size(); ++s) moved = improve(s) || moved;
      if (!moved) return;
    }
  }

 private:
  struct Ref {
    std::size_t doc = 0, index = 0;
    std::int64_t work = 0, group = 0;  ///< attention cost; tokens of its key-value group (shards 0..index)
  };
  struct Move {
    long double saved = 0;
    std::vector<std::pair<std::size_t, std::size_t>> steps;  ///< (shard, rank), applied in order
  };
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();

  std::size_t node(std::size_t r) const { return static_cast<std::size_t>(t_.node_of(static_cast<std::int64_t>(r))); }
  DocumentShard& shard(std::size_t s) { return plan_.documents[refs_[s].doc].shards[refs_[s].index]; }
  std::size_t dst(std::size_t s) { return static_cast<std::size_t>(shard(s).dst); }

  /// Weighted bytes of shard s's queries and key-value group at rank x.
  long double bytes_at(std::size_t s, std::size_t x) {
    const PackedDocument& doc = plan_.documents[refs_[s].doc];
    const std::size_t i = refs_[s].index;
    long double b = static_cast<long double>(p_.q_bytes) * static_cast<long double>(doc.shards[i].len) * weight(doc.shards[i].rank, x);
    for (std::size_t k = 0; k <= i; ++k) b += static_cast<long double>(p_.kv_bytes) * static_cast<long double>(doc.shards[k].len) * weight(doc.shards[k].rank, x);
    return b;
  }
  long double weight(std::int64_t h, std::size_t x) const { return byte_weight(t_, static_cast<std::size_t>(h), x, ratio_); }

  /// Key-value tokens of document d the node-level exchange sends between
  /// nodes: each shard once to every other node attending it or a later shard.
  std::int64_t node_copies(std::size_t d) const {
    const std::vector<DocumentShard>& shards = plan_.documents[d].shards;
    std::int64_t out = 0;
    std::vector<std::size_t> later;  // nodes attending shards k.. of the document
    for (std::size_t k = shards.size(); k-- > 0;) {
      const std::size_t n = node(static_cast<std::size_t>(shards[k].dst));
      if (std::find(later.begin(), later.end(), n) == later.end()) later.push_back(n);
      const std::size_t home = node(static_cast<std::size_t>(shards[k].rank));
      out += shards[k].len * static_cast<std::int64_t>(later.size() - (std::find(later.begin(), later.end(), home) != later.end() ? 1 : 0));
    }
    return out;
  }

  /// Whether the steps would send more key-value tokens between nodes in the node-level exchange.
  bool adds_node_copies(const std::vector<std::pair<std::size_t, std::size_t>>& steps) {
    std::vector<std::size_t> docs;
    for (const auto& step : steps)
      if (std::find(docs.begin(), docs.end(), refs_[step.first].doc) == docs.end()) docs.push_back(refs_[step.first].doc);
    std::int64_t before = 0, after = 0;
    for (std::size_t d : docs) before += node_copies(d);
    std::vector<std::int64_t> was;
    for (const auto& [s, x] : steps) was.push_back(shard(s).dst), shard(s).dst = static_cast<std::int64_t>(x);
    for (std::size_t d : docs) after += node_copies(d);
    for (std::size_t k = steps.size(); k-- > 0;) shard(steps[k].first).dst = was[k];
    return after > before;
  }

  /// Whether rank x can take `work` and `group` more (either may be negative) within the ceiling and its capacity.
  bool fits(std::size_t x, std::int64_t work, std::int64_t group) const {
    if (load_[x] + work > ceiling_) return false;
    return p_.recv_capacity.empty() || kv_[x] + group <= p_.recv_capacity[x];
  }

  /// The best move of shard s onto rank x: plain where x has room, else x
  /// makes room by sending shards away (evict).
  void best_at(std::size_t s, std::size_t x, long double gain, Move& best) {
    const Ref& a = refs_[s];
    if (!fits(x, a.work, a.group)) return evict(s, x, gain, best);
    if (gain > best.saved && !adds_node_copies({{s, x}})) best = {gain, {{s, x}}};
  }

  /// Where a shard evicted to make room for s may go: s's rank (which s
  /// leaves) and the roomiest ranks other than x.
  std::vector<std::size_t> eviction_targets(std::size_t s, std::size_t x) {
    std::vector<std::size_t> targets{dst(s)};
    for (std::size_t r : roomiest_)
      if (r != none && r != x && r != targets.front()) targets.push_back(r);
    return targets;
  }

  /// The shards on x, those whose cheapest move to a target costs the fewest
  /// weighted bytes per unit of attention work first.
  std::vector<std::size_t> eviction_order(std::size_t x, const std::vector<std::size_t>& targets) {
    std::vector<std::pair<long double, std::size_t>> order;
    for (std::size_t o : on_rank_[x]) {
      long double cheapest = std::numeric_limits<long double>::infinity();
      for (std::size_t y : targets) cheapest = std::min(cheapest, bytes_at(o, y) - bytes_at(o, x));
      order.emplace_back(cheapest / static_cast<long double>(std::max<std::int64_t>(refs_[o].work, 1)), o);
    }
    std::sort(order.begin(), order.end());
    std::vector<std::size_t> out;
    for (const auto& entry : order) out.push_back(entry.second);
    return out;
  }

  /// s to x, x making room by sending shards away in eviction order, each to
  /// the target with room where it weighs least, until s fits.
  void evict(std::size_t s, std::size_t x, long double gain, Move& best) {
    const Ref& a = refs_[s];
    const std::vector<std::size_t> targets = eviction_targets(s, x);
    std::vector<std::int64_t> work_in(targets.size(), 0), group_in(targets.size(), 0);  // what each target takes
    work_in[0] = -a.work, group_in[0] = -a.group;  // targets[0] is the rank s leaves
    std::int64_t work = a.work, group = a.group;  // what x takes
    std::vector<std::pair<std::size_t, std::size_t>> steps;
    for (std::size_t o : eviction_order(x, targets)) {
      if (gain <= best.saved) return;
      if (fits(x, work, group)) break;
      const Ref& b = refs_[o];
      std::size_t pick = none;
      long double cost = std::numeric_limits<long double>::infinity();
      for (std::size_t k = 0; k < targets.size(); ++k) {
        const long double c = bytes_at(o, targets[k]) - bytes_at(o, x);
        if (c < cost && fits(targets[k], work_in[k] + b.work, group_in[k] + b.group)) pick = k, cost = c;
      }
      if (pick == none) continue;
      work_in[pick] += b.work, group_in[pick] += b.group, work -= b.work, group -= b.group, gain -= cost;
      steps.emplace_back(o, targets[pick]);
    }
    if (gain <= best.saved || steps.empty() || !fits(x, work, group)) return;
    steps.emplace_back(s, x);
    if (!adds_node_copies(steps)) best = {gain, std::move(steps)};
  }

  /// The three least loaded ranks, the lower rank first among equals: the
  /// roomiest rank other than two is one of them. (The loads stay as they
  /// are while one shard's moves are weighed.)
  void find_roomiest() {
    roomiest_.fill(none);
    for (std::size_t r = 0; r < load_.size(); ++r) {
      std::size_t v = r;
      for (std::size_t& slot : roomiest_) {
        if (slot == none) {
          slot = v;
          break;
        }
        if (load_[v] < load_[slot]) std::swap(v, slot);
      }
    }
  }

  /// Moves shard s (and a shard trading places) where that saves the most weighted bytes.
  bool improve(std::size_t s) {
    find_roomiest();
    const std::size_t d = dst(s);
    const long double here = bytes_at(s, d);
    Move best;
    const PackedDocument& doc = plan_.documents[refs_[s].doc];
    std::vector<std::size_t> nodes;
    for (std::size_t k = 0; k <= refs_[s].index; ++k) {
      const std::size_t n = node(static_cast<std::size_t>(doc.shards[k].rank));
      if (std::find(nodes.begin(), nodes.end(), n) != nodes.end()) continue;
      nodes.push_back(n);
      for (std::size_t x : ranks_of_[n])
        if (x != d) best_at(s, x, here - bytes_at(s, x), best);
    }
    if (best.saved <= 0) return false;
    for (const auto& [shard_id, rank] : best.steps) place(shard_id, rank);
    return true;
  }

  /// Attends shard s on rank x.
  void place(std::size_t s, std::size_t x) {
    const std::size_t d = dst(s);
    const Ref& a = refs_[s];
    load_[d] -= a.work, load_[x] += a.work, kv_[d] -= a.group, kv_[x] += a.group;
    std::vector<std::size_t>& from = on_rank_[d];
    from.erase(std::find(from.begin(), from.end(), s));
    on_rank_[x].push_back(s);
    shard(s).dst = static_cast<std::int64_t>(x);
  }

  QkvDocumentsPlan& plan_;
  const BalanceProblem& p_;
  const Topology& t_;
  long double ratio_;
  std::vector<std::vector<std::size_t>> ranks_of_, on_rank_;
  std::vector<Ref> refs_;
  std::vector<std::int64_t> load_, kv_;
  std::array<std::size_t, 3> roomiest_{};
  std::int64_t ceiling_ = 0;
};

}  // namespace detail

/// The plan with each rank's attention share moved to the rank of the
/// weighted-cheapest permutation (the same attention costs, permuted) (see the top of this header). `problem`
/// gives q_bytes, kv_bytes and recv_capacity (a share only goes to a rank
/// that can hold it); `dedup` counts key-values once per destination rank.
/// Throws invalid_input for a topology of another world size or a ratio
/// that is not a positive finite number.
inline QkvDocumentsPlan relabel_attention_ranks(const QkvDocumentsPlan& plan, const BalanceProblem& problem, const Topology& topology,
                                                double inter_node_ratio = default_inter_node_ratio, bool dedup = false) {
  topology.check_world_size(plan.world_size, "place_on_topology");
  if (!(inter_node_ratio > 0) || inter_node_ratio > 1e12) {
    detail::fail("place_on_topology: inter_node_ratio = ", inter_node_ratio, " must be a positive number (at most 1e12)");
  }
  const auto W = static_cast<std::size_t>(plan.world_size);
  const QkvMetadata meta = plan_qkv(plan);
  const std::vector<long double> by_home = detail::share_bytes_by_home(meta, problem.q_bytes, problem.kv_bytes, dedup);
  const auto ratio = static_cast<long double>(inter_node_ratio);
  // cost[a][x] = sum over homes h of by_home[a][h] * weight(h, x), through per-node sums: O(W^2).
  const auto N = static_cast<std::size_t>(topology.num_nodes());
  std::vector<long double> cost(W * W), node_sum(N);
  long double finite_total = 0;
  for (std::size_t a = 0; a < W; ++a) {
    std::fill(node_sum.begin(), node_sum.end(), 0);
    long double total = 0;
    for (std::size_t h = 0; h < W; ++h) {
      node_sum[static_cast<std::size_t>(topology.node_of(static_cast<std::int64_t>(h)))] += by_home[a * W + h];
      total += by_home[a * W + h];
    }
    for (std::size_t x = 0; x < W; ++x) {
      const long double inside = node_sum[static_cast<std::size_t>(topology.node_of(static_cast<std::int64_t>(x)))];
      cost[a * W + x] = ratio * (total - inside) + (inside - by_home[a * W + x]);
      finite_total += cost[a * W + x];
    }
  }
  if (!problem.recv_capacity.empty()) {  // a share goes only where it fits: forbidden cells cost more than any whole placement
    for (std::size_t a = 0; a < W; ++a)
      for (std::size_t x = 0; x < W; ++x)
        if (meta.kv_fwd.num_recv_tokens(a, W) > problem.recv_capacity[x]) cost[a * W + x] = 2 * finite_total + 1;
  }
  const std::vector<std::size_t> to = detail::min_cost_assignment(cost, W);
  long double kept = 0, moved = 0;  // the identity stays when it is as cheap (no churn for nothing)
  for (std::size_t a = 0; a < W; ++a) kept += cost[a * W + a], moved += cost[a * W + to[a]];
  QkvDocumentsPlan out = plan;
  if (moved < kept) {
    for (PackedDocument& doc : out.documents)
      for (DocumentShard& s : doc.shards) s.dst = static_cast<std::int64_t>(to[static_cast<std::size_t>(s.dst)]);
  }
  return out;
}

/// relabel_attention_ranks, then (causal plans without slices) query shards moved (or
/// traded) into nodes holding their key-values where that saves weighted
/// bytes without raising the largest rank cost (see the top of this header).
inline QkvDocumentsPlan place_on_topology(const QkvDocumentsPlan& plan, const BalanceProblem& problem, const Topology& topology,
                                          double inter_node_ratio = default_inter_node_ratio, bool dedup = false) {
  QkvDocumentsPlan out = relabel_attention_ranks(plan, problem, topology, inter_node_ratio, dedup);
  // The mover counts causal key-value groups (prefixes): not a document's slices.
  if (out.mask.type == MaskType::causal && !detail::has_slices(out)) detail::ShardMover(out, problem, topology, static_cast<long double>(inter_node_ratio)).run(4);
  return out;
}

/// plan_balanced on a topology: the balanced plan, then place_on_topology
/// (the same balance, fewer weighted bytes). A plan with head-parallel
/// documents stays as balanced: their work is tied to their group, so
/// permuting the dispatched work's ranks would undo the balance around it.
inline QkvDocumentsPlan plan_balanced(const BalanceProblem& problem, const BalanceOptions& options, const Topology& topology,
                                      double inter_node_ratio = default_inter_node_ratio, const PlanLimits& limits = {}) {
  QkvDocumentsPlan plan = plan_balanced(problem, options, limits);
  if (detail::has_head_parallel(plan)) return plan;
  return place_on_topology(plan, problem, topology, inter_node_ratio, options.dedup);
}

}  // namespace cpdispatch
