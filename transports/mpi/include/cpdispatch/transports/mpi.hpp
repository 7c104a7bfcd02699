#pragma once
// MpiTransport: the Transport concept (cpdispatch/transport.hpp) over an MPI
// communicator, host memory. CMake target cpdispatch::mpi.
//
// - By default it works on a private duplicate of the caller's communicator
//   (MPI_Comm_dup, collective over it; freed with the transport): the
//   caller's communicator keeps its error handler and never carries our
//   messages. MpiCommunicator::borrow (MpiTransportOptions::communicator)
//   uses the caller's communicator itself instead: then its error handler is
//   MPI_ERRORS_RETURN while the transport lives (the previous one is restored
//   after) and our messages travel on it with tags MPI_TAG_UB down to
//   MPI_TAG_UB - 65. Every MPI return code is checked: a failure throws
//   mpi_error naming the MPI call, the rank, the operation and MPI's own text
//   (MPI_Error_string); code() is the MPI error code.
// - isend/irecv follow the point-to-point contract of transport.hpp: all of
//   them travel on one tag, so the messages between two ranks match in
//   posting order (MPI's non-overtaking rule); the caller's tags only label
//   error messages.
//   (Datatype and operator constructors report through MPI_COMM_WORLD's
//   handler, as MPI prescribes; they only fail when MPI runs out of memory.)
// - Byte counts are size_t. A message above `max_count` bytes (INT_MAX by
//   default) travels as ONE element of a derived datatype (q blocks of
//   max_count bytes, then the remainder), so point-to-point, broadcast and
//   all-gather keep MPI's matching and truncation rules. Reductions above
//   max_count elements run in chunks of at most max_count elements (they are
//   element-wise, so chunking changes nothing; reduce_scatter's chunks are one
//   MPI_Ireduce per root).
// - all_to_all_v: MPI_Alltoallv while every count and displacement fits an
//   int; otherwise (or with MpiAllToAll::point_to_point) non-blocking
//   point-to-point on the reserved tag MPI_TAG_UB, self traffic as memcpy.
//   benchmarks/RESULTS.md has the measurements behind the default.
// - post_all_to_all_v (PostedAllToAllTransport): the same exchange as grouped
//   MPI_Irecv / MPI_Isend on the reserved tag (receives first, ring order),
//   self traffic copied at the post; wait() completes the group (with the
//   timeout, as a collective: a failure or a timeout abandons what is still
//   pending and breaks the transport). Posted exchanges and the
//   point-to-point all_to_all_v share the tag, so they match in posting order.
// - bfloat16 / float16 reductions: user-defined commutative MPI_Ops that sum
//   in fp32 (rounding to nearest even after each addition) over a 2-byte
//   contiguous datatype; created with the transport and freed with it.
// - Timeouts (MpiTransportOptions::timeout, 0 = none): a call that has not
//   completed in time throws timeout_error ("All-reduce timeout on rank 3 in
//   all_reduce(4 float32 elements): not complete after 200 ms ...").
//   Collectives then run as their non-blocking forms plus an MPI_Test loop;
//   without a timeout they are the blocking calls. A collective abandoned at
//   a timeout (or an error) stays pending in MPI (MPI cannot cancel
//   collectives) and may still read and write its buffers, the transport's
//   own count arrays included: the transport is then broken, and every later
//   call throws timeout_error (or backend_error) saying so; make a new one. A
//   timed-out wait() leaves its request pending, so it can be waited on
//   again (the transport stays usable).
// - Agreement (MpiTransportOptions::agree, on by default): after each
//   all-to-all (all_to_all_v, or a posted one's wait) every rank sends every
//   other rank its outcome (256 bytes on a tag of their own, MPI_TAG_UB - 2
//   down to MPI_TAG_UB - 65) and waits for theirs under the exchange's own
//   deadline (plus a quarter of the timeout, so that peers that timed out
//   because of a silent rank report so and are not taken for it). A rank
//   that failed, or said nothing by then (stalled, failed before reaching
//   MPI, or dead), is named in the error that every
//   rank throws ("All-to-all agreement on rank 1 in all_to_all_v(...):
//   exchange #4 completed here but rank(s) 3 reported no outcome in time
//   ..."): timeout_error when a rank
//   was silent, backend_error with the failing rank's code otherwise; the
//   transport is then broken. Even a rank that exchanged no bytes with the
//   faulty one learns of it. With agreement, every rank must wait for its
//   posted all-to-alls in the same order (any order, as long as it is the
//   same everywhere: the agreements are collectives, matched by the
//   exchange's number).
// - Every rank must use the same max_count, all_to_all, agree and timeout-or-not:
//   they choose the MPI calls, and a non-blocking collective does not match
//   a blocking one. (The timeout's length may differ between ranks.)
// - Not thread-safe: one thread at a time per transport (MPI_THREAD_SINGLE
//   suffices when only the main thread uses MPI). Movable, not copyable; a
//   moved-from transport may only be destroyed or assigned to.

#include "cpdispatch/transports/detail/mpi_c_api.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/transport.hpp"
#include "cpdispatch/transports/detail/mpi_agreement.hpp"

namespace cpdispatch {

/// An MPI call failed; code() is the MPI error code (MPI_Error_class maps it
/// to MPI_ERR_RANK, MPI_ERR_ROOT, ...), what() names the call and the rank.
class mpi_error : public backend_error {
 public:
  using backend_error::backend_error;
};

/// Which communicator a transport uses (see the header comment).
enum class MpiCommunicator {
  duplicate,  ///< a private MPI_Comm_dup of the caller's (the default)
  borrow,     ///< the caller's own; its error handler is MPI_ERRORS_RETURN while the transport lives
};

/// How all_to_all_v moves data while every count and displacement fits an int.
enum class MpiAllToAll {
  alltoallv,       ///< one MPI_Alltoallv (MPI_Ialltoallv with a timeout)
  point_to_point,  ///< MPI_Irecv/MPI_Isend per peer with a non-zero count, self by memcpy
};

struct MpiTransportOptions {
  /// The largest count handed to MPI in one int argument: bigger messages
  /// use a derived datatype, bigger reductions run in chunks. INT_MAX unless
  /// a test wants the large-count path with small buffers. The same on every rank.
  std::size_t max_count = INT_MAX;
  MpiAllToAll all_to_all = MpiAllToAll::alltoallv;
  /// 0: wait forever. Otherwise a call not complete after this long throws
  /// timeout_error (see the header comment).
  std::chrono::milliseconds timeout{0};
  MpiCommunicator communicator = MpiCommunicator::duplicate;
  /// After each all-to-all (all_to_all_v, or a posted one's wait) the ranks
  /// tell each other its outcome, so that a failure on any rank, or a rank
  /// that reaches no outcome within the timeout, is an error naming that
  /// rank on every rank (see the header comment). The same on every rank.
  bool agree = true;
};

namespace detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return concat("unknown MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws mpi_error when an MPI call failed. `where()` says where in our
/// terms ("on rank 1 in broadcast(...)"); it runs only on failure.
template <class Where>
void mpi_check(int rc, const char* call, const Where& where) {
  if (rc == MPI_SUCCESS) [[likely]] return;
  throw mpi_error(concat(call, " failed ", where(), ": ", mpi_error_string(rc)), rc);
}

/// An owned MPI datatype handle, freed on destruction. Freeing while an
/// operation that uses the type is pending is fine: MPI keeps it until then.
class MpiOwnedType {
 public:
  MpiOwnedType() = default;
  MpiOwnedType(MpiOwnedType&& other) noexcept : type_(std::exchange(other.type_, MPI_DATATYPE_NULL)) {}
  MpiOwnedType& operator=(MpiOwnedType&& other) noexcept {
    if (this != &other) {
      reset();
      type_ = std::exchange(other.type_, MPI_DATATYPE_NULL);
    }
    return *this;
  }
  MpiOwnedType(const MpiOwnedType&) = delete;
  MpiOwnedType& operator=(const MpiOwnedType&) = delete;
  ~MpiOwnedType() { reset(); }

  MPI_Datatype get() const noexcept { return type_; }
  MPI_Datatype* handle() noexcept { return &type_; }
  /// For MPI's output argument: frees what was held first.
  MPI_Datatype* out() noexcept {
    reset();
    return &type_;
  }
  void reset() noexcept {
    int finalized = 0;
    if (type_ != MPI_DATATYPE_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Type_free(&type_);
    type_ = MPI_DATATYPE_NULL;
  }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

/// `bytes` in the (count, datatype) form MPI takes.
struct MpiMessage {
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  MpiOwnedType derived;  ///< set when `type` is a derived datatype
};

/// MPI_BYTE x bytes when bytes <= max_count; otherwise one element of a
/// committed derived type: q = bytes / max_count contiguous blocks of
/// max_count bytes, then r = bytes % max_count bytes, lower bound 0 and
/// extent exactly `bytes` (so element i of an all-gather lands at i * bytes).
inline MpiMessage mpi_message(std::size_t bytes, std::size_t max_count) {
  MpiMessage m;
  if (bytes <= max_count) {
    m.count = static_cast<int>(bytes);
    return m;
  }
  const std::size_t q = bytes / max_count, r = bytes % max_count;
  if (q > static_cast<std::size_t>(INT_MAX)) {
    fail("MpiTransport: a message of ", bytes, " bytes needs ", q, " blocks of max_count = ", max_count,
         " bytes, more than an int counts");
  }
  auto where = [&] { return concat("building the datatype of a ", bytes, "-byte message"); };
  MpiOwnedType block, blocks, tail, whole;
  mpi_check(MPI_Type_contiguous(static_cast<int>(max_count), MPI_BYTE, block.out()), "MPI_Type_contiguous", where);
  mpi_check(MPI_Type_contiguous(static_cast<int>(q), block.get(), blocks.out()), "MPI_Type_contiguous", where);
  if (r == 0) {
    whole = std::move(blocks);
  } else {
    mpi_check(MPI_Type_contiguous(static_cast<int>(r), MPI_BYTE, tail.out()), "MPI_Type_contiguous", where);
    int lengths[2] = {1, 1};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(q * max_count)};
    MPI_Datatype types[2] = {blocks.get(), tail.get()};
    mpi_check(MPI_Type_create_struct(2, lengths, displacements, types, whole.out()), "MPI_Type_create_struct", where);
  }
  mpi_check(MPI_Type_create_resized(whole.get(), 0, static_cast<MPI_Aint>(bytes), m.derived.out()), "MPI_Type_create_resized",
            where);
  mpi_check(MPI_Type_commit(m.derived.handle()), "MPI_Type_commit", where);
  m.count = 1;
  m.type = m.derived.get();
  return m;
}

/// MPI_User_function summing 16-bit floats (bfloat16 or float16) in fp32.
template <class Half>
void mpi_sum_half(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const unsigned char*>(in);
  auto* b = static_cast<unsigned char*>(inout);
  const auto n = static_cast<std::size_t>(*len);
  for (std::size_t i = 0; i < n; ++i) {
    Half x, y;
    std::memcpy(&x.bits, a + 2 * i, 2);
    std::memcpy(&y.bits, b + 2 * i, 2);
    const Half sum(static_cast<float>(x) + static_cast<float>(y));
    std::memcpy(b + 2 * i, &sum.bits, 2);
  }
}

/// The MPI objects a transport owns, released exactly once (movable only).
struct MpiTransportHandles {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owns_comm = false;
  MPI_Errhandler saved_errhandler = MPI_ERRHANDLER_NULL;  ///< of a borrowed communicator
  MPI_Datatype half = MPI_DATATYPE_NULL;                  ///< 2 contiguous bytes
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op fp16_sum = MPI_OP_NULL;
  std::vector<MPI_Request> pending;    ///< isend/irecv slots; MPI_REQUEST_NULL = free
  std::vector<MPI_Request> abandoned;  ///< given up at a timeout or an error
  std::unique_ptr<MpiAgreementBuffers> agreement;  ///< freed after the requests that may use it

  MpiTransportHandles() = default;
  MpiTransportHandles(MpiTransportHandles&& other) noexcept { take(other); }
  MpiTransportHandles& operator=(MpiTransportHandles&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  MpiTransportHandles(const MpiTransportHandles&) = delete;
  MpiTransportHandles& operator=(const MpiTransportHandles&) = delete;
  ~MpiTransportHandles() { release(); }

  void take(MpiTransportHandles& other) noexcept {
    comm = std::exchange(other.comm, MPI_COMM_NULL);
    owns_comm = std::exchange(other.owns_comm, false);
    saved_errhandler = std::exchange(other.saved_errhandler, MPI_ERRHANDLER_NULL);
    half = std::exchange(other.half, MPI_DATATYPE_NULL);
    bf16_sum = std::exchange(other.bf16_sum, MPI_OP_NULL);
    fp16_sum = std::exchange(other.fp16_sum, MPI_OP_NULL);
    pending = std::move(other.pending);
    abandoned = std::move(other.abandoned);
    agreement = std::move(other.agreement);
    other.pending.clear();
    other.abandoned.clear();
  }

  void release() noexcept {
    int finalized = 1;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) {
      // Requests nobody waited for: point-to-point ones are cancelled, then
      // freed (a receive left posted by a call that failed must not write
      // into a buffer its owner has freed since); an abandoned collective
      // cannot be, so it is tested once and leaked if still pending.
      for (MPI_Request& r : pending) {
        if (r == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
      for (MPI_Request& r : abandoned) {
        int done = 0;
        if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      }
      if (bf16_sum != MPI_OP_NULL) MPI_Op_free(&bf16_sum);
      if (fp16_sum != MPI_OP_NULL) MPI_Op_free(&fp16_sum);
      if (half != MPI_DATATYPE_NULL) MPI_Type_free(&half);
      if (comm != MPI_COMM_NULL) {
        if (owns_comm) {
          MPI_Comm_free(&comm);
        } else if (saved_errhandler != MPI_ERRHANDLER_NULL) {
          MPI_Comm_set_errhandler(comm, saved_errhandler);
        }
      }
      if (saved_errhandler != MPI_ERRHANDLER_NULL) MPI_Errhandler_free(&saved_errhandler);
    }
    comm = MPI_COMM_NULL;
    owns_comm = false;
    saved_errhandler = MPI_ERRHANDLER_NULL;
    half = MPI_DATATYPE_NULL;
    bf16_sum = fp16_sum = MPI_OP_NULL;
    pending.clear();
    abandoned.clear();
    agreement.reset();
  }
};

}  // namespace detail

/// One rank's handle on an MPI communicator (see the header comment).
class MpiTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;

  /// A transport on a private duplicate of `comm` (collective over `comm`),
  /// freed with the transport: its traffic cannot meet anybody else's. With
  /// options.communicator == MpiCommunicator::borrow, on `comm` itself (not
  /// owned; it must outlive the transport).
  explicit MpiTransport(MPI_Comm comm, MpiTransportOptions options = {}) {
    check_mpi_usable(comm);
    check_options(options);
    if (options.communicator == MpiCommunicator::borrow) {
      init(comm, false, options);
      return;
    }
    detail::mpi_check(MPI_Comm_dup(comm, &h_.comm), "MPI_Comm_dup", [] { return std::string("in the MpiTransport constructor"); });
    h_.owns_comm = true;  // freed by h_ even if init() throws
    init(h_.comm, true, options);
  }

  /// The same as the constructor with MpiCommunicator::duplicate.
  static MpiTransport duplicate(MPI_Comm comm, MpiTransportOptions options = {}) {
    options.communicator = MpiCommunicator::duplicate;
    return MpiTransport(comm, options);
  }

  MpiTransport(MpiTransport&&) noexcept = default;
  MpiTransport& operator=(MpiTransport&&) noexcept = default;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  ~MpiTransport() = default;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return size_; }
  MPI_Comm comm() const noexcept { return h_.comm; }
  const MpiTransportOptions& options() const noexcept { return options_; }
  /// Whether an abandoned operation broke the transport (see the header comment).
  bool broken() const noexcept { return !broken_.empty(); }

  /// 0 turns the timeout off.
  void set_timeout(std::chrono::milliseconds timeout) {
    if (timeout.count() < 0) detail::fail("MpiTransport::set_timeout: ", timeout.count(), " ms is negative");
    options_.timeout = timeout;
  }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    check_usable("all_to_all_v");
    check_per_rank(send_counts, "send_counts");
    check_per_rank(send_displs, "send_displs");
    check_per_rank(recv_counts, "recv_counts");
    check_per_rank(recv_displs, "recv_displs");
    auto where = [&] {
      std::size_t out = 0, in = 0;
      for (std::size_t i = 0; i < send_counts.size(); ++i) out += send_counts[i];
      for (std::size_t i = 0; i < recv_counts.size(); ++i) in += recv_counts[i];
      return describe("all_to_all_v(", out, " bytes out, ", in, " bytes in)");
    };
    const auto fits = [&](std::span<const std::size_t> v) {
      return std::all_of(v.begin(), v.end(), [&](std::size_t x) { return x <= options_.max_count; });
    };
    const std::uint64_t exchange = exchange_count_++;
    if (options_.all_to_all == MpiAllToAll::point_to_point || !fits(send_counts) || !fits(send_displs) ||
        !fits(recv_counts) || !fits(recv_displs)) {
      agreed(exchange, where, [&] {
        all_to_all_v_point_to_point(static_cast<const std::byte*>(send), send_counts, send_displs,
                                    static_cast<std::byte*>(recv), recv_counts, recv_displs, where);
      });
      return;
    }
    const auto W = static_cast<std::size_t>(size_);
    int* sc = ints_.data();
    int* sd = sc + W;
    int* rc = sd + W;
    int* rd = rc + W;
    for (std::size_t i = 0; i < W; ++i) {
      sc[i] = static_cast<int>(send_counts[i]);
      sd[i] = static_cast<int>(send_displs[i]);
      rc[i] = static_cast<int>(recv_counts[i]);
      rd[i] = static_cast<int>(recv_displs[i]);
    }
    agreed(exchange, where, [&] {
      collective(
          "All-to-all", "MPI_Alltoallv", "MPI_Ialltoallv",
          [&] { return MPI_Alltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, h_.comm); },
          [&](MPI_Request* r) { return MPI_Ialltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, h_.comm, r); }, where);
    });
  }

  Request isend(const void* buf, std::size_t bytes, int peer, int tag) {
    check_usable("isend");
    auto where = [&] { return describe("isend(", bytes, " bytes to peer ", peer, ", tag ", tag, ")"); };
    const detail::MpiMessage m = detail::mpi_message(bytes, options_.max_count);
    const std::size_t slot = acquire_slot();
    const int rc = MPI_Isend(buf, m.count, m.type, peer, point_to_point_tag(), h_.comm, &h_.pending[slot]);
    if (rc != MPI_SUCCESS) release_slot(slot);
    detail::mpi_check(rc, "MPI_Isend", where);
    return request_of(slot);
  }

  Request irecv(void* buf, std::size_t bytes, int peer, int tag) {
    check_usable("irecv");
    auto where = [&] { return describe("irecv(", bytes, " bytes from peer ", peer, ", tag ", tag, ")"); };
    const detail::MpiMessage m = detail::mpi_message(bytes, options_.max_count);
    const std::size_t slot = acquire_slot();
    const int rc = MPI_Irecv(buf, m.count, m.type, peer, point_to_point_tag(), h_.comm, &h_.pending[slot]);
    if (rc != MPI_SUCCESS) release_slot(slot);
    detail::mpi_check(rc, "MPI_Irecv", where);
    return request_of(slot);
  }

  /// Posts an all-to-all (see the header comment); wait() completes it.
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    check_usable("post_all_to_all_v");
    check_per_rank(send_counts, "send_counts");
    check_per_rank(send_displs, "send_displs");
    check_per_rank(recv_counts, "recv_counts");
    check_per_rank(recv_displs, "recv_displs");
    const auto me = static_cast<std::size_t>(rank_), W = static_cast<std::size_t>(size_);
    if (send_counts[me] != recv_counts[me]) {
      detail::fail("post_all_to_all_v: rank ", me, " sends ", send_counts[me], " bytes to itself but expects ", recv_counts[me]);
    }
    auto where = [&] { return describe("post_all_to_all_v"); };
    const std::size_t x = acquire_exchange();
    exchanges_[x].number = exchange_count_++;
    std::vector<std::size_t>& slots = exchanges_[x].slots;
    const auto post = [&](bool is_send, std::size_t peer, std::size_t bytes, std::byte* at) {
      const detail::MpiMessage m = detail::mpi_message(bytes, options_.max_count);
      slots.push_back(acquire_slot());
      MPI_Request* r = &h_.pending[slots.back()];
      const int p = static_cast<int>(peer);
      detail::mpi_check(is_send ? MPI_Isend(at, m.count, m.type, p, reserved_tag_, h_.comm, r) : MPI_Irecv(at, m.count, m.type, p, reserved_tag_, h_.comm, r),
                        is_send ? "MPI_Isend" : "MPI_Irecv", where);
    };
    try {
      for (std::size_t i = 1; i < W; ++i) {
        const std::size_t src = (me + W - i) % W;
        if (recv_counts[src] != 0) post(false, src, recv_counts[src], static_cast<std::byte*>(recv) + recv_displs[src]);
      }
      for (std::size_t i = 1; i < W; ++i) {
        const std::size_t dst = (me + i) % W;
        const auto* from = static_cast<const std::byte*>(send) + send_displs[dst];
        if (send_counts[dst] != 0) post(true, dst, send_counts[dst], const_cast<std::byte*>(from));  // MPI_Isend reads it only
      }
    } catch (...) {
      finish_exchange(x, true);
      throw;
    }
    if (send_counts[me] != 0) std::memcpy(static_cast<std::byte*>(recv) + recv_displs[me], static_cast<const std::byte*>(send) + send_displs[me], send_counts[me]);
    return Request{posted_bit | (static_cast<std::uint64_t>(exchanges_[x].generation) << 32) | (static_cast<std::uint64_t>(x) + 1)};
  }

  /// Completes an isend/irecv. An error (e.g. MPI_ERR_TRUNCATE when the
  /// message was longer than the receive) consumes the request; a timeout
  /// leaves it pending. A posted all-to-all: see post_all_to_all_v.
  void wait(Request request) {
    check_usable("wait");
    if (request.id & posted_bit) return wait_exchange(request);
    const std::size_t slot = slot_of(request);
    auto where = [&] { return describe("wait(Request{", request.id, "})"); };
    try {
      complete(std::span<MPI_Request>(&h_.pending[slot], 1), "Wait", where);
    } catch (const timeout_error&) {
      throw;
    } catch (...) {
      release_slot(slot);
      throw;
    }
    release_slot(slot);
  }

  void barrier() {
    check_usable("barrier");
    auto where = [&] { return describe("barrier()"); };
    collective(
        "Barrier", "MPI_Barrier", "MPI_Ibarrier", [&] { return MPI_Barrier(h_.comm); },
        [&](MPI_Request* r) { return MPI_Ibarrier(h_.comm, r); }, where);
  }

  void broadcast(void* buf, std::size_t bytes, int root) {
    check_usable("broadcast");
    auto where = [&] { return describe("broadcast(", bytes, " bytes, root ", root, ")"); };
    const detail::MpiMessage m = detail::mpi_message(bytes, options_.max_count);
    collective(
        "Broadcast", "MPI_Bcast", "MPI_Ibcast", [&] { return MPI_Bcast(buf, m.count, m.type, root, h_.comm); },
        [&](MPI_Request* r) { return MPI_Ibcast(buf, m.count, m.type, root, h_.comm, r); }, where);
  }

  /// In place: `buf` holds `count` elements, every rank's sum afterwards.
  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op) {
    check_usable("all_reduce");
    auto where = [&] { return describe("all_reduce(", count, " ", element_name(type), " elements)"); };
    const Reduction red = reduction(type, op);  // not a structured binding: clang 14 cannot capture those
    const std::size_t es = element_size(type);
    detail::checked_bytes(count, es, 1, "all_reduce");
    auto* p = static_cast<std::byte*>(buf);
    std::size_t done = 0;
    do {  // chunks of at most max_count elements (one chunk normally)
      const std::size_t n = std::min(options_.max_count, count - done);
      void* at = p + done * es;
      collective(
          "All-reduce", "MPI_Allreduce", "MPI_Iallreduce",
          [&] { return MPI_Allreduce(MPI_IN_PLACE, at, static_cast<int>(n), red.type, red.op, h_.comm); },
          [&](MPI_Request* r) {
            return MPI_Iallreduce(MPI_IN_PLACE, at, static_cast<int>(n), red.type, red.op, h_.comm, r);
          },
          where);
      done += n;
    } while (done < count);
  }

  /// recv holds world_size() blocks of count_per_rank elements, rank i's at
  /// block i. send == recv + rank() * block is MPI_IN_PLACE.
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
    check_usable("all_gather");
    auto where = [&] { return describe("all_gather(", count_per_rank, " ", element_name(type), " elements per rank)"); };
    const std::size_t bytes = detail::checked_bytes(count_per_rank, element_size(type), static_cast<std::size_t>(size_), "all_gather") /
                              static_cast<std::size_t>(size_);
    const void* source = send == static_cast<const std::byte*>(recv) + static_cast<std::size_t>(rank_) * bytes ? MPI_IN_PLACE : send;
    const detail::MpiMessage m = detail::mpi_message(bytes, options_.max_count);
    collective(
        "All-gather", "MPI_Allgather", "MPI_Iallgather",
        [&] { return MPI_Allgather(source, m.count, m.type, recv, m.count, m.type, h_.comm); },
        [&](MPI_Request* r) { return MPI_Iallgather(source, m.count, m.type, recv, m.count, m.type, h_.comm, r); }, where);
  }

  /// send holds world_size() blocks of count_per_rank elements; recv gets the
  /// sum over ranks of block rank().
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op) {
    check_usable("reduce_scatter");
    auto where = [&] {
      return describe("reduce_scatter(", count_per_rank, " ", element_name(type), " elements per rank)");
    };
    const Reduction red = reduction(type, op);  // not a structured binding: clang 14 cannot capture those
    const std::size_t es = element_size(type);
    detail::checked_bytes(count_per_rank, es, static_cast<std::size_t>(size_), "reduce_scatter");
    if (count_per_rank <= options_.max_count) {
      const int n = static_cast<int>(count_per_rank);
      collective(
          "Reduce-scatter", "MPI_Reduce_scatter_block", "MPI_Ireduce_scatter_block",
          [&] { return MPI_Reduce_scatter_block(send, recv, n, red.type, red.op, h_.comm); },
          [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(send, recv, n, red.type, red.op, h_.comm, r); }, where);
      return;
    }
    // Above max_count elements per rank: chunk c of every block reduces to
    // its own root, one MPI_Ireduce per root, all W in flight at once.
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const auto W = static_cast<std::size_t>(size_);
    for (std::size_t done = 0; done < count_per_rank;) {
      const std::size_t n = std::min(options_.max_count, count_per_rank - done);
      std::span<MPI_Request> reqs(requests_.data(), W);
      std::size_t posted = 0;
      try {
        for (; posted < W; ++posted) {
          const int root = static_cast<int>(posted);
          detail::mpi_check(MPI_Ireduce(in + (posted * count_per_rank + done) * es, root == rank_ ? out + done * es : nullptr,
                                        static_cast<int>(n), red.type, red.op, root, h_.comm, &reqs[posted]),
                            "MPI_Ireduce", where);
        }
        complete(reqs, "Reduce-scatter", where);
      } catch (...) {
        abandon(reqs.first(posted));
        throw;
      }
      done += n;
    }
  }

 private:
  static void check_mpi_usable(MPI_Comm comm) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized) {
      detail::fail("MpiTransport: MPI is ", finalized ? "already finalized" : "not initialized (call MPI_Init first)");
    }
    if (comm == MPI_COMM_NULL) detail::fail("MpiTransport: the communicator is MPI_COMM_NULL");
  }

  static void check_options(const MpiTransportOptions& options) {
    if (options.max_count == 0 || options.max_count > static_cast<std::size_t>(INT_MAX)) {
      detail::fail("MpiTransport: max_count = ", options.max_count, " is outside [1, INT_MAX]");
    }
    if (options.timeout.count() < 0) detail::fail("MpiTransport: timeout = ", options.timeout.count(), " ms is negative");
  }

  void init(MPI_Comm comm, bool owned, const MpiTransportOptions& options) {
    options_ = options;
    auto where = [] { return std::string("in the MpiTransport constructor"); };
    if (!owned) {
      detail::mpi_check(MPI_Comm_get_errhandler(comm, &h_.saved_errhandler), "MPI_Comm_get_errhandler", where);
      h_.comm = comm;
    }
    detail::mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", where);
    detail::mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank", where);
    detail::mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size", where);
    void* tag_ub = nullptr;
    int has_tag_ub = 0;
    detail::mpi_check(MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &has_tag_ub), "MPI_Comm_get_attr", where);
    reserved_tag_ = has_tag_ub ? *static_cast<int*>(tag_ub) : 32767;  // MPI guarantees at least 32767
    detail::mpi_check(MPI_Type_contiguous(2, MPI_BYTE, &h_.half), "MPI_Type_contiguous", where);
    detail::mpi_check(MPI_Type_commit(&h_.half), "MPI_Type_commit", where);
    detail::mpi_check(MPI_Op_create(&detail::mpi_sum_half<bfloat16>, 1, &h_.bf16_sum), "MPI_Op_create", where);
    detail::mpi_check(MPI_Op_create(&detail::mpi_sum_half<float16>, 1, &h_.fp16_sum), "MPI_Op_create", where);
    const auto W = static_cast<std::size_t>(size_);
    ints_.assign(4 * W, 0);
    requests_.assign(2 * W, MPI_REQUEST_NULL);
    statuses_.resize(2 * W);
    if (options.agree && size_ > 1) {
      h_.agreement = std::make_unique<detail::MpiAgreementBuffers>();
      agreement_.init(comm, rank_, size_, reserved_tag_ - 2, *h_.agreement);
    }
  }

  // ---- the outcome agreement (MpiTransportOptions::agree) ----------------

  /// Runs exchange number `exchange` (`body`) inside its agreement: every
  /// rank's outcome reaches every rank, or the error names who failed.
  template <class Where, class Body>
  void agreed(std::uint64_t exchange, const Where& where, const Body& body) {
    if (!h_.agreement) return body();
    detail::MpiDeadline deadline;
    if (options_.timeout.count() != 0) deadline = std::chrono::steady_clock::now() + options_.timeout;
    agreement_.begin(exchange);
    try {
      body();
    } catch (const timeout_error& e) {
      throw timeout_error(with_others(e, agreement_.finish_failed(e, 0, true, deadline, agreement_grace())));
    } catch (const mpi_error& e) {
      throw mpi_error(with_others(e, agreement_.finish_failed(e, e.code(), false, deadline, agreement_grace())), e.code());
    } catch (const backend_error& e) {
      throw backend_error(with_others(e, agreement_.finish_failed(e, e.code(), false, deadline, agreement_grace())), e.code());
    } catch (const std::exception& e) {
      // A failure of this rank's own (a bad argument) leaves the transport
      // usable when every outcome came: nothing is left for a later agreement.
      agreement_.finish_failed(e, 0, false, deadline, agreement_grace());
      keep_leftover_sends();
      if (!agreement_.all_reported() && broken_.empty()) broken_ = e.what();
      throw;
    }
    try {
      agreement_.finish_completed(deadline, agreement_grace(), where);
    } catch (...) {
      keep_leftover_sends();
      if (broken_.empty()) broken_ = current_reason();
      throw;
    }
    keep_leftover_sends();
  }

  /// How long past its deadline an agreement waits for the outcomes still
  /// missing, so that peers that timed out in the exchange are told apart
  /// from the silent rank that made them time out.
  std::chrono::milliseconds agreement_grace() const noexcept { return options_.timeout / 4; }

  std::string with_others(const std::exception& e, const std::string& others) {
    keep_leftover_sends();
    if (broken_.empty()) broken_ = e.what();
    return others.empty() ? std::string(e.what()) : detail::concat(e.what(), "; meanwhile ", others);
  }

  /// Outcome sends still pending when an agreement ended stay for the destructor.
  void keep_leftover_sends() {
    for (MPI_Request& r : agreement_.leftover_sends()) {
      if (r != MPI_REQUEST_NULL) h_.abandoned.push_back(std::exchange(r, MPI_REQUEST_NULL));
    }
  }

  template <class... Args>
  std::string describe(const Args&... args) const {
    return detail::concat("on rank ", rank_, " in ", args...);
  }

  void check_per_rank(std::span<const std::size_t> v, const char* name) const {
    if (v.size() != static_cast<std::size_t>(size_)) {
      detail::fail("all_to_all_v: ", name, " has ", v.size(), " entries, world_size is ", size_);
    }
  }

  /// Refuses every call once an abandoned operation broke the transport.
  void check_usable(const char* call) const {
    if (broken_.empty()) [[likely]] return;
    throw timeout_error(detail::concat("MpiTransport::", call, " on rank ", rank_, ": the transport is unusable since an earlier ",
                                       "operation was abandoned while MPI may still use its buffers (", broken_,
                                       "); make a new transport"));
  }

  /// The tag of isend/irecv: one for all, so a pair's messages match in posting order.
  int point_to_point_tag() const noexcept { return reserved_tag_ - 1; }

  struct Reduction {
    MPI_Datatype type;
    MPI_Op op;
  };
  Reduction reduction(ElementType type, ReduceOp op) const {
    switch (op) {
      case ReduceOp::sum: break;
      default: detail::fail("MpiTransport: unknown ReduceOp ", static_cast<int>(op));
    }
    switch (type) {
      case ElementType::int8: return {MPI_INT8_T, MPI_SUM};
      case ElementType::uint8: return {MPI_UINT8_T, MPI_SUM};
      case ElementType::int32: return {MPI_INT32_T, MPI_SUM};
      case ElementType::int64: return {MPI_INT64_T, MPI_SUM};
      case ElementType::float32: return {MPI_FLOAT, MPI_SUM};
      case ElementType::float64: return {MPI_DOUBLE, MPI_SUM};
      case ElementType::bfloat16: return {h_.half, h_.bf16_sum};
      case ElementType::float16: return {h_.half, h_.fp16_sum};
    }
    detail::fail("MpiTransport: unknown ElementType ", static_cast<int>(type));
  }

  /// One collective: the blocking call, or with a timeout the non-blocking
  /// one and a deadline (a timed-out request is abandoned).
  template <class Blocking, class Start, class Where>
  void collective(const char* title, const char* blocking_call, const char* start_call, const Blocking& blocking,
                  const Start& start, const Where& where) {
    if (options_.timeout.count() == 0) {
      detail::mpi_check(blocking(), blocking_call, where);
      return;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(start(&request), start_call, where);
    try {
      complete(std::span<MPI_Request>(&request, 1), title, where);
    } catch (...) {
      abandon(std::span<MPI_Request>(&request, 1));
      throw;
    }
  }

  /// Completes every request: MPI_Waitall, or with a timeout an MPI_Testall
  /// loop that throws timeout_error at the deadline (requests left pending).
  template <class Where>
  void complete(std::span<MPI_Request> reqs, const char* title, const Where& where) {
    if (reqs.empty()) return;
    const int n = static_cast<int>(reqs.size());
    const bool one = n == 1;  // MPI_Wait/MPI_Test report a single request's own error code
    if (options_.timeout.count() == 0) {
      if (one) {
        detail::mpi_check(MPI_Wait(reqs.data(), MPI_STATUS_IGNORE), "MPI_Wait", where);
      } else {
        check_statuses(MPI_Waitall(n, reqs.data(), statuses_.data()), "MPI_Waitall", reqs, where);
      }
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      int done = 0;
      if (one) {
        detail::mpi_check(MPI_Test(reqs.data(), &done, MPI_STATUS_IGNORE), "MPI_Test", where);
      } else {
        check_statuses(MPI_Testall(n, reqs.data(), &done, statuses_.data()), "MPI_Testall", reqs, where);
      }
      if (done) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw timeout_error(detail::concat(title, " timeout ", where(), ": not complete after ", options_.timeout.count(),
                                           " ms (MpiTransportOptions::timeout)"));
      }
      std::this_thread::yield();
    }
  }

  /// MPI_ERR_IN_STATUS names no cause: report the first failed request's own code.
  template <class Where>
  void check_statuses(int rc, const char* call, std::span<MPI_Request> reqs, const Where& where) {
    if (rc == MPI_SUCCESS) [[likely]] return;
    if (rc == MPI_ERR_IN_STATUS) {
      for (std::size_t i = 0; i < reqs.size(); ++i) {
        const int e = statuses_[i].MPI_ERROR;
        if (e != MPI_SUCCESS && e != MPI_ERR_PENDING) {
          rc = e;
          break;
        }
      }
    }
    detail::mpi_check(rc, call, where);
  }

  /// Keeps still-pending requests for the destructor (see MpiTransportHandles).
  /// Called while the exception that stopped the operation is in flight:
  /// it becomes the reason the transport is broken.
  void abandon(std::span<MPI_Request> reqs) {
    for (MPI_Request& r : reqs) {
      if (r == MPI_REQUEST_NULL) continue;
      h_.abandoned.push_back(std::exchange(r, MPI_REQUEST_NULL));
      if (broken_.empty()) broken_ = current_reason();
    }
  }

  static std::string current_reason() {
    try {
      throw;
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "an unknown exception";
    }
  }

  template <class Where>
  void all_to_all_v_point_to_point(const std::byte* send, std::span<const std::size_t> send_counts,
                                   std::span<const std::size_t> send_displs, std::byte* recv,
                                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                                   const Where& where) {
    const auto me = static_cast<std::size_t>(rank_);
    const auto W = static_cast<std::size_t>(size_);
    if (send_counts[me] != recv_counts[me]) {
      detail::fail("all_to_all_v: rank ", me, " sends ", send_counts[me], " bytes to itself but expects ", recv_counts[me]);
    }
    std::size_t posted = 0;
    try {
      // Receives first, then sends, both in ring order starting at the
      // nearest peer, so no two ranks target the same peer at once.
      for (std::size_t i = 1; i < W; ++i) {
        const std::size_t src = (me + W - i) % W;
        if (recv_counts[src] == 0) continue;
        const detail::MpiMessage m = detail::mpi_message(recv_counts[src], options_.max_count);
        detail::mpi_check(MPI_Irecv(recv + recv_displs[src], m.count, m.type, static_cast<int>(src), reserved_tag_, h_.comm,
                                    &requests_[posted]),
                          "MPI_Irecv", where);
        ++posted;
      }
      for (std::size_t i = 1; i < W; ++i) {
        const std::size_t dst = (me + i) % W;
        if (send_counts[dst] == 0) continue;
        const detail::MpiMessage m = detail::mpi_message(send_counts[dst], options_.max_count);
        detail::mpi_check(MPI_Isend(send + send_displs[dst], m.count, m.type, static_cast<int>(dst), reserved_tag_, h_.comm,
                                    &requests_[posted]),
                          "MPI_Isend", where);
        ++posted;
      }
      if (send_counts[me] != 0) std::memcpy(recv + recv_displs[me], send + send_displs[me], send_counts[me]);
      complete(std::span<MPI_Request>(requests_.data(), posted), "All-to-all", where);
    } catch (...) {
      abandon(std::span<MPI_Request>(requests_.data(), posted));
      throw;
    }
  }

  // ---- posted all-to-alls: their requests live in isend/irecv slots (so the
  // destructor cancels any nobody waited for); the Request has posted_bit
  // set, the exchange + 1 in the low 32 bits and its generation above.
  struct PostedExchange {
    std::vector<std::size_t> slots;
    std::uint64_t number = 0;  ///< in the sequence of all_to_all_v calls and posts
    std::uint32_t generation = 0;
    bool in_use = false;
  };
  static constexpr std::uint64_t posted_bit = std::uint64_t{1} << 63;

  std::size_t acquire_exchange() {
    std::size_t x = 0;
    while (x < exchanges_.size() && exchanges_[x].in_use) ++x;
    if (x == exchanges_.size()) exchanges_.emplace_back();
    exchanges_[x].in_use = true;
    exchanges_[x].slots.clear();
    return x;
  }

  /// Takes the exchange's requests out of their slots; `abandon_them`: keep the pending ones for the destructor.
  void finish_exchange(std::size_t x, bool abandon_them) {
    PostedExchange& e = exchanges_[x];
    if (abandon_them) {
      for (std::size_t slot : e.slots) abandon(std::span<MPI_Request>(&h_.pending[slot], 1));
    }
    for (std::size_t slot : e.slots) release_slot(slot);
    e.slots.clear();
    e.in_use = false;
    e.generation = (e.generation + 1) & 0x7fffffffu;
  }

  void wait_exchange(Request request) {
    const std::uint64_t low = request.id & 0xffffffffu;
    const std::size_t x = static_cast<std::size_t>(low) - 1;
    if (low == 0 || x >= exchanges_.size() || !exchanges_[x].in_use ||
        exchanges_[x].generation != static_cast<std::uint32_t>((request.id & ~posted_bit) >> 32)) {
      detail::fail("wait: Request{", request.id, "} is not a pending posted all-to-all on this transport");
    }
    auto where = [&] { return describe("wait(posted all_to_all_v)"); };
    const std::uint64_t number = exchanges_[x].number;
    posted_requests_.clear();
    for (std::size_t slot : exchanges_[x].slots) posted_requests_.push_back(std::exchange(h_.pending[slot], MPI_REQUEST_NULL));
    agreed(number, where, [&] {
      try {
        complete(std::span<MPI_Request>(posted_requests_), "All-to-all", where);
      } catch (...) {
        abandon(std::span<MPI_Request>(posted_requests_));
        finish_exchange(x, false);
        throw;
      }
      finish_exchange(x, false);
    });
  }


  // ---- isend/irecv requests: slot + 1 in the low 32 bits, the slot's
  // generation in the high 32, so a stale or foreign Request is caught.
  std::size_t acquire_slot() {
    if (free_slots_.empty()) {
      h_.pending.push_back(MPI_REQUEST_NULL);
      generation_.push_back(0);
      free_slots_.reserve(h_.pending.size());
      return h_.pending.size() - 1;
    }
    const std::size_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  void release_slot(std::size_t slot) {
    h_.pending[slot] = MPI_REQUEST_NULL;
    ++generation_[slot];
    free_slots_.push_back(slot);
  }
  Request request_of(std::size_t slot) const {
    return Request{(static_cast<std::uint64_t>(generation_[slot]) << 32) | (static_cast<std::uint64_t>(slot) + 1)};
  }
  std::size_t slot_of(Request request) const {
    const std::uint64_t low = request.id & 0xffffffffu;
    const std::size_t slot = static_cast<std::size_t>(low) - 1;
    if (low == 0 || slot >= h_.pending.size() || generation_[slot] != static_cast<std::uint32_t>(request.id >> 32) ||
        h_.pending[slot] == MPI_REQUEST_NULL) {
      detail::fail("wait: Request{", request.id, "} is not pending on this transport (already waited for, or never issued here)");
    }
    return slot;
  }

  detail::MpiTransportHandles h_;  // first: released last
  MpiTransportOptions options_;
  int rank_ = 0;
  int size_ = 0;
  int reserved_tag_ = 32767;  // MPI_TAG_UB: all_to_all_v's messages; MPI_TAG_UB - 1: isend/irecv
  std::string broken_;        // why the transport is unusable; empty while it is usable
  std::vector<int> ints_;                  // all_to_all_v counts/displacements as int: [4][W]
  std::vector<MPI_Request> requests_;      // all_to_all_v / reduce_scatter in flight: [2W]
  std::vector<MPI_Status> statuses_;       // [2W]
  std::vector<std::uint32_t> generation_;  // per isend/irecv slot
  std::vector<std::size_t> free_slots_;
  std::vector<PostedExchange> exchanges_;       // posted all-to-alls
  std::vector<MPI_Request> posted_requests_;    // one posted all-to-all's requests while it completes
  std::uint64_t exchange_count_ = 0;            // all-to-alls so far (blocking and posted), the agreement's numbering
  detail::MpiAgreement agreement_;
};

static_assert(Transport<MpiTransport>);

}  // namespace cpdispatch
