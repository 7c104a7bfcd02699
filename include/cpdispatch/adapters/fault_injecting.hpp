#pragma once
// FaultInjectingTransport<Inner>: a test double that wraps any transport and,
// by explicit rules or a seeded schedule, makes the N-th call of one kind on
// one rank fail in one of the ways real backends fail. Everything else is
// forwarded unchanged. It records every fault it injected.
//
//   using cpdispatch::testing::FaultRule, cpdispatch::testing::Fault, cpdispatch::testing::TransportCall;
//   world.run([&](cpdispatch::SimTransport& sim) {
//     cpdispatch::testing::FaultInjectingTransport t(sim, {FaultRule{TransportCall::all_to_all_v, 2, Fault::error, 1}});
//     cpdispatch::Dispatcher d(t, fwd, rev, token_bytes);
//     d.forward(mlp, attn);   // first all_to_all_v: forwarded
//     d.forward(mlp, attn);   // second: rank 1 throws backend_error, the others are released by the world
//   });
//
// The faults (on the rank the rule names; -1 = every rank):
// - error:   the call throws backend_error (code FaultOptions::error_code)
//            without reaching the inner transport, as when a backend reports
//            a failure before the peers hear of it.
// - stall:   the call sleeps FaultOptions::stall (choose it longer than the
//            peers' timeout), then throws timeout_error without reaching the
//            inner transport: a rank stuck past everybody's deadline.
// - short_delivery: the rank sends FaultOptions::short_bytes fewer bytes (or
//            one element fewer in typed collectives) than it promised to
//            the first peer other than itself with something to receive:
//            the peers' counts no longer agree with its own.
// - corrupt: one byte of what the rank sends (to that same peer) is flipped
//            (XOR 0xFF) on the way; the caller's buffer is not touched
//            (in-place collectives get a private copy).
// post_all_to_all_v (where the inner transport posts) takes the faults of
// all_to_all_v at the post; the wait of a posted exchange counts as a wait.
// short_delivery and corrupt need a payload: rules naming them for barrier,
// wait or irecv are refused (invalid_input) at construction. A call with no
// byte for another rank is forwarded unchanged and the fault recorded as
// "no remote payload".
//
// Every member exists exactly when the inner transport has it, so the
// wrapper satisfies the same concepts (Transport, PieceTransport, ...).
// Counting starts at 1 per call kind and per wrapper; one wrapper per rank.

#include <algorithm>
#include <array>
#include <concepts>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::testing {

/// The calls a rule can target.
enum class TransportCall : std::size_t {
  all_to_all_v, all_to_all_pieces, isend, irecv, wait, barrier, broadcast, all_reduce, all_gather, reduce_scatter,
  post_all_to_all_v
};
inline constexpr std::size_t transport_call_kinds = 11;

enum class Fault { error, stall, short_delivery, corrupt };

inline const char* call_name(TransportCall c) noexcept {
  constexpr std::array<const char*, transport_call_kinds> names = {
      "all_to_all_v", "all_to_all_pieces", "isend", "irecv", "wait", "barrier", "broadcast", "all_reduce", "all_gather",
      "reduce_scatter", "post_all_to_all_v"};
  return names[static_cast<std::size_t>(c)];
}

inline const char* fault_name(Fault f) noexcept {
  constexpr std::array<const char*, 4> names = {"error", "stall", "short_delivery", "corrupt"};
  return names[static_cast<std::size_t>(f)];
}

/// The `nth` call (1-based) of kind `call` on rank `rank` (-1: every rank) gets `fault`.
struct FaultRule {
  TransportCall call = TransportCall::all_to_all_v;
  std::uint64_t nth = 1;
  Fault fault = Fault::error;
  int rank = -1;
};

struct FaultOptions {
  int error_code = 1;                          ///< backend_error::code() of Fault::error
  std::chrono::milliseconds stall{500};        ///< how long Fault::stall sleeps before it throws
  std::size_t short_bytes = 1;                 ///< bytes Fault::short_delivery withholds (byte-counted calls)
};

/// What the wrapper did: one entry per injected fault.
struct FaultRecord {
  int rank = 0;
  TransportCall call = TransportCall::all_to_all_v;
  std::uint64_t nth = 0;
  Fault fault = Fault::error;
  int peer = -1;             ///< whose bytes were shortened or corrupted; -1 when none
  std::string what;          ///< one line, as in the exception or "flipped byte 12 for rank 3"
};

/// `count` rules drawn from `seed` over the given call kinds and faults:
/// nth in [1, max_nth], rank in [0, world_size). The same arguments give the
/// same rules on every rank, so all ranks agree on the schedule.
inline std::vector<FaultRule> seeded_fault_rules(std::uint64_t seed, int world_size, std::size_t count,
                                                 std::vector<TransportCall> calls, std::vector<Fault> faults,
                                                 std::uint64_t max_nth = 4) {
  if (world_size < 1 || calls.empty() || faults.empty() || max_nth < 1) {
    cpdispatch::detail::fail("seeded_fault_rules: world_size, calls, faults and max_nth must be non-empty / positive");
  }
  std::mt19937_64 rng(seed);
  std::vector<FaultRule> rules;
  for (std::size_t i = 0; i < count; ++i) {
    FaultRule r;
    r.call = calls[rng() % calls.size()];
    r.fault = faults[rng() % faults.size()];
    r.nth = 1 + rng() % max_nth;
    r.rank = static_cast<int>(rng() % static_cast<std::uint64_t>(world_size));
    rules.push_back(r);
  }
  return rules;
}


template <class Inner>
class FaultInjectingTransport {
 public:
  static constexpr MemorySpace memory_space = Inner::memory_space;

  FaultInjectingTransport(Inner& inner, std::vector<FaultRule> rules, FaultOptions options = {})
      : inner_(inner), rules_(std::move(rules)), options_(options) {
    for (std::size_t i = 0; i < rules_.size(); ++i) {
      const FaultRule& r = rules_[i];
      const bool payload_free = r.call == TransportCall::barrier || r.call == TransportCall::wait || r.call == TransportCall::irecv;
      if (payload_free && (r.fault == Fault::short_delivery || r.fault == Fault::corrupt)) {
        cpdispatch::detail::fail("FaultInjectingTransport: rules[", i, "] asks for ", fault_name(r.fault), " in ", call_name(r.call),
                     ", which sends no payload");
      }
      if (r.nth == 0) cpdispatch::detail::fail("FaultInjectingTransport: rules[", i, "].nth is 0 (calls count from 1)");
    }
  }

  FaultInjectingTransport(const FaultInjectingTransport&) = delete;
  FaultInjectingTransport& operator=(const FaultInjectingTransport&) = delete;

  Inner& inner() noexcept { return inner_; }
  const std::vector<FaultRecord>& records() const noexcept { return records_; }
  /// How many calls of `call` this wrapper has seen (faulty ones included).
  std::uint64_t calls(TransportCall call) const noexcept { return counts_[static_cast<std::size_t>(call)]; }

  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires cpdispatch::detail::transport_has_all_to_all_v<Inner>
  {
    const Fault* f = next(TransportCall::all_to_all_v);
    if (!f) return inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    const int peer = remote_peer(send_counts);
    if (*f == Fault::short_delivery && peer >= 0) {
      return inner_.all_to_all_v(send, shortened(send_counts, peer), send_displs, recv, recv_counts, recv_displs);
    }
    if (*f == Fault::corrupt && peer >= 0) {
      const void* copy = corrupted(send, send_extent(send_counts, send_displs), send_displs[static_cast<std::size_t>(peer)], peer);
      return inner_.all_to_all_v(copy, send_counts, send_displs, recv, recv_counts, recv_displs);
    }
    strike(*f, peer);
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }

  void all_to_all_pieces(const void* send, std::span<const BytePiece> send_pieces, std::span<const std::size_t> send_splits,
                         void* recv, std::span<const BytePiece> recv_pieces, std::span<const std::size_t> recv_splits)
    requires cpdispatch::detail::transport_has_all_to_all_pieces<Inner>
  {
    const Fault* f = next(TransportCall::all_to_all_pieces);
    if (!f) return inner_.all_to_all_pieces(send, send_pieces, send_splits, recv, recv_pieces, recv_splits);
    int peer = -1;
    std::size_t piece = 0;  // the last non-empty piece for `peer`
    for (std::size_t p = 0; p + 1 < send_splits.size() && peer < 0; ++p) {
      if (static_cast<int>(p) == rank()) continue;
      for (std::size_t i = send_splits[p]; i < send_splits[p + 1]; ++i)
        if (send_pieces[i].bytes) peer = static_cast<int>(p), piece = i;
    }
    if (peer >= 0 && (*f == Fault::short_delivery || *f == Fault::corrupt)) {
      pieces_copy_.assign(send_pieces.begin(), send_pieces.end());
      if (*f == Fault::short_delivery) {
        const std::size_t cut = std::min(options_.short_bytes, pieces_copy_[piece].bytes);
        pieces_copy_[piece].bytes -= cut;
        note(peer, cpdispatch::detail::concat("withheld ", cut, " bytes of piece ", piece, " for rank ", peer));
        return inner_.all_to_all_pieces(send, pieces_copy_, send_splits, recv, recv_pieces, recv_splits);
      }
      std::size_t extent = 0;
      for (const BytePiece& p : send_pieces) extent = std::max(extent, p.offset + p.bytes);
      const void* copy = corrupted(send, extent, send_pieces[piece].offset, peer);
      return inner_.all_to_all_pieces(copy, send_pieces, send_splits, recv, recv_pieces, recv_splits);
    }
    strike(*f, peer);
    inner_.all_to_all_pieces(send, send_pieces, send_splits, recv, recv_pieces, recv_splits);
  }

  Request isend(const void* buf, std::size_t bytes, int peer, int tag)
    requires cpdispatch::detail::transport_has_point_to_point<Inner>
  {
    const Fault* f = next(TransportCall::isend);
    if (!f || peer == rank() || bytes == 0) {
      if (f) strike(*f, -1);
      return inner_.isend(buf, bytes, peer, tag);
    }
    if (*f == Fault::short_delivery) {
      const std::size_t sent = bytes - std::min(options_.short_bytes, bytes);
      note(peer, cpdispatch::detail::concat("sent ", sent, " of ", bytes, " bytes to rank ", peer));
      return inner_.isend(buf, sent, peer, tag);
    }
    if (*f == Fault::corrupt) {
      std::vector<std::byte>& copy = pending_copies_[next_copy_id_];
      copy.assign(static_cast<const std::byte*>(buf), static_cast<const std::byte*>(buf) + bytes);
      copy[0] ^= std::byte{0xFF};
      note(peer, cpdispatch::detail::concat("flipped byte 0 of the message to rank ", peer));
      const Request r = inner_.isend(copy.data(), bytes, peer, tag);
      copy_of_request_[r.id] = next_copy_id_++;
      return r;
    }
    strike(*f, peer);
    return inner_.isend(buf, bytes, peer, tag);
  }

  Request irecv(void* buf, std::size_t bytes, int peer, int tag)
    requires cpdispatch::detail::transport_has_point_to_point<Inner>
  {
    if (const Fault* f = next(TransportCall::irecv)) strike(*f, peer);
    return inner_.irecv(buf, bytes, peer, tag);
  }

  /// Faults as all_to_all_v's; a corrupted payload's copy lives until the wait.
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires cpdispatch::detail::transport_has_posted_all_to_all<Inner>
  {
    const Fault* f = next(TransportCall::post_all_to_all_v);
    if (!f) return inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    const int peer = remote_peer(send_counts);
    if (*f == Fault::short_delivery && peer >= 0) {
      return inner_.post_all_to_all_v(send, shortened(send_counts, peer), send_displs, recv, recv_counts, recv_displs);
    }
    if (*f == Fault::corrupt && peer >= 0) {
      std::vector<std::byte>& copy = pending_copies_[next_copy_id_];
      flip_copy(copy, send, send_extent(send_counts, send_displs), send_displs[static_cast<std::size_t>(peer)], peer);
      const Request r = inner_.post_all_to_all_v(copy.data(), send_counts, send_displs, recv, recv_counts, recv_displs);
      copy_of_request_[r.id] = next_copy_id_++;
      return r;
    }
    strike(*f, peer);
    return inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }

  void wait(Request request)
    requires (cpdispatch::detail::transport_has_point_to_point<Inner> || cpdispatch::detail::transport_has_posted_all_to_all<Inner>)
  {
    if (const Fault* f = next(TransportCall::wait)) strike(*f, -1);
    inner_.wait(request);
    if (auto it = copy_of_request_.find(request.id); it != copy_of_request_.end()) {
      pending_copies_.erase(it->second);
      copy_of_request_.erase(it);
    }
  }

  void barrier()
    requires cpdispatch::detail::transport_has_barrier<Inner>
  {
    if (const Fault* f = next(TransportCall::barrier)) strike(*f, -1);
    inner_.barrier();
  }

  void broadcast(void* buf, std::size_t bytes, int root)
    requires cpdispatch::detail::transport_has_broadcast<Inner>
  {
    const Fault* f = next(TransportCall::broadcast);
    if (!f) return inner_.broadcast(buf, bytes, root);
    if (rank() != root || bytes == 0 || world_size() == 1) {
      // Only the root's bytes travel; elsewhere short/corrupt mean "promise fewer bytes" / nothing.
      if (*f == Fault::short_delivery && bytes) {
        note(-1, cpdispatch::detail::concat("expects ", bytes - std::min(options_.short_bytes, bytes), " of ", bytes, " bytes"));
        return inner_.broadcast(buf, bytes - std::min(options_.short_bytes, bytes), root);
      }
      strike(*f, -1);
      return inner_.broadcast(buf, bytes, root);
    }
    if (*f == Fault::short_delivery) {
      note(-1, cpdispatch::detail::concat("broadcast ", bytes - std::min(options_.short_bytes, bytes), " of ", bytes, " bytes"));
      return inner_.broadcast(buf, bytes - std::min(options_.short_bytes, bytes), root);
    }
    if (*f == Fault::corrupt) {
      // The root's buffer is its input: corrupt a copy and broadcast that.
      const void* copy = corrupted(buf, bytes, 0, -1);
      inner_.broadcast(const_cast<void*>(copy), bytes, root);
      return;
    }
    strike(*f, -1);
    inner_.broadcast(buf, bytes, root);
  }

  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op)
    requires cpdispatch::detail::transport_has_all_reduce<Inner>
  {
    const Fault* f = next(TransportCall::all_reduce);
    if (!f) return inner_.all_reduce(buf, count, type, op);
    if (typed_fault(*f, count)) {
      if (*f == Fault::short_delivery) return inner_.all_reduce(buf, count - 1, type, op);
      // In place: the result overwrites the buffer, so flipping its first byte is what a corrupt contribution looks like.
      static_cast<std::byte*>(buf)[0] ^= std::byte{0xFF};
      note(-1, "flipped byte 0 of this rank's contribution");
      return inner_.all_reduce(buf, count, type, op);
    }
    inner_.all_reduce(buf, count, type, op);
  }

  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type)
    requires cpdispatch::detail::transport_has_all_gather<Inner>
  {
    const Fault* f = next(TransportCall::all_gather);
    if (!f) return inner_.all_gather(send, recv, count_per_rank, type);
    if (typed_fault(*f, count_per_rank)) {
      if (*f == Fault::short_delivery) return inner_.all_gather(send, recv, count_per_rank - 1, type);
      return inner_.all_gather(corrupted(send, count_per_rank * element_size(type), 0, -1), recv, count_per_rank, type);
    }
    inner_.all_gather(send, recv, count_per_rank, type);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op)
    requires cpdispatch::detail::transport_has_reduce_scatter<Inner>
  {
    const Fault* f = next(TransportCall::reduce_scatter);
    if (!f) return inner_.reduce_scatter(send, recv, count_per_rank, type, op);
    if (typed_fault(*f, count_per_rank)) {
      if (*f == Fault::short_delivery) return inner_.reduce_scatter(send, recv, count_per_rank - 1, type, op);
      const std::size_t bytes = count_per_rank * element_size(type) * static_cast<std::size_t>(world_size());
      return inner_.reduce_scatter(corrupted(send, bytes, 0, -1), recv, count_per_rank, type, op);
    }
    inner_.reduce_scatter(send, recv, count_per_rank, type, op);
  }

 private:
  /// Counts the call; returns the fault of the first rule matching it, if any.
  const Fault* next(TransportCall call) {
    const std::uint64_t n = ++counts_[static_cast<std::size_t>(call)];
    current_ = {rank(), call, n, Fault::error, -1, {}};
    for (const FaultRule& r : rules_) {
      if (r.call == call && r.nth == n && (r.rank < 0 || r.rank == rank())) {
        current_.fault = r.fault;
        return &r.fault;
      }
    }
    return nullptr;
  }

  void note(int peer, std::string what) {
    current_.peer = peer;
    current_.what = std::move(what);
    records_.push_back(current_);
  }

  std::string title() const {
    return cpdispatch::detail::concat("injected ", fault_name(current_.fault), " in ", call_name(current_.call), " #", current_.nth,
                          " on rank ", rank(), " of ", world_size());
  }

  /// error and stall throw; short_delivery / corrupt with nothing to alter are recorded and forwarded.
  void strike(Fault f, int peer) {
    if (f == Fault::error) {
      note(peer, title());
      throw backend_error(title(), options_.error_code);
    }
    if (f == Fault::stall) {
      std::this_thread::sleep_for(options_.stall);
      note(peer, title() + cpdispatch::detail::concat(": stalled ", options_.stall.count(), " ms"));
      throw timeout_error(current_.what);
    }
    note(peer, "no remote payload");
  }

  /// Typed collectives: error/stall strike; short/corrupt need at least one element. True: caller alters the call.
  bool typed_fault(Fault f, std::size_t count) {
    if (f == Fault::error || f == Fault::stall || count == 0) {
      strike(f, -1);
      return false;
    }
    if (f == Fault::short_delivery) note(-1, cpdispatch::detail::concat("contributed ", count - 1, " of ", count, " elements"));
    return true;
  }

  /// `into` = send[0, extent) with byte `at` flipped.
  void flip_copy(std::vector<std::byte>& into, const void* send, std::size_t extent, std::size_t at, int peer) {
    into.assign(static_cast<const std::byte*>(send), static_cast<const std::byte*>(send) + extent);
    if (at < extent) into[at] ^= std::byte{0xFF};
    note(peer, cpdispatch::detail::concat("flipped byte ", at, " of the send buffer", peer >= 0 ? cpdispatch::detail::concat(" (for rank ", peer, ")") : ""));
  }

  /// A copy of send[0, extent) with byte `at` flipped; valid until the next corrupted call.
  const void* corrupted(const void* send, std::size_t extent, std::size_t at, int peer) {
    flip_copy(scratch_, send, extent, at, peer);
    return scratch_.data();
  }

  /// send_counts with `peer`'s count cut by short_bytes; valid until the next shortened call.
  std::span<const std::size_t> shortened(std::span<const std::size_t> send_counts, int peer) {
    const auto p = static_cast<std::size_t>(peer);
    counts_copy_.assign(send_counts.begin(), send_counts.end());
    counts_copy_[p] -= std::min(options_.short_bytes, counts_copy_[p]);
    note(peer, cpdispatch::detail::concat("sent ", counts_copy_[p], " of ", send_counts[p], " bytes to rank ", peer));
    return counts_copy_;
  }

  /// The end of an all-to-all's furthest send segment.
  static std::size_t send_extent(std::span<const std::size_t> counts, std::span<const std::size_t> displs) {
    std::size_t extent = 0;
    for (std::size_t p = 0; p < counts.size(); ++p) extent = std::max(extent, displs[p] + counts[p]);
    return extent;
  }

  /// The first peer other than this rank with bytes to receive, or -1.
  int remote_peer(std::span<const std::size_t> send_counts) const {
    for (std::size_t p = 0; p < send_counts.size(); ++p)
      if (static_cast<int>(p) != rank() && send_counts[p]) return static_cast<int>(p);
    return -1;
  }

  Inner& inner_;
  std::vector<FaultRule> rules_;
  FaultOptions options_;
  std::array<std::uint64_t, transport_call_kinds> counts_{};
  FaultRecord current_;
  std::vector<FaultRecord> records_;
  std::vector<std::size_t> counts_copy_;
  std::vector<BytePiece> pieces_copy_;
  std::vector<std::byte> scratch_;
  std::map<std::uint64_t, std::vector<std::byte>> pending_copies_;  // corrupted isend payloads, until their wait()
  std::map<std::uint64_t, std::uint64_t> copy_of_request_;
  std::uint64_t next_copy_id_ = 0;
};

}  // namespace cpdispatch::testing
