#pragma once
// The exchange engine: every planned exchange runs here, the dispatchers'
// (Dispatcher, KvWireDispatcher, each phase of NodeWireDispatcher; through
// them QkvDispatch) and ContextParallelAttention's. An exchange is one
// direction of the traffic of one or more tensors, each an ExchangePlan.
//
// run_exchange: one plan, one blocking collective. Over a PieceTransport,
// one all_to_all_pieces on the caller's buffers (unless the caller opts
// out); otherwise pack into staging (unless the send side is direct), one
// all_to_all_v, unpack (unless the receive side is direct). Then the traffic
// to this rank itself. One rank makes no transport call. A transport failure
// is rethrown with "<who>::<call> (rank r of W): <collective> failed: " in
// front, same kind; the data path's own failures pass unchanged.
//
// StagedExchange: several tensors (Q, K, V; dK, dV; ...) in one post per
// stage group, posted separately so that the caller computes on what has
// arrived while the rest travels. The pair (home rank h, attention rank a)
// is in group (a - h mod W - 1) * G / (W - 1) of G, both ways, so every rank
// agrees without talking. A post's staging holds, per peer, the first
// tensor's bytes, then the second's, ... (each in its wire order). The
// staging is the data path's; the pack, unpack and self lists are registered
// with it when laid out (between its clear() and commit()). Storage is kept:
// nothing is allocated while a plan fits what an earlier one needed.
//
// Memory is the data path's, through one interface: path.copy(PieceList,
// src, dst), in the path's order (the device path's stream). The host path
// copies the pieces; the device path runs the list uploaded under its id
// (add_exchange registers a plan's lists; StagedExchange its own).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// Who runs an exchange, for the context of a transport failure.
struct ExchangeCaller {
  const char* who;   ///< the dispatcher's class name
  const char* call;  ///< its member function
};

/// The all-to-all of one post: posted where `Posted` and the transport can,
/// else complete on return (an empty Request).
template <bool Posted, class T>
Request all_to_all_bytes(T& transport, const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                         void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  if constexpr (Posted && PostedAllToAllTransport<T>) {
    return transport.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  } else {
    transport.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    return Request{};
  }
}

/// Where a pack puts the checksums of what it writes into `send`: a
/// transport that checks what it sends and takes them from the pack
/// (DeviceChecksummedTransport::pack_sums: one pass over the bytes instead
/// of a second one of its own) says where; for others, nullptr.
template <class T>
auto pack_sums(T& transport, const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
               std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  if constexpr (requires { transport.pack_sums(send, send_counts, send_displs, recv_counts, recv_displs); }) {
    return transport.pack_sums(send, send_counts, send_displs, recv_counts, recv_displs);
  } else {
    return nullptr;
  }
}

/// A pack's copy of `list`, checksumming what it writes where `sums` (from pack_sums) says.
template <class Path, class Sums>
void pack_copy(const Path& path, PieceList list, const std::byte* in, std::byte* staging, Sums sums) {
  if constexpr (!std::is_null_pointer_v<Sums>) {
    if (sums) return path.copy(list, in, staging, *sums);
  }
  path.copy(list, in, staging);
}

/// Registers `ex`'s three piece lists with `path` (between its clear() and
/// commit()), in Stage order; returns the id of the first, run_exchange's `lists`.
template <class Path>
std::size_t add_exchange(Path& path, const ExchangePlan& ex) {
  const std::size_t first = path.add_copies(ex.send.copies);
  path.add_copies(ex.self);
  path.add_copies(ex.recv.copies);
  return first;
}

/// Runs `ex` from `in` to `out`. `lists` is the id of the exchange's pack
/// list (its self and unpack lists follow, in Stage order); `staging` holds
/// ex.staging_bytes() bytes (unused over all_to_all_pieces).
/// `Pieces` false: all_to_all_v even over a PieceTransport (a plan without piece lists).
template <bool Pieces = true, class T, class Path>
void run_exchange(T& transport, Path& path, std::size_t lists, const ExchangePlan& ex, const std::byte* in, std::byte* out, std::byte* staging,
                  ExchangeCaller caller) {
  constexpr bool pieces = Pieces && PieceTransport<T>;
  const auto list = [lists](Stage stage, const std::vector<CopyPiece>& p) { return PieceList{lists + static_cast<std::size_t>(stage), p}; };
  const bool alone = transport.world_size() == 1;
  auto context = [&] {
    return concat(caller.who, "::", caller.call, " (rank ", transport.rank(), " of ", transport.world_size(), "): ",
                  pieces ? "all_to_all_pieces" : "all_to_all_v", " failed: ");
  };
  if constexpr (pieces) {  // no staging: the transport reads and writes the pieces in place
    try {
      if (!alone) transport.all_to_all_pieces(in, ex.send.pieces, ex.send.splits, out, ex.recv.pieces, ex.recv.splits);
    } catch (...) {
      rethrow_with_context(context());
    }
  } else {
    std::byte* recv_staging = staging + ex.recv_staging_offset();
    if (!ex.send.direct) {
      pack_copy(path, list(Stage::pack, ex.send.copies), in, staging, pack_sums(transport, staging, ex.send.counts, ex.send.displs, ex.recv.counts, ex.recv.displs));
    }
    try {
      if (!alone) {
        all_to_all_bytes<false>(transport, ex.send.direct ? static_cast<const void*>(in) : staging, ex.send.counts, ex.send.displs,
                                ex.recv.direct ? static_cast<void*>(out) : recv_staging, ex.recv.counts, ex.recv.displs);
      }
    } catch (...) {
      rethrow_with_context(context());
    }
    if (!ex.recv.direct) path.copy(list(Stage::unpack, ex.recv.copies), recv_staging, out);
  }
  path.copy(list(Stage::self, ex.self), in, out);
}

/// One tensor of a staged exchange: its plan (one direction) and buffers
/// (its input `in`, its output `out`).
struct StagedTensor {
  const ExchangePlan* plan = nullptr;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
};

/// The stage groups of a step in `stages` stages on W ranks (round 0 is the
/// rank's own data; each other round a group): at most W - 1.
inline int stage_groups(std::int64_t stages, std::int64_t world_size) { return static_cast<int>(std::min(stages - 1, world_size - 1)); }

/// The group of the pair (home rank h, attention rank a), h != a, among `groups` groups of W ranks.
inline int stage_group(int home, int attention, int world_size, int groups) {
  const int distance = ((attention - home) % world_size + world_size) % world_size;
  return static_cast<int>(static_cast<long long>(distance - 1) * groups / (world_size - 1));
}

template <class Path>
class StagedExchange {
 public:
  /// Lays out the exchange of `tensors`' plans (one direction; `forward`:
  /// this rank sends as home rank; their buffers are not read here) for rank
  /// `me` of `world_size` in `groups` stage groups (0: one group, every
  /// peer), and registers its lists with `path`. Its calls then take tensors
  /// of the same plans in the same order, with their buffers.
  void lay_out(Path& path, std::span<const StagedTensor> tensors, int me, int world_size, int groups, bool forward) {
    const auto W = static_cast<std::size_t>(world_size);
    groups_ = std::max(groups, 1);
    tensors_ = tensors.size();
    plans_.clear();
    for (const StagedTensor& t : tensors) plans_.push_back(t.plan);
    const std::span<const ExchangePlan* const> plans(plans_);
    for (auto* v : {&send_at_, &recv_at_, &send_counts_, &recv_counts_}) v->assign(W, 0);
    send_group_.assign(W, 0);
    recv_group_.assign(W, 0);
    std::size_t sent = 0, received = 0;
    for (std::size_t p = 0; p < W; ++p) {
      const int peer = static_cast<int>(p);
      if (peer != me && groups > 0) {
        send_group_[p] = forward ? stage_group(me, peer, world_size, groups) : stage_group(peer, me, world_size, groups);
        recv_group_[p] = forward ? stage_group(peer, me, world_size, groups) : stage_group(me, peer, world_size, groups);
      }
      send_at_[p] = sent;
      recv_at_[p] = received;
      for (const ExchangePlan* plan : plans) {
        send_counts_[p] += plan->send.counts[p];
        recv_counts_[p] += plan->recv.counts[p];
      }
      sent += send_counts_[p];
      received += recv_counts_[p];
    }
    grow(send_staging_, sent);
    grow(recv_staging_, received);
    counts_.assign(2 * W, 0);
    register_lists(path, plans, me);
  }

  /// Staging for up to `send` and `recv` bytes, and room for `pieces` pieces in each list.
  void reserve(std::size_t send, std::size_t recv, std::size_t pieces) {
    grow(send_staging_, send);
    grow(recv_staging_, recv);
    for (std::vector<CopyPiece>& list : lists_) list.reserve(pieces);
  }

  /// Copies the traffic to this rank itself (no transport call).
  void copy_self(Path& path, std::span<const StagedTensor> tensors) const {
    check(tensors);
    for (std::size_t t = 0; t < tensors.size(); ++t) path.copy(self_[t], tensors[t].in, tensors[t].out);
  }

  /// Packs group `group`'s peers and posts their exchange; over a transport
  /// without posts the exchange completes here.
  template <class T>
  Request post(T& transport, Path& path, std::span<const StagedTensor> tensors, int group) {
    const std::size_t W = send_at_.size();
    std::span<std::size_t> send(counts_.data(), W), recv(counts_.data() + W, W);
    check(tensors);
    for (std::size_t p = 0; p < W; ++p) {
      send[p] = send_group_[p] == group ? send_counts_[p] : 0;
      recv[p] = recv_group_[p] == group ? recv_counts_[p] : 0;
    }
    const auto sums = pack_sums(transport, send_staging_.data(), send, send_at_, recv, recv_at_);
    for (std::size_t t = 0; t < tensors.size(); ++t) pack_copy(path, pack_[index(group, t)], tensors[t].in, send_staging_.data(), sums);
    return all_to_all_bytes<true>(transport, send_staging_.data(), send, send_at_, recv_staging_.data(), recv, recv_at_);
  }

  template <class T>
  static void wait(T& transport, Request request) {
    if constexpr (PostedAllToAllTransport<T>) transport.wait(request);
  }

  /// After the wait: unpacks what group `group`'s peers sent.
  void finish(Path& path, std::span<const StagedTensor> tensors, int group) {
    check(tensors);
    for (std::size_t t = 0; t < tensors.size(); ++t) path.copy(unpack_[index(group, t)], recv_staging_.data(), tensors[t].out);
  }

  int groups() const noexcept { return groups_; }

  /// The bytes group `group`'s post sends plus receives.
  std::int64_t group_bytes(int group) const noexcept {
    std::size_t n = 0;
    for (std::size_t p = 0; p < send_at_.size(); ++p) {
      if (send_group_[p] == group) n += send_counts_[p];
      if (recv_group_[p] == group) n += recv_counts_[p];
    }
    return static_cast<std::int64_t>(n);
  }

 private:
  /// A call's tensors are those of the lay-out: the same plans, in its order.
  void check(std::span<const StagedTensor> tensors) const {
    bool same = tensors.size() == plans_.size();
    for (std::size_t t = 0; same && t < tensors.size(); ++t) same = tensors[t].plan == plans_[t];
    if (!same) fail("StagedExchange: a call's ", tensors.size(), " tensors are not the ", plans_.size(), " it was laid out for, in its order");
  }

  std::size_t index(int group, std::size_t tensor) const noexcept { return static_cast<std::size_t>(group) * tensors_ + tensor; }

  static void grow(typename Path::template buffer<std::byte>& b, std::size_t bytes) {
    if (b.size() < bytes) b.resize(bytes);
  }

  /// Per group and tensor, the pack (input -> staging) and unpack (staging ->
  /// output) of its peers' pieces; per tensor, its traffic to this rank.
  void register_lists(Path& path, std::span<const ExchangePlan* const> plans, int me) {
    const std::size_t W = send_at_.size(), n = static_cast<std::size_t>(groups_) * tensors_;
    for (auto* v : {&pack_, &unpack_}) v->assign(n, PieceList{});
    self_.assign(tensors_, PieceList{});
    if (lists_.size() < 2 * n) lists_.resize(2 * n);
    for (std::size_t t = 0; t < tensors_; ++t) self_[t] = {path.add_copies(plans[t]->self), plans[t]->self};
    for (int g = 0; g < groups_; ++g) {
      for (std::size_t t = 0; t < tensors_; ++t) {
        for (bool sending : {true, false}) {
          std::vector<CopyPiece>& list = lists_[2 * index(g, t) + (sending ? 0 : 1)];
          list.clear();
          for (std::size_t p = 0; p < W; ++p) {
            if (static_cast<int>(p) == me || (sending ? send_group_[p] : recv_group_[p]) != g) continue;
            add_peer(list, plans, t, p, sending);
          }
          (sending ? pack_ : unpack_)[index(g, t)] = {path.add_copies(list), list};
        }
      }
    }
  }

  /// Peer p's pieces of tensor t, between the tensor's buffer and the peer's staging region.
  void add_peer(std::vector<CopyPiece>& list, std::span<const ExchangePlan* const> plans, std::size_t t, std::size_t p, bool sending) {
    std::size_t at = sending ? send_at_[p] : recv_at_[p];
    for (std::size_t u = 0; u < t; ++u) at += sending ? plans[u]->send.counts[p] : plans[u]->recv.counts[p];
    const Side& side = sending ? plans[t]->send : plans[t]->recv;
    for (std::size_t i = side.splits[p]; i < side.splits[p + 1]; ++i) {
      const BytePiece& piece = side.pieces[i];
      if (sending) append_piece(list, piece.offset, at, piece.bytes); else append_piece(list, at, piece.offset, piece.bytes);
      at += piece.bytes;
    }
  }

  int groups_ = 1;
  std::size_t tensors_ = 0;
  std::vector<const ExchangePlan*> plans_;  // the lay-out's, in its order
  std::vector<std::size_t> send_at_, recv_at_, send_counts_, recv_counts_, counts_;
  std::vector<int> send_group_, recv_group_;
  std::vector<PieceList> pack_, unpack_, self_;  // the lists registered with the path
  std::vector<std::vector<CopyPiece>> lists_;  // per group and tensor: pack, unpack (the path refers to them)
  typename Path::template buffer<std::byte> send_staging_, recv_staging_;
};

}  // namespace cpdispatch::detail
