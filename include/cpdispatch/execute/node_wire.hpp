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
// AllToAllTransport serves, without sub-communicators; the exchange engine
// (run_exchange, execute/staged_exchange.hpp) runs it, as for the other
// dispatchers. At construction every phase is laid out
// (NodeWirePlan) and the scratch (relay, wire, gather and replica buffers and
// the phases' staging, one arena) is allocated: calls do not allocate. Host
// transports run the lists with memcpy; device transports (the device sim,
// NCCL: include cpdispatch/cuda/data_path.hpp from a .cu file) with the device
// data path's copy, fan-in and combine kernels on the transport's stream, the
// buffers in device memory.
// The attention layout is byte-identical to KvWireDispatcher's (and the
// section 2 Dispatcher's); gradients equal theirs exactly for integers and up
// to the documented reassociation for floating types, and are reproducible.
// Every rank makes the same calls (each call is two collectives). The
// transport is held by reference and must outlive the dispatcher.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/exchange_owner.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
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

/// One rank's node-level exchange, laid out once. Each step is an exchange
/// over the arena (input, output and, at staging_at, staging of
/// run_exchange) plus the pieces a forward step reads from the caller's
/// input: packed into the staging before the exchange, copied to itself
/// after. Every scratch buffer is a token-aligned region of one arena (relay,
/// wire, gather, replica, then the staging), so each list reads one buffer
/// (the caller's or the arena) and writes one.
struct NodeWirePlan {
  enum Step : std::size_t { between_forward, inside_forward, inside_reverse, between_reverse, steps };

  /// The exchange (arena -> arena, never direct, no piece lists); the input's pack (-> staging) and self (-> arena).
  struct StepPlan { ExchangePlan exchange; std::vector<CopyPiece> pack_input, self_input; };
  std::array<StepPlan, steps> step;
  std::vector<CopyPiece> fan_out_pieces;
  KvFanList relay_fan;  ///< each relayed shard's own wire gradient and its node's gathered ones, arena -> arena
  std::size_t relay_at = 0, wire_at = 0, gather_at = 0, replica_at = 0, staging_at = 0, arena_bytes = 0;
};

/// Where a piece is read: the caller's buffer (`input`) or the arena, at `offset` bytes.
struct NodeSource {
  bool input;
  std::size_t offset;
};

/// One step: `out` pieces are sent per peer from source(piece), `in` pieces
/// received per peer into the arena at target(piece). Reverse, pieces with
/// rev_offset -1 (a relay's own copy) do not travel.
template <class Source, class Target>
void lay_out_node_step(NodeWirePlan::StepPlan& st, const std::vector<NodePiece>& out, const std::vector<std::size_t>& out_splits,
                       const std::vector<NodePiece>& in, const std::vector<std::size_t>& in_splits, bool forward, std::size_t tb, std::size_t me,
                       Source source, Target target) {
  const std::size_t W = out_splits.size() - 1;
  const auto bytes = [tb](std::int64_t tokens) { return static_cast<std::size_t>(tokens) * tb; };
  const auto travels = [forward](const NodePiece& p) { return forward || p.rev_offset >= 0; };
  ExchangePlan& ex = st.exchange;
  // A piece read from the caller's input joins the input's list, one read from the arena the exchange's.
  const auto add = [&](std::vector<CopyPiece>& arena_list, std::vector<CopyPiece>& input_list, const NodePiece& p, std::size_t dst) {
    const NodeSource from = source(p);
    append_piece(from.input ? input_list : arena_list, from.offset, dst, bytes(p.len));
  };
  // Peer by peer through the staging (pieces from several buffers are never direct); itself apart.
  const auto lay_out = [&](Side& side, const std::vector<NodePiece>& pieces, const std::vector<std::size_t>& splits, auto&& place) {
    side.direct = false;
    for (auto* v : {&side.counts, &side.displs}) v->assign(W, 0);
    for (std::size_t peer = 0; peer < W; ++peer) {
      side.displs[peer] = side.staging;
      for (std::size_t i = splits[peer]; i < splits[peer + 1] && peer != me; ++i) {
        if (!travels(pieces[i])) continue;
        place(pieces[i], side.staging);
        side.staging += bytes(pieces[i].len);
      }
      side.counts[peer] = side.staging - side.displs[peer];
    }
  };
  lay_out(ex.send, out, out_splits, [&](const NodePiece& p, std::size_t at) { add(ex.send.copies, st.pack_input, p, at); });
  lay_out(ex.recv, in, in_splits, [&](const NodePiece& p, std::size_t at) { append_piece(ex.recv.copies, at, target(p), bytes(p.len)); });
  // The traffic to itself: its own pieces, in the same order on both sides.
  for (std::size_t i = out_splits[me], j = in_splits[me]; i < out_splits[me + 1]; ++i, ++j) {
    if (travels(out[i])) add(ex.self, st.self_input, out[i], target(in[j]));
  }
}

/// The arena's regions, the four steps, the fan-out and the relay sums of one rank.
inline NodeWirePlan plan_node_steps(const KvFanList& fan, const RankNodeWire& node, std::size_t tb, std::size_t me) {
  NodeWirePlan plan;
  const auto bytes = [tb](std::int64_t tokens) { return static_cast<std::size_t>(tokens) * tb; };
  plan.wire_at = plan.relay_at + bytes(node.relay_tokens);
  plan.gather_at = plan.wire_at + bytes(node.wire_tokens);
  plan.replica_at = plan.gather_at + bytes(node.gather_tokens);
  // 256-byte aligned, as run_exchange aligns the receive staging within it.
  plan.staging_at = (plan.replica_at + bytes(node.num_copies * node.mlp_tokens) + 255) / 256 * 256;
  using P = NodeWirePlan;
  const NodePhase &between = node.between, &inside = node.inside;
  lay_out_node_step(plan.step[P::between_forward], between.send, between.send_splits, between.recv, between.recv_splits, true, tb, me,
                    [&](const NodePiece& p) { return NodeSource{true, bytes(p.fwd_offset)}; },
                    [&](const NodePiece& p) { return plan.relay_at + bytes(p.fwd_offset); });
  lay_out_node_step(plan.step[P::inside_forward], inside.send, inside.send_splits, inside.recv, inside.recv_splits, true, tb, me,
                    [&](const NodePiece& p) { return p.from_relay ? NodeSource{false, plan.relay_at + bytes(p.fwd_offset)} : NodeSource{true, bytes(p.fwd_offset)}; },
                    [&](const NodePiece& p) { return plan.wire_at + bytes(p.fwd_offset); });
  // Reverse, what each rank received goes back to its sender.
  lay_out_node_step(plan.step[P::inside_reverse], inside.recv, inside.recv_splits, inside.send, inside.send_splits, false, tb, me,
                    [&](const NodePiece& p) { return NodeSource{false, plan.wire_at + bytes(p.rev_offset)}; },
                    [&](const NodePiece& p) { return (p.from_relay ? plan.gather_at : plan.replica_at) + bytes(p.rev_offset); });
  lay_out_node_step(plan.step[P::between_reverse], between.recv, between.recv_splits, between.send, between.send_splits, false, tb, me,
                    [&](const NodePiece& p) { return NodeSource{false, plan.relay_at + bytes(p.rev_offset)}; },
                    [&](const NodePiece& p) { return plan.replica_at + bytes(p.rev_offset); });
  for (const P::StepPlan& s : plan.step) plan.arena_bytes = std::max(plan.arena_bytes, plan.staging_at + s.exchange.staging_bytes());
  for (std::size_t e = 0; e < fan.num_entries(); ++e) {
    for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i) {
      append_piece(plan.fan_out_pieces, plan.wire_at + bytes(fan.wire_offset[e]), bytes(fan.attn_offset[i]), bytes(fan.seq_len[e]));
    }
  }
  // Relay sums as a fan list over the arena (offsets in tokens: every region is token-aligned).
  KvFanList& r = plan.relay_fan;
  const auto token = [tb](std::size_t at) { return static_cast<std::int64_t>(at / tb); };
  r.copy_splits.push_back(0);
  for (std::size_t e = 0; e < node.relay_offset.size(); ++e) {
    r.wire_offset.push_back(token(plan.relay_at) + node.relay_offset[e]);
    r.seq_len.push_back(node.relay_len[e]);
    r.attn_offset.push_back(token(plan.wire_at) + node.relay_wire_offset[e]);
    for (std::size_t k = node.gather_splits[e]; k < node.gather_splits[e + 1]; ++k) r.attn_offset.push_back(token(plan.gather_at) + node.gather_offset[k]);
    r.copy_splits.push_back(r.attn_offset.size());
  }
  r.src_rank.assign(r.seq_len.size(), static_cast<std::int64_t>(me));
  r.src_shard.assign(r.seq_len.size(), 0);
  r.attention_tokens = r.wire_tokens = token(plan.arena_bytes);
  return plan;
}

}  // namespace detail

template <AllToAllTransport T>
class NodeWireDispatcher {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  using Plan = detail::NodeWirePlan;
  using Owner = detail::ExchangeOwner<T, Plan::steps>;  // slots by Step

 public:
  using transport_type = T;
  using const_buffer = typename Owner::const_buffer;  ///< in the transport's memory space
  using mutable_buffer = typename Owner::mutable_buffer;

  /// `fan`: this rank's section 2c fan list (plan_kv_wire(...).fan[rank] or
  /// plan_kv_wire_for_rank's); `node`: this rank's node-level wire.
  NodeWireDispatcher(T& transport, KvFanList fan, RankNodeWire node, std::size_t token_bytes)
      : owner_(transport, "NodeWireDispatcher"),
        fan_(checked(transport, std::move(fan), node, token_bytes)),
        node_(std::move(node)),
        tb_(token_bytes),
        plan_(detail::plan_node_steps(fan_, node_, tb_, static_cast<std::size_t>(transport.rank()))),
        combine_(combine_of(node_, transport)) {
    std::array<const detail::ExchangePlan*, Plan::steps> exchanges{};
    for (std::size_t s = 0; s < Plan::steps; ++s) exchanges[s] = &plan_.step[s].exchange;
    owner_.lay_out(exchanges, [&](auto& path) {
      for (std::size_t s = 0; s < Plan::steps; ++s) {
        const Plan::StepPlan& st = plan_.step[s];
        pack_input_[s] = {path.add_copies(st.pack_input), st.pack_input};
        self_input_[s] = {path.add_copies(st.self_input), st.self_input};
      }
      fan_out_ = {path.add_copies(plan_.fan_out_pieces), plan_.fan_out_pieces};
      attention_fan_in_ = path.add_fan_in(fan_, tb_);
      relay_fan_in_ = path.add_fan_in(plan_.relay_fan, tb_);
      combine_id_ = path.add_combine(combine_, tb_);
    });
    owner_.grow_staging(plan_.arena_bytes);
  }

  NodeWireBufferSizes required_bytes() const { return {bytes(node_.mlp_tokens), bytes(fan_.attention_tokens)}; }

  /// Between nodes into the relay buffer, inside nodes into the wire buffer,
  /// then the fan-out into the attention layout.
  void forward(const_buffer mlp, mutable_buffer attention) {
    const NodeWireBufferSizes need = required_bytes();
    owner_.check_buffers("forward", {{mlp, "mlp", need.mlp_bytes}, {attention, "attention", need.attention_bytes}});
    step("forward", Plan::between_forward, mlp.data());
    step("forward", Plan::inside_forward, mlp.data());
    owner_.data_path().copy(fan_out_, owner_.staging(), attention.data());
  }

  /// The gradient of this rank's KV shards (MLP layout) from the gradient of
  /// its attention layout; `type` is the element type (token_bytes a multiple of its size).
  void reverse_combine(const_buffer attention_grad, mutable_buffer grad, ElementType type) {
    const NodeWireBufferSizes need = required_bytes();
    const std::initializer_list<detail::BufferUse> buffers = {{grad, "grad", need.mlp_bytes}, {attention_grad, "attention_grad", need.attention_bytes}};
    owner_.check_elements("reverse_combine", type, tb_, buffers);  // the fan-in reads attention_grad, the combine writes grad, as elements
    owner_.check_buffers("reverse_combine", buffers);
    auto& path = owner_.data_path();
    std::byte* arena = owner_.staging();
    path.fan_in(attention_fan_in_, type, attention_grad.data(), arena + plan_.wire_at);
    step("reverse_combine", Plan::inside_reverse, nullptr);
    path.fan_in(relay_fan_in_, type, arena, arena);
    step("reverse_combine", Plan::between_reverse, nullptr);
    const std::size_t replica = bytes(node_.num_copies * node_.mlp_tokens);
    path.combine(combine_id_, type, arena + plan_.replica_at, replica, grad.data(), grad.size());
  }

 private:
  std::size_t bytes(std::int64_t tokens) const { return static_cast<std::size_t>(tokens) * tb_; }

  static KvFanList checked(const T& transport, KvFanList fan, const RankNodeWire& node, std::size_t token_bytes) {
    const auto W = static_cast<std::size_t>(transport.world_size());
    if (node.rank != transport.rank()) detail::fail("NodeWireDispatcher: the node wire is rank ", node.rank, "'s, the transport is rank ", transport.rank());
    if (node.between.send_splits.size() != W + 1 || node.inside.send_splits.size() != W + 1 || node.between.recv_splits.size() != W + 1 ||
        node.inside.recv_splits.size() != W + 1) {
      detail::fail("NodeWireDispatcher: the node wire is planned for ", node.between.send_splits.size() - 1, " ranks, the transport has ", W);
    }
    if (token_bytes == 0) detail::fail("NodeWireDispatcher: token_bytes must be positive");
    if (fan.wire_tokens != node.wire_tokens) {
      detail::fail("NodeWireDispatcher: the fan list's wire buffer holds ", fan.wire_tokens, " tokens, the node wire fills ", node.wire_tokens);
    }
    return fan;
  }

  /// The home combine's mask and shard lengths.
  static RankMetadata combine_of(const RankNodeWire& node, const T& transport) {
    RankMetadata m;
    m.rank = transport.rank();
    m.world_size = transport.world_size();
    m.recv_seq_lens = node.shard_len;
    m.seq_recv_mask = std::vector<std::int64_t>(node.replica_mask.begin(), node.replica_mask.end());
    m.mask_copies = static_cast<std::size_t>(node.num_copies);
    return m;
  }

  /// One step: the input's pieces into the staging, the exchange over the arena (all_to_all_v even over a
  /// PieceTransport: the sends read two buffers), the input's traffic to itself. `input`: none in reverse.
  void step(const char* call, Plan::Step s, const std::byte* input) {
    auto& path = owner_.data_path();
    std::byte* arena = owner_.staging();
    path.copy(pack_input_[s], input, arena + plan_.staging_at);
    owner_.template run<false>(s, plan_.step[s].exchange, arena, arena, arena + plan_.staging_at, call);
    path.copy(self_input_[s], input, arena);
  }

  Owner owner_;  // its staging is the arena (relay, wire, gather, replica, then the steps' staging)
  KvFanList fan_;
  RankNodeWire node_;
  std::size_t tb_;
  Plan plan_;
  RankMetadata combine_;
  std::array<detail::PieceList, Plan::steps> pack_input_, self_input_;  // the ids of the lists below with the data path
  detail::PieceList fan_out_;
  std::size_t attention_fan_in_ = 0, relay_fan_in_ = 0, combine_id_ = 0;
};

}  // namespace cpdispatch
