#pragma once
// The deduplicated KV exchange on one rank (docs/plan-format.md,
// section 2c): each KV shard crosses the network once per destination rank.
//
//   const QkvMetadata meta = plan_qkv(plan);          // same plan on every rank
//   const KvWireMetadata wire = plan_kv_wire(meta);
//   KvWireDispatcher kv(transport, wire, kv_token_bytes);
//   kv.forward(kv_mlp, kv_attn);                       // one exchange + local fan-out
//   ... attention ...
//   kv.reverse_combine(dkv_attn, dkv_wire, dkv_replica, dkv_mlp, ElementType::bfloat16);
//
// forward: ONE exchange (all_to_all_v, or all_to_all_pieces where the
// transport has it) carries each KV shard once per destination rank, straight
// into the place of its first copy in the attention layout; the fan-out then
// copies it to the places of its other copies. The attention layout is
// exactly the one Dispatcher(kv_fwd, kv_rev).forward writes.
// reverse_combine: the fan-in sums, for every received shard, the gradients of
// its copies (copy index ascending; fp32 accumulation for 16-bit types,
// integers wrap) into the wire buffer (the shards this rank received, once
// each, back to back in wire order), ONE exchange takes them home into slot u
// of the [C][T] replica buffer, and the home sums the slots in use
// (ascending). Equal to the non-deduplicated reverse_combine up to
// floating-point reassociation (each fan-in sum is rounded to the element
// type once), exact for integers, deterministic.
//
// When to use it: when query shards of one document share a destination rank
// (zig-zag causal balancing puts two on every rank), the wire carries fewer
// bytes than kv_fwd; when they never do, the wire equals kv_fwd and the
// fan-in is one extra local copy.
//
// Buffers are the caller's (bytes; a token is `token_bytes` wide): mlp [T],
// attention (this rank's KV attention layout), wire (backward scratch),
// replica [C][T], grad [T]. required_bytes() gives the sizes; short buffers
// throw capacity_error naming the buffer, the needed and the given size,
// before anything is written. Buffers of one call must not overlap. Staging
// for transports without all_to_all_pieces is allocated at construction;
// calls do not allocate. Every rank makes the same calls (each is one
// collective). The transport is held by reference and must outlive the
// dispatcher; errors from it propagate with "KvWireDispatcher::<call> (rank r
// of W): all_to_all_v failed: " in front, keeping their kind.
//
// Memory spaces: as the Dispatcher's. Host transports take std::span<std::byte>;
// device transports (NCCL, the device sim) take cuda::DeviceSpan and need
// cpdispatch/cuda/data_path.hpp in the translation unit (compiled by nvcc),
// else the dispatcher is refused at compile time. On the device, the fan-out
// is a copy kernel and the fan-in a summing kernel (same order and
// arithmetic as the host's: bit-identical results), the piece lists and fan
// lists are uploaded once at construction, and every call is stream-ordered
// on the transport's stream with no allocation and no host synchronisation,
// so calls can be captured in a CUDA graph.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/fan_in.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/execute/exchange_owner.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/transport.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"

namespace cpdispatch {

/// The buffer sizes of one KvWireDispatcher, in bytes.
struct KvWireBufferSizes {
  std::size_t mlp_bytes = 0;        ///< forward input; reverse_combine's gradient output
  std::size_t attention_bytes = 0;  ///< forward output; reverse_combine's input
  std::size_t wire_bytes = 0;       ///< reverse_combine's scratch: the fan-in's sums, one per received shard
  std::size_t replica_bytes = 0;    ///< [C][T] replica buffer
  friend bool operator==(const KvWireBufferSizes&, const KvWireBufferSizes&) = default;
};

namespace detail {

/// Checks that a rank's fan list belongs to its wire slices: one entry per
/// received wire entry, in order, back to back, each with at least one copy
/// inside the attention layout.
inline void check_fan_list(const KvFanList& fan, const RankMetadata& wire_rev, const std::string& who) {
  const std::size_t n = fan.num_entries();
  if (fan.wire_offset.size() != n || fan.src_rank.size() != n || fan.src_shard.size() != n || fan.copy_splits.size() != n + 1) {
    fail(who, ": the fan list's arrays disagree on the number of entries (", n, ")");
  }
  if (wire_rev.seq_len.size() != n) fail(who, ": the fan list has ", n, " entries, kv_wire_rev receives ", wire_rev.seq_len.size());
  if (fan.copy_splits[0] != 0 || fan.copy_splits[n] != fan.attn_offset.size()) {
    fail(who, ": fan.copy_splits must run from 0 to the ", fan.attn_offset.size(), " copies of fan.attn_offset");
  }
  std::int64_t at = 0;
  for (std::size_t e = 0; e < n; ++e) {
    const std::int64_t len = fan.seq_len[e];
    if (len != wire_rev.seq_len[e] || fan.src_rank[e] != wire_rev.dst_rank[e] || fan.wire_offset[e] != at) {
      fail(who, ": fan entry ", e, " (", len, " tokens of rank ", fan.src_rank[e], " at wire offset ", fan.wire_offset[e],
           ") does not match kv_wire_rev entry ", e, " (", wire_rev.seq_len[e], " tokens of rank ", wire_rev.dst_rank[e], " at ", at, ")");
    }
    at += len;
    if (fan.copy_splits[e + 1] <= fan.copy_splits[e]) fail(who, ": fan entry ", e, " has no copy in the attention layout");
    for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i) {
      if (fan.attn_offset[i] < 0 || fan.attn_offset[i] > fan.attention_tokens - len) {
        fail(who, ": fan.attn_offset[", i, "] = ", fan.attn_offset[i], " with ", len, " tokens falls outside the attention layout of ",
             fan.attention_tokens, " tokens");
      }
      const std::int64_t gap = fan.attn_offset[i] - fan.attn_offset[fan.copy_splits[e]];
      if (i > fan.copy_splits[e] && gap < len && -gap < len) {
        fail(who, ": fan.attn_offset[", i, "] = ", fan.attn_offset[i], " overlaps the first copy of fan entry ", e);
      }
    }
  }
  if (fan.wire_tokens != at) fail(who, ": fan.wire_tokens = ", fan.wire_tokens, " but its entries hold ", at);
}

/// The three exchanges of the deduplicated path.
enum class WireExchange : std::size_t { forward, reverse, reverse_in_place };

/// The fan-out of fan entry e, appended to `pieces` (bytes, attention ->
/// attention): its first copy, where the wire lands it, to each of its other copies.
inline void append_fan_out(std::vector<CopyPiece>& pieces, const KvFanList& fan, std::size_t e, std::size_t tb) {
  const std::span<const std::int64_t> copies = fan.copies(e);
  const auto bytes = [tb](std::int64_t tokens) { return static_cast<std::size_t>(tokens) * tb; };
  for (std::size_t c = 1; c < copies.size(); ++c) append_piece(pieces, bytes(copies[0]), bytes(copies[c]), bytes(fan.seq_len[e]));
}

/// Fan entry e as an entry of `in_place`, a fan list whose fan-in sums each
/// entry's copies at its first copy (wire offset = first copy), as the fan-out's reverse.
inline void append_fan_in_place(KvFanList& in_place, const KvFanList& fan, std::size_t e) {
  const std::span<const std::int64_t> copies = fan.copies(e);
  in_place.seq_len.push_back(fan.seq_len[e]);
  in_place.src_rank.push_back(fan.src_rank[e]);
  in_place.src_shard.push_back(fan.src_shard[e]);
  in_place.wire_offset.push_back(copies.empty() ? 0 : copies[0]);
  in_place.attn_offset.insert(in_place.attn_offset.end(), copies.begin(), copies.end());
  in_place.copy_splits.push_back(in_place.attn_offset.size());
}

/// Empties a fan list, keeping its storage.
inline void clear_fan_list(KvFanList& fan) noexcept {
  for (auto* v : {&fan.seq_len, &fan.src_rank, &fan.src_shard, &fan.wire_offset, &fan.attn_offset}) v->clear();
  fan.copy_splits.assign(1, 0);
  fan.wire_tokens = fan.attention_tokens = 0;
}

/// Every entry of `fan` as an entry of `in_place` (its storage reused): the
/// fan-in that sums each entry at its first copy, over the attention layout alone.
inline void fan_in_place_of(const KvFanList& fan, KvFanList& in_place) {
  clear_fan_list(in_place);
  for (std::size_t e = 0; e < fan.num_entries(); ++e) append_fan_in_place(in_place, fan, e);
  in_place.attention_tokens = fan.attention_tokens;
}

/// Both exchanges of one rank's deduplicated KV path, and its fan-out,
/// computed once. Forward: home MLP layout -> the attention layout at each
/// wire entry's FIRST copy (so the wire never needs a buffer of its own),
/// then the fan-out copies that first copy to the others. Reverse: the
/// fan-in's sums in the wire buffer -> slot u of the home's replica buffer.
struct WirePlan {
  ExchangePlan forward, reverse;
  ExchangePlan reverse_in_place;  ///< the same from each shard's first copy in the attention layout
  std::vector<CopyPiece> fan_out;  ///< attention -> attention, bytes
  std::int64_t mlp_tokens = 0, attention_tokens = 0, wire_tokens = 0, replica_tokens = 0;
};

/// This rank's wire traffic as home (shard g, slot u to each peer) and as
/// destination (its fan entries from each peer), both in wire order.
struct WireTraffic {
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> home_to;  // [peer] -> (g, u)
  std::vector<std::vector<std::size_t>> entries_from;                     // [peer] -> fan entry
};

/// Fills `t`, reusing its storage.
inline void wire_traffic(const RankMetadata& fwd, const RankMetadata& rev, const KvFanList& fan, const std::string& who, WireTraffic& t) {
  const auto W = static_cast<std::size_t>(fwd.world_size);
  const std::size_t C = fwd.num_copies;
  t.home_to.resize(W);
  t.entries_from.resize(W);
  for (auto& v : t.home_to) v.clear();
  for (auto& v : t.entries_from) v.clear();
  for (std::size_t g = 0; g < fwd.seq_len.size(); ++g) {
    for (std::size_t u = 0; u < C; ++u) {
      const std::int64_t d = fwd.dst_rank[g * C + u];
      if ((*rev.seq_recv_mask)[g * C + u] != (d >= 0 ? 1 : 0)) {
        fail(who, ": kv_wire_rev.seq_recv_mask[", g, "][", u, "] = ", (*rev.seq_recv_mask)[g * C + u], " but kv_wire_fwd.dst_rank[", g,
             "][", u, "] = ", d);
      }
      if (d >= 0 && fwd.seq_len[g] > 0) t.home_to[static_cast<std::size_t>(d)].emplace_back(g, u);
    }
  }
  for (std::size_t e = 0; e < fan.num_entries(); ++e) t.entries_from[static_cast<std::size_t>(fan.src_rank[e])].push_back(e);
  for (std::size_t p = 0; p < W; ++p) {  // what one rank can check of the others: per-peer token counts
    std::int64_t sent = 0, received = 0;
    for (auto [g, u] : t.home_to[p]) sent += fwd.seq_len[g];
    for (std::size_t e : t.entries_from[p]) received += fan.seq_len[e];
    if (sent != rev.num_recv_tokens[p] || received != fwd.num_recv_tokens[p]) {
      fail(who, ": rank ", p, " gets ", sent, " tokens and sends ", received, ", but kv_wire_rev / kv_wire_fwd count ", rev.num_recv_tokens[p],
           " and ", fwd.num_recv_tokens[p], " (the slices are not of one plan)");
    }
  }
}

/// The per-peer token ranges of the wire's exchanges, kept between plans.
struct WireRanges {
  std::vector<std::vector<TokenRange>> fwd_send, fwd_recv, rev_send, rev_recv, in_place_send;

  void reset(std::size_t W) {
    for (auto* side : {&fwd_send, &fwd_recv, &rev_send, &rev_recv, &in_place_send}) {
      side->resize(W);
      for (auto& v : *side) v.clear();
    }
  }
};


/// The piece lists of both exchanges and the fan-out (see WirePlan), written
/// into `plan`'s storage; `lens` and `P` are this rank's shard lengths and MLP
/// positions, `r` the per-peer ranges' storage.
inline void lay_out_wire(WirePlan& plan, const KvFanList& fan, const WireTraffic& t, const std::vector<std::int64_t>& lens,
                         const std::vector<std::int64_t>& P, std::size_t tb, std::size_t me, const std::string& who, WireRanges& r) {
  const std::size_t W = t.home_to.size();
  const auto bytes = [tb](std::int64_t tokens) { return static_cast<std::size_t>(tokens) * tb; };
  const auto first = [&fan](std::size_t e) { return fan.attn_offset[fan.copy_splits[e]]; };
  const auto slot = [&](std::size_t g, std::size_t u) { return static_cast<std::int64_t>(u) * plan.mlp_tokens + P[g]; };
  r.reset(W);
  auto &fwd_send = r.fwd_send, &fwd_recv = r.fwd_recv, &rev_send = r.rev_send, &rev_recv = r.rev_recv, &in_place_send = r.in_place_send;
  for (std::vector<CopyPiece>* pieces : {&plan.forward.self, &plan.reverse.self, &plan.reverse_in_place.self, &plan.fan_out}) pieces->clear();
  for (std::size_t p = 0; p < W; ++p) {
    if (p == me) continue;
    for (auto [g, u] : t.home_to[p]) {
      fwd_send[p].push_back({P[g], lens[g]});
      rev_recv[p].push_back({slot(g, u), lens[g]});
    }
    for (std::size_t e : t.entries_from[p]) {
      fwd_recv[p].push_back({first(e), fan.seq_len[e]});
      rev_send[p].push_back({fan.wire_offset[e], fan.seq_len[e]});
      in_place_send[p].push_back({first(e), fan.seq_len[e]});
    }
  }
  // Traffic to itself: its shards to itself pair with its own fan entries, in order.
  const auto& mine = t.home_to[me];
  const auto& own = t.entries_from[me];
  if (mine.size() != own.size()) fail(who, ": it sends ", mine.size(), " shards to itself but its fan list receives ", own.size(), " from itself");
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto [g, u] = mine[i];
    if (fan.seq_len[own[i]] != lens[g]) {
      fail(who, ": its own fan entry ", own[i], " (", fan.seq_len[own[i]], " tokens) does not match its shard ", g, " (", lens[g], ")");
    }
    append_piece(plan.forward.self, bytes(P[g]), bytes(first(own[i])), bytes(lens[g]));
    append_piece(plan.reverse.self, bytes(fan.wire_offset[own[i]]), bytes(slot(g, u)), bytes(lens[g]));
    append_piece(plan.reverse_in_place.self, bytes(first(own[i])), bytes(slot(g, u)), bytes(lens[g]));
  }
  for (std::size_t e = 0; e < fan.num_entries(); ++e) append_fan_out(plan.fan_out, fan, e, tb);
  lay_out_side(plan.forward.send, fwd_send, tb, true);
  lay_out_side(plan.forward.recv, fwd_recv, tb, false);
  lay_out_side(plan.reverse.send, rev_send, tb, true);
  lay_out_side(plan.reverse.recv, rev_recv, tb, false);
  lay_out_side(plan.reverse_in_place.send, in_place_send, tb, true);
  plan.reverse_in_place.recv = plan.reverse.recv;
}

/// Plans one rank's WirePlan from its wire slices, checking that they belong
/// together. It keeps its working storage, and writes into the plan's,
/// between calls: once a plan fits what earlier ones needed (per peer too),
/// planning allocates nothing.
class WirePlanner {
 public:
  /// Fills `plan`; on a throw `plan` is unspecified (plan into a spare to keep a plan).
  void plan(const RankMetadata& fwd, const RankMetadata& rev, const KvFanList& fan, std::size_t tb, int rank, int world, WirePlan& plan) {
    name(rank, world);
    if (tb == 0) fail(who_, ": token_bytes must be positive");
    if (world <= 0 || rank < 0 || rank >= world) fail(who_, ": the transport's rank() / world_size() are not a rank of a world");
    for (auto [name, m] : {std::pair{"kv_wire_fwd", &fwd}, std::pair{"kv_wire_rev", &rev}}) {
      if (m->world_size != world) fail(who_, ": ", name, ".world_size = ", m->world_size, " but the transport's world_size() = ", world);
      if (m->rank != rank) fail(who_, ": ", name, " is the slice of rank ", m->rank, " but the transport is rank ", rank);
      check_slice(*m, name, who_, prefix_);
    }
    const std::size_t C = fwd.num_copies;
    if (!fwd.has_copies || rev.has_copies || !rev.seq_recv_mask || rev.mask_copies != C || *rev.recv_seq_lens != fwd.seq_len) {
      fail(who_, ": kv_wire_fwd / kv_wire_rev are not the forward (with copies) and reverse (with seq_recv_mask) slices of one wire plan");
    }
    check_fan_list(fan, rev, who_);
    wire_traffic(fwd, rev, fan, who_, traffic_);
    plan.mlp_tokens = 0;
    positions_.resize(fwd.seq_len.size());
    for (std::size_t g = 0; g < positions_.size(); ++g) {
      positions_[g] = plan.mlp_tokens;
      plan.mlp_tokens = add_tokens(plan.mlp_tokens, fwd.seq_len[g], who_.c_str());
    }
    if (__builtin_mul_overflow(static_cast<std::int64_t>(C), plan.mlp_tokens, &plan.replica_tokens)) fail(who_, ": the replica buffer overflows 64 bits");
    plan.attention_tokens = fan.attention_tokens;
    plan.wire_tokens = fan.wire_tokens;
    lay_out_wire(plan, fan, traffic_, fwd.seq_len, positions_, tb, static_cast<std::size_t>(rank), who_, ranges_);
  }

 private:
  /// "KvWireDispatcher (rank r of W)", into storage kept between plans.
  void name(int rank, int world) {
    char digits[48];
    const int n = std::snprintf(digits, sizeof digits, "(rank %d of %d)", rank, world);
    who_.assign("KvWireDispatcher ");
    who_.append(digits, static_cast<std::size_t>(std::max(n, 0)));
  }

  std::string who_, prefix_;
  WireTraffic traffic_;
  std::vector<std::int64_t> positions_;  // each shard's place in the MLP layout
  WireRanges ranges_;
};

}  // namespace detail

template <class T>
class KvWireDispatcher {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  using Owner = detail::ExchangeOwner<T, 3>;  // slots by WireExchange
  using Exchange = detail::WireExchange;
  /// A plan: the exchanges, the home combine's mask (rev), the fan-in (fan),
  /// and with all_to_all_pieces the fan-in at each shard's first copy.
  struct State {
    detail::WirePlan plan;
    RankMetadata rev;
    KvFanList fan, in_place_fan;
    KvWireBufferSizes sizes;
  };

 public:
  using transport_type = T;
  using const_buffer = typename Owner::const_buffer;  ///< in the transport's memory space
  using mutable_buffer = typename Owner::mutable_buffer;

  /// From this rank's part of plan_kv_wire's output. Throws invalid_input when
  /// it is not this transport's rank, or its parts do not belong together.
  KvWireDispatcher(T& transport, RankKvWire slice, std::size_t token_bytes) : owner_(transport, "KvWireDispatcher"), token_bytes_(token_bytes) {
    plan(slice, state_.now);
    state_.now.rev = std::move(slice.rev);
    state_.now.fan = std::move(slice.fan);
    if constexpr (PieceTransport<T>) detail::fan_in_place_of(state_.now.fan, state_.now.in_place_fan);
    lay_out();
    owner_.grow_staging(staging_of(state_.now));
  }

  /// The same from the global wire metadata: takes the part of transport.rank().
  KvWireDispatcher(T& transport, const KvWireMetadata& wire, std::size_t token_bytes)
      : KvWireDispatcher(transport, slice_of(transport, wire), token_bytes) {}

  /// The next step's slice, replanned in place (host transports): once a
  /// plan fits what earlier ones needed (per peer too), nothing is
  /// allocated. On a throw the dispatcher keeps its plan.
  void replan(const RankKvWire& slice)
    requires(detail::memory_space_of<T>() == MemorySpace::host)
  {
    prepare_replan(slice);
    commit_replan();
  }

  /// replan in two steps, for a caller that replans several dispatchers at
  /// once: prepare_replan plans and checks (it may throw; the current plan
  /// stays in use), commit_replan switches to it (never throws; nothing
  /// without a prepared plan).
  void prepare_replan(const RankKvWire& slice)
    requires(detail::memory_space_of<T>() == MemorySpace::host)
  {
    state_.prepare([&](State& next) {
      plan(slice, next);
      next.rev = slice.rev;
      next.fan = slice.fan;
      if constexpr (PieceTransport<T>) detail::fan_in_place_of(next.fan, next.in_place_fan);
      owner_.grow_staging(staging_of(next));
    });
  }

  void commit_replan() noexcept {
    if (state_.commit()) lay_out();
  }

  const KvWireBufferSizes& required_bytes() const noexcept { return state_.now.sizes; }
  /// The piece lists of the exchanges and the fan list, for a caller that
  /// runs the forward in stages itself (ContextParallelAttention): the
  /// forward exchange lands each shard at its first copy, the fan list then
  /// says where its other copies go.
  const detail::WirePlan& plan() const noexcept { return state_.now.plan; }
  const KvFanList& fan() const noexcept { return state_.now.fan; }
  /// The reverse slice: which slot of the replica each home shard's copy from each peer fills (for the home's combine).
  const RankMetadata& reverse_slice() const noexcept { return state_.now.rev; }
  int rank() const noexcept { return owner_.rank(); }
  int world_size() const noexcept { return owner_.world_size(); }
  std::size_t token_bytes() const noexcept { return token_bytes_; }

  /// MLP layout -> attention layout: one exchange (each shard once per
  /// destination, into its first copy's place), then the local fan-out.
  void forward(const_buffer mlp, mutable_buffer attention) {
    const char* call = "forward";
    const KvWireBufferSizes& sizes = required_bytes();
    owner_.check_buffers(call, {{mlp, "mlp", sizes.mlp_bytes}, {attention, "attention", sizes.attention_bytes}});
    exchange(call, Exchange::forward, mlp.data(), attention.data());
    owner_.data_path().copy(fan_out_, attention.data(), attention.data());
  }

  /// Attention-layout gradients -> `grad` [T]: the fan-in sums each received
  /// shard's copies into `wire`, one exchange takes them home into `replica`
  /// ([C][T], slot u in slab u), and the home sums the slots in use.
  void reverse_combine(const_buffer attention_grad, mutable_buffer wire, mutable_buffer replica, mutable_buffer grad, ElementType type) {
    const char* call = "reverse_combine";
    const KvWireBufferSizes& sizes = required_bytes();
    const std::initializer_list<detail::BufferUse> buffers = {{attention_grad, "attention_grad", sizes.attention_bytes},
                                                              {wire, "wire", sizes.wire_bytes},
                                                              {replica, "replica", sizes.replica_bytes},
                                                              {grad, "grad", sizes.mlp_bytes}};
    owner_.check_elements(call, type, token_bytes_, buffers);  // the fan-in and the combine read and write all four as elements
    owner_.check_buffers(call, buffers);
    owner_.data_path().fan_in(fan_in_, type, attention_grad.data(), wire.data());
    exchange(call, Exchange::reverse, wire.data(), replica.data());
    combine(type, replica, grad);
  }

  /// The same without the wire buffer, for a caller that no longer needs the
  /// attention-layout gradients (their contents afterwards are unspecified).
  /// Same results, bit for bit, as reverse_combine, with less memory traffic:
  /// where the transport has all_to_all_pieces, the fan-in sums in place, at
  /// each shard's first copy, and the exchange sends from there (shards with
  /// a single copy are not copied at all); otherwise the fan-in writes
  /// straight into the send staging (no pack pass).
  void reverse_combine_in_place(mutable_buffer attention_grad, mutable_buffer replica, mutable_buffer grad, ElementType type) {
    const char* call = "reverse_combine_in_place";
    const KvWireBufferSizes& sizes = required_bytes();
    const std::initializer_list<detail::BufferUse> buffers = {{attention_grad, "attention_grad", sizes.attention_bytes},
                                                              {replica, "replica", sizes.replica_bytes},
                                                              {grad, "grad", sizes.mlp_bytes}};
    owner_.check_elements(call, type, token_bytes_, buffers);
    owner_.check_buffers(call, buffers);
    if constexpr (PieceTransport<T>) {
      owner_.data_path().fan_in(fan_in_place_, type, attention_grad.data());
      exchange(call, Exchange::reverse_in_place, attention_grad.data(), replica.data());
    } else {  // the staging's head is the wire buffer, the exchange's own staging follows it
      std::byte* wire = owner_.staging();
      owner_.data_path().fan_in(fan_in_, type, attention_grad.data(), wire);
      exchange(call, Exchange::reverse, wire, replica.data(), wire_staging_of(sizes));
    }
    combine(type, replica, grad);
  }

 private:
  /// Plans `slice` into `into`'s plan and sizes.
  void plan(const RankKvWire& slice, State& into) {
    planner_.plan(slice.fwd, slice.rev, slice.fan, token_bytes_, owner_.rank(), owner_.world_size(), into.plan);
    const char* who = "KvWireDispatcher";
    const detail::WirePlan& p = into.plan;
    into.sizes = {detail::token_bytes_of(p.mlp_tokens, token_bytes_, who), detail::token_bytes_of(p.attention_tokens, token_bytes_, who),
                  detail::token_bytes_of(p.wire_tokens, token_bytes_, who), detail::token_bytes_of(p.replica_tokens, token_bytes_, who)};
  }

  /// Without all_to_all_pieces, reverse_combine_in_place's wire buffer heads
  /// the owned staging (256-byte aligned end); none otherwise.
  static std::size_t wire_staging_of(const KvWireBufferSizes& sizes) noexcept {
    if constexpr (PieceTransport<T>) return 0;
    else return (sizes.wire_bytes + 255) / 256 * 256;
  }

  /// The owned staging: none with all_to_all_pieces.
  static std::size_t staging_of(const State& s) noexcept {
    if constexpr (PieceTransport<T>) return 0;
    else return std::max({s.plan.forward.staging_bytes(), s.plan.reverse.staging_bytes(), wire_staging_of(s.sizes) + s.plan.reverse.staging_bytes()});
  }

  static RankKvWire slice_of(const T& transport, const KvWireMetadata& wire) {
    const int W = transport.world_size();
    if (wire.fwd.world_size != W || wire.rev.world_size != W || wire.fan.size() != static_cast<std::size_t>(W)) {
      detail::fail("KvWireDispatcher (rank ", transport.rank(), " of ", W, "): the wire metadata is for ", wire.fwd.world_size, " ranks, with ",
                   wire.fan.size(), " fan lists");
    }
    detail::check_shapes(wire.fwd, "kv_wire_fwd");
    detail::check_shapes(wire.rev, "kv_wire_rev");
    return wire.get_slice(transport.rank());
  }

  /// One collective (none when alone), then the traffic to itself. Without
  /// all_to_all_pieces, the exchange's staging starts `staging_at` bytes into
  /// the owned staging.
  void exchange(const char* call, Exchange which, const std::byte* in, std::byte* out, std::size_t staging_at = 0) {
    const auto w = static_cast<std::size_t>(which);
    std::byte* staging = nullptr;
    if constexpr (!PieceTransport<T>) staging = owner_.staging() + staging_at;
    owner_.run(w, *exchanges()[w], in, out, staging, call);
  }

  /// The plan's exchanges, by WireExchange (reverse_in_place serves all_to_all_pieces only).
  std::array<const detail::ExchangePlan*, 3> exchanges() const noexcept {
    const detail::WirePlan& p = state_.now.plan;
    return {&p.forward, &p.reverse, PieceTransport<T> ? &p.reverse_in_place : nullptr};
  }

  void combine(ElementType type, mutable_buffer replica, mutable_buffer grad) {
    const KvWireBufferSizes& sizes = required_bytes();
    owner_.data_path().combine(combine_, type, replica.data(), sizes.replica_bytes, grad.data(), sizes.mlp_bytes);
  }

  /// The plan's lists with the data path (the host path keeps views of the
  /// plan; once the lists have been seen, this allocates nothing).
  void lay_out() {
    const State& s = state_.now;
    owner_.lay_out(exchanges(), [&](auto& path) {
      fan_out_ = {path.add_copies(s.plan.fan_out), s.plan.fan_out};
      fan_in_ = path.add_fan_in(s.fan, token_bytes_);
      if constexpr (PieceTransport<T>) fan_in_place_ = path.add_fan_in_place(s.in_place_fan, token_bytes_);
      combine_ = path.add_combine(s.rev, token_bytes_);
    });
  }

  Owner owner_;
  std::size_t token_bytes_;
  detail::WirePlanner planner_;  // its storage, kept between plans
  detail::ReplanPair<State> state_;  // the plan in use, and prepare_replan's
  detail::PieceList fan_out_;  // the ids of the lists below with the data path
  std::size_t fan_in_ = 0, fan_in_place_ = 0, combine_ = 0;
};
}  // namespace cpdispatch
