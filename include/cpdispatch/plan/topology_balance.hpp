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
// candidates, so the weighted bytes never rise. Then (causal plans), single
// query shards attending on another node move to a rank of their home's node
// where that saves weighted bytes and that rank's attention cost stays at or
// under the plan's largest: the largest rank cost, and so max / mean, never rises.
//
//   const Topology topology = Topology::uniform(W, 8);
//   const QkvDocumentsPlan plan = plan_balanced(problem, options, topology);

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/dedup.hpp"
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

/// Causal plans: moves single query shards to a rank of their home's node
/// where that saves weighted bytes and the rank's attention cost stays at or
/// under the plan's largest (so balance is no worse), in document order,
/// each to its best such rank.
inline void move_shards_into_nodes(QkvDocumentsPlan& plan, const BalanceProblem& problem, const Topology& t, long double ratio) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  const PlanCost cost = plan_cost(plan);
  std::vector<std::int64_t> load = cost.attention, kv = cost.kv_tokens;
  const std::int64_t ceiling = cost.max_attention();
  std::vector<std::vector<std::size_t>> ranks_of(static_cast<std::size_t>(t.num_nodes()));
  for (std::size_t r = 0; r < W; ++r) ranks_of[static_cast<std::size_t>(t.node_of(static_cast<std::int64_t>(r)))].push_back(r);
  const auto qb = static_cast<long double>(problem.q_bytes), kb = static_cast<long double>(problem.kv_bytes);
  for (PackedDocument& doc : plan.documents) {
    std::int64_t context = 0;
    for (std::size_t i = 0; i < doc.shards.size(); ++i) {
      DocumentShard& s = doc.shards[i];
      const std::int64_t work = attention_cost(context, s.len), group = context + s.len;
      // Weighted bytes of this query shard and its KV group (shards 0..i) at rank x.
      const auto bytes_at = [&](std::size_t x) {
        long double b = qb * static_cast<long double>(s.len) * byte_weight(t, static_cast<std::size_t>(s.rank), x, ratio);
        for (std::size_t k = 0; k <= i; ++k) {
          b += kb * static_cast<long double>(doc.shards[k].len) * byte_weight(t, static_cast<std::size_t>(doc.shards[k].rank), x, ratio);
        }
        return b;
      };
      const auto d = static_cast<std::size_t>(s.dst);
      long double best = bytes_at(d);
      std::size_t to = d;
      for (std::size_t x : ranks_of[static_cast<std::size_t>(t.node_of(s.rank))]) {
        if (x == d || load[x] + work > ceiling) continue;
        if (!problem.recv_capacity.empty() && kv[x] + group > problem.recv_capacity[x]) continue;
        const long double b = bytes_at(x);
        if (b < best) best = b, to = x;
      }
      if (to != d) {
        load[d] -= work, load[to] += work;
        kv[d] -= group, kv[to] += group;
        s.dst = static_cast<std::int64_t>(to);
      }
      context = group;
    }
  }
}

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

/// relabel_attention_ranks, then (causal plans) single query shards moved
/// into their home's node where that saves weighted bytes without raising
/// the largest rank cost (see the top of this header).
inline QkvDocumentsPlan place_on_topology(const QkvDocumentsPlan& plan, const BalanceProblem& problem, const Topology& topology,
                                          double inter_node_ratio = default_inter_node_ratio, bool dedup = false) {
  QkvDocumentsPlan out = relabel_attention_ranks(plan, problem, topology, inter_node_ratio, dedup);
  if (out.mask.type == MaskType::causal) detail::move_shards_into_nodes(out, problem, topology, static_cast<long double>(inter_node_ratio));
  return out;
}

/// plan_balanced on a topology: the balanced plan, then place_on_topology
/// (the same balance, fewer weighted bytes).
inline QkvDocumentsPlan plan_balanced(const BalanceProblem& problem, const BalanceOptions& options, const Topology& topology,
                                      double inter_node_ratio = default_inter_node_ratio, const PlanLimits& limits = {}) {
  return place_on_topology(plan_balanced(problem, options, limits), problem, topology, inter_node_ratio, options.dedup);
}

}  // namespace cpdispatch
