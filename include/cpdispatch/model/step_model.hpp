#pragma once
// A step-time model of one attention layer on a cluster (docs/node-exchange.md,
// "Step-time model"): bytes over each tier / bandwidth + latency per message,
// attention FLOPs / rate (or, with ClusterModel::kernel, the kernel's time
// summed over the entries each rank runs: kernel_rate.hpp), a plan's stage
// groups and rounds as the context-parallel op runs them; for a plan's three KV
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

#include "cpdispatch/attention/detail/share_entries.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/attention/step_trace.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/model/kernel_rate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
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

/// `stages` equal steps, each step's transfer overlapping the previous
/// step's attention (a ring): the longer side plus one step of the shorter.
inline double overlapped(double compute, double comm, std::int64_t stages) {
  return std::max(compute, comm) + std::min(compute, comm) / static_cast<double>(stages);
}

/// Tokens each rank sends to each other rank in one exchange: [src * W + dst].
using PairTokens = std::vector<double>;

/// Rank r's part of one exchange `t`, per tier (0 inside its node, 1
/// between nodes): what it sends, what it receives, and its peers with
/// bytes either way.
struct TierTraffic {
  double send[2] = {0, 0}, recv[2] = {0, 0}, peers[2] = {0, 0};
};
inline TierTraffic tier_traffic(const PairTokens& t, std::size_t W, std::size_t r, const Topology& topo) {
  TierTraffic out;
  for (std::size_t p = 0; p < W; ++p) {
    if (p == r) continue;
    const int tier = topo.same_node(static_cast<std::int64_t>(r), static_cast<std::int64_t>(p)) ? 0 : 1;
    const double sent = t[r * W + p], received = t[p * W + r];
    out.send[tier] += sent;
    out.recv[tier] += received;
    out.peers[tier] += (sent > 0 || received > 0) ? 1 : 0;
  }
  return out;
}

/// Time of one exchange on rank r: on each tier, the larger of the bytes it
/// sends and receives over the bandwidth plus a latency per peer; the tiers
/// run at once.
inline double exchange_time(const PairTokens& t, std::size_t W, std::size_t r, double bytes, const Topology& topo,
                            const ClusterModel& c) {
  const TierTraffic x = tier_traffic(t, W, r, topo);
  const LinkTier tiers[2] = {c.intra, c.inter};
  double slowest = 0;
  for (int k = 0; k < 2; ++k) {
    slowest = std::max(slowest, std::max(x.send[k], x.recv[k]) * bytes / tiers[k].bandwidth + x.peers[k] * tiers[k].latency);
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
  for (const std::int64_t pairs : cost.attention) out.push_back({seconds(pairs), 2.5 * seconds(pairs)});
  return out;
}

/// `t` ([home * W + attention] bytes, either way) split by stage group:
/// the pair (h, a) in group stage_group(h, a); one group of everything when groups = 0.
inline std::vector<PairTokens> by_group(const PairTokens& t, std::size_t W, int groups) {
  std::vector<PairTokens> out(static_cast<std::size_t>(std::max(groups, 1)), PairTokens(W * W, 0));
  for (std::size_t h = 0; h < W; ++h)
    for (std::size_t a = 0; a < W; ++a) {
      if (h == a) continue;
      const int g = groups == 0 ? 0 : stage_group(static_cast<int>(h), static_cast<int>(a), static_cast<int>(W), groups);
      out[static_cast<std::size_t>(g)][h * W + a] = t[h * W + a];
    }
  return out;
}

/// Each stage group's post of `t`: its slowest rank's time (the step's communication, summed).
inline std::vector<double> group_posts(const PairTokens& t, std::size_t W, int groups, const Topology& topo, const ClusterModel& c) {
  std::vector<double> out;
  for (const PairTokens& g : by_group(t, W, groups)) out.push_back(slowest(g, W, 1, topo, c));
  return out;
}

/// `t` the other way: [dst * W + src] becomes [src * W + dst].
inline PairTokens transposed(const PairTokens& t, std::size_t W) {
  PairTokens out(t.size(), 0);
  for (std::size_t s = 0; s < W; ++s)
    for (std::size_t d = 0; d < W; ++d) out[d * W + s] = t[s * W + d];
  return out;
}

/// Each rank's links as the op's posts use them (SimulatedLinkTransport's
/// schedule; NCCL's enqueue): one full-duplex link a rank per tier, each
/// side queuing its own traffic. A rank's post occupies its sending side
/// for a latency a peer it exchanges with on that tier plus the bytes it
/// sends over the bandwidth (its receiving side likewise for what it
/// receives), each from the post or from when that side frees up; what a
/// post brings a rank is there once its own sides are done and every peer
/// that sends it bytes has sent them. No rank waits for the others to post.
class RankLinks {
 public:
  RankLinks(std::size_t W, const Topology& topo, const ClusterModel& c)
      : W_(W), topo_(&topo), tiers_{c.intra, c.inter}, send_free_(2 * W, 0.0), recv_free_(2 * W, 0.0) {}

  /// Every rank posts its part of `t` ([src * W + dst] bytes), rank r at
  /// `at[r]`; returns when each rank has what the post brings it.
  std::vector<double> post(const PairTokens& t, std::span<const double> at) {
    std::vector<double> sent(2 * W_), out(W_);
    for (std::size_t r = 0; r < W_; ++r) {
      const TierTraffic x = tier_traffic(t, W_, r, *topo_);
      out[r] = at[r];
      for (std::size_t k = 0; k < 2; ++k) {
        sent[2 * r + k] = at[r];
        if (x.peers[k] == 0) continue;
        const double latency = x.peers[k] * tiers_[k].latency;
        double& s = send_free_[2 * r + k];
        double& v = recv_free_[2 * r + k];
        s = std::max(at[r], s) + latency + x.send[k] / tiers_[k].bandwidth;
        v = std::max(at[r], v) + latency + x.recv[k] / tiers_[k].bandwidth;
        sent[2 * r + k] = s;
        out[r] = std::max({out[r], s, v});
      }
    }
    for (std::size_t r = 0; r < W_; ++r)
      for (std::size_t p = 0; p < W_; ++p)
        if (p != r && t[p * W_ + r] > 0) out[r] = std::max(out[r], sent[2 * p + tier(p, r)]);
    return out;
  }

 private:
  std::size_t tier(std::size_t a, std::size_t b) const {
    return topo_->same_node(static_cast<std::int64_t>(a), static_cast<std::int64_t>(b)) ? 0 : 1;
  }

  std::size_t W_;
  const Topology* topo_;
  LinkTier tiers_[2];
  std::vector<double> send_free_, recv_free_;  // [rank * 2 + tier]
};

/// Rank r's attention by round, as the op cuts it (StagePlan, and each
/// head-parallel document in the round it is whole): each round's share of
/// the rank's forward FLOPs, dispatched and head-parallel, and the round
/// after which the key-value gradients of each stage group are complete.
struct RankRounds {
  std::vector<double> dispatched, head_parallel;  ///< [groups + 1]; together sum to 1 (the last round's when the rank attends nothing)
  std::vector<int> kv_ready;                      ///< [groups]
};
inline RankRounds rank_rounds(const QkvMetadata& m, std::size_t r, int groups, const LayerShape& shape) {
  const int me = static_cast<int>(r), W = static_cast<int>(m.kv_fwd.world_size);
  const RankAttentionLayout attn = attention_of(m.attn, me);
  std::vector<AttentionEntry> entries;
  std::vector<std::size_t> entry_begin;
  share_entries(attn, entries, entry_begin);
  StagePlan plan;
  plan.build(entries, entry_begin, attn.cu_seqlens_q, attn.cu_seqlens_kv, m.q_rev.get_slice(me), m.kv_rev.get_slice(me), me, W, groups, true,
             "model_plan");
  RankRounds out;
  out.dispatched.assign(static_cast<std::size_t>(plan.rounds()), 0.0);
  out.head_parallel = out.dispatched;
  for (const StagePass& pass : plan.passes())
    for (std::size_t i = pass.begin; i < pass.end; ++i) {
      out.dispatched[static_cast<std::size_t>(pass.round)] += kernel_entry(plan.parts()[i], shape.heads_q, shape.head_dim).forward_flops();
    }
  const HeadParallelLayout& hp = m.hp_attn;
  if (hp.degree != 0 && r < hp.seqlens.size()) {
    std::vector<int> whole;  // each document's round
    document_rounds(hp.cu_seqlens[r], m.hp_rev.get_slice(me), [&](std::int64_t home) { return plan.round_of(home); }, whole);
    for (std::size_t d = 0; d < whole.size(); ++d) {
      each_head_parallel_entry(hp, r, d, shape.heads_q, shape.head_dim,
                               [&](const KernelEntry& e) { out.head_parallel[static_cast<std::size_t>(whole[d])] += e.forward_flops(); });
    }
  }
  const double total = std::accumulate(out.dispatched.begin(), out.dispatched.end(), std::accumulate(out.head_parallel.begin(), out.head_parallel.end(), 0.0));
  for (auto* v : {&out.dispatched, &out.head_parallel})
    for (double& s : *v) s = total > 0 ? s / total : 0.0;
  if (total == 0) out.dispatched.back() = 1;
  for (int g = 0; g < groups; ++g) out.kv_ready.push_back(plan.kv_ready(g));
  return out;
}

/// The model's events, when a timeline is asked for (the op's names:
/// "<call> <name> [group]").
struct ModelTrace {
  std::vector<StepTrace>* ranks = nullptr;
  const char* call = "";
  void add(std::size_t r, const char* name, int group, double start, double end) const {
    if (!ranks) return;
    const auto ns = [&](double t) { return static_cast<std::int64_t>(std::llround(t * 1e9)); };
    (*ranks)[r].push({name, call, group, ns(start), ns(end), 0});
  }
};

/// The ranks attending their rounds, rank r from `start[r]` on, while the
/// stage groups arrive (`arrive[g][r]`: when group g's post has brought
/// rank r what it sends it): round 0 from the start (with no stage groups,
/// once the one post has arrived), round k + 1 once group k has.
/// `seconds(r)`: rank r's compute. Returns when each rank is done;
/// `reach[g][r]` (when given) becomes when rank r has attended the
/// dispatched part of the round after which group g's key-value gradients
/// are complete. Records each wait and kernel in `trace`.
template <class Seconds>
std::vector<double> attend_rounds(std::span<const RankRounds> ranks, std::span<const std::vector<double>> arrive, std::span<const double> start,
                                  int groups, Seconds seconds, std::vector<std::vector<double>>* reach, const ModelTrace& trace) {
  std::vector<double> done;
  if (reach) reach->assign(arrive.size(), std::vector<double>(ranks.size(), 0.0));
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankRounds& rank = ranks[r];
    double t = start[r];
    for (std::size_t k = 0; k < rank.dispatched.size(); ++k) {
      if (k > 0 || groups == 0) {  // the group this round needs
        const std::size_t g = k > 0 ? k - 1 : 0;
        trace.add(r, "wait", static_cast<int>(g), t, std::max(t, arrive[g][r]));
        t = std::max(t, arrive[g][r]);
      }
      const int round = groups == 0 ? -1 : static_cast<int>(k);
      const double d = seconds(r) * rank.dispatched[k], h = seconds(r) * rank.head_parallel[k];
      if (d > 0) trace.add(r, "kernel", round, t, t + d);  // the op records a kernel where it has parts, a wait always
      if (h > 0) trace.add(r, "kernel (head-parallel)", round, t + d, t + d + h);
      // The op posts a group's key-value gradients after the round's dispatched pass, before its head-parallel one.
      for (std::size_t g = 0; reach && g < reach->size(); ++g)
        if (groups == 0 || static_cast<std::size_t>(rank.kv_ready[g]) == k) (*reach)[g][r] = t + d;
      t += d + h;
    }
    done.push_back(t);
  }
  return done;
}

inline double sum(std::span<const double> v) { return std::accumulate(v.begin(), v.end(), 0.0); }

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

namespace detail::step_model {

/// What model_plan's three rows share: the queries' and the slabs' tokens
/// and posts, each rank's rounds and compute.
struct PlanParts {
  std::size_t W = 0;
  int groups = 0;
  double bq = 0, bkv = 0;
  PairTokens q, hp;
  HeadParallelTokenBytes bhp;
  PairTokens outputs_home, grads_home;  // [attention * W + home] bytes: the outputs; the query gradients and the slabs' dk, dv
  std::vector<PairTokens> dout_groups;  // the output gradients out, by stage group
  std::vector<ComputeSeconds> compute;
  std::vector<RankRounds> ranks;
};
inline PlanParts plan_parts(const QkvMetadata& m, const PlanCost& cost, const Topology& topo, const ClusterModel& c, const LayerShape& shape) {
  c.check();
  shape.check();
  topo.check_world_size(m.kv_fwd.world_size, "model_plan");
  if (cost.world_size != m.kv_fwd.world_size) detail::fail("model_plan: the cost has world_size = ", cost.world_size, ", the metadata ", m.kv_fwd.world_size);
  PlanParts p;
  p.W = static_cast<std::size_t>(m.kv_fwd.world_size);
  p.groups = stage_groups(shape.stages, static_cast<std::int64_t>(p.W));
  p.bq = shape.q_token_bytes(), p.bkv = 2 * shape.kv_token_bytes();  // K and V: two tensors a token
  p.q = flat_tokens(m.q_fwd);
  p.hp = m.hp_attn.degree == 0 ? PairTokens(p.W * p.W, 0) : flat_tokens(m.hp_fwd);
  p.bhp = head_parallel_token_bytes(m, shape);
  const PairTokens out = one_post({{&p.q, p.bq}, {&p.hp, p.bhp.q}});  // the output gradients out; the outputs home the other way
  p.outputs_home = transposed(out, p.W);
  p.grads_home = transposed(one_post({{&p.q, p.bq}, {&p.hp, p.bhp.qkv}}), p.W);
  p.dout_groups = by_group(out, p.W, p.groups);
  for (std::size_t r = 0; r < p.W; ++r) p.ranks.push_back(rank_rounds(m, r, p.groups, shape));
  p.compute = plan_compute(m, cost, c, shape);
  return p;
}

/// Forward: every rank posts its stage groups at once (`in_groups`, each
/// arriving `delay` later still), attends its rounds as they arrive, then
/// posts its outputs home; returns when each rank has its outputs.
inline std::vector<double> plan_forward(const PlanParts& p, RankLinks& links, std::span<const PairTokens> in_groups, double delay,
                                        std::vector<StepTrace>* trace) {
  const ModelTrace events{trace, "forward"};
  const std::vector<double> zero(p.W, 0.0);
  std::vector<std::vector<double>> arrive;
  for (const PairTokens& g : in_groups) {
    arrive.push_back(links.post(g, zero));
    for (double& t : arrive.back()) t += delay;
  }
  const auto seconds = [&](std::size_t r) { return p.compute[r].forward; };
  const std::vector<double> attended = attend_rounds(p.ranks, arrive, zero, p.groups, seconds, nullptr, events);
  const std::vector<double> end = links.post(p.outputs_home, attended);
  for (std::size_t r = 0; r < p.W; ++r) events.add(r, "wait", 0, attended[r], end[r]);
  return end;
}

/// Backward, rank r from `start[r]`: the output gradients out by stage
/// group, the rounds as they arrive, each group's key-value gradients
/// (`kv_groups`) posted home once the rank has attended the round that
/// completes them (with the node-level exchange, group 0's `kv_delay` after
/// the last rank has: its phases are collectives), then, once they are all
/// home, the query gradients; returns when each rank has its gradients.
inline std::vector<double> plan_backward(const PlanParts& p, RankLinks& links, std::span<const PairTokens> kv_groups, std::span<const double> start,
                                         double kv_delay, std::vector<StepTrace>* trace) {
  const ModelTrace events{trace, "backward"};
  std::vector<std::vector<double>> arrive, reach, kv_home;
  for (const PairTokens& g : p.dout_groups) arrive.push_back(links.post(g, start));
  const auto seconds = [&](std::size_t r) { return p.compute[r].backward; };
  const std::vector<double> done = attend_rounds(p.ranks, arrive, start, p.groups, seconds, &reach, events);
  for (std::size_t g = 0; g < kv_groups.size(); ++g) kv_home.push_back(links.post(kv_groups[g], reach[g]));
  if (kv_delay > 0) {
    const double phases = *std::max_element(reach[0].begin(), reach[0].end()) + kv_delay;
    for (double& t : kv_home[0]) t = std::max(t, phases);
  }
  std::vector<double> at(p.W);
  for (std::size_t r = 0; r < p.W; ++r) {  // the key-value gradients home by group
    at[r] = done[r];
    for (std::size_t g = 0; g < kv_home.size(); ++g) events.add(r, "wait", static_cast<int>(g), at[r], std::max(at[r], kv_home[g][r])), at[r] = std::max(at[r], kv_home[g][r]);
  }
  const std::vector<double> end = links.post(p.grads_home, at);
  for (std::size_t r = 0; r < p.W; ++r) events.add(r, "wait", 0, at[r], end[r]);
  return end;
}

/// One of model_plan's rows (form 0 flat, 1 dedup, 2 node-level), its
/// timeline recorded in `trace` when given.
inline StepTime plan_row(const QkvMetadata& m, const PlanParts& p, const Topology& topo, const ClusterModel& c, int form, std::vector<StepTrace>* trace) {
  const char* names[3] = {"flat", "dedup", "node-level"};
  const std::size_t W = p.W;
  PairTokens kv(W * W, 0), between, inside;
  double node_phases = 0;  // two exchanges (a relay forwards only what it has received): forward between nodes, then inside; backward the reverse
  if (form == 0) kv = flat_tokens(m.kv_fwd);
  if (form == 1) kv = dedup_tokens(m.kv_fwd);
  if (form == 2) node_tokens(m.kv_fwd, topo, between, inside), node_phases = slowest(between, W, p.bkv, topo, c) + slowest(inside, W, p.bkv, topo, c);
  const PairTokens out = one_post({{&p.q, p.bq}, {&kv, p.bkv}, {&p.hp, p.bhp.qkv}}), kv_bytes = one_post({{&kv, p.bkv}});
  std::vector<double> in_posts = group_posts(out, W, p.groups, topo, c);
  std::vector<double> kv_posts = group_posts(kv_bytes, W, p.groups, topo, c);  // in reverse as long (sent and received swap)
  if (form == 2) in_posts[0] += node_phases, kv_posts[0] = node_phases;
  StepTime t;
  t.scheme = names[form];
  for (const ComputeSeconds& cr : p.compute) {
    t.forward_compute = std::max(t.forward_compute, cr.forward);
    t.backward_compute = std::max(t.backward_compute, cr.backward);
  }
  t.forward_comm = sum(in_posts) + slowest(p.outputs_home, W, 1, topo, c);
  for (const PairTokens& g : p.dout_groups) t.backward_comm += slowest(g, W, 1, topo, c);
  t.backward_comm += sum(kv_posts) + slowest(p.grads_home, W, 1, topo, c);
  std::vector<PairTokens> kv_groups = by_group(kv_bytes, W, p.groups);
  for (PairTokens& g : kv_groups) g = transposed(g, W);  // the gradients go home
  RankLinks links(W, topo, c);
  const std::vector<double> forward = plan_forward(p, links, by_group(out, W, p.groups), node_phases, trace);
  const std::vector<double> end = plan_backward(p, links, kv_groups, forward, node_phases, trace);
  t.forward = *std::max_element(forward.begin(), forward.end());
  t.step = *std::max_element(end.begin(), end.end());
  t.backward = t.step - t.forward;
  t.inter_node_bytes = inter_bytes(p.q, W, topo, 2 * p.bq) + (form < 2 ? inter_bytes(kv, W, topo, p.bkv) : inter_bytes(between, W, topo, p.bkv));
  return t;
}

}  // namespace detail::step_model

/// The plan's three KV exchanges: "flat" (section 2), "dedup" (section 2c),
/// "node-level". Queries and outputs travel flat in all three. The posts
/// are those the op makes (ContextParallelAttention at shape.stages: G =
/// stages - 1 stage groups, at most W - 1), each rank's at its own time on
/// its own links (RankLinks: a rank waits for the peers that send it bytes,
/// not for the others). Forward, the queries, the key-values (flat or
/// deduplicated) and the head-parallel documents' slabs (section 2f) ride
/// one post a stage group, the pair of home rank h and attention rank a in
/// group stage_group(h, a), all posted at the start; every rank attends its
/// rounds as the op cuts them (round 0 its own, round g + 1 once group g
/// has arrived: each dispatched part in the round its queries and
/// key-values are both there, each head-parallel document once all its
/// slabs are), its compute split over the rounds by their FLOPs, then posts
/// the outputs of both parts home. Backward, each rank from the end of its
/// forward: the output gradients come in stage groups as the inputs did;
/// each group's key-value gradients go home in one post once the rank has
/// attended the dispatched part of the round that completes them (the op
/// posts them before that round's head-parallel documents); once they are
/// all home, the query gradients of both parts with the head-parallel
/// key-value gradients ride one post home. The node-level exchange's
/// key-values take their own two phases each way (collectives: every group
/// arrives that much later; the gradients' phases start once every rank is
/// ready to send them). The step ends when the last rank has its gradients.
/// A head-parallel document's work counts 1/u on each rank of its group, as
/// plan_cost counts it.
inline std::vector<StepTime> model_plan(const QkvMetadata& m, const PlanCost& cost, const Topology& topo,
                                        const ClusterModel& c, const LayerShape& shape) {
  const detail::step_model::PlanParts parts = detail::step_model::plan_parts(m, cost, topo, c, shape);
  std::vector<StepTime> out;
  for (int form = 0; form < 3; ++form) out.push_back(detail::step_model::plan_row(m, parts, topo, c, form, nullptr));
  return out;
}

/// model_plan's timeline of the exchange the op runs (dedup or flat): on
/// each rank, its waits for each stage group, the outputs and the gradients,
/// and its kernel in each round (dispatched, then head-parallel), forward
/// then backward, named as the op's trace names them (attention/step_trace.hpp),
/// so that write_chrome_trace writes it beside a measured step.
inline std::vector<StepTrace> model_plan_trace(const QkvMetadata& m, const PlanCost& cost, const Topology& topo, const ClusterModel& c,
                                               const LayerShape& shape, bool dedup) {
  const detail::step_model::PlanParts parts = detail::step_model::plan_parts(m, cost, topo, c, shape);
  std::vector<StepTrace> ranks;
  for (std::size_t r = 0; r < parts.W; ++r) ranks.emplace_back(static_cast<int>(r));
  detail::step_model::plan_row(m, parts, topo, c, dedup ? 1 : 0, &ranks);
  return ranks;
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
