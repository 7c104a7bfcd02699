#pragma once
// A step-time model of one attention layer on a cluster (docs/node-exchange.md,
// "Step-time model"): bytes over each tier / bandwidth + latency per message,
// attention FLOPs / rate (or, with ClusterModel::kernel, the kernel's time
// summed over the entries each rank runs: kernel_rate.hpp), stages
// overlapped as the context-parallel op runs them; for a plan's three KV
// exchanges and for the peers' schemes on the same batch (zig-zag ring,
// Ulysses, and USP -- Ulysses inside groups of ranks,
// the ring across them -- of which the first two and Transformer Engine's
// a2a+p2p are cases), with grouped-query attention's fewer key-value heads.
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
#include <initializer_list>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/model/kernel_rate.hpp"
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
/// the attention FLOP rate of one GPU -- or, with `kernel`, the attention
/// kernel's time over each entry a rank runs (kernel_rate.hpp): then a
/// rank's compute is the sum over its entries, so short shards and small
/// heads cost what the kernel takes on them.
struct ClusterModel {
  LinkTier intra{450e9, 3e-6};  ///< NVLink
  LinkTier inter{50e9, 5e-6};   ///< InfiniBand, 400 Gb/s per GPU
  double attention_flops = 400e12;
  std::int64_t ranks_per_node = 8;
  std::optional<KernelRates> kernel{};  ///< unset: every FLOP at attention_flops

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
    if (kernel) kernel->check();
  }
};

/// The attention layer: query heads, key-value heads (grouped-query
/// attention), head dimension, bytes per element, and the stages the
/// context-parallel op splits the remote key-values into. `heads_q` alone sets
/// both head counts: `heads_kv` = 0 means as many key-value heads as query heads.
struct LayerShape {
  std::int64_t heads_q = 32;  ///< query heads
  std::int64_t head_dim = 128;
  std::int64_t element_bytes = 2;
  std::int64_t stages = 4;
  std::int64_t heads_kv = 0;  ///< key-value heads; 0: as many as heads_q
  void check() const {
    if (heads_q < 1 || head_dim < 1 || element_bytes < 1 || stages < 1) {
      detail::fail("LayerShape: heads_q = ", heads_q, ", head_dim = ", head_dim, ", element_bytes = ", element_bytes,
                   ", stages = ", stages, " must all be at least 1");
    }
    if (heads_kv < 0 || heads_q % kv_heads() != 0) {
      detail::fail("LayerShape: heads_kv = ", heads_kv, " must be 0 (as many as heads_q) or divide heads_q = ", heads_q);
    }
  }
  std::int64_t kv_heads() const { return heads_kv > 0 ? heads_kv : heads_q; }
  /// Bytes of one token of a query-sized tensor (Q, O or their gradients).
  double q_token_bytes() const { return static_cast<double>(heads_q * head_dim * element_bytes); }
  /// Bytes of one token of K or of V (or of their gradients).
  double kv_token_bytes() const { return static_cast<double>(kv_heads() * head_dim * element_bytes); }
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
  std::int64_t group = 0;            ///< model_usp's group size u (the ring 1, Ulysses W); 0 for the plan's rows
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
/// Compute follows the query heads (a key-value head serves its group's query heads).
inline double forward_flops(double pairs, const LayerShape& shape) {
  return 4.0 * pairs * static_cast<double>(shape.head_dim * shape.heads_q);
}

/// Bytes a token of a head-parallel document (section 2f) sends each other
/// rank of its group: 1/u of the query heads, and 1/u of the key-value heads
/// (one head when u is a multiple of them). `q`: a query-sized tensor (Q, O
/// or their gradients); `qkv`: Q, K and V together.
struct HeadParallelTokenBytes {
  double q = 0, qkv = 0;
};
inline HeadParallelTokenBytes head_parallel_token_bytes(const QkvMetadata& m, const LayerShape& shape) {
  if (m.hp_attn.degree == 0) return {};
  const std::int64_t u = m.hp_attn.degree, W = m.hp_fwd.world_size;
  if (!head_parallel_degree_allowed(u, W, shape.heads_q, shape.kv_heads())) {
    fail("model_plan: head_parallel_degree = ", u, " does not fit heads_q = ", shape.heads_q, ", heads_kv = ", shape.kv_heads(),
         ": it must divide heads_q, and divide heads_kv or be a multiple of it");
  }
  const double U = static_cast<double>(u), kv_share = shape.kv_heads() % u == 0 ? U : static_cast<double>(shape.kv_heads());
  const double q = shape.q_token_bytes() / U;
  return {q, q + 2 * shape.kv_token_bytes() / kv_share};
}

/// Tensors that ride one post: per pair, the sum of each one's tokens times its bytes a token.
inline PairTokens one_post(std::initializer_list<std::pair<const PairTokens*, double>> tensors) {
  PairTokens out(tensors.begin()->first->size(), 0);
  for (const auto& [tokens, bytes] : tensors)
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += (*tokens)[i] * bytes;
  return out;
}

/// Each rank's compute of a plan: its entries priced by the cluster's
/// kernel, else its pairs (plan_cost's) at attention_flops, backward 2.5x.
inline std::vector<ComputeSeconds> plan_compute(const QkvMetadata& m, const PlanCost& cost, const ClusterModel& c, const LayerShape& shape) {
  if (c.kernel) return plan_compute_seconds(m, *c.kernel, shape.heads_q, shape.head_dim);
  std::vector<ComputeSeconds> out;
  const auto seconds = [&](std::int64_t pairs) { return forward_flops(static_cast<double>(pairs), shape) / c.attention_flops; };
  for (std::size_t r = 0; r < cost.attention.size(); ++r) {
    const double f = seconds(cost.attention[r]), hp = r < cost.head_parallel_attention.size() ? seconds(cost.head_parallel_attention[r]) : 0.0;
    out.push_back({f, 2.5 * f, hp, 2.5 * hp});
  }
  return out;
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

/// The ranks whose ring successor (the same rank of the next group of
/// `group`) sits on another node: the links that cross between nodes in
/// each ring step.
inline double ring_crossings(std::int64_t world_size, std::int64_t group, std::int64_t ranks_per_node) {
  double n = 0;
  for (std::int64_t r = 0; r < world_size; ++r) n += r / ranks_per_node != (r + group) % world_size / ranks_per_node ? 1 : 0;
  return n;
}

/// The all-to-all inside groups of `group` consecutive ranks, each rank's
/// `bytes` spread evenly over its group: per rank, the slower of the part
/// that stays in its node and the part that leaves it, plus a latency a
/// peer; the slowest rank's time and the bytes that cross between nodes.
struct GroupAllToAll {
  double seconds = 0, inter_node_bytes = 0;
};
inline GroupAllToAll group_all_to_all(double bytes, std::int64_t world_size, std::int64_t group, const ClusterModel& c) {
  GroupAllToAll out;
  for (std::int64_t r = 0; r < world_size; ++r) {
    const std::int64_t first = r / group * group, node = r / c.ranks_per_node;
    std::int64_t inside = 0;
    for (std::int64_t p = first; p < first + group; ++p) inside += p != r && p / c.ranks_per_node == node ? 1 : 0;
    const double in = static_cast<double>(inside), across = static_cast<double>(group - 1 - inside), U = static_cast<double>(group);
    const double intra = bytes * in / U / c.intra.bandwidth + in * c.intra.latency;
    const double inter = bytes * across / U / c.inter.bandwidth + across * c.inter.latency;
    out.seconds = std::max(out.seconds, std::max(intra, inter));
    out.inter_node_bytes += bytes * across / U;
  }
  return out;
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
  const auto add = [](std::int64_t len, const DocumentShard& s) { return len + s.len; };
  for (const PackedDocument& d : plan.documents) out.push_back(std::accumulate(d.shards.begin(), d.shards.end(), std::int64_t{0}, add));
  return out;
}
inline std::vector<std::int64_t> document_lengths(const QkvPlan& plan) {
  std::vector<std::int64_t> out;
  for (const RankDocuments& r : plan.ranks)
    for (const Document& d : r.docs) out.push_back(std::accumulate(d.shard_len.begin(), d.shard_len.end(), std::int64_t{0}));
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

/// The most key-value tokens one rank sends or receives in a plan's
/// forward exchange (K and V each carry them): every copy (flat, section 2)
/// or each shard once per destination rank (dedup, section 2c).
inline double max_kv_tokens_per_rank(const Metadata& kv_fwd, bool dedup) {
  using namespace detail::step_model;
  const auto W = static_cast<std::size_t>(kv_fwd.world_size);
  const PairTokens t = dedup ? dedup_tokens(kv_fwd) : flat_tokens(kv_fwd);
  double most = 0;
  for (std::size_t r = 0; r < W; ++r) {
    double sent = 0, received = 0;
    for (std::size_t p = 0; p < W; ++p) sent += t[r * W + p], received += t[p * W + r];
    most = std::max(most, std::max(sent, received));
  }
  return most;
}

/// The plan's three KV exchanges: "flat" (section 2), "dedup" (section 2c),
/// "node-level". Queries and outputs travel flat in all three. The posts are
/// those the op makes: forward, the queries, the key-values (flat or
/// deduplicated) and the head-parallel documents' slabs (section 2f) ride
/// one post out, in `stages` stage groups that the dispatched attention
/// overlaps; the head-parallel documents are priced as attended once all have
/// arrived, and the outputs of both parts ride one post home after the
/// kernel. Backward, the output gradients come in stage groups and the
/// dispatched key-value gradients leave as each group's are done, both
/// overlapped with the dispatched attention; then the head-parallel
/// documents' backward, and the query gradients of both parts with the
/// head-parallel key-value gradients ride one post home. The node-level
/// exchange's key-values take their own two phases each way. (The op
/// attends a head-parallel document in the round its last slab arrives,
/// and its head-parallel backward also overlaps the last key-value
/// gradients' travel, which this does not count: the step is priced high by
/// at most the work of documents whole before the last round and, backward,
/// the smaller of the two.) A head-parallel document's work counts 1/u on
/// each rank of its group, as plan_cost counts it.
inline std::vector<StepTime> model_plan(const QkvMetadata& m, const PlanCost& cost, const Topology& topo,
                                        const ClusterModel& c, const LayerShape& shape) {
  using namespace detail::step_model;
  c.check();
  shape.check();
  topo.check_world_size(m.kv_fwd.world_size, "model_plan");
  if (cost.world_size != m.kv_fwd.world_size) detail::fail("model_plan: the cost has world_size = ", cost.world_size, ", the metadata ", m.kv_fwd.world_size);
  const auto W = static_cast<std::size_t>(m.kv_fwd.world_size);
  const double bq = shape.q_token_bytes(), bkv = 2 * shape.kv_token_bytes();  // K and V: two tensors a token
  const PairTokens q = flat_tokens(m.q_fwd), none(W * W, 0);
  const PairTokens hp = m.hp_attn.degree == 0 ? none : flat_tokens(m.hp_fwd);
  const HeadParallelTokenBytes bhp = head_parallel_token_bytes(m, shape);
  PairTokens between, inside;
  node_tokens(m.kv_fwd, topo, between, inside);
  const PairTokens kv_forms[3] = {flat_tokens(m.kv_fwd), dedup_tokens(m.kv_fwd), none};
  // Every post is a collective: it ends when its busiest rank is done, and
  // the next starts after it, so each costs its slowest rank's time. A post
  // in reverse takes as long (sent and received swap). The node-level
  // exchange's two phases are two such exchanges (a relay forwards only what
  // it has received): forward between nodes, then inside; backward the reverse.
  const double q_home = slowest(one_post({{&q, bq}, {&hp, bhp.q}}), W, 1, topo, c);         // outputs home; output gradients out
  const double grads_home = slowest(one_post({{&q, bq}, {&hp, bhp.qkv}}), W, 1, topo, c);  // query gradients and the slabs' dk, dv
  const double node_phases = slowest(between, W, bkv, topo, c) + slowest(inside, W, bkv, topo, c);
  const char* names[3] = {"flat", "dedup", "node-level"};
  std::vector<StepTime> out;
  const std::vector<ComputeSeconds> compute = plan_compute(m, cost, c, shape);
  for (int form = 0; form < 3; ++form) {
    const double in = slowest(one_post({{&q, bq}, {&kv_forms[form], bkv}, {&hp, bhp.qkv}}), W, 1, topo, c) + (form == 2 ? node_phases : 0);
    const double kv_home = form == 2 ? node_phases : slowest(kv_forms[form], W, bkv, topo, c);
    const double fm = in + q_home, bm = q_home + kv_home + grads_home;
    StepTime t;
    t.scheme = names[form];
    for (std::size_t r = 0; r < W; ++r) {
      const ComputeSeconds& cr = compute[r];
      const double f = overlapped(cr.forward - cr.head_parallel_forward, in, shape.stages) + cr.head_parallel_forward + q_home;
      const double bw = overlapped(cr.backward - cr.head_parallel_backward, q_home + kv_home, shape.stages) + cr.head_parallel_backward + grads_home;
      if (f + bw > t.step) {
        t.step = f + bw;
        t.forward_compute = cr.forward, t.forward_comm = fm, t.forward = f;
        t.backward_compute = cr.backward, t.backward_comm = bm, t.backward = bw;
      }
    }
    t.inter_node_bytes = inter_bytes(q, W, topo, 2 * bq) +
                         (form < 2 ? inter_bytes(kv_forms[form], W, topo, bkv) : inter_bytes(between, W, topo, bkv));
    out.push_back(t);
  }
  return out;
}

/// USP (unified sequence parallelism): Ulysses inside groups of `group`
/// consecutive ranks (an all-to-all from sequence to heads, each rank then
/// holding its group's tokens on heads / group query heads and
/// heads_kv / group key-value heads), and ring attention with the zig-zag
/// layout across the W / group groups (documents padded to a multiple of
/// 2 x groups, split into 2 x groups chunks, group g holding chunks g and
/// 2 x groups - 1 - g): groups - 1 ring steps, each passing every rank's
/// key-values (forward) or key-values and their gradients (backward) to
/// the same rank of the next group, overlapped with one block of attention;
/// the ring steps in lockstep, so a step waits for its slowest link. The
/// all-to-alls overlap nothing. Needs group | W, group | heads and
/// group | key-value heads (else not feasible); group = 1 is the zig-zag
/// ring, group = W Ulysses, group = ranks_per_node Transformer Engine's a2a+p2p.
inline StepTime model_usp(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                          std::int64_t group, const ClusterModel& c, const LayerShape& shape,
                          std::span<const std::vector<AttentionSlice>> slices = {}) {
  using namespace detail::step_model;
  StepTime t = peer_row("usp", c, shape);
  t.scheme += " u=" + std::to_string(group);
  t.group = group;
  if (group < 1 || group > world_size) detail::fail("model_usp: group = ", group, " must be between 1 and world_size = ", world_size);
  if (world_size % group != 0 || shape.heads_q % group != 0 || shape.kv_heads() % group != 0) {
    t.feasible = false;
    return t;
  }
  const std::int64_t groups = world_size / group;
  const double W = static_cast<double>(world_size), G = static_cast<double>(groups), U = static_cast<double>(group);
  const auto [tokens, pairs] = batch_totals(docs, mask, groups > 1 ? 2 * groups : 1, slices);
  // Forward: Q, K and V to heads, O back; backward: dO to heads, dQ, dK and dV back -- the same bytes.
  const double a2a_bytes = std::ceil(tokens / W) * 2 * (shape.q_token_bytes() + shape.kv_token_bytes());
  const GroupAllToAll a2a = group_all_to_all(a2a_bytes, world_size, group, c);
  const double step_bytes = tokens / G / U * 2 * shape.kv_token_bytes();
  const double crossings = ring_crossings(world_size, group, c.ranks_per_node);
  const LinkTier link = crossings > 0 ? c.inter : c.intra;
  const double steps = G - 1;
  const double ring_f = steps * (step_bytes / link.bandwidth + link.latency);
  const double ring_b = steps * (2 * step_bytes / link.bandwidth + link.latency);
  const std::int64_t stages = std::max<std::int64_t>(1, groups - 1);
  // Every rank computes alike: its share of the pairs, or with the kernel's rates the entries of its chunks.
  const double one_rate = forward_flops(pairs / W, shape) / c.attention_flops;
  const ComputeSeconds compute = c.kernel ? usp_compute_seconds(docs, mask, world_size, group, *c.kernel, shape.heads_q, shape.head_dim, slices)
                                          : ComputeSeconds{one_rate, 2.5 * one_rate};
  t.forward_compute = compute.forward;
  t.backward_compute = compute.backward;
  t.forward_comm = a2a.seconds + ring_f;
  t.backward_comm = a2a.seconds + ring_b;
  t.forward = a2a.seconds + overlapped(t.forward_compute, ring_f, stages);
  t.backward = a2a.seconds + overlapped(t.backward_compute, ring_b, stages);
  t.inter_node_bytes = a2a.inter_node_bytes + steps * crossings * step_bytes;
  return finish(t);
}

/// The group sizes USP can run: every u with 1 < u < W dividing W, the
/// query heads and the key-value heads (u = 1 is the ring, u = W Ulysses).
inline std::vector<std::int64_t> usp_groups(std::int64_t world_size, const LayerShape& shape) {
  std::vector<std::int64_t> out;
  for (std::int64_t u = 2; u < world_size; ++u) {
    if (world_size % u == 0 && shape.heads_q % u == 0 && shape.kv_heads() % u == 0) out.push_back(u);
  }
  return out;
}

/// USP at the group size of usp_groups that the model finds fastest (the
/// first on a tie); not feasible when there is none.
inline StepTime model_usp_best(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                               const ClusterModel& c, const LayerShape& shape, std::span<const std::vector<AttentionSlice>> slices = {}) {
  StepTime best = detail::step_model::peer_row("usp", c, shape);
  best.feasible = false;
  for (const std::int64_t u : usp_groups(world_size, shape)) {
    StepTime t = model_usp(docs, mask, world_size, u, c, shape, slices);
    if (!best.feasible || t.step < best.step) best = std::move(t);
  }
  return best;
}

/// Transformer Engine's p2p ring with zig-zag: USP with groups of one rank.
inline StepTime model_zigzag_ring(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                                  const ClusterModel& c, const LayerShape& shape,
                                  std::span<const std::vector<AttentionSlice>> slices = {}) {
  StepTime t = model_usp(docs, mask, world_size, 1, c, shape, slices);
  t.scheme = "zig-zag ring";
  return t;
}

/// Ulysses (DeepSpeed): USP with one group of all W ranks -- all-to-alls
/// only, the query heads and the key-value heads split over the ranks.
inline StepTime model_ulysses(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                              const ClusterModel& c, const LayerShape& shape, std::span<const std::vector<AttentionSlice>> slices = {}) {
  StepTime t = model_usp(docs, mask, world_size, world_size, c, shape, slices);
  t.scheme = "ulysses";
  return t;
}

/// Transformer Engine's a2a+p2p: USP with a group per node (ranks_per_node
/// ranks; not feasible unless it divides W and the heads).
inline StepTime model_hierarchical(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                                   const ClusterModel& c, const LayerShape& shape,
                                   std::span<const std::vector<AttentionSlice>> slices = {}) {
  c.check();
  StepTime t = model_usp(docs, mask, world_size, std::min(c.ranks_per_node, world_size), c, shape, slices);
  t.scheme = "a2a+p2p";
  return t;
}

/// All seven rows: the plan's three exchanges, then the peers on the same
/// batch (USP at its best group size). A plan with slices (its layout has attn.entries) needs its
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
  rows.push_back(model_usp_best(docs, cost.mask, W, c, shape, slices));
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

/// The head-parallel group sizes plan_for_cluster tries for a layer: every
/// u > 1 that head_parallel_degree_allowed admits, in increasing order.
inline std::vector<std::int64_t> head_parallel_degrees(std::int64_t world_size, const LayerShape& shape) {
  std::vector<std::int64_t> out;
  for (std::int64_t u = 2; u <= world_size; ++u)
    if (head_parallel_degree_allowed(u, world_size, shape.heads_q, shape.kv_heads())) out.push_back(u);
  return out;
}

namespace detail::step_model {

/// BalanceOptions::pair_weight for a layer on a cluster: a pair's attention
/// time, forward and backward, over the time of one byte unit of `problem`
/// inside a node, both ways (a unit of q_bytes stands for a query token's
/// bytes, else one of kv_bytes for K and V of a token).
inline double pair_weight(const BalanceProblem& p, const ClusterModel& c, const LayerShape& shape) {
  const double unit = p.q_bytes > 0    ? shape.q_token_bytes() / static_cast<double>(p.q_bytes)
                      : p.kv_bytes > 0 ? 2 * shape.kv_token_bytes() / static_cast<double>(p.kv_bytes)
                                       : 0;
  if (unit == 0) return 0;
  return 3.5 * forward_flops(1, shape) / c.attention_flops / (2 * unit / c.intra.bandwidth);
}

/// `plan` as the step model prices it on the cluster, kept in `best` when faster.
inline void keep_faster(QkvDocumentsPlan plan, double slack, const BalanceOptions& options, const ClusterModel& cluster,
                        const LayerShape& shape, const Topology& topology, const PlanLimits& limits, std::optional<ClusterPlan>& best) {
  plan.dedup = options.dedup;
  const std::vector<StepTime> rows = model_plan(plan_qkv(plan, limits), plan_cost(plan, 1, 1, limits), topology, cluster, shape);
  const StepTime& t = rows[options.dedup ? 1 : 0];
  if (!best || t.step < best->modelled.step) best = ClusterPlan{std::move(plan), slack, t};
}

}  // namespace detail::step_model

/// The balanced plan the step model says runs fastest on `cluster`:
/// plan_balanced at each slack of `slacks`, each modelled with the exchange
/// it will run (dedup when options.dedup, else flat), the fastest kept (the
/// first on a tie, so the better balanced). Where attention dominates the
/// step this is plan_balanced's own plan; where the links do, it gives up
/// balance for bytes. With options.head_parallel = automatic it also tries,
/// at each slack, head-parallel documents in groups of each u of
/// head_parallel_degrees (the heads from `shape`, the link weights from
/// `cluster`; a u that makes no document head-parallel is the plan without),
/// the plan without them first, and, where the heads allow a group of all
/// W ranks, every document head-parallel over them (Ulysses' layout, cost
/// slack 0; left out where a rank's recv_capacity cannot hold it).
/// `options.cost_slack`, and with automatic options' heads,
/// head_parallel_degree and link weights, are ignored.
inline ClusterPlan plan_for_cluster(const BalanceProblem& problem, const ClusterModel& cluster, const LayerShape& shape,
                                    const Topology& topology, BalanceOptions options = {},
                                    std::span<const double> slacks = cluster_slacks, const PlanLimits& limits = {}) {
  if (slacks.empty()) detail::fail("plan_for_cluster: no cost slack to try");
  cluster.check();
  shape.check();
  options.heads_q = shape.heads_q;
  options.heads_kv = shape.kv_heads();
  options.ranks_per_node = cluster.ranks_per_node;
  options.inter_node_ratio = cluster.intra.bandwidth / cluster.inter.bandwidth;
  options.pair_weight = detail::step_model::pair_weight(problem, cluster, shape);
  std::optional<ClusterPlan> best;
  std::optional<QkvDocumentsPlan> first;  // the first slack's dispatched plan
  for (const double slack : slacks) {
    if (!(slack >= 0)) detail::fail("plan_for_cluster: cost slack ", slack, " must be at least 0");
    options.cost_slack = slack;
    const QkvDocumentsPlan dispatched = detail::balance::plan_dispatched(problem, options, limits);
    if (!first) first = dispatched;
    detail::step_model::keep_faster(dispatched, slack, options, cluster, shape, topology, limits, best);
    if (options.head_parallel == HeadParallel::off) continue;
    for (const std::int64_t u : head_parallel_degrees(problem.world_size, shape)) {
      options.head_parallel_degree = u;
      QkvDocumentsPlan plan = detail::balance::with_head_parallel(problem, options, detail::balance::check_head_parallel(problem, options), dispatched);
      if (plan.head_parallel_degree != 0) detail::step_model::keep_faster(std::move(plan), slack, options, cluster, shape, topology, limits, best);
    }
  }
  const std::vector<std::int64_t> degrees = head_parallel_degrees(problem.world_size, shape);
  if (options.head_parallel != HeadParallel::off && !degrees.empty() && degrees.back() == problem.world_size) {
    try {  // Ulysses' layout, so that the plan is never modelled slower than it; not where a rank cannot hold it
      detail::step_model::keep_faster(detail::balance::all_head_parallel(problem, problem.world_size, std::move(*first)), 0, options, cluster, shape,
                                      topology, limits, best);
    } catch (const capacity_error&) {
    }
  }
  return std::move(*best);
}

}  // namespace cpdispatch
