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
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/transport.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/dedup.hpp"

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
  using path = typename detail::dispatcher_path<T>::type;
  static_assert(detail::data_path_available<path>(),
                "cpdispatch: KvWireDispatcher over a device transport needs the CUDA data path: include cpdispatch/cuda/data_path.hpp "
                "(from a .cu file) where it is used");
  using Exchange = detail::WireExchange;

 public:
  using transport_type = T;
  using const_buffer = typename path::const_buffer;  ///< in the transport's memory space
  using mutable_buffer = typename path::mutable_buffer;

  /// From this rank's part of plan_kv_wire's output. Throws invalid_input when
  /// it is not this transport's rank, or its parts do not belong together.
  KvWireDispatcher(T& transport, RankKvWire slice, std::size_t token_bytes)
      : transport_(transport),
        rank_(transport.rank()),
        world_size_(transport.world_size()),
        token_bytes_(token_bytes),
        plan_(first_plan(slice)),
        rev_(std::move(slice.rev)),
        fan_(std::move(slice.fan)),
        sizes_(sizes_of(plan_, token_bytes)),
        wire_staging_bytes_(wire_staging_of(sizes_)),
        path_(transport) {
    if constexpr (PieceTransport<T>) detail::fan_in_place_of(fan_, in_place_fan_);
    lay_out_path();
    grow_staging(staging_of(plan_, wire_staging_bytes_));
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
    prepared_ = false;
    planner_.plan(slice.fwd, slice.rev, slice.fan, token_bytes_, rank_, world_size_, next_plan_);
    next_sizes_ = sizes_of(next_plan_, token_bytes_);
    next_rev_ = slice.rev;
    next_fan_ = slice.fan;
    if constexpr (PieceTransport<T>) detail::fan_in_place_of(next_fan_, next_in_place_fan_);
    grow_staging(staging_of(next_plan_, wire_staging_of(next_sizes_)));
    prepared_ = true;
  }

  void commit_replan() noexcept {
    if (!prepared_) return;
    std::swap(plan_, next_plan_);
    std::swap(rev_, next_rev_);
    std::swap(fan_, next_fan_);
    std::swap(in_place_fan_, next_in_place_fan_);
    sizes_ = next_sizes_;
    wire_staging_bytes_ = wire_staging_of(sizes_);
    lay_out_path();
    prepared_ = false;
  }

  const KvWireBufferSizes& required_bytes() const noexcept { return sizes_; }
  /// The piece lists of the exchanges and the fan list, for a caller that
  /// runs the forward in stages itself (ContextParallelAttention): the
  /// forward exchange lands each shard at its first copy, the fan list then
  /// says where its other copies go.
  const detail::WirePlan& plan() const noexcept { return plan_; }
  const KvFanList& fan() const noexcept { return fan_; }
  /// The reverse slice: which slot of the replica each home shard's copy from each peer fills (for the home's combine).
  const RankMetadata& reverse_slice() const noexcept { return rev_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  std::size_t token_bytes() const noexcept { return token_bytes_; }

  /// MLP layout -> attention layout: one exchange (each shard once per
  /// destination, into its first copy's place), then the local fan-out.
  void forward(const_buffer mlp, mutable_buffer attention) {
    const char* call = "forward";
    check_buffers(call, {{mlp.data(), mlp.size(), "mlp", sizes_.mlp_bytes}, {attention.data(), attention.size(), "attention", sizes_.attention_bytes}});
    exchange(call, Exchange::forward, mlp.data(), attention.data());
    path_.copy(fan_out_, attention.data(), attention.data());
  }

  /// Attention-layout gradients -> `grad` [T]: the fan-in sums each received
  /// shard's copies into `wire`, one exchange takes them home into `replica`
  /// ([C][T], slot u in slab u), and the home sums the slots in use.
  void reverse_combine(const_buffer attention_grad, mutable_buffer wire, mutable_buffer replica, mutable_buffer grad, ElementType type) {
    const char* call = "reverse_combine";
    check_combine(call, type, {{attention_grad.data(), attention_grad.size(), "attention_grad", sizes_.attention_bytes},
                               {wire.data(), wire.size(), "wire", sizes_.wire_bytes},
                               {replica.data(), replica.size(), "replica", sizes_.replica_bytes},
                               {grad.data(), grad.size(), "grad", sizes_.mlp_bytes}});
    path_.fan_in(fan_in_, type, attention_grad.data(), wire.data());
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
    check_combine(call, type, {{attention_grad.data(), attention_grad.size(), "attention_grad", sizes_.attention_bytes},
                               {replica.data(), replica.size(), "replica", sizes_.replica_bytes},
                               {grad.data(), grad.size(), "grad", sizes_.mlp_bytes}});
    if constexpr (PieceTransport<T>) {
      path_.fan_in(fan_in_place_, type, attention_grad.data());
      exchange(call, Exchange::reverse_in_place, attention_grad.data(), replica.data());
    } else {  // the staging's head is the wire buffer, the exchange's own staging follows it
      std::byte* wire = staging_.data();
      path_.fan_in(fan_in_, type, attention_grad.data(), wire);
      exchange(call, Exchange::reverse, wire, replica.data(), wire_staging_bytes_);
    }
    combine(type, replica, grad);
  }

 private:
  struct Buffer {
    const std::byte* data;
    std::size_t size;
    const char* name;
    std::size_t used;
  };

  detail::WirePlan first_plan(const RankKvWire& slice) {
    detail::WirePlan plan;
    planner_.plan(slice.fwd, slice.rev, slice.fan, token_bytes_, rank_, world_size_, plan);
    return plan;
  }

  static KvWireBufferSizes sizes_of(const detail::WirePlan& plan, std::size_t tb) {
    const char* who = "KvWireDispatcher";
    return {detail::token_bytes_of(plan.mlp_tokens, tb, who), detail::token_bytes_of(plan.attention_tokens, tb, who),
            detail::token_bytes_of(plan.wire_tokens, tb, who), detail::token_bytes_of(plan.replica_tokens, tb, who)};
  }

  /// Without all_to_all_pieces, reverse_combine_in_place's wire buffer heads
  /// the owned staging (256-byte aligned end); none otherwise.
  static std::size_t wire_staging_of(const KvWireBufferSizes& sizes) noexcept {
    if constexpr (PieceTransport<T>) return 0;
    else return (sizes.wire_bytes + 255) / 256 * 256;
  }

  /// The owned staging: none with all_to_all_pieces.
  static std::size_t staging_of(const detail::WirePlan& plan, std::size_t wire_staging) noexcept {
    if constexpr (PieceTransport<T>) return 0;
    else return std::max({plan.forward.staging_bytes(), plan.reverse.staging_bytes(), wire_staging + plan.reverse.staging_bytes()});
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

  template <class E = invalid_input, class... Args>
  [[noreturn]] void fail(const char* call, Args&&... args) const {
    detail::fail<E>("KvWireDispatcher::", call, " (rank ", rank_, " of ", world_size_, "): ", std::forward<Args>(args)...);
  }

  /// The element type's fit, alignment, then check_buffers.
  void check_combine(const char* call, ElementType type, std::initializer_list<Buffer> buffers) const {
    const std::size_t es = element_size(type);
    if (token_bytes_ % es != 0) {
      fail(call, "token_bytes = ", token_bytes_, " is not a multiple of the ", es, "-byte ", element_name(type), " element");
    }
    for (const Buffer& b : buffers) {
      if (reinterpret_cast<std::uintptr_t>(b.data) % es != 0) fail(call, b.name, " is not aligned to ", es, " bytes for ", element_name(type));
    }
    check_buffers(call, buffers);
  }

  /// Capacity of every buffer first, then pairwise overlap: nothing is written before all pass.
  void check_buffers(const char* call, std::initializer_list<Buffer> buffers) const {
    for (const Buffer& b : buffers) {
      if (b.size < b.used) fail<capacity_error>(call, b.name, " holds ", b.size, " bytes, the plan needs ", b.used);
    }
    const std::less<const std::byte*> before;
    for (auto a = buffers.begin(); a != buffers.end(); ++a) {
      for (auto b = a + 1; b != buffers.end(); ++b) {
        if (a->used && b->used && before(a->data, b->data + b->used) && before(b->data, a->data + a->used)) {
          fail(call, a->name, " and ", b->name, " overlap");
        }
      }
    }
  }

  /// One collective (none when alone), then the traffic to itself. Without
  /// all_to_all_pieces, the exchange's staging starts `staging_at` bytes into
  /// the owned staging.
  void exchange(const char* call, Exchange which, const std::byte* in, std::byte* out, std::size_t staging_at = 0) {
    const auto w = static_cast<std::size_t>(which);
    std::byte* staging = nullptr;
    if constexpr (!PieceTransport<T>) staging = staging_.data() + staging_at;
    detail::run_exchange(transport_, path_, lists_[w], *exchanges()[w], in, out, staging, {"KvWireDispatcher", call});
  }

  /// The plan's exchanges, by WireExchange (reverse_in_place serves all_to_all_pieces only).
  std::array<const detail::ExchangePlan*, 3> exchanges() const noexcept { return {&plan_.forward, &plan_.reverse, &plan_.reverse_in_place}; }

  void combine(ElementType type, mutable_buffer replica, mutable_buffer grad) {
    path_.combine(combine_, type, replica.data(), sizes_.replica_bytes, grad.data(), sizes_.mlp_bytes);
  }

  /// The plan's lists with the data path (the host path keeps views of
  /// plan_, fan_ and rev_; once the lists have been seen, this allocates nothing).
  void lay_out_path() {
    path_.clear();
    const std::size_t used = PieceTransport<T> ? 3 : 2;
    for (std::size_t w = 0; w < used; ++w) lists_[w] = detail::add_exchange(path_, *exchanges()[w]);
    fan_out_ = {path_.add_copies(plan_.fan_out), plan_.fan_out};
    fan_in_ = path_.add_fan_in(fan_, token_bytes_);
    if constexpr (PieceTransport<T>) fan_in_place_ = path_.add_fan_in_place(in_place_fan_, token_bytes_);
    combine_ = path_.add_combine(rev_, token_bytes_);
    path_.commit();
  }

  /// The owned staging grows to `bytes` (never shrinks).
  void grow_staging(std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
  }

  T& transport_;
  int rank_;
  int world_size_;
  std::size_t token_bytes_;
  detail::WirePlanner planner_;  // its storage, kept between plans
  detail::WirePlan plan_;
  RankMetadata rev_;  // the home combine's mask
  KvFanList fan_;     // the fan-in
  KvWireBufferSizes sizes_;
  std::size_t wire_staging_bytes_;  // without all_to_all_pieces: the in-place fan-in's wire, at the staging's head
  path path_;  // the lists below, registered from the above
  std::size_t lists_[3] = {};  // each exchange's first piece list, by WireExchange
  detail::PieceList fan_out_;
  std::size_t fan_in_ = 0, fan_in_place_ = 0, combine_ = 0;
  KvFanList in_place_fan_;  // all_to_all_pieces: the fan-in at each shard's first copy
  typename path::template buffer<std::byte> staging_;  // owned staging (none with all_to_all_pieces)
  // prepare_replan's, swapped in by commit_replan (both keep their storage)
  detail::WirePlan next_plan_;
  RankMetadata next_rev_;
  KvFanList next_fan_, next_in_place_fan_;
  KvWireBufferSizes next_sizes_{};
  bool prepared_ = false;
};
}  // namespace cpdispatch
