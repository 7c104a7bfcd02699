#pragma once
// SimulatedLinkTransport<Inner>: a Transport adapter that makes any host
// transport behave like a slower network, for benchmarks of the overlapped
// GEMM and for measuring the node-level exchange. Each rank has one
// full-duplex link of `bandwidth` bytes per second each way: what it sends
// and what it receives move at once, as over a NIC or an NVLink port. A
// message posted at time t starts when the sending side is free (start =
// max(t, sending side free)), occupies it for bytes / bandwidth, and is
// delivered `latency` after that. The waits that model
// this SLEEP (they do not spin), so the modelled communication takes wall
// time but no CPU: on a 2-core machine a GEMM and the communication really
// run side by side.
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
// - post_all_to_all_v (PostedAllToAllTransport): returns at once, as NCCL's
//   enqueue does, without waiting for the peers to post theirs: the bytes
//   move as the inner transport's isend/irecv (one message per peer with
//   bytes, behind an 8-byte header with the time the sender's link is done
//   sending them), so posts from different ranks need not meet. Its sends
//   occupy the sending side for (W-1) L + bytes sent / bw, its receives the
//   receiving side for (W-1) L + bytes received / bw, each from the post or
//   from when that side frees up, and wait() sleeps until both are done and
//   every peer's sending side has sent this rank its bytes (a peer that
//   posts late delivers late; alone and posted together, the all_to_all_v
//   time above). Compute between the two hides it. As the transport
//   contract says, the buffers are read and written until wait() returns
//   (a rank that fails with posts outstanding leaves them to its world's
//   abort, as NCCL leaves them to ncclCommAbort). Exchanges
//   posted back to back queue on each side separately: one that mostly sends
//   and one that mostly receives overlap, as they do on a full-duplex link,
//   so a rank's exchanges take the larger of its total sent and received
//   (the step-time model's assumption for the op's stages).
// - Like the transports it wraps, it is used by one thread at a time.
//
// Two tiers (the constructor with a Topology): a cluster of nodes, links
// inside a node (`intra`, NVLink) and between nodes (`inter`, InfiniBand).
// Each rank has one full-duplex link per tier, and the two work at once. A
// message to a peer on the rank's node uses the intra-node link, to a peer
// on another node the inter-node link, with that tier's bandwidth and
// latency. An all_to_all_v (blocking or posted) occupies each tier's
// sending side for latency x (peers of that tier it sends to or receives
// from) + bytes sent over that tier / bandwidth, and its receiving side
// likewise for the bytes received; alone it takes
//     latency x (peers of that tier) + max(bytes sent, bytes received over that tier) / bandwidth
// on the slower tier. These are the step-time model's
// assumptions (cpdispatch/model/step_model.hpp, detail::step_model::exchange_time:
// the same per-tier formula, peers with no bytes either way cost no latency,
// the tiers at once), so a planned exchange measured over this adapter
// checks the model's communication part. (The one-tier adapter keeps its
// (W-1) L, every peer.) Collectives cross every node, so with two or more
// nodes a ring step costs the slower tier's L + B/bw (a broadcast or barrier
// the slower tier's formula above) and occupies both links; on one node they
// run on the intra-node link alone.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// The simulated network: one full-duplex link per rank (per tier).
struct LinkModel {
  std::chrono::nanoseconds latency{0};
  /// Bytes per second of each rank's link, each way; must be positive.
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

  /// One tier: every peer over `model`. Wraps `inner`, which must outlive the adapter.
  SimulatedLinkTransport(Inner& inner, LinkModel model) : inner_(inner), tiers_{model, model} { check(model, ""); }

  /// Two tiers: `topology` gives the node of each rank (its world_size must
  /// be the inner transport's); `intra` links ranks of one node, `inter`
  /// ranks of different nodes.
  SimulatedLinkTransport(Inner& inner, Topology topology, LinkModel intra, LinkModel inter)
      : inner_(inner), topology_(std::move(topology)), tiers_{intra, inter} {
    if (topology_->world_size() != inner.world_size()) {
      cpdispatch::detail::fail("SimulatedLinkTransport: topology describes ", topology_->world_size(),
                               " ranks, but world_size = ", inner.world_size());
    }
    check(intra, "intra ");
    check(inter, "inter ");
  }
  SimulatedLinkTransport(const SimulatedLinkTransport&) = delete;
  SimulatedLinkTransport& operator=(const SimulatedLinkTransport&) = delete;

  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }
  /// The one tier's link (with a topology: the intra-node link).
  const LinkModel& model() const noexcept { return tiers_[0]; }
  const LinkModel& intra_model() const noexcept { return tiers_[0]; }
  const LinkModel& inter_model() const noexcept { return tiers_[1]; }
  /// The node of each rank, or nullptr with one tier.
  const Topology* topology() const noexcept { return topology_ ? &*topology_ : nullptr; }
  Inner& inner() noexcept { return inner_; }
  /// Bytes this rank's link has carried to other ranks so far: messages,
  /// all-to-all payloads, and the collectives' shares as their ring
  /// algorithms (above) send them.
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }
  /// Bytes this rank has received from other ranks so far: messages and
  /// all-to-all payloads (collectives receive what they send).
  std::uint64_t bytes_received() const noexcept { return bytes_received_; }
  /// When this rank's links finish what has been given to them so far (the
  /// modelled schedule: the latest of every side's free time).
  Clock::time_point busy_until() const noexcept {
    return std::max({send_free_[0], send_free_[1], receive_free_[0], receive_free_[1]});
  }

  Request isend(const void* buf, std::size_t bytes, int peer, int tag) {
    const std::size_t k = tier_of(peer);
    const Clock::time_point start = std::max(Clock::now(), send_free_[k]);
    const Clock::time_point sent = start + tiers_[k].transmit_time(bytes);
    if (peer != rank()) bytes_sent_ += bytes;
    auto pending = std::make_unique<Pending>();
    pending->is_send = true;
    pending->done_at = sent;
    pending->header = (sent + tiers_[k].latency).time_since_epoch().count();
    pending->header_request = inner_.isend(&pending->header, sizeof pending->header, peer, tag);
    try {
      pending->payload_request = inner_.isend(buf, bytes, peer, tag);
    } catch (...) {
      retired_.push_back(std::move(pending));  // the header may still be in flight: keep its storage
      throw;
    }
    send_free_[k] = sent;
    return remember(std::move(pending));
  }

  Request irecv(void* buf, std::size_t bytes, int peer, int tag) {
    if (peer != rank()) bytes_received_ += bytes;
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
    if (pending->posted) return wait_posted(std::move(pending));
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
    count(send_counts, recv_counts);
    std::this_thread::sleep_until(occupy_links(all_to_all_time(send_counts, recv_counts)).done);
  }

  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    check_posted(send_counts, send_displs, recv_counts, recv_displs);
    count(send_counts, recv_counts);
    const Sides sides = occupy_links(all_to_all_time(send_counts, recv_counts));
    auto pending = std::make_unique<Pending>();
    pending->posted = true;
    pending->done_at = sides.done;
    const auto W = static_cast<std::size_t>(world_size()), me = static_cast<std::size_t>(rank());
    pending->times.assign(2 * W, 0);  // per peer: when this rank's side sends it its bytes, when the peer's side sends them here
    try {
      for (std::size_t p = 0; p < W; ++p) {  // the receives first, then the sends, each header ahead of its payload
        if (p == me || recv_counts[p] == 0) continue;
        pending->requests.push_back(inner_.irecv(&pending->times[W + p], sizeof(std::int64_t), static_cast<int>(p), posted_tag));
        pending->requests.push_back(inner_.irecv(static_cast<std::byte*>(recv) + recv_displs[p], recv_counts[p], static_cast<int>(p), posted_tag));
      }
      for (std::size_t p = 0; p < W; ++p) {
        if (p == me || send_counts[p] == 0) continue;
        pending->times[p] = sides.sent[tier_of(static_cast<int>(p))].time_since_epoch().count();
        pending->requests.push_back(inner_.isend(&pending->times[p], sizeof(std::int64_t), static_cast<int>(p), posted_tag));
        pending->requests.push_back(inner_.isend(static_cast<const std::byte*>(send) + send_displs[p], send_counts[p], static_cast<int>(p), posted_tag));
      }
    } catch (...) {
      retired_.push_back(std::move(pending));  // what was posted may still be in flight: keep its storage
      throw;
    }
    if (send_counts[me] > 0) std::memcpy(static_cast<std::byte*>(recv) + recv_displs[me], static_cast<const std::byte*>(send) + send_displs[me], send_counts[me]);
    return remember(std::move(pending));
  }

  void barrier() {
    inner_.barrier();
    int rounds = 0;
    while ((1 << rounds) < world_size()) ++rounds;
    occupy(ring([rounds](const LinkModel& m) { return rounds * m.latency; }));
  }

  void broadcast(void* buf, std::size_t bytes, int root) {
    inner_.broadcast(buf, bytes, root);
    if (world_size() > 1) collective_bytes(bytes);
    occupy(ring([&](const LinkModel& m) { return peers() * m.latency + m.transmit_time(bytes); }));
  }

  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op) {
    inner_.all_reduce(buf, count, type, op);
    const std::size_t block = count * element_size(type) / static_cast<std::size_t>(world_size());
    collective_bytes(2 * static_cast<std::uint64_t>(peers()) * block);
    occupy(2 * peers() * ring_step(block));
  }

  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
    inner_.all_gather(send, recv, count_per_rank, type);
    collective_bytes(static_cast<std::uint64_t>(peers()) * count_per_rank * element_size(type));
    occupy(peers() * ring_step(count_per_rank * element_size(type)));
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op) {
    inner_.reduce_scatter(send, recv, count_per_rank, type, op);
    collective_bytes(static_cast<std::uint64_t>(peers()) * count_per_rank * element_size(type));
    occupy(peers() * ring_step(count_per_rank * element_size(type)));
  }

 private:
  using Span = std::chrono::nanoseconds;

  struct Pending {
    bool is_send = false;
    bool posted = false;  // a posted all-to-all (its requests below, not the two that follow)
    std::int64_t header = 0;  // the delivery time, in steady_clock ticks since its epoch
    Request header_request;
    Request payload_request;
    Clock::time_point done_at;
    std::vector<std::int64_t> times;  // posted: the sending sides' finish times it sends and receives (see post_all_to_all_v)
    std::vector<Request> requests;    // posted: its point-to-point messages on the inner transport
  };

  /// A label for the posted all-to-alls' messages (tags take no part in matching).
  static constexpr int posted_tag = 32000;

  /// A posted all-to-all's counts and displacements: one per rank, and this rank's bytes to itself as many as it receives from itself.
  void check_posted(std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs) const {
    const auto W = static_cast<std::size_t>(world_size()), me = static_cast<std::size_t>(rank());
    const std::pair<const char*, std::size_t> sizes[] = {{"send_counts", send_counts.size()}, {"send_displs", send_displs.size()},
                                                         {"recv_counts", recv_counts.size()}, {"recv_displs", recv_displs.size()}};
    for (const auto& [name, size] : sizes) {
      if (size != W) cpdispatch::detail::fail("SimulatedLinkTransport::post_all_to_all_v (rank ", rank(), "): ", name, " has ", size, " entries, world_size = ", W);
    }
    if (send_counts[me] != recv_counts[me]) {
      cpdispatch::detail::fail("SimulatedLinkTransport::post_all_to_all_v (rank ", rank(), "): send_counts[", me, "] = ", send_counts[me],
                               " bytes to itself, but recv_counts[", me, "] = ", recv_counts[me]);
    }
  }

  /// A posted all-to-all is done once its messages have arrived, this
  /// rank's link has carried them, and every peer's sending side has sent it
  /// its bytes (a peer that posted late sends late).
  void wait_posted(std::unique_ptr<Pending> pending) {
    const std::size_t W = pending->times.size() / 2;
    for (std::size_t i = 0; i < pending->requests.size(); ++i) {
      try {
        inner_.wait(pending->requests[i]);
      } catch (...) {
        pending->requests.erase(pending->requests.begin(), pending->requests.begin() + static_cast<std::ptrdiff_t>(i + 1));
        retired_.push_back(std::move(pending));  // the rest may still be in flight
        throw;
      }
    }
    Clock::time_point done = pending->done_at;
    for (std::size_t p = W; p < 2 * W; ++p) done = std::max(done, Clock::time_point(Clock::duration(pending->times[p])));
    std::this_thread::sleep_until(done);
  }

  static void check(const LinkModel& model, const char* tier) {
    if (!(model.bandwidth > 0) || !std::isfinite(model.bandwidth)) {
      cpdispatch::detail::fail("SimulatedLinkTransport: ", tier, "bandwidth = ", model.bandwidth, " bytes/s must be positive and finite");
    }
    if (model.latency.count() < 0) {
      cpdispatch::detail::fail("SimulatedLinkTransport: ", tier, "latency = ", model.latency.count(), " ns must not be negative");
    }
  }

  Request remember(std::unique_ptr<Pending> pending) {
    const std::uint64_t id = next_id_++;
    pending_.emplace(id, std::move(pending));
    return Request{id};
  }

  std::int64_t peers() const { return world_size() - 1; }

  /// 0: the intra-node link (and the only one without a topology), 1: the inter-node link.
  std::size_t tier_of(int peer) const {
    if (!topology_ || peer < 0 || peer >= world_size()) return 0;  // the inner transport rejects a bad peer
    return topology_->same_node(rank(), peer) ? 0 : 1;
  }

  /// A collective's time `f(link)`: on the slower tier once it spans nodes.
  template <class F>
  Span ring(F f) const {
    if (!topology_ || topology_->num_nodes() == 1) return f(tiers_[0]);
    return std::max(f(tiers_[0]), f(tiers_[1]));
  }

  /// One ring step of `block` bytes.
  Span ring_step(std::size_t block) const {
    return ring([block](const LinkModel& m) { return m.latency + m.transmit_time(block); });
  }

  /// How long an all-to-all occupies each tier's sending and receiving sides (see the header comment).
  struct Spans {
    Span send[2]{}, receive[2]{};
  };

  Spans all_to_all_time(std::span<const std::size_t> send_counts, std::span<const std::size_t> recv_counts) const {
    std::size_t sent[2] = {0, 0}, received[2] = {0, 0};
    std::int64_t partners[2] = {0, 0};
    const auto me = static_cast<std::size_t>(rank());
    for (std::size_t p = 0; p < static_cast<std::size_t>(world_size()); ++p) {
      if (p == me) continue;
      const std::size_t out = p < send_counts.size() ? send_counts[p] : 0, in = p < recv_counts.size() ? recv_counts[p] : 0;
      const std::size_t k = tier_of(static_cast<int>(p));
      sent[k] += out;
      received[k] += in;
      partners[k] += (out > 0 || in > 0) ? 1 : 0;
    }
    Spans out;
    if (world_size() == 1) return out;
    if (!topology_) partners[0] = peers();  // one tier keeps its (W-1) L, every peer
    for (std::size_t k = 0; k < 2; ++k) {
      if (partners[k] == 0) continue;
      out.send[k] = partners[k] * tiers_[k].latency + tiers_[k].transmit_time(sent[k]);
      out.receive[k] = partners[k] * tiers_[k].latency + tiers_[k].transmit_time(received[k]);
    }
    return out;
  }

  /// When an all-to-all's sending side of each tier is done, and when the last side is.
  struct Sides {
    Clock::time_point sent[2], done;
  };

  /// Each side of each tier's link is busy for its span from now (or from
  /// when it frees up).
  Sides occupy_links(const Spans& spans) {
    const Clock::time_point now = Clock::now();
    Sides out{{now, now}, now};
    const auto occupy_side = [&](Clock::time_point& free, Span span) {
      if (span.count() <= 0) return now;
      free = std::max(now, free) + span;
      out.done = std::max(out.done, free);
      return free;
    };
    for (std::size_t k = 0; k < 2; ++k) {
      out.sent[k] = occupy_side(send_free_[k], spans.send[k]);
      occupy_side(receive_free_[k], spans.receive[k]);
    }
    return out;
  }

  /// A collective's bytes: each rank of a ring sends and receives as much.
  void collective_bytes(std::uint64_t bytes) noexcept {
    bytes_sent_ += bytes;
    bytes_received_ += bytes;
  }

  /// An all-to-all's bytes to and from other ranks.
  void count(std::span<const std::size_t> send_counts, std::span<const std::size_t> recv_counts) noexcept {
    const auto me = static_cast<std::size_t>(rank());
    for (std::size_t p = 0; p < send_counts.size(); ++p) bytes_sent_ += p == me ? 0 : send_counts[p];
    for (std::size_t p = 0; p < recv_counts.size(); ++p) bytes_received_ += p == me ? 0 : recv_counts[p];
  }

  /// A collective's modelled time: every link is busy for `span` from now
  /// (or from when the last frees up).
  void occupy(Span span) {
    if (span.count() <= 0) return;
    const Clock::time_point done = std::max({Clock::now(), send_free_[0], send_free_[1], receive_free_[0], receive_free_[1]}) + span;
    for (std::size_t k = 0; k < 2; ++k) send_free_[k] = receive_free_[k] = done;
    std::this_thread::sleep_until(done);
  }

  Inner& inner_;
  std::optional<Topology> topology_;
  LinkModel tiers_[2];  // intra-node, inter-node (the same model twice with one tier)
  Clock::time_point send_free_[2]{}, receive_free_[2]{};  // each tier's sending and receiving sides
  std::uint64_t bytes_sent_ = 0;
  std::uint64_t bytes_received_ = 0;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, std::unique_ptr<Pending>> pending_;
  std::vector<std::unique_ptr<Pending>> retired_;  // headers of failed requests, kept until the adapter goes
};

}  // namespace cpdispatch
