#pragma once
// The transport concepts: what the layers of cpdispatch need from a
// communication backend, split by kind of communication so that each consumer
// asks only for what it uses.
//
//   TransportBase            memory_space, rank(), world_size()
//   AllToAllTransport        + all_to_all_v                 (the Dispatcher)
//     PieceTransport         + all_to_all_pieces            (optional; spares the dispatcher its staging)
//     PostedAllToAllTransport + post_all_to_all_v, wait      (optional; lets compute run while an exchange travels)
//   CollectiveTransport      + barrier, broadcast, all_reduce, all_gather, reduce_scatter
//                                                           (the tensor-parallel layers)
//   PointToPointTransport    + isend, irecv, wait           (with CollectiveTransport: the comm-GEMM overlap)
//   Transport                all of the above but PieceTransport (the sim, MPI and NCCL transports)
//
// Contract (every transport, whatever its backend):
// - A transport is one rank's handle on a communicator of world_size() ranks.
//   It is held by reference (gMock objects are not copyable); the concepts
//   never ask for copies or moves.
// - Buffers belong to the caller and must stay valid until the call returns
//   (blocking calls) or until wait() returns (isend/irecv). Pointers are in
//   the transport's memory_space: host memory for sim and MPI, device memory
//   for NCCL. The dispatcher checks this at compile time through its
//   buffer types.
// - Counts and displacements of all_to_all_v, isend, irecv and broadcast are
//   in BYTES; typed collectives count ELEMENTS of `ElementType`.
// - Collective calls (all_to_all_v, all_to_all_pieces, barrier, broadcast,
//   all_reduce, all_gather, reduce_scatter) must be made by every rank in the
//   same order.
// - Point-to-point (the one contract MPI, NCCL and the sim honour):
//   * the messages rank a sends rank b are matched with rank b's receives
//     from rank a in the order each side posted them (first send with first
//     receive, and so on), separately for each direction; a send and its
//     receive must agree on the size;
//   * tags are labels for diagnostics and take no part in matching (NCCL has
//     none), so both sides must post the messages of a pair in the same order;
//   * a transport may defer the actual transfer until wait(): post every
//     send and receive of one exchange before waiting for any of them, and
//     wait for every request exactly once.
// - Device transports order work on their own stream; a call returns once the
//   work is enqueued, and results are visible to later work on that stream.
// - Failures throw an exception of the cpdispatch::error family
//   (backend_error carries the backend's own code). After a throw, the
//   transport may be unusable, but the caller's objects stay valid.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <type_traits>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/memory_space.hpp"

namespace cpdispatch {

/// Reductions of all_reduce / reduce_scatter.
enum class ReduceOp { sum };

/// Handle of a pending isend/irecv; the transport alone interprets `id`.
struct Request {
  std::uint64_t id = 0;
  friend bool operator==(Request, Request) = default;
};

/// A run of `bytes` bytes at `offset` bytes from the start of a buffer
/// (the optional all_to_all_pieces below).
struct BytePiece {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  friend bool operator==(BytePiece, BytePiece) = default;
};

namespace detail {

// One concept per member, so that a failed check names the missing member.
template <class T>
concept transport_has_memory_space = requires {
  { T::memory_space } -> std::convertible_to<MemorySpace>;
};
template <class T>
concept transport_has_rank = requires(const T& t) {
  { t.rank() } -> std::convertible_to<int>;
  { t.world_size() } -> std::convertible_to<int>;
};
template <class T>
concept transport_has_all_to_all_v = requires(T& t, const void* send, void* recv, std::span<const std::size_t> counts) {
  t.all_to_all_v(send, counts, counts, recv, counts, counts);
};
template <class T>
concept transport_has_all_to_all_pieces = requires(T& t, const void* send, void* recv, std::span<const BytePiece> pieces,
                                                   std::span<const std::size_t> splits) {
  t.all_to_all_pieces(send, pieces, splits, recv, pieces, splits);
};
template <class T>
concept transport_has_isend_irecv = requires(T& t, const void* send, void* recv, std::size_t bytes, int peer, int tag) {
  { t.isend(send, bytes, peer, tag) } -> std::same_as<Request>;
  { t.irecv(recv, bytes, peer, tag) } -> std::same_as<Request>;
};
template <class T>
concept transport_has_wait = requires(T& t, Request r) { t.wait(r); };
template <class T>
concept transport_has_point_to_point = transport_has_isend_irecv<T> && transport_has_wait<T>;
template <class T>
concept transport_has_posted_all_to_all = transport_has_wait<T> && requires(T& t, const void* send, void* recv, std::span<const std::size_t> counts) {
  { t.post_all_to_all_v(send, counts, counts, recv, counts, counts) } -> std::same_as<Request>;
};
template <class T>
concept transport_has_barrier = requires(T& t) { t.barrier(); };
template <class T>
concept transport_has_broadcast = requires(T& t, void* buf, std::size_t bytes, int root) { t.broadcast(buf, bytes, root); };
template <class T>
concept transport_has_all_reduce = requires(T& t, void* buf, std::size_t count, ElementType type) { t.all_reduce(buf, count, type, ReduceOp::sum); };
template <class T>
concept transport_has_all_gather = requires(T& t, const void* send, void* recv, std::size_t count, ElementType type) {
  t.all_gather(send, recv, count, type);
};
template <class T>
concept transport_has_reduce_scatter = requires(T& t, const void* send, void* recv, std::size_t count, ElementType type) {
  t.reduce_scatter(send, recv, count, type, ReduceOp::sum);
};
template <class T>
concept transport_has_collectives = transport_has_all_reduce<T> && transport_has_all_gather<T> && transport_has_reduce_scatter<T>;

}  // namespace detail

/// The base of every transport: where its buffers live and who it is.
///   static constexpr MemorySpace memory_space;   int rank() const;   int world_size() const;
template <class T>
concept TransportBase = detail::transport_has_memory_space<T> && detail::transport_has_rank<T>;

/// An all-to-all of bytes, the one call the Dispatcher makes:
///   void all_to_all_v(const void* send, span<const size_t> send_counts, span<const size_t> send_displs,
///                     void* recv, span<const size_t> recv_counts, span<const size_t> recv_displs);   // bytes
template <class T>
concept AllToAllTransport = TransportBase<T> && detail::transport_has_all_to_all_v<T>;

/// Refinement of AllToAllTransport: an all-to-all of scattered pieces, which spares the
/// dispatcher its pack into (and unpack from) staging:
///   void all_to_all_pieces(const void* send, span<const BytePiece> send_pieces, span<const size_t> send_splits,
///                          void* recv, span<const BytePiece> recv_pieces, span<const size_t> recv_splits);
/// `splits` have world_size()+1 entries: peer p's pieces are [splits[p], splits[p+1]). The bytes one rank sends
/// another are the concatenation of the sender's pieces for that peer, laid over the receiver's pieces for the
/// sender in order (boundaries need not line up; the totals must agree). A collective, like all_to_all_v. The
/// dispatcher calls it instead of all_to_all_v when the transport has it (the sim transport does).
template <class T>
concept PieceTransport = AllToAllTransport<T> && detail::transport_has_all_to_all_pieces<T>;

/// Refinement of AllToAllTransport: an all-to-all posted now and completed by a later wait, so that the caller
/// computes while it travels (ContextParallelAttention's stages):
///   Request post_all_to_all_v(const void* send, span<const size_t> send_counts, span<const size_t> send_displs,
///                             void* recv, span<const size_t> recv_counts, span<const size_t> recv_displs);   // bytes
///   void wait(Request);
/// Contract:
/// - Posting is a collective: every rank posts the same exchanges in the same order, in one sequence with its
///   blocking collectives. Several exchanges may be posted before the first wait; each is waited for exactly once,
///   in any order.
/// - The send buffer must not change and the receive buffer must not be read until wait() returns; the count and
///   displacement spans need only live during the post (the transport keeps what it needs).
/// - A transport may move the bytes at the post (the sim: every rank meets there), in the background, or at the
///   wait; the received bytes are in place when wait() returns. Errors surface at the post or at the wait.
/// A transport with only all_to_all_v still serves every consumer: they call it where they would post (no overlap).
/// `posted_all_to_all_v<T>` says which a consumer got.
template <class T>
concept PostedAllToAllTransport = AllToAllTransport<T> && detail::transport_has_posted_all_to_all<T>;

/// Whether consumers of T overlap exchanges with compute (T posts) or exchange in one blocking call.
template <class T>
inline constexpr bool posted_all_to_all_v = PostedAllToAllTransport<T>;

/// Typed collectives, used by the tensor-parallel layers:
///   void barrier();
///   void broadcast(void* buf, size_t bytes, int root);
///   void all_reduce(void* buf, size_t count, ElementType, ReduceOp);                        // in place
///   void all_gather(const void* send, void* recv, size_t count_per_rank, ElementType);
///   void reduce_scatter(const void* send, void* recv, size_t count_per_rank, ElementType, ReduceOp);
template <class T>
concept CollectiveTransport = TransportBase<T> && detail::transport_has_barrier<T> && detail::transport_has_broadcast<T> &&
                              detail::transport_has_collectives<T>;

/// Point-to-point messages (see the contract at the top of this header):
///   Request isend(const void* buf, size_t bytes, int peer, int tag);
///   Request irecv(void* buf, size_t bytes, int peer, int tag);
///   void wait(Request);
template <class T>
concept PointToPointTransport = TransportBase<T> && detail::transport_has_point_to_point<T>;

/// A transport that serves every layer: all-to-all, collectives and point-to-point.
template <class T>
concept Transport = AllToAllTransport<T> && CollectiveTransport<T> && PointToPointTransport<T>;

/// The point-to-point requests one step has posted and not yet waited for
/// (at most N). wait() retires one. Left by an exception, the destructor
/// still waits for the others, ignoring their errors, because the contract
/// lets a backend move bytes until wait() returns: without it a transfer
/// could still read from, or write into, a buffer the caller frees while the
/// exception unwinds. A peer that failed too releases such a wait the way
/// the backend releases any wait on a failed peer (the sim when that rank
/// returns or the world aborts; MPI and NCCL when the job or communicator is
/// aborted).
template <class T, std::size_t N = 2>
class PendingRequests {
 public:
  explicit PendingRequests(T& transport) noexcept : transport_(transport) {}
  PendingRequests(const PendingRequests&) = delete;
  PendingRequests& operator=(const PendingRequests&) = delete;
  ~PendingRequests() {
    for (std::size_t i = 0; i < count_; ++i) {
      try {
        transport_.wait(pending_[i]);
      } catch (...) {  // the step's own exception is the news; this wait only keeps buffers safe
      }
    }
  }

  /// Records a request just posted and hands it back.
  Request add(Request request) noexcept {
    if (count_ == N) std::terminate();  // a step posting more than it declared is a bug of its own, not of the input
    pending_[count_++] = request;
    return request;
  }

  /// Waits for `request` (one added here); it is retired even when the wait throws.
  void wait(Request request) {
    for (std::size_t i = 0; i < count_; ++i) {
      if (pending_[i] == request) {
        pending_[i] = pending_[--count_];
        break;
      }
    }
    transport_.wait(request);
  }

 private:
  T& transport_;
  Request pending_[N]{};
  std::size_t count_ = 0;
};

// Checks a transport type at its point of use: one readable line per missing
// member instead of a template backtrace. Each consumer uses the macro of the
// concept it needs, e.g. `CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);`.
#define CPDISPATCH_CHECK_TRANSPORT_BASE(T)                                                                             \
  static_assert(::cpdispatch::detail::transport_has_memory_space<T>,                                                   \
                "cpdispatch: the transport lacks `static constexpr MemorySpace memory_space`");                        \
  static_assert(::cpdispatch::detail::transport_has_rank<T>,                                                           \
                "cpdispatch: the transport lacks `int rank() const` or `int world_size() const`")

#define CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T)                                                                       \
  CPDISPATCH_CHECK_TRANSPORT_BASE(T);                                                                                  \
  static_assert(::cpdispatch::detail::transport_has_all_to_all_v<T>,                                                   \
                "cpdispatch: the transport lacks `all_to_all_v(send, send_counts, send_displs, recv, recv_counts, "    \
                "recv_displs)`")

#define CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(T)                                                                       \
  CPDISPATCH_CHECK_TRANSPORT_BASE(T);                                                                                  \
  static_assert(::cpdispatch::detail::transport_has_barrier<T>, "cpdispatch: the transport lacks `barrier()`");       \
  static_assert(::cpdispatch::detail::transport_has_broadcast<T>,                                                      \
                "cpdispatch: the transport lacks `broadcast(void* buf, size_t bytes, int root)`");                     \
  static_assert(::cpdispatch::detail::transport_has_collectives<T>,                                                    \
                "cpdispatch: the transport lacks `all_reduce`, `all_gather` or `reduce_scatter` (typed collectives)")

#define CPDISPATCH_CHECK_POINT_TO_POINT_TRANSPORT(T)                                                                   \
  CPDISPATCH_CHECK_TRANSPORT_BASE(T);                                                                                  \
  static_assert(::cpdispatch::detail::transport_has_point_to_point<T>,                                                 \
                "cpdispatch: the transport lacks `Request isend(...)`, `Request irecv(...)` or `wait(Request)`")

/// Every member of every concept (a transport meant to serve all layers).
#define CPDISPATCH_CHECK_TRANSPORT(T)                                                                                  \
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);                                                                            \
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(T);                                                                            \
  CPDISPATCH_CHECK_POINT_TO_POINT_TRANSPORT(T)

}  // namespace cpdispatch
