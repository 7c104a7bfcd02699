#pragma once
// NcclTransport: the Transport concept (cpdispatch/transport.hpp) over an
// NCCL communicator, device memory. CMake target cpdispatch::nccl.
//
//   ncclComm_t comm = ...;  cudaStream_t stream = ...;      // yours; borrowed
//   cpdispatch::NcclTransport t(comm, stream);
//   cpdispatch::Dispatcher q(t, qkv.q_fwd, qkv.q_rev, token_bytes);  // + cuda/data_path.hpp, in a .cu
//
// - It borrows an ncclComm_t and a cudaStream_t (both must outlive it);
//   every call enqueues its work on that stream (posted exchanges on the
//   communication stream: below) and returns: nothing blocks the host,
//   results are visible to later work on the stream, and a sequence of
//   calls can be captured in a CUDA graph (NCCL >= 2.9). The
//   communicator's GPU must be current on the calling thread.
// - all_to_all_v: ncclGroupStart, one ncclSend and one ncclRecv per peer
//   with a non-zero count, ncclGroupEnd; traffic to itself is a
//   cudaMemcpyAsync. Counts are bytes (ncclUint8). Send and receive counts of
//   a pair of ranks must agree: NCCL cannot check that (a mismatch is
//   undefined, as with MPI_Alltoallv), but the dispatcher's always do.
// - post_all_to_all_v (PostedAllToAllTransport): the exchange runs on a
//   communication stream, so compute enqueued on the stream after the post
//   overlaps it on the GPU. The transport creates that stream (non-blocking,
//   on the communicator's GPU) and destroys it with itself, or borrows yours
//   from NcclTransportOptions::comm_stream (it must then outlive the
//   transport; it may even be the stream itself, which gives up the
//   overlap). The post records an event on the stream (the inputs are
//   ready), makes the communication stream wait for it, enqueues the group
//   there (the copy to itself too) and records a completion event, taken
//   from a pool the transport reuses (no allocation per post once the pool
//   holds as many events as posts are ever outstanding). wait() makes the
//   stream wait for that event and returns: no host synchronisation
//   anywhere. Until then the send buffer must not change and the receive
//   buffer must not be read, on any stream. Every request is waited for
//   exactly once; a graph capture must wait for its posts before it ends.
// - One order of NCCL operations: a rank's GPU must reach the operations of
//   one communicator in the order every other rank's does, or they mismatch
//   or deadlock (NCCL does not order kernels of two streams). Posted
//   exchanges run on the communication stream; everything else
//   (all_to_all_v, the collectives, barrier, the isend/irecv groups) on the
//   stream. A post waits for the stream's earlier work (its input event),
//   and any other call made while posted exchanges are outstanding first
//   makes the stream wait for their completion. So each GPU runs the
//   communicator's operations in the order the host called them, which is
//   the program order and the same on every rank (the collective contract).
//   The price: a collective called between a post and its wait ends that
//   exchange's overlap (it runs after the exchange).
// - Collectives map to NCCL's: broadcast (bytes), all_reduce (in place),
//   all_gather, reduce_scatter; ElementType bfloat16 is ncclBfloat16, float16 is
//   ncclFloat16, and so on. NCCL's reductions sum in its own order (ring or
//   tree): 16-bit results may differ from the sim transports' in the last bit.
// - barrier(): an all-reduce of one int on the stream. Stream-ordered, like
//   everything here: later work on the stream starts after every rank's work
//   before its barrier; the host is not blocked.
// - isend / irecv / wait: NCCL has no tags and matches the point-to-point
//   operations between two ranks in the order they are issued, and separate
//   ungrouped operations can deadlock (a send waits for its receive on the
//   GPU). So isend and irecv only record the operation; the first wait() for
//   any recorded request, or the next collective call, issues ALL recorded
//   operations as one NCCL group on the stream, in posting order. wait()
//   then returns at once: the operation is complete in stream order (later
//   work on the stream sees the received data; the send buffer may be
//   reused by later stream work). Tags are accepted for the concept and
//   ignored, so messages between two ranks must be posted in the same order
//   on both sides (MPI programs with reordering tags are not supported), and
//   both ranks must reach their flushing call. Every request must be waited for.
// - Failures: every CUDA and NCCL call is checked; a failure throws
//   nccl_error (or cuda_error) naming the call, the file and line and the
//   library's error ("ncclSend failed at nccl.hpp:210: ncclInvalidUsage
//   (invalid usage ...)"; code() is the ncclResult_t), after clearing CUDA's
//   last error. Bad arguments (span sizes, peers, roots) are invalid_input.
//   Non-blocking communicators are supported: an ncclInProgress result is
//   waited out by polling ncclCommGetAsyncError, for at most
//   NcclTransportOptions::timeout when one is given. A call still in progress
//   then (a dead or mismatched peer) aborts the communicator (ncclCommAbort)
//   and throws timeout_error naming the call and the rank; check_async()
//   reports (and aborts on) an asynchronous error NCCL found. After an abort
//   the transport is broken: every later call throws nccl_error. A request
//   whose group failed to issue throws from its wait().
// - A stuck call is reported: NcclTransportOptions::deadline (300 s unless
//   set; none turns it off) starts a watchdog thread at the first call that
//   communicates. It watches an event recorded on the communication stream
//   after each post, and one recorded on the stream after each call there
//   (all_to_all_v, the collectives, a group of point-to-point messages); a
//   call not done by its deadline (a peer that never makes it, a dead GPU,
//   a deadlock) makes it read NCCL's asynchronous state, write a report
//   (the call; for a post the peers it sends to and receives from; the
//   state) and abort the communicator, so the GPU stops waiting and a host
//   blocked on the stream gets it back. The transport's next call throws
//   timeout_error with the report; broken() is true. Per call it costs an
//   event record, a capture query and a lock; the thread polls every tenth
//   of the deadline (at most a second) and is joined at destruction. Calls
//   captured into a CUDA graph are not watched (they run when the graph is
//   launched, which the transport does not see).
// - The communicator's GPU (ncclCommCuDevice) must be the current device of
//   the calling thread: checked at construction and at every call
//   (invalid_input naming both devices).
// - Not thread-safe: one thread at a time per transport. Movable, not copyable.
//
// Plain C++ over the CUDA runtime and NCCL: compiles with the host compiler
// too (only the dispatcher's device data path needs nvcc).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// An NCCL call failed; code() is the ncclResult_t.
class nccl_error : public backend_error {
 public:
  using backend_error::backend_error;
};

namespace detail {

/// "ncclInvalidUsage" for ncclInvalidUsage: the enumerator's own name.
constexpr const char* nccl_result_name(int code) noexcept {
  switch (code) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}

/// Builds the nccl_error of a failed call (clears CUDA's last error first,
/// since NCCL failures often start as CUDA ones). `last_message` is NCCL's
/// own account of its last error (ncclGetLastError), appended when non-empty.
inline nccl_error make_nccl_error(ncclResult_t code, std::string_view call, std::string_view file, int line,
                                  std::string_view last_message) {
  (void)cudaGetLastError();
  const char* description = ncclGetErrorString(code);
  const std::string detail = last_message.empty() ? std::string() : concat("NCCL: ", last_message);
  return nccl_error(backend_failure_message(call, file, line, nccl_result_name(code), description ? description : "no description", detail),
                    static_cast<int>(code));
}

/// Throws nccl_error unless `code` is ncclSuccess; ncclInProgress (a
/// non-blocking communicator) is waited out first.
inline void nccl_check(ncclResult_t code, std::string_view call, std::string_view file, int line, ncclComm_t comm = nullptr) {
  if (code == ncclInProgress && comm != nullptr) {
    do {
      if (const ncclResult_t polled = ncclCommGetAsyncError(comm, &code); polled != ncclSuccess) code = polled;
    } while (code == ncclInProgress);
  }
  if (code == ncclSuccess) [[likely]] return;
  const char* last = ncclGetLastError(comm);
  throw make_nccl_error(code, call, file, line, last ? last : "");
}

constexpr ncclDataType_t nccl_data_type(ElementType type) noexcept {
  switch (type) {
    case ElementType::int8: return ncclInt8;
    case ElementType::uint8: return ncclUint8;
    case ElementType::int32: return ncclInt32;
    case ElementType::int64: return ncclInt64;
    case ElementType::float32: return ncclFloat32;
    case ElementType::float64: return ncclFloat64;
    case ElementType::bfloat16: return ncclBfloat16;
    case ElementType::float16: return ncclFloat16;
  }
  return ncclUint8;
}

constexpr ncclRedOp_t nccl_reduce_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
  }
  return ncclSum;
}

}  // namespace detail
}  // namespace cpdispatch

/// Throws nccl_error naming the call, the file and line and NCCL's error.
#define CPDISPATCH_NCCL_CHECK(expr) ::cpdispatch::detail::nccl_check((expr), #expr, __FILE__, __LINE__)
/// The same for calls on a communicator that may be non-blocking.
#define CPDISPATCH_NCCL_CHECK_COMM(expr, comm) ::cpdispatch::detail::nccl_check((expr), #expr, __FILE__, __LINE__, (comm))

namespace cpdispatch {

namespace cuda {
class DeviceDataPath;  // the dispatcher's data path: cpdispatch/cuda/data_path.hpp
}  // namespace cuda

namespace detail {

/// NcclTransport's watchdog (NcclTransportOptions::deadline): one thread,
/// started at the first watched call, that watches two lanes, each with one
/// event recorded after every call of the lane: the posted exchanges on the
/// communication stream, and the calls on the stream (collectives, blocking
/// exchanges, point-to-point groups). A stream runs its work in order, so
/// the event of a lane's last call marks every call before it done too. A
/// call still not done `deadline` after it was made (the first such: the
/// deadline counts from the lane's oldest call not seen done) makes the
/// thread read NCCL's asynchronous state, abort the communicator (the GPUs
/// stop waiting for the missing peer) and keep a report, which the
/// transport's next call throws.
class NcclWatchdog {
 public:
  NcclWatchdog(ncclComm_t comm, int device, int rank, int size, std::chrono::milliseconds deadline)
      : comm_(comm), device_(device), rank_(rank), size_(size), deadline_(deadline),
        poll_(std::clamp<std::chrono::milliseconds>(deadline / 10, std::chrono::milliseconds(1), std::chrono::milliseconds(1000))) {}
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;
  ~NcclWatchdog() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// After post `id` was enqueued on `comm_stream`: watches it. `send` and
  /// `recv`: its peers (those with bytes to send or receive), for the report.
  void posted(cudaStream_t comm_stream, std::uint64_t id, std::span<const std::size_t> send, std::span<const std::size_t> recv) {
    watch(posts_, comm_stream, [&] {
      std::string peers;
      for (const auto& [what, counts] : {std::pair{"receives from rank(s)", recv}, std::pair{"sends to rank(s)", send}}) {
        peers += peers.empty() ? "" : "; ";
        peers += what;
        bool any = false;
        for (std::size_t p = 0; p < counts.size(); ++p) {
          if (counts[p] == 0 || static_cast<int>(p) == rank_) continue;
          peers += (any ? ", " : " ") + std::to_string(p);
          any = true;
        }
        if (!any) peers += " none";
      }
      return concat("posted exchange #", id, "|", " (", peers, ")");
    });
  }

  /// After `op`, the transport's call number `n` on `stream`, was enqueued: watches it.
  void called(cudaStream_t stream, const char* op, std::uint64_t n) {
    watch(calls_, stream, [&] { return concat(op, " (call #", n, " on the stream)|"); });
  }

  /// Whether the deadline passed; then report() holds what happened.
  bool fired() const noexcept { return fired_.load(std::memory_order_acquire); }
  const std::string& report() const noexcept { return report_; }

 private:
  /// One stream's watched calls.
  struct Lane {
    const char* made;     // "posted", "called"
    const char* missing;  // what a peer failed to do
    std::optional<cuda::Event> event;  // recorded after every call
    bool pending = false;              // some call is not known to be done
    std::uint64_t calls = 0, generation = 0;  // since the first pending one; every call
    std::string first;  // the first pending call: "<name>|<peers>"
    std::chrono::steady_clock::time_point first_at;
  };

  /// Records the lane's event after a call; `describe()` names the call when it is the first pending one.
  template <class Describe>
  void watch(Lane& lane, cudaStream_t stream, Describe&& describe) {
    std::lock_guard lock(mutex_);
    if (!lane.event) lane.event.emplace();
    if (!lane.pending) {
      lane.pending = true;
      lane.calls = 0;
      lane.first = describe();
      lane.first_at = std::chrono::steady_clock::now();
    }
    ++lane.calls;
    ++lane.generation;
    lane.event->record(stream);  // under the lock: the thread never pairs an older record with this generation
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }

  void run() {
    (void)cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, poll_, [this] { return stop_; });
      if (stop_) return;
      for (Lane* lane : {&posts_, &calls_}) {
        if (!lane->pending) continue;
        const std::uint64_t generation = lane->generation;
        lock.unlock();
        const cudaError_t state = cudaEventQuery(lane->event->get());
        if (state != cudaSuccess && state != cudaErrorNotReady) (void)cudaGetLastError();
        lock.lock();
        if (state == cudaSuccess && generation == lane->generation) {
          lane->pending = false;  // every call of the lane so far is done
          continue;
        }
        if (!lane->pending || std::chrono::steady_clock::now() - lane->first_at <= deadline_) continue;
        fire(*lane);
        return;
      }
    }
  }

  /// Reads NCCL's state, writes the report, then aborts the communicator
  /// (in this order: once the abort ends the stream's wait, the transport's
  /// next call must already see the report, not reach NCCL).
  void fire(const Lane& lane) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t polled = ncclCommGetAsyncError(comm_, &async);
    const std::size_t bar = lane.first.find('|');
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - lane.first_at).count();
    report_ = concat("NcclTransport: ", lane.first.substr(0, bar), lane.calls > 1 ? concat(" (and the ", lane.calls - 1, " after it)") : "", " on rank ",
                     rank_, " of ", size_, lane.first.substr(bar + 1), " was not done ", waited, " ms after it was ", lane.made,
                     " (NcclTransportOptions::deadline = ", deadline_.count(), " ms): a peer that never ", lane.missing,
                     ", a dead GPU or a deadlock; NCCL's asynchronous state: ", polled == ncclSuccess ? nccl_result_name(async) : nccl_result_name(polled),
                     "; the communicator was aborted");
    fired_.store(true, std::memory_order_release);
    (void)ncclCommAbort(comm_);
  }

  ncclComm_t comm_;
  int device_, rank_, size_;
  std::chrono::milliseconds deadline_, poll_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  Lane posts_{"posted", "posted its side", {}, false, 0, 0, {}, {}};
  Lane calls_{"called", "made the same call", {}, false, 0, 0, {}, {}};
  std::atomic<bool> fired_{false};
  std::string report_;  // written before fired_ is set
  std::thread thread_;  // last: started after everything above exists
};

}  // namespace detail

// Inside NcclTransport: checks an NCCL call with the transport's timeout.
#define CPDISPATCH_NCCL_TRANSPORT_CHECK(expr) check((expr), #expr, __FILE__, __LINE__)

struct NcclTransportOptions {
  /// Bound on waiting out ncclInProgress (non-blocking communicators) in any
  /// call; past it the communicator is aborted and timeout_error thrown.
  /// None: wait as long as NCCL says the call is in progress.
  std::optional<std::chrono::milliseconds> timeout;
  /// The stream posted exchanges run on; borrowed, must outlive the
  /// transport. Null: the transport creates its own.
  cudaStream_t comm_stream = nullptr;
  /// Deadline of every call that communicates: the posted exchanges
  /// (post_all_to_all_v) and the calls on the stream (all_to_all_v, the
  /// collectives, the groups of point-to-point messages). A watchdog thread
  /// (started at the first such call) aborts the communicator when a call
  /// is not done this long after it was made (a peer that never makes it,
  /// a dead GPU, a deadlock), so that the GPUs stop waiting; the
  /// transport's next call then throws timeout_error naming the call (a
  /// post: its peers too) and NCCL's asynchronous state. A call on the
  /// stream is done once the stream reaches and passes it, so the time the
  /// stream's earlier work takes counts too. Calls captured into a CUDA
  /// graph are not watched. None: no watchdog.
  std::optional<std::chrono::milliseconds> deadline = std::chrono::seconds(300);
};

class NcclTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::device;
  using data_path = cuda::DeviceDataPath;  ///< the dispatcher's data path (cpdispatch/cuda/data_path.hpp)

  /// Borrows `comm` and `stream`; allocates one int of device memory (the
  /// barrier's) and creates the communication stream unless the options
  /// lend one. The communicator's device must be current.
  NcclTransport(ncclComm_t comm, cudaStream_t stream, NcclTransportOptions options = {})
      : comm_(comm), stream_(stream), options_(options) {
    if (comm == nullptr) detail::fail("NcclTransport: the communicator is null");
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclCommUserRank(comm, &rank_));
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclCommCount(comm, &size_));
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclCommCuDevice(comm, &device_));
    check_device("NcclTransport");
    if (options_.comm_stream) {
      comm_stream_ = options_.comm_stream;
    } else {
      own_comm_stream_.emplace();
      comm_stream_ = own_comm_stream_->get();
    }
    inputs_ready_.emplace();
    if (options_.deadline) {
      if (options_.deadline->count() < 1) fail("NcclTransport", detail::concat("options.deadline = ", options_.deadline->count(), " ms must be at least 1 ms"));
      watchdog_ = std::make_unique<detail::NcclWatchdog>(comm_, device_, rank_, size_, *options_.deadline);
    }
    barrier_word_.allocate(1);
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(barrier_word_.data(), 0, sizeof(std::int32_t), stream_));
  }
  // Every resource is a movable owner (or a handle that stays valid), so
  // the defaults move correctly; a moved-from transport may only be
  // destroyed or assigned to.
  NcclTransport(NcclTransport&&) = default;
  NcclTransport& operator=(NcclTransport&&) = default;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;
  ~NcclTransport() = default;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return size_; }
  ncclComm_t comm() const noexcept { return comm_; }
  /// The communicator's GPU.
  int device() const noexcept { return device_; }
  /// True after the communicator was aborted (a timeout or an asynchronous error).
  bool broken() const noexcept { return !broken_.empty() || (watchdog_ && watchdog_->fired()); }

  /// Throws nccl_error, after aborting the communicator, when NCCL reports
  /// an asynchronous error on it (e.g. a peer failed); returns otherwise.
  void check_async() {
    usable("check_async");
    ncclResult_t state = ncclSuccess;
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclSuccess || state == ncclInProgress) return;
    abort(detail::concat("asynchronous error ", detail::nccl_result_name(state)));
    throw nccl_error(detail::concat("NcclTransport: check_async on rank ", rank_, " of ", size_, ": NCCL reports the asynchronous error ",
                                    detail::nccl_result_name(state), " (", ncclGetErrorString(state), "); the communicator was aborted"),
                     static_cast<int>(state));
  }
  /// The stream: every call but the posted exchanges is ordered on it.
  cudaStream_t stream() const noexcept { return stream_; }
  /// The stream posted exchanges run on (owned, or NcclTransportOptions::comm_stream).
  cudaStream_t comm_stream() const noexcept { return comm_stream_; }
  /// Posted exchanges not yet waited for.
  std::size_t outstanding() const noexcept { return outstanding_.size(); }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    check_exchange("all_to_all_v", send_counts, send_displs, recv_counts, recv_displs);
    before_blocking();
    exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, stream_);
    watch_call("all_to_all_v");
  }

  /// The exchange, on the communication stream after the stream's earlier
  /// work; wait() orders the stream after it (see the header).
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    check_exchange("post_all_to_all_v", send_counts, send_displs, recv_counts, recv_displs);
    flush();  // recorded point-to-point operations go first
    const cudaEvent_t done = take_event();
    try {
      inputs_ready_->record(stream_);
      inputs_ready_->wait_on(comm_stream_);
      exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, comm_stream_);
      CPDISPATCH_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
    } catch (...) {
      free_events_.push_back(done);
      throw;
    }
    const std::uint64_t id = next_request_++;
    if (watchdog_) {
      // A post captured into a graph runs when the graph is launched, not now: not watched.
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      CPDISPATCH_CUDA_CHECK(cudaStreamIsCapturing(comm_stream_, &capture));
      if (capture == cudaStreamCaptureStatusNone) watchdog_->posted(comm_stream_, id, send_counts, recv_counts);
    }
    outstanding_.push_back({id, done, false});
    return Request{id};
  }

  /// Records the send; it is issued at the first wait() or collective (see the header).
  Request isend(const void* buf, std::size_t bytes, int peer, int tag) { return post("isend", true, buf, nullptr, bytes, peer, tag); }
  Request irecv(void* buf, std::size_t bytes, int peer, int tag) { return post("irecv", false, nullptr, buf, bytes, peer, tag); }

  void wait(Request request) {
    if (failed_.erase(request.id)) {
      throw nccl_error(detail::concat("NcclTransport: wait on rank ", rank_, " of ", size_, ": request ", request.id,
                                      " was never issued: the NCCL group that carried it failed"),
                       static_cast<int>(ncclInvalidUsage));
    }
    usable("wait");
    for (auto it = outstanding_.begin(); it != outstanding_.end(); ++it) {
      if (it->id != request.id) continue;
      if (!it->ordered) CPDISPATCH_CUDA_CHECK(cudaStreamWaitEvent(stream_, it->done, 0));
      free_events_.push_back(it->done);
      outstanding_.erase(it);
      return;
    }
    if (issued_.erase(request.id)) return;
    for (const Posted& p : posted_) {
      if (p.id != request.id) continue;
      flush();
      issued_.erase(request.id);
      return;
    }
    fail("wait", detail::concat("request ", request.id, " is not pending on this rank"));
  }

  void barrier() {
    usable("barrier");
    before_blocking();
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclAllReduce(barrier_word_.data(), barrier_word_.data(), 1, ncclInt32, ncclSum, comm_, stream_));
    watch_call("barrier");
  }

  void broadcast(void* buf, std::size_t bytes, int root) {
    if (root < 0 || root >= size_) fail("broadcast", detail::concat("root ", root, " is outside [0, ", size_, ")"));
    usable("broadcast");
    before_blocking();
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    watch_call("broadcast");
  }

  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op) {
    usable("all_reduce");
    before_blocking();
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclAllReduce(buf, buf, count, detail::nccl_data_type(type), detail::nccl_reduce_op(op), comm_, stream_));
    watch_call("all_reduce");
  }

  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
    usable("all_gather");
    before_blocking();
    CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclAllGather(send, recv, count_per_rank, detail::nccl_data_type(type), comm_, stream_));
    watch_call("all_gather");
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op) {
    usable("reduce_scatter");
    before_blocking();
    CPDISPATCH_NCCL_TRANSPORT_CHECK(
        ncclReduceScatter(send, recv, count_per_rank, detail::nccl_data_type(type), detail::nccl_reduce_op(op), comm_, stream_));
    watch_call("reduce_scatter");
  }

  /// Point-to-point operations recorded and not yet issued.
  std::size_t posted() const noexcept { return posted_.size(); }

 private:
  struct Posted {
    std::uint64_t id;
    bool is_send;
    const void* send;
    void* recv;
    std::size_t bytes;
    int peer;
  };

  /// ncclGroupStart ... ncclGroupEnd; ends the group also when a call in it threw.
  class Group {
   public:
    explicit Group(NcclTransport& t) : t_(t) { CPDISPATCH_NCCL_CHECK(ncclGroupStart()); }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;
    ~Group() {
      if (open_) (void)ncclGroupEnd();  // already failing: the first error is the one reported
    }
    void end() {
      open_ = false;
      t_.check(ncclGroupEnd(), "ncclGroupEnd()", __FILE__, __LINE__);
    }

   private:
    NcclTransport& t_;
    bool open_ = true;
  };

  /// Throws nccl_error unless `code` is ncclSuccess; ncclInProgress is
  /// waited out, within the timeout.
  void check(ncclResult_t code, const char* call, const char* file, int line) {
    if (code == ncclInProgress) code = wait_in_progress(call);
    if (code == ncclSuccess) [[likely]] return;
    const char* last = ncclGetLastError(comm_);
    throw detail::make_nccl_error(code, call, file, line, last ? last : "");
  }

  ncclResult_t wait_in_progress(const char* call) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      if (const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state); rc != ncclSuccess) return rc;
      if (state != ncclInProgress) return state;
      if (options_.timeout && std::chrono::steady_clock::now() - start > *options_.timeout) {
        const std::string name(detail::call_name_of(call));
        abort(name + " timed out");
        throw timeout_error(detail::concat("NcclTransport: ", name, " on rank ", rank_, " of ", size_, ": not complete after ",
                                           options_.timeout->count(), " ms (NcclTransportOptions::timeout); the communicator was aborted"));
      }
      std::this_thread::yield();
    }
  }

  /// Aborts the communicator: its pending work is dropped, and this transport refuses every later call.
  void abort(std::string why) {
    (void)ncclCommAbort(comm_);
    broken_ = std::move(why);
  }

  /// Refuses calls on a broken transport and from a thread whose current device is not the communicator's.
  void usable(const char* op) const {
    if (watchdog_ && watchdog_->fired()) throw timeout_error(detail::concat(watchdog_->report(), " (seen at ", op, ")"));
    if (!broken_.empty()) {
      throw nccl_error(detail::concat("NcclTransport: ", op, " on rank ", rank_, " of ", size_, ": the communicator was aborted (", broken_,
                                      "); make a new one"),
                       static_cast<int>(ncclInvalidUsage));
    }
    check_device(op);
  }

  void check_device(const char* op) const {
    int current = -1;
    CPDISPATCH_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) {
      fail(op, detail::concat("the current device is ", current, ", but the communicator's is ", device_, " (cudaSetDevice(", device_, ") first)"));
    }
  }

  [[noreturn]] void fail(const char* op, const std::string& what) const {
    detail::fail("NcclTransport: ", op, " on rank ", rank_, " of ", size_, ": ", what);
  }

  /// The argument checks of both exchanges; then usable().
  void check_exchange(const char* op, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                      std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) const {
    const auto W = static_cast<std::size_t>(size_);
    for (auto [name, s] : {std::pair{"send_counts", send_counts}, std::pair{"send_displs", send_displs}, std::pair{"recv_counts", recv_counts},
                           std::pair{"recv_displs", recv_displs}}) {
      if (s.size() != W) fail(op, detail::concat(name, " has ", s.size(), " entries, world_size is ", W));
    }
    usable(op);
    const auto me = static_cast<std::size_t>(rank_);
    if (send_counts[me] != recv_counts[me]) {
      fail(op, detail::concat("send_counts[", me, "] = ", send_counts[me], " to itself but recv_counts[", me, "] = ", recv_counts[me]));
    }
  }

  /// One group of sends and receives, and the copy to itself, on `on`.
  void exchange(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs, cudaStream_t on) {
    const auto W = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    {
      Group group(*this);
      for (std::size_t p = 0; p < W; ++p) {
        if (p == me) continue;
        const int peer = static_cast<int>(p);
        if (send_counts[p]) CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclSend(in + send_displs[p], send_counts[p], ncclUint8, peer, comm_, on));
        if (recv_counts[p]) CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclRecv(out + recv_displs[p], recv_counts[p], ncclUint8, peer, comm_, on));
      }
      group.end();
    }
    if (send_counts[me]) {
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out + recv_displs[me], in + send_displs[me], send_counts[me], cudaMemcpyDeviceToDevice, on));
    }
  }

  /// A completion event from the pool; a new one only when every pooled event is in use.
  cudaEvent_t take_event() {
    if (free_events_.empty()) {
      events_.emplace_back();
      free_events_.reserve(events_.size());  // giving events back never allocates
      outstanding_.reserve(events_.size());
      return events_.back().get();
    }
    const cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }

  /// Makes the stream wait for every outstanding posted exchange. The
  /// communication stream runs them in posting order, so the last one's
  /// event covers all of them.
  void order_after_posts() {
    if (outstanding_.empty() || outstanding_.back().ordered) return;
    CPDISPATCH_CUDA_CHECK(cudaStreamWaitEvent(stream_, outstanding_.back().done, 0));
    for (Outstanding& o : outstanding_) o.ordered = true;
  }

  /// Before an NCCL call on the stream: the outstanding posts first, then the recorded point-to-point operations.
  void before_blocking() {
    order_after_posts();
    flush();
  }

  Request post(const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer, int /*tag: see the header*/) {
    if (peer < 0 || peer >= size_) fail(op, detail::concat("peer ", peer, " is outside [0, ", size_, ")"));
    usable(op);
    const std::uint64_t id = next_request_++;
    posted_.push_back({id, is_send, send, recv, bytes, peer});
    return Request{id};
  }

  /// Issues every recorded point-to-point operation as one group, in posting
  /// order. Requests count as issued only once the group went through; when
  /// it fails, each of them fails its wait().
  void flush() {
    if (posted_.empty()) return;
    order_after_posts();
    std::vector<Posted> batch = std::move(posted_);
    posted_.clear();
    try {
      Group group(*this);
      for (const Posted& p : batch) {
        if (p.bytes == 0) continue;  // both sides skip it: nothing to match
        if (p.is_send) CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclSend(p.send, p.bytes, ncclUint8, p.peer, comm_, stream_));
        else CPDISPATCH_NCCL_TRANSPORT_CHECK(ncclRecv(p.recv, p.bytes, ncclUint8, p.peer, comm_, stream_));
      }
      group.end();
    } catch (...) {
      for (const Posted& p : batch) failed_.insert(p.id);
      throw;
    }
    for (const Posted& p : batch) issued_.insert(p.id);
    watch_call("the group of point-to-point messages");
  }

  /// Watches the call just enqueued on the stream (not while the stream is
  /// captured: a graph runs at its launch, which the transport does not see).
  void watch_call(const char* op) {
    if (!watchdog_) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CPDISPATCH_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    if (capture == cudaStreamCaptureStatusNone) watchdog_->called(stream_, op, ++calls_);
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  NcclTransportOptions options_;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  std::string broken_;  // why the communicator was aborted; empty while usable
  std::unique_ptr<detail::NcclWatchdog> watchdog_;  // with options.deadline
  cuda::DeviceBuffer<std::int32_t> barrier_word_;
  std::optional<cuda::Stream> own_comm_stream_;  // empty when NcclTransportOptions::comm_stream lends one
  cudaStream_t comm_stream_ = nullptr;
  // The stream at a post; reused: a wait captures the event's state when it
  // is called. Made after the communicator is checked (a bad one is reported first).
  std::optional<cuda::Event> inputs_ready_;
  struct Outstanding {
    std::uint64_t id;
    cudaEvent_t done;  // recorded on the communication stream after the exchange
    bool ordered;      // the stream already waits for it (order_after_posts)
  };
  std::vector<Outstanding> outstanding_;  // posted exchanges not yet waited for, in posting order
  std::vector<cuda::Event> events_;       // the pool: every completion event made
  std::vector<cudaEvent_t> free_events_;  // those of events_ not in outstanding_
  std::vector<Posted> posted_;
  std::unordered_set<std::uint64_t> issued_;  // issued, not yet waited for
  std::unordered_set<std::uint64_t> failed_;  // in a group that failed to issue, not yet waited for
  std::uint64_t next_request_ = 1;
  std::uint64_t calls_ = 0;  // calls on the stream the watchdog watched
};

#undef CPDISPATCH_NCCL_TRANSPORT_CHECK

}  // namespace cpdispatch
