#pragma once
// The per-rank dispatch plan: from this rank's forward and reverse metadata
// slices to the piece lists and byte counts of its two exchanges, computed once
// (O(entries log entries + W)) so that each call is pack -> one all_to_all_v ->
// unpack, or one all_to_all_pieces for transports that have it.
//
// Why both slices: a rank's forward slice says where its own tokens go, its
// reverse slice says what it receives (entry m came from rev.dst_rank[m], has
// rev.seq_len[m] tokens and sits back to back in the attention layout).
// Wire order: the pieces between two ranks travel in ascending order of their
// position in the attention layout (the forward dst_offset at the receiver),
// in both directions. That is how both sides agree without talking.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/bytes.hpp"

namespace cpdispatch::detail {

/// One side (send or receive) of an exchange, in both forms a transport may take.
struct Side {
  // all_to_all_v: byte counts and displacements per peer (self: 0). When every
  // peer's bytes are one contiguous range of the caller's buffer (`direct`),
  // the transport works on that buffer; otherwise on staging, with `copies`
  // the pack (buffer -> staging) or unpack (staging -> buffer).
  bool direct = true;
  std::vector<std::size_t> counts, displs;
  std::vector<CopyPiece> copies;
  std::size_t staging = 0;  ///< bytes of staging this side needs
  // all_to_all_pieces: the caller's buffer as pieces, peer p's in [splits[p], splits[p+1]).
  std::vector<BytePiece> pieces;
  std::vector<std::size_t> splits;
};

/// Everything one exchange needs, computed once per plan.
struct ExchangePlan {
  Side send;                     ///< read from the input
  Side recv;                     ///< written into the output
  std::vector<CopyPiece> self;   ///< input -> output (traffic to oneself)
  std::int64_t input_tokens = 0, output_tokens = 0;
  std::size_t input_bytes = 0, output_bytes = 0;

  /// Staging for all_to_all_v: the send side's, then the receive side's.
  /// The receive staging starts 256-byte aligned after the send staging, so
  /// that the unpack can use wide accesses whatever the token size (no
  /// padding when either side needs no staging).
  std::size_t recv_staging_offset() const noexcept {
    return send.staging == 0 || recv.staging == 0 ? send.staging : (send.staging + 255) / 256 * 256;
  }
  std::size_t staging_bytes() const noexcept { return recv_staging_offset() + recv.staging; }
};

struct DispatchPlan {
  ExchangePlan forward;  ///< MLP layout -> attention layout
  ExchangePlan reverse;  ///< attention layout -> MLP layout / [C][T] replica buffer
};

/// A run of tokens at `pos` in some buffer.
struct TokenRange {
  std::int64_t pos = 0;
  std::int64_t len = 0;
};

inline void append_piece(std::vector<CopyPiece>& pieces, std::size_t src, std::size_t dst, std::size_t bytes) {
  if (bytes == 0) return;
  if (!pieces.empty()) {
    CopyPiece& last = pieces.back();
    if (last.src + last.bytes == src && last.dst + last.bytes == dst) {  // adjacent on both sides: one memcpy
      last.bytes += bytes;
      return;
    }
  }
  pieces.push_back({src, dst, bytes});
}

/// Lays out one side of an exchange into `side`, reusing its storage.
/// `ranges(p, emit)` calls emit(TokenRange) for each range of the caller's
/// buffer that travels to (send) or from (receive) peer p, in wire order;
/// adjacent ranges merge into one piece.
template <class Ranges>
void lay_out_side(Side& side, std::size_t W, std::size_t token_bytes, bool is_send, Ranges&& ranges) {
  side.direct = true;
  side.counts.assign(W, 0);
  side.displs.assign(W, 0);
  side.splits.assign(W + 1, 0);
  side.pieces.clear();
  side.copies.clear();
  side.staging = 0;
  for (std::size_t p = 0; p < W; ++p) {
    ranges(p, [&](TokenRange r) {
      const std::size_t at = static_cast<std::size_t>(r.pos) * token_bytes, n = static_cast<std::size_t>(r.len) * token_bytes;
      side.counts[p] += n;
      if (n == 0) return;
      if (side.pieces.size() > side.splits[p] && side.pieces.back().offset + side.pieces.back().bytes == at) {
        side.pieces.back().bytes += n;
      } else {
        side.pieces.push_back({at, n});
      }
    });
    side.splits[p + 1] = side.pieces.size();
    if (side.splits[p + 1] - side.splits[p] > 1) side.direct = false;  // not one contiguous range
  }
  for (std::size_t p = 0; p < W; ++p) {
    if (side.splits[p + 1] == side.splits[p]) continue;  // nothing: displacement 0
    if (side.direct) {
      side.displs[p] = side.pieces[side.splits[p]].offset;
      continue;
    }
    side.displs[p] = side.staging;
    for (std::size_t i = side.splits[p]; i < side.splits[p + 1]; ++i) {
      const BytePiece& piece = side.pieces[i];
      if (is_send) append_piece(side.copies, piece.offset, side.staging, piece.bytes);
      else append_piece(side.copies, side.staging, piece.offset, piece.bytes);
      side.staging += piece.bytes;
    }
  }
}

/// The same from per-peer lists: `by_peer[p]` in wire order.
inline void lay_out_side(Side& side, const std::vector<std::vector<TokenRange>>& by_peer, std::size_t token_bytes, bool is_send) {
  lay_out_side(side, by_peer.size(), token_bytes, is_send, [&](std::size_t p, auto&& emit) {
    for (const TokenRange& r : by_peer[p]) emit(r);
  });
}

inline std::string entry_str(const RankMetadata& m, std::size_t j, std::size_t k) {
  return m.has_copies ? index_str(j, k) : index_str(j);
}

/// One slice on its own, by the format's per-rank rules (RankMetadata::validate);
/// messages read "<who>: <name>.<field>...". `prefix` is scratch for that prefix.
inline void check_slice(const RankMetadata& m, const char* name, std::string_view who, std::string& prefix) {
  prefix.assign(who);
  prefix += ": ";
  prefix += name;
  m.validate(prefix);
}

/// The arguments and both slices, each on its own: this rank's, of this world, well formed.
inline void check_slices(const RankMetadata& fwd, const RankMetadata& rev, std::size_t token_bytes, int rank, int world_size,
                         std::string_view who, std::string& prefix) {
  if (token_bytes == 0) fail(who, ": token_bytes must be positive");
  if (world_size <= 0) fail(who, ": the transport's world_size() = ", world_size, " must be positive");
  if (rank < 0 || rank >= world_size) fail(who, ": the transport's rank() = ", rank, " is outside [0, ", world_size, ")");
  for (auto [name, m] : {std::pair{"fwd", &fwd}, std::pair{"rev", &rev}}) {
    if (m->world_size != world_size) {
      fail(who, ": ", name, ".world_size = ", m->world_size, " but the transport's world_size() = ", world_size);
    }
    if (m->rank != rank) fail(who, ": ", name, " is the slice of rank ", m->rank, " but the transport is rank ", rank);
    check_slice(*m, name, who, prefix);
  }
  if (rev.has_copies || rev.num_copies != 1) {
    fail(who, ": rev has ", rev.num_copies, " copies per entry, but reverse metadata sends each entry to one rank (fwd and rev swapped?)");
  }
  for (std::size_t m = 0; m < rev.seq_len.size(); ++m) {
    if (rev.dst_rank[m] < 0) fail(who, ": rev.dst_rank[", m, "] = -1, but every received entry goes back to a rank");
  }
}

/// Where this rank's tokens sit, in tokens: P[j] of shard j in the MLP layout
/// (T tokens), Q[m] of entry m in the attention layout (A tokens), and the
/// reverse output (R: T, or C x T for the replica buffer).
struct Positions {
  std::vector<std::int64_t> P, Q;
  std::int64_t T = 0, A = 0, R = 0;

  /// Where copy k of shard j returns to in the reverse output.
  std::int64_t replica_pos(const RankMetadata& fwd, std::size_t j, std::size_t k) const noexcept {
    return (fwd.has_copies ? static_cast<std::int64_t>(k) * T : 0) + P[j];
  }
};

/// The positions into `at` (its storage reused), checking that the sizes of the two slices agree.
inline void positions_of(const RankMetadata& fwd, const RankMetadata& rev, std::string_view who, Positions& at) {
  at.P.resize(fwd.seq_len.size());
  at.Q.resize(rev.seq_len.size());
  at.T = at.A = 0;
  for (std::size_t j = 0; j < at.P.size(); ++j) {
    at.P[j] = at.T;
    at.T = add_tokens(at.T, fwd.seq_len[j], who);
  }
  for (std::size_t m = 0; m < at.Q.size(); ++m) {
    at.Q[m] = at.A;
    at.A = add_tokens(at.A, rev.seq_len[m], who);
  }
  const std::size_t W = fwd.num_recv_tokens.size() - 1, C = fwd.num_copies;
  if (at.A != fwd.num_total_recv_tokens || at.A != fwd.num_recv_tokens[W]) {
    fail(who, ": rev's entries hold ", at.A, " tokens, but fwd.num_recv_tokens says this rank receives ", fwd.num_recv_tokens[W],
         " (fwd and rev are not slices of one plan)");
  }
  at.R = at.T;
  if (fwd.has_copies && __builtin_mul_overflow(static_cast<std::int64_t>(C), at.T, &at.R)) {
    fail(who, ": the replica buffer of ", C, " copies x ", at.T, " tokens overflows 64 bits");
  }
  if (rev.output_tokens() != at.R) {
    fail(who, ": rev returns into ", rev.output_tokens(), " tokens, but fwd's ", fwd.has_copies ? "replica buffer holds " : "shards hold ",
         at.R, fwd.has_copies ? concat(" (", C, " copies x ", at.T, " tokens)") : std::string(), " (fwd and rev are not slices of one plan)");
  }
  if (rev.recv_seq_lens && (rev.mask_copies != C || *rev.recv_seq_lens != fwd.seq_len)) {
    fail(who, ": rev.recv_seq_lens / seq_recv_mask (", rev.mask_copies, " copies) do not describe fwd's ", fwd.seq_len.size(),
         " shards of ", C, " copies");
  }
}

/// One copy of a shard this rank sends.
struct ShardCopy {
  std::size_t peer;         ///< the receiver
  std::int64_t dst_offset;  ///< at the receiver's attention layout
  std::size_t j, k;         ///< shard, copy
};

/// One entry this rank receives (and sends back).
struct EntryFrom {
  std::size_t peer;  ///< its home rank
  std::size_t m;     ///< the entry
};

/// Who this rank exchanges what with, in wire order, peer by peer: the
/// forward sends (= reverse receives) by ascending dst_offset, the reverse
/// sends (= forward receives) by ascending entry. Peer p's are
/// [send_splits[p], send_splits[p + 1]) and likewise for the receives.
struct Routes {
  std::vector<ShardCopy> sends;
  std::vector<EntryFrom> receives;
  std::vector<std::size_t> send_splits, receive_splits;

  std::span<const ShardCopy> sends_to(std::size_t p) const noexcept {
    return std::span(sends).subspan(send_splits[p], send_splits[p + 1] - send_splits[p]);
  }
  std::span<const EntryFrom> receives_from(std::size_t p) const noexcept {
    return std::span(receives).subspan(receive_splits[p], receive_splits[p + 1] - receive_splits[p]);
  }
};

/// [W + 1] offsets of each peer's run in `items`, sorted by peer.
template <class Item>
void split_by_peer(const std::vector<Item>& items, std::size_t W, std::vector<std::size_t>& splits) {
  splits.assign(W + 1, 0);
  for (const Item& i : items) ++splits[i.peer + 1];
  for (std::size_t p = 0; p < W; ++p) splits[p + 1] += splits[p];
}

/// The routes into `routes` (its storage reused). The slices are checked: every peer is in [0, W).
inline void routes_of(const RankMetadata& fwd, const RankMetadata& rev, std::size_t W, Routes& routes) {
  routes.sends.clear();
  routes.receives.clear();
  const std::size_t C = fwd.num_copies;
  for (std::size_t j = 0; j < fwd.seq_len.size(); ++j) {
    if (fwd.seq_len[j] == 0) continue;
    for (std::size_t k = 0; k < C; ++k) {
      const std::int64_t d = fwd.dst_rank[j * C + k];
      if (d >= 0) routes.sends.push_back({static_cast<std::size_t>(d), fwd.dst_offset[j * C + k], j, k});
    }
  }
  // std::sort, not std::stable_sort: the latter allocates. The keys are unique.
  std::sort(routes.sends.begin(), routes.sends.end(), [](const ShardCopy& a, const ShardCopy& b) {
    return std::tie(a.peer, a.dst_offset, a.j, a.k) < std::tie(b.peer, b.dst_offset, b.j, b.k);
  });
  for (std::size_t m = 0; m < rev.seq_len.size(); ++m) {
    if (rev.seq_len[m] > 0) routes.receives.push_back({static_cast<std::size_t>(rev.dst_rank[m]), m});
  }
  std::sort(routes.receives.begin(), routes.receives.end(),
            [](const EntryFrom& a, const EntryFrom& b) { return std::tie(a.peer, a.m) < std::tie(b.peer, b.m); });
  split_by_peer(routes.sends, W, routes.send_splits);
  split_by_peer(routes.receives, W, routes.receive_splits);
}

/// Per-peer token counts must agree with num_recv_tokens of both slices.
inline void check_peer_counts(const RankMetadata& fwd, const RankMetadata& rev, const Routes& routes, std::string_view who) {
  for (std::size_t p = 0; p + 1 < routes.send_splits.size(); ++p) {
    std::int64_t sent = 0, received = 0;
    for (const ShardCopy& c : routes.sends_to(p)) sent = add_tokens(sent, fwd.seq_len[c.j], who);
    for (const EntryFrom& e : routes.receives_from(p)) received = add_tokens(received, rev.seq_len[e.m], who);
    if (sent != rev.num_recv_tokens[p]) {
      fail(who, ": fwd sends ", sent, " tokens to rank ", p, ", but rev.num_recv_tokens[", p, "] = ", rev.num_recv_tokens[p],
           " come back (fwd and rev are not slices of one plan)");
    }
    if (received != fwd.num_recv_tokens[p]) {
      fail(who, ": rev has ", received, " tokens from rank ", p, ", but fwd.num_recv_tokens[", p, "] = ", fwd.num_recv_tokens[p],
           " (fwd and rev are not slices of one plan)");
    }
  }
}

/// Traffic to oneself: fwd's copies to this rank (by dst_offset) and rev's
/// entries from this rank (by entry) must be the same pieces.
inline void check_self_traffic(const RankMetadata& fwd, const RankMetadata& rev, const Positions& at, const Routes& routes,
                               std::size_t me, std::string_view who) {
  const auto self_copies = routes.sends_to(me);
  const auto self_entries = routes.receives_from(me);
  if (self_entries.size() != self_copies.size()) {
    fail(who, ": fwd sends ", self_copies.size(), " pieces to this rank itself, rev receives ", self_entries.size(),
         " from it (fwd and rev are not slices of one plan)");
  }
  for (std::size_t i = 0; i < self_copies.size(); ++i) {
    const ShardCopy& c = self_copies[i];
    const std::size_t m = self_entries[i].m;
    const std::int64_t len = fwd.seq_len[c.j];
    const std::int64_t back_to = at.replica_pos(fwd, c.j, c.k);
    if (at.Q[m] != c.dst_offset || rev.seq_len[m] != len || rev.dst_offset[m] != back_to) {
      fail(who, ": fwd.dst_offset", entry_str(fwd, c.j, c.k), " = ", c.dst_offset, " (", len, " tokens to itself) does not match rev entry ",
           m, " (at ", at.Q[m], ", ", rev.seq_len[m], " tokens, back to ", rev.dst_offset[m], ", expected ", back_to,
           "): fwd and rev are not slices of one plan");
    }
  }
}

/// Where the forward reads a shard's copies: from the shard in the MLP
/// layout, or (a head-parallel part's slabs) each copy from its own slot of
/// the replica buffer, where the reverse returns it.
enum class ForwardFrom { shards, replicas };

/// Both exchanges' piece lists from the checked routes, into `plan`'s storage.
inline void lay_out_exchanges(DispatchPlan& plan, const RankMetadata& fwd, const RankMetadata& rev, const Positions& at,
                              const Routes& routes, std::size_t me, std::size_t token_bytes, ForwardFrom from) {
  const std::size_t W = routes.send_splits.size() - 1;
  const auto bytes = [token_bytes](std::int64_t tokens) { return static_cast<std::size_t>(tokens) * token_bytes; };
  const auto source = [&](const ShardCopy& c) { return from == ForwardFrom::replicas ? at.replica_pos(fwd, c.j, c.k) : at.P[c.j]; };
  plan.forward.self.clear();
  plan.reverse.self.clear();
  for (const ShardCopy& c : routes.sends_to(me)) {
    append_piece(plan.forward.self, bytes(source(c)), bytes(c.dst_offset), bytes(fwd.seq_len[c.j]));
  }
  for (const EntryFrom& e : routes.receives_from(me)) {
    append_piece(plan.reverse.self, bytes(at.Q[e.m]), bytes(rev.dst_offset[e.m]), bytes(rev.seq_len[e.m]));
  }
  // Each peer's shard copies: from their MLP position (forward send), back into their replica slot (reverse receive).
  auto copies_by = [&](bool back) {
    return [&, back](std::size_t p, auto&& emit) {
      if (p == me) return;
      for (const ShardCopy& c : routes.sends_to(p)) emit(TokenRange{back ? at.replica_pos(fwd, c.j, c.k) : source(c), fwd.seq_len[c.j]});
    };
  };
  // Each peer's entries, at their attention-layout position both ways.
  auto entries = [&](std::size_t p, auto&& emit) {
    if (p == me) return;
    for (const EntryFrom& e : routes.receives_from(p)) emit(TokenRange{at.Q[e.m], rev.seq_len[e.m]});
  };
  lay_out_side(plan.forward.send, W, token_bytes, true, copies_by(false));
  lay_out_side(plan.forward.recv, W, token_bytes, false, entries);
  lay_out_side(plan.reverse.send, W, token_bytes, true, entries);
  lay_out_side(plan.reverse.recv, W, token_bytes, false, copies_by(true));
}

/// Builds both exchanges of one rank from its forward and reverse slices (see
/// the header comment), checking that the two slices belong together as far
/// as one rank can tell: sizes, per-peer token counts, and its traffic to
/// itself. It keeps its working storage, and writes into the plan's, between
/// calls: once a plan fits what an earlier one needed, planning allocates
/// nothing.
class DispatchPlanner {
 public:
  /// Fills `plan` for rank `rank` of `world_size`; `who` starts error messages.
  /// On a throw `plan` is unspecified (plan into a spare to keep a plan).
  void plan(const RankMetadata& fwd, const RankMetadata& rev, std::size_t token_bytes, int rank, int world_size, std::string_view who,
            DispatchPlan& plan, ForwardFrom from = ForwardFrom::shards) {
    check_slices(fwd, rev, token_bytes, rank, world_size, who, prefix_);
    positions_of(fwd, rev, who, at_);
    routes_of(fwd, rev, static_cast<std::size_t>(world_size), routes_);
    check_peer_counts(fwd, rev, routes_, who);
    check_self_traffic(fwd, rev, at_, routes_, static_cast<std::size_t>(rank), who);
    plan.forward.input_tokens = from == ForwardFrom::replicas ? at_.R : at_.T;
    plan.forward.output_tokens = plan.reverse.input_tokens = at_.A;
    plan.reverse.output_tokens = at_.R;
    for (ExchangePlan* ex : {&plan.forward, &plan.reverse}) {
      ex->input_bytes = token_bytes_of(ex->input_tokens, token_bytes, who);
      ex->output_bytes = token_bytes_of(ex->output_tokens, token_bytes, who);
    }
    lay_out_exchanges(plan, fwd, rev, at_, routes_, static_cast<std::size_t>(rank), token_bytes, from);
  }

  /// Room for slices of up to `pieces` shard copies or entries each way in a
  /// world of W, in this planner and in `plan`.
  void reserve(DispatchPlan& plan, std::size_t pieces, std::size_t W) {
    prefix_.reserve(64);
    at_.P.reserve(pieces);
    at_.Q.reserve(pieces);
    routes_.sends.reserve(pieces);
    routes_.receives.reserve(pieces);
    routes_.send_splits.reserve(W + 1);
    routes_.receive_splits.reserve(W + 1);
    for (ExchangePlan* ex : {&plan.forward, &plan.reverse}) {
      ex->self.reserve(pieces);
      for (Side* s : {&ex->send, &ex->recv}) {
        s->pieces.reserve(pieces);
        s->copies.reserve(pieces);
        s->counts.reserve(W);
        s->displs.reserve(W);
        s->splits.reserve(W + 1);
      }
    }
  }

 private:
  std::string prefix_;
  Positions at_;
  Routes routes_;
};

/// One plan, from a planner of its own.
inline DispatchPlan plan_dispatch(const RankMetadata& fwd, const RankMetadata& rev, std::size_t token_bytes, int rank,
                                  int world_size) {
  DispatchPlan plan;
  DispatchPlanner().plan(fwd, rev, token_bytes, rank, world_size, concat("Dispatcher (rank ", rank, " of ", world_size, ")"), plan);
  return plan;
}

}  // namespace cpdispatch::detail
