#pragma once
// The staged exchange of ContextParallelAttention: one direction of the
// exchanges of up to three tensors (Q, K, V forward; dK, dV backward ...),
// cut by peer into stages that are posted separately, so that the op computes
// on what has arrived while the rest travels.
//
// Peers are grouped by ring distance: the traffic of the pair (home rank h,
// attention rank a) belongs to group (a - h mod W - 1) * G / (W - 1) of G
// groups, in both directions, so every rank agrees on it without talking.
// All tensors of one post share one staging region per peer: Q's bytes for
// that peer, then K's, then V's (each in the plan's wire order), so a stage
// is ONE post. Staging keeps its storage across plans: nothing is allocated
// while a plan fits what an earlier one needed.

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// One tensor of a staged exchange: its plan (one direction) and buffers.
struct StagedTensor {
  const ExchangePlan* plan = nullptr;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
};

/// The group of the pair (home rank h, attention rank a), h != a, among `groups` groups of W ranks.
inline int stage_group(int home, int attention, int world_size, int groups) {
  const int distance = ((attention - home) % world_size + world_size) % world_size;
  return static_cast<int>(static_cast<long long>(distance - 1) * groups / (world_size - 1));
}

class StagedExchange {
 public:
  static constexpr int all_groups = -1;

  /// Lays out the exchange of `plans` (one direction; `forward`: this rank
  /// sends as home rank) for rank `me` of `world_size`, in `groups` groups.
  void lay_out(std::span<const ExchangePlan* const> plans, int me, int world_size, int groups, bool forward) {
    const auto W = static_cast<std::size_t>(world_size);
    send_at_.assign(W, 0);
    recv_at_.assign(W, 0);
    send_group_.assign(W, 0);
    recv_group_.assign(W, 0);
    send_counts_.assign(W, 0);
    recv_counts_.assign(W, 0);
    std::size_t sent = 0, received = 0;
    for (std::size_t p = 0; p < W; ++p) {
      const int peer = static_cast<int>(p);
      if (peer != me) {
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
    if (send_staging_.size() < sent) send_staging_.resize(sent);
    if (recv_staging_.size() < received) recv_staging_.resize(received);
    counts_.assign(2 * W, 0);
  }

  /// Staging for up to `send` and `recv` bytes.
  void reserve(std::size_t send, std::size_t recv) {
    if (send_staging_.size() < send) send_staging_.resize(send);
    if (recv_staging_.size() < recv) recv_staging_.resize(recv);
  }

  /// Copies the traffic to this rank itself (no transport call).
  static void copy_self(std::span<const StagedTensor> tensors) {
    for (const StagedTensor& t : tensors) {
      for (const CopyPiece& c : t.plan->self) std::memcpy(t.out + c.dst, t.in + c.src, c.bytes);
    }
  }

  /// Packs group `group`'s peers (all_groups: every peer) and posts their
  /// exchange; over a transport without posts the exchange completes here.
  template <class T>
  Request post(T& transport, std::span<const StagedTensor> tensors, int group) {
    const std::size_t W = send_at_.size();
    std::span<std::size_t> send(counts_.data(), W), recv(counts_.data() + W, W);
    for (std::size_t p = 0; p < W; ++p) {
      send[p] = in_group(send_group_[p], group) ? send_counts_[p] : 0;
      recv[p] = in_group(recv_group_[p], group) ? recv_counts_[p] : 0;
      if (send[p] == 0) continue;
      std::byte* at = send_staging_.data() + send_at_[p];
      for (const StagedTensor& t : tensors) {
        const Side& side = t.plan->send;
        for (std::size_t i = side.splits[p]; i < side.splits[p + 1]; ++i) {
          std::memcpy(at, t.in + side.pieces[i].offset, side.pieces[i].bytes);
          at += side.pieces[i].bytes;
        }
      }
    }
    if constexpr (PostedAllToAllTransport<T>) {
      return transport.post_all_to_all_v(send_staging_.data(), send, send_at_, recv_staging_.data(), recv, recv_at_);
    } else {
      transport.all_to_all_v(send_staging_.data(), send, send_at_, recv_staging_.data(), recv, recv_at_);
      return Request{};
    }
  }

  template <class T>
  static void wait(T& transport, Request request) {
    if constexpr (PostedAllToAllTransport<T>) transport.wait(request);
  }

  /// After the wait: unpacks what group `group`'s peers sent.
  void finish(std::span<const StagedTensor> tensors, int group) const {
    for (std::size_t p = 0; p < recv_at_.size(); ++p) {
      if (!in_group(recv_group_[p], group) || recv_counts_[p] == 0) continue;
      const std::byte* at = recv_staging_.data() + recv_at_[p];
      for (const StagedTensor& t : tensors) {
        const Side& side = t.plan->recv;
        for (std::size_t i = side.splits[p]; i < side.splits[p + 1]; ++i) {
          std::memcpy(t.out + side.pieces[i].offset, at, side.pieces[i].bytes);
          at += side.pieces[i].bytes;
        }
      }
    }
  }

 private:
  static bool in_group(int peer_group, int group) noexcept { return group == all_groups || peer_group == group; }

  std::vector<std::size_t> send_at_, recv_at_, send_counts_, recv_counts_, counts_;
  std::vector<int> send_group_, recv_group_;
  std::vector<std::byte> send_staging_, recv_staging_;
};

}  // namespace cpdispatch::detail
