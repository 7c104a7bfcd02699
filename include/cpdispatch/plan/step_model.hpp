#pragma once
// A step-time model of one attention layer on a cluster (docs/node-exchange.md,
// "Step-time model"): bytes over each tier / bandwidth + latency per message,
// attention FLOPs / rate, stages overlapped as the context-parallel op runs
// them; for a plan's three KV exchanges and for the peers' schemes on the same
// batch (zig-zag ring, Ulysses, hierarchical all-to-all + ring).
//
//   const QkvMetadata m = plan_qkv(plan);
//   const auto rows = model_step(m, plan_cost(plan), document_lengths(plan),
//                                Topology::uniform(W, 8), ClusterModel::h100_ib(), LayerShape{},
//                                document_slices(plan));
//
// Documents with slices (docs/plan-format.md, section 2e) count their allowed
// pairs, and the plan's exchanges send their needed sets (as planned); the
// peers are given each document's slices (document_slices) to count the same
// pairs.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/topology.hpp"

namespace cpdispatch {

/// One tier of links, per GPU: bytes a second and seconds a message.
struct LinkTier {
  double bandwidth = 1;
  double latency = 0;
};

/// A described cluster: links inside a node and between nodes, per GPU, and
/// the attention FLOP rate of one GPU.
struct ClusterModel {
  LinkTier intra{450e9, 3e-6};  ///< NVLink
  LinkTier inter{50e9, 5e-6};   ///< InfiniBand, 400 Gb/s per GPU
  double attention_flops = 400e12;
  std::int64_t ranks_per_node = 8;

  /// H100: ~400 TFLOP/s attention, NVLink 450 GB/s, 400 Gb/s InfiniBand per GPU.
  static ClusterModel h100_ib() { return {}; }
  /// H200: the H100's compute and links with a faster attention (more memory
  /// bandwidth); NVLink and InfiniBand as the H100.
  static ClusterModel h200_ib() {
    ClusterModel c;
    c.attention_flops = 450e12;
    return c;
  }
  void check() const {
    if (!(intra.bandwidth > 0) || !(inter.bandwidth > 0)) detail::fail("ClusterModel: bandwidths must be positive");
    if (!(intra.latency >= 0) || !(inter.latency >= 0)) detail::fail("ClusterModel: latencies must be at least 0");
    if (!(attention_flops > 0)) detail::fail("ClusterModel: attention_flops must be positive");
    if (ranks_per_node < 1) detail::fail("ClusterModel: ranks_per_node = ", ranks_per_node, " must be at least 1");
  }
};

/// The attention layer: heads, head dimension, bytes per element, and the
/// stages the context-parallel op splits the remote key-values into.
struct LayerShape {
  std::int64_t heads = 32;
  std::int64_t head_dim = 128;
  std::int64_t element_bytes = 2;
  std::int64_t stages = 4;
  void check() const {
    if (heads < 1 || head_dim < 1 || element_bytes < 1 || stages < 1) {
      detail::fail("LayerShape: heads = ", heads, ", head_dim = ", head_dim, ", element_bytes = ", element_bytes,
                   ", stages = ", stages, " must all be at least 1");
    }
  }
  /// Bytes of one token of one tensor (Q, K, V, O or a gradient).
  double token_bytes() const { return static_cast<double>(heads * head_dim * element_bytes); }
};

/// One scheme's modelled time of one layer (seconds): the slowest rank's
/// forward and backward, and its compute and communication alone.
struct StepTime {
  std::string scheme;
  bool feasible = true;  ///< false: the scheme cannot run this shape (e.g. Ulysses with heads % W != 0)
  double forward_compute = 0, forward_comm = 0, forward = 0;
  double backward_compute = 0, backward_comm = 0, backward = 0;
  double step = 0;                   ///< max over ranks of forward + backward
  double inter_node_bytes = 0;       ///< forward bytes that cross between nodes, all ranks
};

namespace detail::step_model {

/// The op runs the local attention first and the remote in `stages`, each
/// overlapping the next stage's transfer: the longer side plus one stage of the shorter.
inline double overlapped(double compute, double comm, std::int64_t stages) {
  return std::max(compute, comm) + std::min(compute, comm) / static_cast<double>(stages);
}

/// Tokens each rank sends to each other rank in one exchange: [src * W + dst].
using PairTokens = std::vector<double>;

/// Time of one exchange on rank r: on each tier, the larger of the bytes it
/// sends and receives over the bandwidth plus a latency per peer; the tiers
/// run at once.
inline double exchange_time(const PairTokens& t, std::size_t W, std::size_t r, double bytes, const Topology& topo,
                            const ClusterModel& c) {
  double send[2] = {0, 0}, recv[2] = {0, 0}, msgs[2] = {0, 0};
  for (std::size_t p = 0; p < W; ++p) {
    if (p == r) continue;
    const int tier = topo.same_node(static_cast<std::int64_t>(r), static_cast<std::int64_t>(p)) ? 0 : 1;
    const double out = t[r * W + p], in = t[p * W + r];
    send[tier] += out;
    recv[tier] += in;
    msgs[tier] += (out > 0 || in > 0) ? 1 : 0;
  }
  const LinkTier tiers[2] = {c.intra, c.inter};
  double slowest = 0;
  for (int k = 0; k < 2; ++k) {
    slowest = std::max(slowest, std::max(send[k], recv[k]) * bytes / tiers[k].bandwidth + msgs[k] * tiers[k].latency);
  }
  return slowest;
}

/// The slowest rank's time of one exchange: when the collective ends.
inline double slowest(const PairTokens& t, std::size_t W, double bytes, const Topology& topo, const ClusterModel& c) {
  double most = 0;
  for (std::size_t r = 0; r < W; ++r) most = std::max(most, exchange_time(t, W, r, bytes, topo, c));
  return most;
}

/// Section 1 / 2: num_recv_tokens[d][s] as [s * W + d].
inline PairTokens flat_tokens(const Metadata& m) {
  const auto W = static_cast<std::size_t>(m.world_size);
  PairTokens out(W * W, 0);
  for (std::size_t d = 0; d < W; ++d)
    for (std::size_t s = 0; s < W; ++s)
      if (s != d) out[s * W + d] = static_cast<double>(m.num_recv_tokens(d, s));
  return out;
}

/// Section 2c: each KV shard once per destination rank.
inline PairTokens dedup_tokens(const Metadata& kv) {
  const auto W = static_cast<std::size_t>(kv.world_size);
  PairTokens out(W * W, 0);
  std::vector<std::int64_t> seen;
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < kv.max_seqs(); ++g) {
      seen.clear();
      for (std::size_t u = 0; u < kv.num_copies(); ++u) {
        const std::int64_t d = kv.has_copies() ? kv.dst_rank(r, g, u) : kv.dst_rank(r, g);
        if (d < 0 || d == static_cast<std::int64_t>(r) || std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
        seen.push_back(d);
        out[r * W + static_cast<std::size_t>(d)] += static_cast<double>(kv.seq_len(r, g));
      }
    }
  }
  return out;
}

/// The node-level exchange's two phases: between nodes, then inside nodes.
inline void node_tokens(const Metadata& kv, const Topology& topo, PairTokens& between, PairTokens& inside) {
  const auto W = static_cast<std::size_t>(kv.world_size);
  between.assign(W * W, 0);
  inside.assign(W * W, 0);
  for (const RankNodeWire& w : plan_node_wire(kv, topo).ranks) {
    const auto r = static_cast<std::size_t>(w.rank);
    for (const NodePiece& p : w.between.send) between[r * W + static_cast<std::size_t>(p.peer)] += static_cast<double>(p.len);
    for (const NodePiece& p : w.inside.send) {
      if (p.peer != w.rank) inside[r * W + static_cast<std::size_t>(p.peer)] += static_cast<double>(p.len);
    }
  }
}

inline double inter_bytes(const PairTokens& t, std::size_t W, const Topology& topo, double bytes) {
  double total = 0;
  for (std::size_t s = 0; s < W; ++s)
    for (std::size_t d = 0; d < W; ++d)
      if (!topo.same_node(static_cast<std::int64_t>(s), static_cast<std::int64_t>(d))) total += t[s * W + d] * bytes;
  return total;
}

/// Pairs of one document of `len` tokens under the mask.
inline double document_pairs(double len, const AttentionMask& mask) {
  if (mask.type == MaskType::full) return len * len;
  if (mask.type == MaskType::sliding_window) {
    const double w = std::min(len, static_cast<double>(mask.window));
    return w * (w + 1) / 2 + (len - w) * w;
  }
  return len * (len + 1) / 2;
}

/// Forward FLOPs of `pairs` (query, key) pairs on every head; backward is 2.5x.
inline double forward_flops(double pairs, const LayerShape& shape) {
  return 4.0 * pairs * static_cast<double>(shape.head_dim * shape.heads);
}

inline StepTime finish(StepTime t) {
  t.step = t.forward + t.backward;
  return t;
}

/// A peer scheme's row, once the model and the shape are checked.
inline StepTime peer_row(const char* scheme, const ClusterModel& c, const LayerShape& shape) {
  c.check();
  shape.check();
  StepTime t;
  t.scheme = scheme;
  return t;
}

/// A batch's tokens and the (query, key) pairs its mask lets through, each
/// document padded first to a multiple of `pad` (the zig-zag layouts' rule; 1:
/// no padding). A document with slices (`slices[j]` not empty) counts its
/// allowed pairs: its padding sees nothing and is seen by nothing.
struct BatchTotals {
  double tokens = 0, pairs = 0;
};
inline BatchTotals batch_totals(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t pad,
                                std::span<const std::vector<AttentionSlice>> slices) {
  if (!slices.empty() && slices.size() != docs.size()) {
    detail::fail("model_step: slices are given for ", slices.size(), " documents, but the batch has ", docs.size());
  }
  BatchTotals b;
  for (std::size_t j = 0; j < docs.size(); ++j) {
    const std::int64_t len = docs[j];
    const double padded = static_cast<double>((len + pad - 1) / pad * pad);
    b.tokens += padded;
    const bool sliced = !slices.empty() && !slices[j].empty();
    b.pairs += sliced ? static_cast<double>(slice_pairs(slices[j], 0, len, 0, len)) : document_pairs(padded, mask);
  }
  return b;
}

}  // namespace detail::step_model

/// The documents' lengths of a plan (each document's shards summed).
inline std::vector<std::int64_t> document_lengths(const QkvDocumentsPlan& plan) {
  std::vector<std::int64_t> out;
  for (const PackedDocument& d : plan.documents) {
    std::int64_t len = 0;
    for (const DocumentShard& s : d.shards) len += s.len;
    out.push_back(len);
  }
  return out;
}
inline std::vector<std::int64_t> document_lengths(const QkvPlan& plan) {
  std::vector<std::int64_t> out;
  for (const RankDocuments& r : plan.ranks)
    for (const Document& d : r.docs) {
      std::int64_t len = 0;
      for (std::int64_t l : d.shard_len) len += l;
      out.push_back(len);
    }
  return out;
}

/// The documents' slices of a plan (section 2e), in document_lengths' order;
/// empty when no document has any (the peers then count the plan's mask).
inline std::vector<std::vector<AttentionSlice>> document_slices(const QkvDocumentsPlan& plan) {
  std::vector<std::vector<AttentionSlice>> out;
  for (const PackedDocument& d : plan.documents) out.push_back(d.slices);
  const bool any = std::any_of(out.begin(), out.end(), [](const auto& s) { return !s.empty(); });
  return any ? out : std::vector<std::vector<AttentionSlice>>{};
}
/// A per-rank plan has no slices.
inline std::vector<std::vector<AttentionSlice>> document_slices(const QkvPlan&) { return {}; }

/// The plan's three KV exchanges: "flat" (section 2), "dedup" (section 2c),
/// "node-level". Queries and outputs travel flat in all three; backward
/// moves the same bytes in reverse (output gradients out, query and KV
/// gradients back).
inline std::vector<StepTime> model_plan(const QkvMetadata& m, const PlanCost& cost, const Topology& topo,
                                        const ClusterModel& c, const LayerShape& shape) {
  using namespace detail::step_model;
  c.check();
  shape.check();
  topo.check_world_size(m.kv_fwd.world_size, "model_plan");
  if (cost.world_size != m.kv_fwd.world_size) detail::fail("model_plan: the cost has world_size = ", cost.world_size, ", the metadata ", m.kv_fwd.world_size);
  const auto W = static_cast<std::size_t>(m.kv_fwd.world_size);
  const double b = shape.token_bytes();
  const PairTokens q = flat_tokens(m.q_fwd);
  PairTokens between, inside;
  node_tokens(m.kv_fwd, topo, between, inside);
  const PairTokens kv_forms[2] = {flat_tokens(m.kv_fwd), dedup_tokens(m.kv_fwd)};
  // Every exchange is a collective: it ends when its busiest rank is done,
  // and the next starts after it, so each costs its slowest rank's time.
  // K and V are two tensors a token. An exchange in reverse takes as long
  // (sent and received swap), so queries out and outputs back cost the same,
  // and backward's gradients as much as forward's copies. The node-level
  // exchange's two phases are two such exchanges (a relay forwards only what
  // it has received): forward between nodes, then inside; backward the reverse.
  const double qo = 2 * slowest(q, W, b, topo, c);
  const double between_time = slowest(between, W, 2 * b, topo, c), inside_time = slowest(inside, W, 2 * b, topo, c);
  const double kv_times[3] = {slowest(kv_forms[0], W, 2 * b, topo, c), slowest(kv_forms[1], W, 2 * b, topo, c), between_time + inside_time};
  const char* names[3] = {"flat", "dedup", "node-level"};
  std::vector<StepTime> out;
  for (int form = 0; form < 3; ++form) {
    StepTime t;
    t.scheme = names[form];
    for (std::size_t r = 0; r < W; ++r) {
      const double fc = forward_flops(static_cast<double>(cost.attention[r]), shape) / c.attention_flops;
      const double fm = qo + kv_times[form], bm = fm;
      const double f = overlapped(fc, fm, shape.stages), bw = overlapped(2.5 * fc, bm, shape.stages);
      if (f + bw > t.step) {
        t.step = f + bw;
        t.forward_compute = fc, t.forward_comm = fm, t.forward = f;
        t.backward_compute = 2.5 * fc, t.backward_comm = bm, t.backward = bw;
      }
    }
    t.inter_node_bytes = inter_bytes(q, W, topo, 2 * b) +
                         (form < 2 ? inter_bytes(kv_forms[form], W, topo, 2 * b) : inter_bytes(between, W, topo, 2 * b));
    out.push_back(t);
  }
  return out;
}

/// Transformer Engine's p2p ring with zig-zag: each document padded to a
/// multiple of 2W, split into 2W chunks (rank i holds chunks i and 2W-1-i),
/// W-1 ring steps each passing every rank's KV (forward) or KV and its
/// gradient (backward) to the next rank, each overlapped with one block of
/// attention. The ring steps in lockstep, so a step waits for its slowest link.
inline StepTime model_zigzag_ring(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                                  const ClusterModel& c, const LayerShape& shape,
                                  std::span<const std::vector<AttentionSlice>> slices = {}) {
  using namespace detail::step_model;
  StepTime t = peer_row("zig-zag ring", c, shape);
  const double W = static_cast<double>(world_size);
  const auto [tokens, pairs] = batch_totals(docs, mask, 2 * world_size, slices);
  const LinkTier link = world_size > c.ranks_per_node ? c.inter : c.intra;
  const double steps = W - 1;
  const double step_bytes = tokens / W * 2 * shape.token_bytes();
  t.forward_compute = forward_flops(pairs / W, shape) / c.attention_flops;
  t.backward_compute = 2.5 * t.forward_compute;
  t.forward_comm = steps * (step_bytes / link.bandwidth + link.latency);
  t.backward_comm = steps * (2 * step_bytes / link.bandwidth + link.latency);
  const std::int64_t stages = std::max<std::int64_t>(1, world_size - 1);
  t.forward = overlapped(t.forward_compute, t.forward_comm, stages);
  t.backward = overlapped(t.backward_compute, t.backward_comm, stages);
  const double nodes = std::ceil(W / static_cast<double>(c.ranks_per_node));
  t.inter_node_bytes = nodes > 1 ? steps * nodes * step_bytes : 0;  // one ring link per node boundary
  return finish(t);
}

/// Ulysses: an all-to-all from sequence to heads (Q, K, V) before attention
/// and back (O) after it, the reverse for the gradients; nothing overlaps.
/// Needs heads % W == 0.
inline StepTime model_ulysses(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                              const ClusterModel& c, const LayerShape& shape, std::span<const std::vector<AttentionSlice>> slices = {}) {
  using namespace detail::step_model;
  StepTime t = peer_row("ulysses", c, shape);
  if (shape.heads % world_size != 0) {
    t.feasible = false;
    return t;
  }
  const double W = static_cast<double>(world_size);
  const auto [tokens, pairs] = batch_totals(docs, mask, 1, slices);
  const double local = std::ceil(tokens / W) * shape.token_bytes();  // one tensor's bytes per rank
  const double rpn = static_cast<double>(std::min(c.ranks_per_node, world_size));
  // Four tensors each way: of a rank's share, (rpn-1)/W stays in the node, (W-rpn)/W leaves it.
  const double intra = 4 * local * (rpn - 1) / W / c.intra.bandwidth + (rpn - 1) * c.intra.latency;
  const double inter = 4 * local * (W - rpn) / W / c.inter.bandwidth + (W - rpn) * c.inter.latency;
  t.forward_comm = t.backward_comm = std::max(intra, inter);
  t.forward_compute = forward_flops(pairs / W, shape) / c.attention_flops;
  t.backward_compute = 2.5 * t.forward_compute;
  t.forward = t.forward_compute + t.forward_comm;
  t.backward = t.backward_compute + t.backward_comm;
  t.inter_node_bytes = 4 * local * (W - rpn);
  return finish(t);
}

/// Transformer Engine's a2a+p2p: Ulysses inside each node (heads split over
/// its ranks_per_node ranks), a zig-zag ring between nodes (documents padded
/// to a multiple of 2 * nodes), each ring step overlapped. Needs heads %
/// ranks_per_node == 0 and world_size % ranks_per_node == 0.
inline StepTime model_hierarchical(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                                   const ClusterModel& c, const LayerShape& shape,
                                   std::span<const std::vector<AttentionSlice>> slices = {}) {
  using namespace detail::step_model;
  StepTime t = peer_row("a2a+p2p", c, shape);
  const std::int64_t rpn = std::min(c.ranks_per_node, world_size);
  if (shape.heads % rpn != 0 || world_size % rpn != 0) {
    t.feasible = false;
    return t;
  }
  const std::int64_t nodes = world_size / rpn;
  const double W = static_cast<double>(world_size), N = static_cast<double>(nodes), R = static_cast<double>(rpn);
  const auto [tokens, pairs] = batch_totals(docs, mask, 2 * nodes, slices);
  const double local = tokens / W * shape.token_bytes();
  const double a2a = 4 * local * (R - 1) / R / c.intra.bandwidth + (R - 1) * c.intra.latency;
  // After the all-to-all a rank holds its node's tokens on heads/rpn heads: tokens/N * (1/R) per tensor.
  const double step_bytes = tokens / N / R * 2 * shape.token_bytes();
  const double steps = N - 1;
  const double ring_f = steps * (step_bytes / c.inter.bandwidth + c.inter.latency);
  const double ring_b = steps * (2 * step_bytes / c.inter.bandwidth + c.inter.latency);
  const std::int64_t stages = std::max<std::int64_t>(1, nodes - 1);
  t.forward_compute = forward_flops(pairs / W, shape) / c.attention_flops;
  t.backward_compute = 2.5 * t.forward_compute;
  t.forward_comm = a2a + ring_f;
  t.backward_comm = a2a + ring_b;
  t.forward = a2a + overlapped(t.forward_compute, ring_f, stages);
  t.backward = a2a + overlapped(t.backward_compute, ring_b, stages);
  t.inter_node_bytes = steps * W * step_bytes;
  return finish(t);
}

/// All six rows: the plan's three exchanges, then the peers on the same
/// batch. A plan with slices (its layout has attn.entries) needs its
/// documents' slices (document_slices), so that the peers count its pairs.
inline std::vector<StepTime> model_step(const QkvMetadata& m, const PlanCost& cost, const std::vector<std::int64_t>& docs,
                                        const Topology& topo, const ClusterModel& c, const LayerShape& shape,
                                        std::span<const std::vector<AttentionSlice>> slices = {}) {
  if (slices.empty() && !m.attn.entries.empty()) {
    detail::fail("model_step: the plan's documents have slices; pass document_slices(plan) so that the peers count their pairs");
  }
  std::vector<StepTime> rows = model_plan(m, cost, topo, c, shape);
  const std::int64_t W = m.kv_fwd.world_size;
  rows.push_back(model_zigzag_ring(docs, cost.mask, W, c, shape, slices));
  rows.push_back(model_ulysses(docs, cost.mask, W, c, shape, slices));
  rows.push_back(model_hierarchical(docs, cost.mask, W, c, shape, slices));
  return rows;
}


/// The cost slacks plan_for_cluster tries: how much less balanced in
/// attention a plan may be for fewer bytes (BalanceOptions::cost_slack).
inline constexpr double cluster_slacks[] = {0.01, 0.05, 0.1, 0.25, 0.5, 1.0};

/// What plan_for_cluster chose.
struct ClusterPlan {
  QkvDocumentsPlan plan;
  double cost_slack = 0;  ///< the slack it was balanced with
  StepTime modelled;      ///< its modelled step (the exchange options.dedup selects)
};

/// The balanced plan the step model says runs fastest on `cluster`:
/// plan_balanced at each slack of `slacks`, each modelled with the exchange
/// it will run (dedup when options.dedup, else flat), the fastest kept (the
/// first on a tie, so the better balanced). Where attention dominates the
/// step this is plan_balanced's own plan; where the links do, it gives up
/// balance for bytes. `options.cost_slack` is ignored.
inline ClusterPlan plan_for_cluster(const BalanceProblem& problem, const ClusterModel& cluster, const LayerShape& shape,
                                    const Topology& topology, BalanceOptions options = {},
                                    std::span<const double> slacks = cluster_slacks, const PlanLimits& limits = {}) {
  if (slacks.empty()) detail::fail("plan_for_cluster: no cost slack to try");
  ClusterPlan best;
  bool found = false;
  for (const double slack : slacks) {
    if (!(slack >= 0)) detail::fail("plan_for_cluster: cost slack ", slack, " must be at least 0");
    options.cost_slack = slack;
    QkvDocumentsPlan plan = plan_balanced(problem, options, limits);
    plan.dedup = options.dedup;
    const std::vector<StepTime> rows = model_plan(plan_qkv(plan, limits), plan_cost(plan, 1, 1, limits), topology, cluster, shape);
    const StepTime& t = rows[options.dedup ? 1 : 0];
    if (!found || t.step < best.modelled.step) {
      best = ClusterPlan{std::move(plan), slack, t};
      found = true;
    }
  }
  return best;
}

}  // namespace cpdispatch
