#pragma once
// SimulatedLinkTransport<Inner>: a Transport adapter that makes any host
// transport behave like a slower network, for benchmarks of the overlapped
// GEMM. Each rank has one outgoing link of `bandwidth` bytes per second; a
// message posted at time t starts when the link is free (start = max(t,
// link free)), occupies it for bytes / bandwidth, and is delivered `latency`
// after that. The waits that model this SLEEP (they do not spin), so the
// modelled communication takes wall time but no CPU: on a 2-core machine a
// GEMM and the communication really run side by side.
//
// - isend/irecv/wait: the data moves through the inner transport at once;
//   the sender also sends the delivery time (an 8-byte header message with
//   the same tag, ahead of the payload). wait() on a send returns when the
//   link has finished transmitting it, wait() on a receive when it has been
//   delivered. Times are std::chrono::steady_clock, which every thread of a
//   process and every process of one Linux machine (CLOCK_MONOTONIC) share:
//   ranks must run on one machine (sim, or mpiexec on one host).
// - Collectives run on the inner transport and then sleep the time the ring
//   algorithm would take on these links, starting when the inner call
//   returned (every rank has arrived by then) or when the rank's link becomes
//   free, whichever is later (W = world_size, B = bytes per rank's block,
//   L = latency, bw = bandwidth):
//     reduce_scatter, all_gather   (W-1) (L + B/bw)
//     all_reduce                   2 (W-1) (L + (bytes/W)/bw)
//     broadcast                    (W-1) L + bytes/bw        (pipelined ring)
//     all_to_all_v                 (W-1) L + max(bytes sent, bytes received to and from peers)/bw
//     barrier                      ceil(log2 W) L            (dissemination)
//   One rank (W = 1) costs nothing.
// - post_all_to_all_v (PostedAllToAllTransport): the bytes move through the
//   inner all_to_all_v at the post, and the link is busy for the
//   all_to_all_v time above from then (or from when it frees up); wait()
//   sleeps until that time has passed. Compute between the two hides it.
// - Like the transports it wraps, it is used by one thread at a time.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// The simulated network: one outgoing link per rank.
struct LinkModel {
  std::chrono::nanoseconds latency{0};
  /// Bytes per second of each rank's outgoing link; must be positive.
  double bandwidth = 1e9;

  /// How long the link is busy sending `bytes`.
  std::chrono::nanoseconds transmit_time(std::size_t bytes) const {
    return std::chrono::nanoseconds(static_cast<std::int64_t>(std::llround(static_cast<double>(bytes) / bandwidth * 1e9)));
  }
};

template <class Inner>
class SimulatedLinkTransport {
  CPDISPATCH_CHECK_TRANSPORT(Inner);
  static_assert(Inner::memory_space == MemorySpace::host,
                "cpdispatch: SimulatedLinkTransport wraps host transports (it times messages on the host clock)");

 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;
  using Clock = std::chrono::steady_clock;

  /// Wraps `inner`, which must outlive the adapter.
  SimulatedLinkTransport(Inner& inner, LinkModel model) : inner_(inner), model_(model) {
    if (!(model.bandwidth > 0) || !std::isfinite(model.bandwidth)) {
      cpdispatch::detail::fail("SimulatedLinkTransport: bandwidth = ", model.bandwidth, " bytes/s must be positive and finite");
    }
    if (model.latency.count() < 0) {
      cpdispatch::detail::fail("SimulatedLinkTransport: latency = ", model.latency.count(), " ns must not be negative");
    }
  }
  SimulatedLinkTransport(const SimulatedLinkTransport&) = delete;
  SimulatedLinkTransport& operator=(const SimulatedLinkTransport&) = delete;

  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }
  const LinkModel& model() const noexcept { return model_; }
  Inner& inner() noexcept { return inner_; }
  /// Bytes this rank's link has carried to other ranks so far: messages,
  /// all-to-all payloads, and the collectives' shares as their ring
  /// algorithms (above) send them.
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

  Request isend(const void* buf, std::size_t bytes, int peer, int tag) {
    const Clock::time_point start = std::max(Clock::now(), link_free_);
    const Clock::time_point sent = start + model_.transmit_time(bytes);
    if (peer != rank()) bytes_sent_ += bytes;
    auto pending = std::make_unique<Pending>();
    pending->is_send = true;
    pending->done_at = sent;
    pending->header = (sent + model_.latency).time_since_epoch().count();
    pending->header_request = inner_.isend(&pending->header, sizeof pending->header, peer, tag);
    try {
      pending->payload_request = inner_.isend(buf, bytes, peer, tag);
    } catch (...) {
      retired_.push_back(std::move(pending));  // the header may still be in flight: keep its storage
      throw;
    }
    link_free_ = sent;
    return remember(std::move(pending));
  }

  Request irecv(void* buf, std::size_t bytes, int peer, int tag) {
    auto pending = std::make_unique<Pending>();
    pending->header_request = inner_.irecv(&pending->header, sizeof pending->header, peer, tag);
    try {
      pending->payload_request = inner_.irecv(buf, bytes, peer, tag);
    } catch (...) {
      retired_.push_back(std::move(pending));
      throw;
    }
    return remember(std::move(pending));
  }

  void wait(Request request) {
    const auto it = pending_.find(request.id);
    if (it == pending_.end()) {
      cpdispatch::detail::fail("SimulatedLinkTransport::wait: request ", request.id, " is not pending on rank ", rank());
    }
    std::unique_ptr<Pending> pending = std::move(it->second);
    pending_.erase(it);
    if (pending->posted) {  // an all-to-all whose bytes are in place: only the link's time remains
      std::this_thread::sleep_until(pending->done_at);
      return;
    }
    try {
      inner_.wait(pending->header_request);
      inner_.wait(pending->payload_request);
    } catch (...) {
      retired_.push_back(std::move(pending));  // a failed wait may leave the inner request pending
      throw;
    }
    if (!pending->is_send) pending->done_at = Clock::time_point(Clock::duration(pending->header));
    std::this_thread::sleep_until(pending->done_at);
  }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    count_sent(send_counts);
    occupy(all_to_all_time(send_counts, recv_counts));
  }

  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    count_sent(send_counts);
    auto pending = std::make_unique<Pending>();
    pending->posted = true;
    pending->done_at = std::max(Clock::now(), link_free_) + all_to_all_time(send_counts, recv_counts);
    link_free_ = pending->done_at;
    return remember(std::move(pending));
  }

  void barrier() {
    inner_.barrier();
    int rounds = 0;
    while ((1 << rounds) < world_size()) ++rounds;
    occupy(rounds * model_.latency);
  }

  void broadcast(void* buf, std::size_t bytes, int root) {
    inner_.broadcast(buf, bytes, root);
    if (world_size() > 1) bytes_sent_ += bytes;
    occupy(peers() * model_.latency + model_.transmit_time(bytes));
  }

  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op) {
    inner_.all_reduce(buf, count, type, op);
    const std::size_t block = count * element_size(type) / static_cast<std::size_t>(world_size());
    bytes_sent_ += 2 * static_cast<std::uint64_t>(peers()) * block;
    occupy(2 * peers() * (model_.latency + model_.transmit_time(block)));
  }

  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
    inner_.all_gather(send, recv, count_per_rank, type);
    bytes_sent_ += static_cast<std::uint64_t>(peers()) * count_per_rank * element_size(type);
    occupy(peers() * (model_.latency + model_.transmit_time(count_per_rank * element_size(type))));
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op) {
    inner_.reduce_scatter(send, recv, count_per_rank, type, op);
    bytes_sent_ += static_cast<std::uint64_t>(peers()) * count_per_rank * element_size(type);
    occupy(peers() * (model_.latency + model_.transmit_time(count_per_rank * element_size(type))));
  }

 private:
  struct Pending {
    bool is_send = false;
    bool posted = false;  // a posted all-to-all (no inner requests)
    std::int64_t header = 0;  // the delivery time, in steady_clock ticks since its epoch
    Request header_request;
    Request payload_request;
    Clock::time_point done_at;
  };

  Request remember(std::unique_ptr<Pending> pending) {
    const std::uint64_t id = next_id_++;
    pending_.emplace(id, std::move(pending));
    return Request{id};
  }

  std::int64_t peers() const { return world_size() - 1; }

  /// An all-to-all's modelled time: the latency to every peer, then the larger of the bytes sent and received off-rank.
  std::chrono::nanoseconds all_to_all_time(std::span<const std::size_t> send_counts, std::span<const std::size_t> recv_counts) const {
    std::size_t sent = 0, received = 0;
    const auto me = static_cast<std::size_t>(rank());
    for (std::size_t p = 0; p < send_counts.size(); ++p) sent += p == me ? 0 : send_counts[p];
    for (std::size_t p = 0; p < recv_counts.size(); ++p) received += p == me ? 0 : recv_counts[p];
    if (world_size() == 1) return std::chrono::nanoseconds{0};
    return peers() * model_.latency + model_.transmit_time(std::max(sent, received));
  }

  void count_sent(std::span<const std::size_t> send_counts) noexcept {
    for (std::size_t p = 0; p < send_counts.size(); ++p) {
      if (p != static_cast<std::size_t>(rank())) bytes_sent_ += send_counts[p];
    }
  }

  /// A collective's modelled time: the link is busy for `span` from now (or from when it frees up).
  void occupy(std::chrono::nanoseconds span) {
    if (span.count() <= 0) return;
    const Clock::time_point done = std::max(Clock::now(), link_free_) + span;
    link_free_ = done;
    std::this_thread::sleep_until(done);
  }

  Inner& inner_;
  LinkModel model_;
  Clock::time_point link_free_{};
  std::uint64_t bytes_sent_ = 0;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, std::unique_ptr<Pending>> pending_;
  std::vector<std::unique_ptr<Pending>> retired_;  // headers of failed requests, kept until the adapter goes
};

}  // namespace cpdispatch
