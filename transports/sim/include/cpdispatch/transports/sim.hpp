#pragma once
// The in-process transport: a world of N ranks run as N threads of one
// process, exchanging through shared memory (memcpy). The same per-rank code
// runs on it unchanged as on MPI:
//
//   cpdispatch::SimWorld world(8);
//   world.run([&](cpdispatch::SimTransport& t) {
//     cpdispatch::Dispatcher q(t, qkv.q_fwd, qkv.q_rev, token_bytes);
//     q.forward(mlp[t.rank()], attn[t.rank()]);
//   });
//
// Semantics (those of the Transport contract, transport.hpp):
// - Collectives: every rank publishes its buffers and all meet; then the
//   copies (or reductions) run and each rank returns once nobody reads its
//   buffers any more. The all-to-alls split their copies into one task per
//   receiver, taken by whichever ranks are running, and every rank returns
//   when all tasks are done: a rank the OS has not scheduled holds nobody up.
//   The typed collectives meet a second time instead. Ranks must call the
//   same collectives in the same order; a mismatch (another collective,
//   count, type, root) is an error naming both calls.
// - Reductions sum in rank order (0, 1, ..., W-1), so every rank gets the same,
//   reproducible result; 16-bit floats accumulate in fp32 and round once;
//   integers wrap around (two's complement). Buffers of one collective must
//   not overlap each other (no in-place all_gather / reduce_scatter).
// - isend/irecv match by (source, destination, tag) in posting order; sizes
//   must agree exactly. Every request must be waited for.
// - Failure: when a rank's function throws (or a transport call fails), the
//   world is aborted: ranks blocked in a collective or wait() are released
//   with an error instead of hanging (after any copy still touching their
//   buffers has finished), and run() rethrows the FIRST exception with
//   "SimWorld rank r of W: " in front (same kind, original nested). A rank
//   that returns while others wait for it in a collective is an error too.
//   After a failure the world's transports are unusable until the next run().
// - Besides the Transport concept it offers all_to_all_pieces
//   (PieceTransport): receivers copy straight from the senders' pieces, so a
//   Dispatcher over it needs no staging. SimPackingTransport hides that
//   member (the pack / all_to_all_v / unpack path, as over MPI).
// - It posts exchanges too (PostedAllToAllTransport): post_all_to_all_v is
//   all_to_all_v (every rank meets at the post and the bytes move there),
//   and wait() then only retires the request. So the sim never overlaps;
//   SimulatedLinkTransport over it models a link that does.
// - SimOptions::timeout bounds every wait; expiry throws timeout_error naming
//   the rank, the operation and the bound ("All-reduce timeout on rank 2 of 4
//   in all_reduce: not complete after 100 ms") and aborts the world. None by
//   default.
//
// The threads, the meetings, the mailboxes and the abort are
// transports/detail/sim_world.hpp's, shared with the single-GPU cpdispatch::DeviceSimWorld;
// this header adds what moves the bytes (memcpy, and the shared exchange).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/transports/detail/sim_world.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

struct SimOptions {
  /// Bound on every wait of every rank (collectives and wait()); none: wait forever.
  std::optional<std::chrono::milliseconds> timeout;
};

class SimWorld;

namespace detail::sim {

/// A rank's published buffers for the collective in progress.
struct Slot {
  const void* send = nullptr;
  void* recv = nullptr;
  std::span<const std::size_t> send_counts = {};  // all_to_all_v; the splits for all_to_all_pieces
  std::span<const std::size_t> send_displs = {};  // all_to_all_v
  std::span<const std::size_t> recv_counts = {};  // all_to_all_v; the splits for all_to_all_pieces
  std::span<const std::size_t> recv_displs = {};  // all_to_all_v
  std::span<const BytePiece> send_pieces = {};    // all_to_all_pieces
  std::span<const BytePiece> recv_pieces = {};    // all_to_all_pieces
};

template <class E>
E load(const std::byte* p, std::size_t i) {
  E v;
  std::memcpy(&v, p + i * sizeof(E), sizeof(E));
  return v;
}

/// out[i] = in[0][i] + in[1][i] + ... in this order (see the header comment).
template <class E>
void sum_elements(std::byte* out, std::span<const std::byte* const> in, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    E result;
    if constexpr (std::is_integral_v<E>) {
      using U = std::make_unsigned_t<E>;
      U acc = 0;
      for (const std::byte* p : in) acc = static_cast<U>(acc + static_cast<U>(load<E>(p, i)));
      result = static_cast<E>(acc);
    } else {
      using Acc = accumulator_t<E>;
      Acc acc = static_cast<Acc>(load<E>(in[0], i));
      for (std::size_t s = 1; s < in.size(); ++s) acc += static_cast<Acc>(load<E>(in[s], i));
      result = E(acc);
    }
    std::memcpy(out + i * sizeof(E), &result, sizeof(E));
  }
}

inline void sum(ElementType type, std::byte* out, std::span<const std::byte* const> in, std::size_t count) {
  switch (type) {
    case ElementType::int8: return sum_elements<std::int8_t>(out, in, count);
    case ElementType::uint8: return sum_elements<std::uint8_t>(out, in, count);
    case ElementType::int32: return sum_elements<std::int32_t>(out, in, count);
    case ElementType::int64: return sum_elements<std::int64_t>(out, in, count);
    case ElementType::float32: return sum_elements<float>(out, in, count);
    case ElementType::float64: return sum_elements<double>(out, in, count);
    case ElementType::bfloat16: return sum_elements<bfloat16>(out, in, count);
    case ElementType::float16: return sum_elements<float16>(out, in, count);
  }
}

}  // namespace detail::sim

/// One rank's handle on a SimWorld; made by SimWorld::run, valid during it.
class SimTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;

  SimTransport(const SimTransport&) = delete;
  SimTransport& operator=(const SimTransport&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept;

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs);
  /// The optional PieceTransport member: receivers copy straight from the
  /// senders' pieces into their own (no staging anywhere).
  void all_to_all_pieces(const void* send, std::span<const BytePiece> send_pieces, std::span<const std::size_t> send_splits,
                         void* recv, std::span<const BytePiece> recv_pieces, std::span<const std::size_t> recv_splits);
  /// The PostedAllToAllTransport member: the exchange completes here; wait() retires the request.
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs);
  Request isend(const void* buf, std::size_t bytes, int peer, int tag);
  Request irecv(void* buf, std::size_t bytes, int peer, int tag);
  void wait(Request request);
  void barrier();
  void broadcast(void* buf, std::size_t bytes, int root);
  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op);
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type);
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op);

 private:
  friend class SimWorld;
  SimTransport(SimWorld& world, int rank);

  /// Fails the world with "SimTransport: <op> on rank <rank> of W: <what>".
  [[noreturn]] void fail(const char* op, const std::string& what);
  void publish(const detail::sim::Slot& slot);
  Request post(const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer, int tag);

  SimWorld& world_;
  int rank_;
  std::vector<const std::byte*> sources_;  // reduction inputs, one per rank
  std::vector<std::byte> scratch_;         // all_reduce result before it is written back
  detail::sim::Requests<detail::sim::Message> requests_;
  std::vector<std::uint64_t> posted_;      // posted exchanges not yet waited for (their ids have the top bit set)
  std::uint64_t next_posted_ = 0;
  static constexpr std::uint64_t posted_bit = std::uint64_t{1} << 63;
};

/// A SimTransport seen as a plain Transport, without all_to_all_pieces: a
/// dispatcher over it packs, calls all_to_all_v and unpacks, as it does over
/// MPI. For tests and benchmarks of that path.
class SimPackingTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;

  explicit SimPackingTransport(SimTransport& sim) noexcept : sim_(sim) {}

  int rank() const noexcept { return sim_.rank(); }
  int world_size() const noexcept { return sim_.world_size(); }
  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    sim_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    return sim_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
  Request isend(const void* buf, std::size_t bytes, int peer, int tag) { return sim_.isend(buf, bytes, peer, tag); }
  Request irecv(void* buf, std::size_t bytes, int peer, int tag) { return sim_.irecv(buf, bytes, peer, tag); }
  void wait(Request request) { sim_.wait(request); }
  void barrier() { sim_.barrier(); }
  void broadcast(void* buf, std::size_t bytes, int root) { sim_.broadcast(buf, bytes, root); }
  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op) { sim_.all_reduce(buf, count, type, op); }
  void all_gather(const void* send, void* recv, std::size_t count, ElementType type) { sim_.all_gather(send, recv, count, type); }
  void reduce_scatter(const void* send, void* recv, std::size_t count, ElementType type, ReduceOp op) {
    sim_.reduce_scatter(send, recv, count, type, op);
  }

 private:
  SimTransport& sim_;
};

/// N ranks as threads in this process.
class SimWorld : private detail::sim::World<detail::sim::Message> {
 public:
  explicit SimWorld(int world_size, SimOptions options = {})
      : World({"SimWorld", "SimTransport", "SimOptions::timeout"}, world_size, options.timeout), options_(options) {}

  using World::world_size;
  using World::running;  // whether run() is under way
  const SimOptions& options() const noexcept { return options_; }

  /// Runs per_rank(SimTransport&) on world_size() threads at once (rank r on
  /// thread r) and returns when all have returned. Rethrows the first
  /// exception of any rank, with the rank named (see the header comment).
  template <class F>
  void run(F&& per_rank) {
    run_ranks([this] { slots_.assign(static_cast<std::size_t>(world_size()), {}); },
              [this, &per_rank](int r) {
                SimTransport transport(*this, r);  // gone before the world hears that rank r returned
                per_rank(transport);
              });
  }

 private:
  friend class SimTransport;

  /// All ranks meet (see World::arrive_and_wait); an exchange's task
  /// counters start afresh at each meeting.
  std::uint64_t arrive_and_wait(int rank, const detail::sim::Call& call) {
    return World::arrive_and_wait(rank, call, [this] {
      next_task_.store(0);
      tasks_done_ = 0;
    });
  }

  /// The second half of an exchange, after the meeting `generation` where
  /// every rank published its buffers: the ranks that run share the
  /// per-receiver tasks (task(r) fills rank r's receive buffer and returns an
  /// error message, empty when all went well), and each returns once all are
  /// done, so no buffer is reused while being read.
  template <class Task>
  void share_tasks(int rank, const char* op, std::uint64_t generation, Task&& task) {
    const int size = world_size();
    for (;;) {
      const std::size_t r = next_task_.fetch_add(1);
      if (r >= static_cast<std::size_t>(size)) break;
      read_others(rank, op, [&] { return task(static_cast<int>(r)); }, static_cast<int>(r));
      Lock lock(mutex_);
      if (++tasks_done_ == size) {
        exchanged_ = generation;
        notify_all();
      }
    }
    Lock lock(mutex_);
    wait_locked(lock, rank, op, [&] { return exchanged_ >= generation; });
  }

  SimOptions options_;
  // collectives (slots are written under the mutex before arriving, read after the meeting)
  std::vector<detail::sim::Slot> slots_;
  // exchanges: receiver tasks handed out / finished, the last meeting whose exchange is complete
  std::atomic<std::size_t> next_task_{0};
  int tasks_done_ = 0;
  std::uint64_t exchanged_ = 0;
};

// ---- SimTransport ----------------------------------------------------------

inline SimTransport::SimTransport(SimWorld& world, int rank)
    : world_(world), rank_(rank), sources_(static_cast<std::size_t>(world.world_size())) {
  posted_.reserve(64);  // posts in flight at once (an op's stage groups): a step's posts allocate nothing
}

inline int SimTransport::world_size() const noexcept { return world_.world_size(); }

inline void SimTransport::fail(const char* op, const std::string& what) { world_.raise_invalid(rank_, op, what); }

inline void SimTransport::publish(const detail::sim::Slot& slot) {
  std::lock_guard lock(world_.mutex_);
  world_.slots_[static_cast<std::size_t>(rank_)] = slot;
}

inline void SimTransport::all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                       std::span<const std::size_t> send_displs, void* recv,
                                       std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  const char* op = "all_to_all_v";
  const auto W = static_cast<std::size_t>(world_.world_size());
  for (auto [name, s] : {std::pair{"send_counts", send_counts}, std::pair{"send_displs", send_displs},
                         std::pair{"recv_counts", recv_counts}, std::pair{"recv_displs", recv_displs}}) {
    if (s.size() != W) fail(op, detail::concat(name, " has ", s.size(), " entries, world_size is ", W));
  }
  publish({.send = send, .recv = recv, .send_counts = send_counts, .send_displs = send_displs, .recv_counts = recv_counts,
           .recv_displs = recv_displs});
  const std::uint64_t generation = world_.arrive_and_wait(rank_, {op});
  world_.share_tasks(rank_, op, generation, [&](int receiver) -> std::string {
    const auto r = static_cast<std::size_t>(receiver);
    const detail::sim::Slot& to = world_.slots_[r];
    for (std::size_t s = 0; s < W; ++s) {
      const detail::sim::Slot& from = world_.slots_[s];
      const std::size_t bytes = from.send_counts[r];
      if (bytes != to.recv_counts[s]) {
        return detail::concat("SimTransport: ", op, " on rank ", r, " of ", W, ": rank ", s, " sends ", bytes, " bytes to rank ", r,
                              ", which expects recv_counts[", s, "] = ", to.recv_counts[s]);
      }
      if (bytes) {
        std::memcpy(static_cast<std::byte*>(to.recv) + to.recv_displs[s], static_cast<const std::byte*>(from.send) + from.send_displs[r],
                    bytes);
      }
    }
    return {};
  });
}

inline void SimTransport::all_to_all_pieces(const void* send, std::span<const BytePiece> send_pieces,
                                            std::span<const std::size_t> send_splits, void* recv,
                                            std::span<const BytePiece> recv_pieces, std::span<const std::size_t> recv_splits) {
  const char* op = "all_to_all_pieces";
  const auto W = static_cast<std::size_t>(world_.world_size());
  for (auto [name, splits, pieces] : {std::tuple{"send_splits", send_splits, send_pieces.size()},
                                      std::tuple{"recv_splits", recv_splits, recv_pieces.size()}}) {
    if (splits.size() != W + 1) fail(op, detail::concat(name, " has ", splits.size(), " entries, world_size + 1 is ", W + 1));
    for (std::size_t p = 0; p < W; ++p) {
      if (splits[p] > splits[p + 1] || splits[p + 1] > pieces) {
        fail(op, detail::concat(name, "[", p, "..", p + 1, "] = ", splits[p], "..", splits[p + 1], " is not a range of the ", pieces, " pieces"));
      }
    }
  }
  publish({.send = send, .recv = recv, .send_counts = send_splits, .recv_counts = recv_splits, .send_pieces = send_pieces,
           .recv_pieces = recv_pieces});
  const std::uint64_t generation = world_.arrive_and_wait(rank_, {op});
  world_.share_tasks(rank_, op, generation, [&](int receiver) -> std::string {
    const auto r = static_cast<std::size_t>(receiver);
    const detail::sim::Slot& to = world_.slots_[r];
    for (std::size_t s = 0; s < W; ++s) {
      const detail::sim::Slot& from = world_.slots_[s];
      const auto theirs = from.send_pieces.subspan(from.send_counts[r], from.send_counts[r + 1] - from.send_counts[r]);
      const auto mine = to.recv_pieces.subspan(to.recv_counts[s], to.recv_counts[s + 1] - to.recv_counts[s]);
      std::size_t sent = 0, expected = 0;
      for (const BytePiece& p : theirs) sent += p.bytes;
      for (const BytePiece& p : mine) expected += p.bytes;
      if (sent != expected) {
        return detail::concat("SimTransport: ", op, " on rank ", r, " of ", W, ": rank ", s, " sends ", sent, " bytes to rank ", r,
                              ", whose pieces for it hold ", expected);
      }
      // Lay the sender's byte stream over the receiver's pieces.
      std::size_t i = 0, j = 0, at_i = 0, at_j = 0;  // piece index and offset inside it, both sides
      while (i < theirs.size() && j < mine.size()) {
        const std::size_t n = std::min(theirs[i].bytes - at_i, mine[j].bytes - at_j);
        if (n) {
          std::memcpy(static_cast<std::byte*>(to.recv) + mine[j].offset + at_j,
                      static_cast<const std::byte*>(from.send) + theirs[i].offset + at_i, n);
        }
        at_i += n;
        at_j += n;
        if (at_i == theirs[i].bytes) ++i, at_i = 0;
        if (at_j == mine[j].bytes) ++j, at_j = 0;
      }
    }
    return {};
  });
}

inline void SimTransport::barrier() { world_.arrive_and_wait(rank_, {"barrier"}); }

inline void SimTransport::broadcast(void* buf, std::size_t bytes, int root) {
  const char* op = "broadcast";
  if (root < 0 || root >= world_size()) fail(op, detail::concat("root ", root, " is outside [0, ", world_size(), ")"));
  publish({.send = buf, .recv = buf});
  const detail::sim::Call call{op, bytes, -1, root};
  world_.arrive_and_wait(rank_, call);
  world_.read_others(rank_, op, [&] {
    if (rank_ != root && bytes) std::memcpy(buf, world_.slots_[static_cast<std::size_t>(root)].send, bytes);
    return std::string();
  });
  world_.arrive_and_wait(rank_, call);
}

inline void SimTransport::all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp) {
  const char* op = "all_reduce";
  const std::size_t bytes = detail::checked_bytes(count, element_size(type), 1, "SimTransport::all_reduce");
  publish({.send = buf, .recv = buf});
  const detail::sim::Call call{op, count, static_cast<int>(type), -1};
  world_.arrive_and_wait(rank_, call);
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  world_.read_others(rank_, op, [&] {
    for (std::size_t s = 0; s < sources_.size(); ++s) sources_[s] = static_cast<const std::byte*>(world_.slots_[s].send);
    detail::sim::sum(type, scratch_.data(), sources_, count);
    return std::string();
  });
  world_.arrive_and_wait(rank_, call);  // everyone has read every buffer: now write ours
  if (bytes) std::memcpy(buf, scratch_.data(), bytes);
}

inline void SimTransport::all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
  const char* op = "all_gather";
  const std::size_t bytes = detail::checked_bytes(count_per_rank, element_size(type), 1, "SimTransport::all_gather");
  detail::checked_bytes(count_per_rank, element_size(type), world_.slots_.size(), "SimTransport::all_gather");
  publish({.send = send, .recv = recv});
  const detail::sim::Call call{op, count_per_rank, static_cast<int>(type), -1};
  world_.arrive_and_wait(rank_, call);
  world_.read_others(rank_, op, [&] {
    for (std::size_t s = 0; s < world_.slots_.size(); ++s) {
      if (bytes) std::memcpy(static_cast<std::byte*>(recv) + s * bytes, world_.slots_[s].send, bytes);
    }
    return std::string();
  });
  world_.arrive_and_wait(rank_, call);
}

inline void SimTransport::reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp) {
  const char* op = "reduce_scatter";
  const std::size_t bytes = detail::checked_bytes(count_per_rank, element_size(type), 1, "SimTransport::reduce_scatter");
  detail::checked_bytes(count_per_rank, element_size(type), world_.slots_.size(), "SimTransport::reduce_scatter");
  publish({.send = send, .recv = recv});
  const detail::sim::Call call{op, count_per_rank, static_cast<int>(type), -1};
  world_.arrive_and_wait(rank_, call);
  world_.read_others(rank_, op, [&] {
    for (std::size_t s = 0; s < sources_.size(); ++s) {
      sources_[s] = static_cast<const std::byte*>(world_.slots_[s].send) + static_cast<std::size_t>(rank_) * bytes;
    }
    detail::sim::sum(type, static_cast<std::byte*>(recv), sources_, count_per_rank);
    return std::string();
  });
  world_.arrive_and_wait(rank_, call);
}

inline Request SimTransport::post(const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer,
                                  int tag) {
  auto msg = world_.new_message(rank_, op, is_send, send, recv, bytes, peer, tag);
  // Paired: copy now, under the world's lock (both buffers are alive until their waits).
  world_.post(rank_, op, msg, [](detail::sim::Message& s, detail::sim::Message& r) {
    if (s.bytes) std::memcpy(r.recv, s.send, s.bytes);
  });
  return requests_.add(std::move(msg));
}

inline Request SimTransport::isend(const void* buf, std::size_t bytes, int peer, int tag) {
  return post("isend", true, buf, nullptr, bytes, peer, tag);
}

inline Request SimTransport::irecv(void* buf, std::size_t bytes, int peer, int tag) {
  return post("irecv", false, nullptr, buf, bytes, peer, tag);
}

inline Request SimTransport::post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                               std::span<const std::size_t> send_displs, void* recv,
                                               std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  const std::uint64_t id = posted_bit | next_posted_++;
  posted_.push_back(id);
  return Request{id};
}

inline void SimTransport::wait(Request request) {
  if (request.id & posted_bit) {  // a posted exchange: its bytes moved at the post
    const auto it = std::find(posted_.begin(), posted_.end(), request.id);
    if (it == posted_.end()) fail("wait", detail::concat("request ", request.id, " is not a pending posted exchange on this rank"));
    posted_.erase(it);
    return;
  }
  world_.wait_request(rank_, requests_, request);  // the bytes were copied when the two were paired
}

}  // namespace cpdispatch
