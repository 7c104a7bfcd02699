#pragma once
// The node-level KV exchange on one rank (docs/node-exchange.md): each KV
// shard crosses between nodes once per destination node, then fans out inside
// the node; backward, gradients are summed inside the node first.
//
//   const QkvMetadata meta = plan_qkv(plan);                     // same plan on every rank
//   const KvWireMetadata wire = plan_kv_wire(meta);              // section 2c: wire buffers and fan lists
//   NodeWireDispatcher kv(transport, wire.fan[rank], plan_node_wire_for_rank(meta.kv_fwd, topology, rank), kv_token_bytes);
//   kv.forward(kv_mlp, kv_attn);                                 // between nodes, inside nodes, fan-out
//   ... attention ...
//   kv.reverse_combine(dkv_attn, dkv_mlp, ElementType::bfloat16); // fan-in, inside, relay sum, between, home combine
//
// Each phase is one all_to_all_v over the whole world (a rank's peers in the
// inside phase are on its node; in the between phase on other nodes), so any
// AllToAllTransport serves, without sub-communicators. Host memory only. The
// dispatcher owns its scratch (relay, wire, gather and replica buffers and the
// staging of each phase), allocated at construction: calls do not allocate.
// The attention layout is byte-identical to KvWireDispatcher's (and the
// section 2 Dispatcher's); gradients equal theirs exactly for integers and up
// to the documented reassociation for floating types, and are reproducible.
// Every rank makes the same calls (each call is two collectives). The
// transport is held by reference and must outlive the dispatcher.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/dedup.hpp"
#include "cpdispatch/execute/detail/rethrow.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/dedup.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// The caller's buffer sizes of one NodeWireDispatcher, in bytes.
struct NodeWireBufferSizes {
  std::size_t mlp_bytes = 0;        ///< forward input; reverse_combine's gradient output
  std::size_t attention_bytes = 0;  ///< forward output; reverse_combine's input
  friend bool operator==(const NodeWireBufferSizes&, const NodeWireBufferSizes&) = default;
};

namespace detail {

/// out = the sum of the `ins` (in order), accumulated as the fan-in does:
/// fp32 for 16-bit types, rounded once; integers wrap.
template <class E>
void sum_pieces(std::span<const std::byte* const> ins, std::byte* out_bytes, std::size_t n) {
  E* out = reinterpret_cast<E*>(out_bytes);
  const auto in = [&](std::size_t k) { return reinterpret_cast<const E*>(ins[k]); };
  if (ins.size() == 1) {
    std::memcpy(out, in(0), n * sizeof(E));
    return;
  }
  if constexpr (std::is_same_v<accumulator_t<E>, E>) {
    for (std::size_t i = 0; i < n; ++i) {
      E acc = sum_of(in(0)[i], in(1)[i]);
      for (std::size_t k = 2; k < ins.size(); ++k) acc = sum_of(acc, in(k)[i]);
      out[i] = acc;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      float acc = 0.0f;
      for (std::size_t k = 0; k < ins.size(); ++k) acc += E::to_float(in(k)[i].bits);
      out[i] = E(acc);
    }
  }
}

}  // namespace detail

template <AllToAllTransport T>
class NodeWireDispatcher {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  static_assert(T::memory_space == MemorySpace::host, "NodeWireDispatcher runs on host transports (sim, MPI)");

 public:
  /// `fan`: this rank's section 2c fan list (plan_kv_wire(...).fan[rank] or
  /// plan_kv_wire_for_rank's); `node`: this rank's node-level wire.
  NodeWireDispatcher(T& transport, KvFanList fan, RankNodeWire node, std::size_t token_bytes)
      : transport_(transport), fan_(std::move(fan)), node_(std::move(node)), tb_(token_bytes) {
    const auto W = static_cast<std::size_t>(transport.world_size());
    if (node_.rank != transport.rank()) detail::fail("NodeWireDispatcher: the node wire is rank ", node_.rank, "'s, the transport is rank ", transport.rank());
    if (node_.between.send_splits.size() != W + 1 || node_.inside.send_splits.size() != W + 1) {
      detail::fail("NodeWireDispatcher: the node wire is planned for ", node_.between.send_splits.size() - 1, " ranks, the transport has ", W);
    }
    if (token_bytes == 0) detail::fail("NodeWireDispatcher: token_bytes must be positive");
    if (fan_.wire_tokens != node_.wire_tokens) {
      detail::fail("NodeWireDispatcher: the fan list's wire buffer holds ", fan_.wire_tokens, " tokens, the node wire fills ", node_.wire_tokens);
    }
    relay_.resize(bytes(node_.relay_tokens));
    wire_.resize(bytes(node_.wire_tokens));
    gather_.resize(bytes(node_.gather_tokens));
    replica_.resize(bytes(node_.num_copies * node_.mlp_tokens));
    std::size_t most = 0;
    for (const NodePhase* p : {&node_.between, &node_.inside}) most = std::max({most, total(p->send), total(p->recv)});
    send_staging_.resize(bytes(static_cast<std::int64_t>(most)));
    recv_staging_.resize(send_staging_.size());
    combine_.recv_seq_lens = node_.shard_len;
    combine_.seq_recv_mask = std::vector<std::int64_t>(node_.replica_mask.begin(), node_.replica_mask.end());
    combine_.mask_copies = static_cast<std::size_t>(node_.num_copies);
    counts_.assign(4 * W, 0);
    std::size_t widest = 0;
    for (std::size_t e = 0; e + 1 < node_.gather_splits.size(); ++e) widest = std::max(widest, node_.gather_splits[e + 1] - node_.gather_splits[e]);
    sum_inputs_.reserve(widest + 1);
  }

  NodeWireBufferSizes required_bytes() const { return {bytes(node_.mlp_tokens), bytes(fan_.attention_tokens)}; }

  /// Between nodes into the relay buffer, inside nodes into the wire buffer,
  /// then the fan-out into the attention layout.
  void forward(ConstBytes mlp, MutableBytes attention) {
    check("forward: ", mlp.size(), attention.size());
    phase("forward", node_.between.send, node_.between.send_splits, node_.between.recv, node_.between.recv_splits, Direction::forward,
          [&](const NodePiece& p) { return mlp.data() + bytes(p.fwd_offset); }, [&](const NodePiece& p) { return relay_.data() + bytes(p.fwd_offset); });
    phase("forward", node_.inside.send, node_.inside.send_splits, node_.inside.recv, node_.inside.recv_splits, Direction::forward,
          [&](const NodePiece& p) { return (p.from_relay ? relay_.data() : mlp.data()) + bytes(p.fwd_offset); },
          [&](const NodePiece& p) { return wire_.data() + bytes(p.fwd_offset); });
    for (std::size_t e = 0; e < fan_.num_entries(); ++e) {
      for (std::size_t i = fan_.copy_splits[e]; i < fan_.copy_splits[e + 1]; ++i) {
        std::memcpy(attention.data() + bytes(fan_.attn_offset[i]), wire_.data() + bytes(fan_.wire_offset[e]), bytes(fan_.seq_len[e]));
      }
    }
  }

  /// The gradient of this rank's KV shards (MLP layout) from the gradient of
  /// its attention layout; `type` is the element type (token_bytes a multiple of its size).
  void reverse_combine(ConstBytes attention_grad, MutableBytes grad, ElementType type) {
    check("reverse_combine: ", grad.size(), attention_grad.size());
    const std::size_t es = element_size(type);
    if (tb_ % es != 0) detail::fail("NodeWireDispatcher::reverse_combine: token_bytes = ", tb_, " is not a multiple of the ", es, "-byte element");
    detail::with_element_type(type, [&](auto* tag) {
      using E = std::remove_pointer_t<decltype(tag)>;
      detail::fan_in<E>(fan_, attention_grad.data(), wire_.data(), tb_ / es);
    });
    // Inside nodes, reverse: what each rank received goes back to its sender.
    phase("reverse_combine", node_.inside.recv, node_.inside.recv_splits, node_.inside.send, node_.inside.send_splits, Direction::reverse,
          [&](const NodePiece& p) { return wire_.data() + bytes(p.rev_offset); },
          [&](const NodePiece& p) { return (p.from_relay ? gather_.data() : replica_.data()) + bytes(p.rev_offset); });
    detail::with_element_type(type, [&](auto* tag) { relay_sums<std::remove_pointer_t<decltype(tag)>>(es); });
    phase("reverse_combine", node_.between.recv, node_.between.recv_splits, node_.between.send, node_.between.send_splits, Direction::reverse,
          [&](const NodePiece& p) { return relay_.data() + bytes(p.rev_offset); },
          [&](const NodePiece& p) { return replica_.data() + bytes(p.rev_offset); });
    combine_copies(combine_, replica_, grad, tb_, type);
  }

 private:
  enum class Direction { forward, reverse };

  std::size_t bytes(std::int64_t tokens) const { return static_cast<std::size_t>(tokens) * tb_; }

  static std::size_t total(const std::vector<NodePiece>& pieces) {
    std::size_t t = 0;
    for (const NodePiece& p : pieces) t += static_cast<std::size_t>(p.len);
    return t;
  }

  void check(const char* call, std::size_t mlp, std::size_t attention) const {
    const NodeWireBufferSizes need = required_bytes();
    if (mlp < need.mlp_bytes) detail::fail<capacity_error>("NodeWireDispatcher::", call, "the MLP-layout buffer holds ", mlp, " bytes, the plan needs ", need.mlp_bytes);
    if (attention < need.attention_bytes) {
      detail::fail<capacity_error>("NodeWireDispatcher::", call, "the attention buffer holds ", attention, " bytes, the plan needs ", need.attention_bytes);
    }
  }

  /// One all_to_all_v: `out` pieces are packed per peer from read(piece),
  /// `in` pieces unpacked per peer into write(piece). Reverse, pieces with
  /// rev_offset -1 (a relay's own copy) do not travel.
  template <class Read, class Write>
  void phase(const char* call, const std::vector<NodePiece>& out, const std::vector<std::size_t>& out_splits, const std::vector<NodePiece>& in,
             const std::vector<std::size_t>& in_splits, Direction dir, Read read, Write write) {
    const auto W = static_cast<std::size_t>(transport_.world_size());
    std::span<std::size_t> sc(counts_.data(), W), sd(counts_.data() + W, W), rc(counts_.data() + 2 * W, W), rd(counts_.data() + 3 * W, W);
    const auto travels = [dir](const NodePiece& p) { return dir == Direction::forward || p.rev_offset >= 0; };
    const auto me = static_cast<std::size_t>(transport_.rank());
    std::size_t at = 0;
    for (std::size_t peer = 0; peer < W; ++peer) {
      sd[peer] = at;
      for (std::size_t i = out_splits[peer]; i < out_splits[peer + 1] && peer != me; ++i) {
        if (!travels(out[i])) continue;
        std::memcpy(send_staging_.data() + at, read(out[i]), bytes(out[i].len));
        at += bytes(out[i].len);
      }
      sc[peer] = at - sd[peer];
    }
    at = 0;
    for (std::size_t peer = 0; peer < W; ++peer) {
      rd[peer] = at;
      for (std::size_t i = in_splits[peer]; i < in_splits[peer + 1] && peer != me; ++i) at += travels(in[i]) ? bytes(in[i].len) : 0;
      rc[peer] = at - rd[peer];
    }
    try {
      if (W > 1) transport_.all_to_all_v(send_staging_.data(), sc, sd, recv_staging_.data(), rc, rd);
    } catch (...) {
      detail::rethrow_with_context(detail::concat("NodeWireDispatcher::", call, " (rank ", transport_.rank(), " of ", W, "): all_to_all_v failed: "));
    }
    at = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (!travels(in[i]) || (i >= in_splits[me] && i < in_splits[me + 1])) continue;
      std::memcpy(write(in[i]), recv_staging_.data() + at, bytes(in[i].len));
      at += bytes(in[i].len);
    }
    // The traffic to itself: its own pieces, in the same order on both sides.
    for (std::size_t i = out_splits[me], j = in_splits[me]; i < out_splits[me + 1]; ++i, ++j) {
      if (travels(out[i])) std::memcpy(write(in[j]), read(out[i]), bytes(out[i].len));
    }
  }

  /// Each relayed shard: its own wire gradient plus the gathered ones of its
  /// node (slot ascending), into the relay buffer.
  template <class E>
  void relay_sums(std::size_t es) {
    const std::size_t token_elems = tb_ / es;
    for (std::size_t e = 0; e < node_.relay_offset.size(); ++e) {
      sum_inputs_.clear();  // capacity reserved at construction
      sum_inputs_.push_back(wire_.data() + bytes(node_.relay_wire_offset[e]));
      for (std::size_t k = node_.gather_splits[e]; k < node_.gather_splits[e + 1]; ++k) sum_inputs_.push_back(gather_.data() + bytes(node_.gather_offset[k]));
      detail::sum_pieces<E>(sum_inputs_, relay_.data() + bytes(node_.relay_offset[e]), static_cast<std::size_t>(node_.relay_len[e]) * token_elems);
    }
  }

  T& transport_;
  KvFanList fan_;
  RankNodeWire node_;
  std::size_t tb_;
  // Scratch (operator new aligns it for every element type; offsets are whole tokens).
  std::vector<std::byte> relay_, wire_, gather_, replica_, send_staging_, recv_staging_;
  RankMetadata combine_;  // the home combine's mask and shard lengths
  std::vector<std::size_t> counts_;
  std::vector<const std::byte*> sum_inputs_;
};

}  // namespace cpdispatch
