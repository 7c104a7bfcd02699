#pragma once
// The single-GPU simulation: a world of W virtual ranks on ONE GPU, each rank
// a host thread with its own CUDA stream and its own device buffers, the
// exchanges device-to-device copies. The dispatcher and the kernels run on it
// exactly as on NCCL (memory_space == device), so both are tested, and
// benchmarked, at W > 1 with a single GPU.
//
//   cpdispatch::DeviceSimWorld world(4);
//   world.run([&](cpdispatch::DeviceSimTransport& t) {
//     cpdispatch::Dispatcher q(t, qkv.q_fwd, qkv.q_rev, token_bytes);   // needs cuda/data_path.hpp
//     q.forward(mlp[t.rank()], attn[t.rank()]);                          // DeviceSpans
//   });
//   world.synchronize();                                                 // wait for the streams
//
// Semantics (the Transport contract for device transports, transport.hpp):
// - Every call (post_all_to_all_v aside: below) is stream-ordered on the
//   rank's stream (stream(), owned by the world) and returns once its work
//   is enqueued; the host is not blocked beyond meeting the other ranks'
//   threads. Results are visible to later work on that stream; run() does
//   not wait for the streams (synchronize()).
// - Collectives: each rank records an event at its stream's current position
//   and publishes its buffers; all ranks meet (host barrier); each rank's
//   stream waits for the events of the ranks it reads from and copies (or
//   reduces) into its own buffers; each records a second event; all meet
//   again; each rank's stream waits for every other rank's second event, so
//   no rank's later work overwrites a buffer another rank still reads.
//   Collectives must match across ranks (op, count, type, root), as in the
//   host sim; a mismatch is an invalid_input naming both calls.
// - Reductions sum in rank order with the host sim's arithmetic (16-bit
//   floats accumulate in fp32 and round once; integers wrap around), so the
//   device and host sims agree bit for bit on finite values. all_reduce
//   works through a per-rank scratch buffer that grows on first use (a
//   cudaMalloc: make one call of each size before capturing a graph). A
//   buffer outgrown later is kept until the world is destroyed, so a graph
//   captured before still finds the memory it was recorded with.
// - isend/irecv match by (source, destination, tag) in posting order, as in
//   the host sim. The copy is enqueued on the receiver's stream when the two
//   are matched (by whichever rank posts second), after the sender's stream
//   reached its isend; wait(isend) makes the sender's stream wait for that
//   copy, wait(irecv) orders it before the receiver's later work. wait()
//   blocks the host until the message is matched. Every request must be
//   waited for.
// - post_all_to_all_v (PostedAllToAllTransport): the exchange runs on the
//   rank's communication stream (comm_stream(), owned by the world), so
//   compute enqueued on stream() after the post overlaps it. The post
//   records an event on stream() (the inputs are ready), the communication
//   stream waits for it, and the collective's protocol above runs there
//   (the ranks still meet on the host at the post); a completion event,
//   taken from a pool the rank reuses, is recorded after the other ranks'
//   reads of our send buffer. wait() makes stream() wait for that event:
//   no host synchronisation. Until then the send buffer must not change and
//   the receive buffer must not be read. The other calls stay on stream()
//   and are not ordered after outstanding posts (the copies name their
//   streams; there is no shared communicator whose order matters).
// - No all_to_all_pieces: a dispatcher over this transport packs, calls
//   all_to_all_v and unpacks with the device kernels, as over NCCL.
// - Failure and timeouts as in the host sim, by the same code
//   (transports/detail/sim_world.hpp): a failing rank aborts the world, ranks waiting
//   for it are released with an error, run() rethrows the first exception
//   with "DeviceSimWorld rank r of W: " in front; a timeout reads
//   "All-reduce timeout on rank 2 of 4 in all_reduce: not complete after
//   100 ms (DeviceSimOptions::timeout)".
//   After a CUDA failure the streams may hold unfinished work; the world
//   stays usable unless the error was a sticky one (the CUDA context is then
//   lost for the whole process).
// - The transports belong to the world and live as long as it: objects built
//   on them in one run() (dispatchers, with their uploads and staging) can be
//   used in later runs and captures.
// - capture(per_rank) records everything the ranks enqueue into ONE CUDA
//   graph (each rank's stream joins a capture begun on an origin stream, in
//   cudaStreamCaptureModeRelaxed), so a whole multi-rank step can be replayed
//   with DeviceSimGraph::launch. Captured work must not allocate (construct
//   dispatchers and make a first call of each collective size beforehand).
//
// Requires nvcc (the reductions are kernels): include from a .cu file.

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/transports/device_sim.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transports/detail/sim_world.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::cuda {
namespace kernels {

// ---- the reductions: element-wise sums of W buffers in rank order ---------------

template <ElementType D>
struct sum_element;
template <class S, class U>  // integers: wrap around in the unsigned type, as the host sim does
struct sum_integer {
  using storage = S;
  using acc = U;
  __host__ __device__ static acc first(storage x) { return static_cast<acc>(x); }
  __host__ __device__ static acc add(acc a, storage x) { return static_cast<acc>(a + static_cast<acc>(x)); }
  __host__ __device__ static storage store(acc a) { return static_cast<storage>(a); }
};
template <class F>
struct sum_float {
  using storage = F;
  using acc = F;
  __host__ __device__ static acc first(storage x) { return x; }
  __host__ __device__ static acc add(acc a, storage x) { return a + x; }
  __host__ __device__ static storage store(acc a) { return a; }
};
template <class Half>
struct sum_half {  // fp32 accumulation, one rounding at the end
  using storage = std::uint16_t;
  using acc = float;
  __host__ __device__ static acc first(storage x) { return Half::to_float(x); }
  __host__ __device__ static acc add(acc a, storage x) { return a + Half::to_float(x); }
  __host__ __device__ static storage store(acc a) { return Half::from_float(a); }
};
template <>
struct sum_element<ElementType::int8> : sum_integer<std::int8_t, std::uint8_t> {};
template <>
struct sum_element<ElementType::uint8> : sum_integer<std::uint8_t, std::uint8_t> {};
template <>
struct sum_element<ElementType::int32> : sum_integer<std::int32_t, std::uint32_t> {};
template <>
struct sum_element<ElementType::int64> : sum_integer<std::int64_t, std::uint64_t> {};
template <>
struct sum_element<ElementType::float32> : sum_float<float> {};
template <>
struct sum_element<ElementType::float64> : sum_float<double> {};
template <>
struct sum_element<ElementType::bfloat16> : sum_half<bfloat16> {};
template <>
struct sum_element<ElementType::float16> : sum_half<float16> {};

/// Sources per sum pass (kernel parameters); more ranks take several passes
/// through an accumulator buffer, which keeps the order and the rounding.
inline constexpr unsigned sum_sources_per_pass = 8;
struct SumSources {
  const void* at[sum_sources_per_pass];
};

/// acc = (first ? src[0] : acc) + src[first ? 1 : 0] + ... ; on the last
/// pass the result goes to `out` (rounded once for 16-bit types). The loop
/// over the sources runs over every slot with constant indices (unrolled on
/// the device), so the sources stay in registers instead of a stack copy.
template <ElementType D>
__host__ __device__ __forceinline__ void sum_at(void* out, void* acc_buffer, const SumSources& src, unsigned sources, bool first, bool last,
                                                std::uint64_t i) {
  using S = sum_element<D>;
  using T = typename S::storage;
  using A = typename S::acc;
  const T x0 = static_cast<const T*>(src.at[0])[i];  // every pass has at least one source
  A a = first ? S::first(x0) : S::add(static_cast<const A*>(acc_buffer)[i], x0);
CPDISPATCH_UNROLL
  for (unsigned s = 1; s < sum_sources_per_pass; ++s) {
    if (s < sources) a = S::add(a, static_cast<const T*>(src.at[s])[i]);
  }
  if (last) static_cast<T*>(out)[i] = S::store(a); else static_cast<A*>(acc_buffer)[i] = a;
}

template <ElementType D>
__global__ void sum_kernel(void* out, void* acc_buffer, SumSources src, unsigned sources, bool first, bool last, std::uint64_t count) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < count; i += std::uint64_t{gridDim.x} * blockDim.x) {
    sum_at<D>(out, acc_buffer, src, sources, first, last, i);
  }
}

}  // namespace kernels

/// out[i] = sources[0][i] + sources[1][i] + ... in this order, for `count`
/// elements of `type` (the sim transport's semantics: fp32 accumulation and
/// one rounding for 16-bit floats, wrap-around for integers). With more than
/// sum_sources_per_pass sources, `acc_buffer` must hold count accumulators
/// (count * 8 bytes suffice; invalid_input when it is null); otherwise it
/// may be null. `out` must not be one of the sources.
inline void launch_sum(ElementType type, void* out, void* acc_buffer, std::span<const void* const> sources, std::size_t count,
                       cudaStream_t stream) {
  if (count == 0 || sources.empty()) return;
  if (sources.size() > kernels::sum_sources_per_pass && acc_buffer == nullptr) {
    detail::fail("launch_sum: ", sources.size(), " sources take several passes and need an accumulator buffer, but acc_buffer is null");
  }
  constexpr unsigned threads = 256;
  const std::size_t wanted = (count + threads - 1) / threads;
  const auto blocks = static_cast<unsigned>(wanted < max_blocks ? wanted : max_blocks);
  for (std::size_t at = 0; at < sources.size(); at += kernels::sum_sources_per_pass) {
    kernels::SumSources src{};
    const std::size_t n = std::min<std::size_t>(kernels::sum_sources_per_pass, sources.size() - at);
    for (std::size_t s = 0; s < n; ++s) src.at[s] = sources[at + s];
    const bool first = at == 0, last = at + n == sources.size();
    const auto m = static_cast<unsigned>(n);
    auto run = [&](auto kernel) { launch_kernel("sum_kernel", kernel, blocks, threads, stream, out, acc_buffer, src, m, first, last, std::uint64_t{count}); };
    switch (type) {
      case ElementType::int8: run(&kernels::sum_kernel<ElementType::int8>); break;
      case ElementType::uint8: run(&kernels::sum_kernel<ElementType::uint8>); break;
      case ElementType::int32: run(&kernels::sum_kernel<ElementType::int32>); break;
      case ElementType::int64: run(&kernels::sum_kernel<ElementType::int64>); break;
      case ElementType::float32: run(&kernels::sum_kernel<ElementType::float32>); break;
      case ElementType::float64: run(&kernels::sum_kernel<ElementType::float64>); break;
      case ElementType::bfloat16: run(&kernels::sum_kernel<ElementType::bfloat16>); break;
      case ElementType::float16: run(&kernels::sum_kernel<ElementType::float16>); break;
    }
  }
}

}  // namespace cpdispatch::cuda

namespace cpdispatch {

struct DeviceSimOptions {
  /// Bound on every host-side wait (meeting the other ranks, wait()); none: wait forever.
  std::optional<std::chrono::milliseconds> timeout;
  /// The GPU of every rank; -1: the device current when the world is made.
  /// The world makes it current on the constructing thread and on every rank's.
  int device = -1;
};

class DeviceSimWorld;
class DeviceSimTransport;
class DeviceSimGraph;

}  // namespace cpdispatch

namespace cpdispatch::detail::device_sim {

/// One pending isend or irecv, with the stream positions that order its copy.
struct Message : detail::sim::Message {
  std::optional<cuda::Event> ready;  // isend: the sender's stream position at posting
  std::optional<cuda::Event> done;   // recorded on the receiver's stream after the copy
};

/// A rank's published buffers for the collective in progress.
struct SimSlot {
  const void* send = nullptr;
  void* recv = nullptr;
  std::span<const std::size_t> send_counts = {};
  std::span<const std::size_t> send_displs = {};
};

}  // namespace cpdispatch::detail::device_sim

namespace cpdispatch::cuda {
class DeviceDataPath;  // the dispatcher's data path: cpdispatch/cuda/data_path.hpp
}  // namespace cpdispatch::cuda

namespace cpdispatch {

/// One rank's handle on a DeviceSimWorld; owned by the world, handed to run() / capture().
class DeviceSimTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::device;
  using data_path = cuda::DeviceDataPath;  ///< the dispatcher's data path (cpdispatch/cuda/data_path.hpp)

  DeviceSimTransport(const DeviceSimTransport&) = delete;
  DeviceSimTransport& operator=(const DeviceSimTransport&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept;
  /// This rank's stream (owned by the world): all of the rank's work but the posted exchanges is ordered on it.
  cudaStream_t stream() const noexcept;
  /// This rank's communication stream (owned by the world): the posted exchanges run on it.
  cudaStream_t comm_stream() const noexcept;

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs);
  /// PostedAllToAllTransport: all_to_all_v on comm_stream() after stream()'s earlier work; wait() orders stream() after it.
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
  friend class DeviceSimWorld;
  DeviceSimTransport(DeviceSimWorld& world, int rank) : world_(world), rank_(rank) {}

  [[noreturn]] void fail(const char* op, const std::string& what);
  /// The two-phase protocol of every collective (see the header comment),
  /// on stream `on`; `read` enqueues this rank's copies or reductions there
  /// between the meetings.
  template <class Read>
  void collective(const detail::sim::Call& call, detail::device_sim::SimSlot slot, cudaStream_t on, Read&& read);
  /// Makes `on` wait for rank s to reach its publishing point in this collective.
  void after_publish_of(std::size_t s, cudaStream_t on);
  /// all_to_all_v's copies into this rank, on `on`.
  void exchange(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs, cudaStream_t on);
  /// A completion event from the pool; a new one only when every pooled event is in use.
  cudaEvent_t take_event();
  Request post(const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer, int tag);
  void sum(ElementType type, void* out, std::span<const void* const> sources, std::size_t count);
  /// Replaces `buffer` by a larger one when it holds fewer than `bytes`, keeping the old one alive.
  void grow(cuda::DeviceBuffer<std::byte>& buffer, std::size_t bytes);
  /// count * element_size(type), or invalid_input naming `op` when it overflows.
  std::size_t bytes_of(const char* op, std::size_t count, ElementType type);

  DeviceSimWorld& world_;
  int rank_;
  std::vector<const void*> sources_;  // reduction inputs, one per rank
  detail::sim::Requests<detail::device_sim::Message> requests_;
  struct PostedExchange {
    std::uint64_t id;  // the top bit set
    cudaEvent_t done;  // recorded on comm_stream() once the exchange is complete everywhere it matters
  };
  std::vector<PostedExchange> posted_;  // posted exchanges not yet waited for, in posting order
  cuda::Event inputs_ready_;             // stream() at a post; reused: a wait captures the event's state when it is called
  std::vector<cuda::Event> events_;       // the pool: every completion event made
  std::vector<cudaEvent_t> free_events_;  // those of events_ not in posted_
  std::uint64_t next_posted_ = 0;
  static constexpr std::uint64_t posted_bit = std::uint64_t{1} << 63;
};

/// A replayable CUDA graph of every rank's work (DeviceSimWorld::capture).
class DeviceSimGraph {
 public:
  DeviceSimGraph(DeviceSimGraph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  DeviceSimGraph& operator=(DeviceSimGraph&& other) noexcept {
    if (this != &other) {
      release();
      exec_ = std::exchange(other.exec_, nullptr);
    }
    return *this;
  }
  DeviceSimGraph(const DeviceSimGraph&) = delete;
  DeviceSimGraph& operator=(const DeviceSimGraph&) = delete;
  ~DeviceSimGraph() { release(); }

  /// Replays the captured work (all ranks) ordered on `stream`.
  void launch(cudaStream_t stream) const { CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  friend class DeviceSimWorld;
  explicit DeviceSimGraph(cudaGraphExec_t exec) noexcept : exec_(exec) {}
  void release() noexcept {
    if (exec_) {
      (void)cudaGraphExecDestroy(exec_);
      (void)cudaGetLastError();
    }
    exec_ = nullptr;
  }
  cudaGraphExec_t exec_ = nullptr;
};

/// W virtual ranks on one GPU, as threads of this process.
class DeviceSimWorld : private detail::sim::World<detail::device_sim::Message> {
 public:
  explicit DeviceSimWorld(int world_size, DeviceSimOptions options = {})
      : World({"DeviceSimWorld", "DeviceSimTransport", "DeviceSimOptions::timeout"}, world_size, options.timeout), options_(options) {
    if (options_.device < 0) CPDISPATCH_CUDA_CHECK(cudaGetDevice(&options_.device));
    CPDISPATCH_CUDA_CHECK(cudaSetDevice(options_.device));
    const auto W = static_cast<std::size_t>(world_size);
    streams_.reserve(W);
    comm_streams_.reserve(W);
    for (std::size_t r = 0; r < W; ++r) {
      streams_.emplace_back();
      comm_streams_.emplace_back();
      published_.emplace_back();
      read_.emplace_back();
      joined_.emplace_back();
    }
    scratch_.resize(W);
    accumulators_.resize(W);
    for (int r = 0; r < world_size; ++r) transports_.push_back(std::unique_ptr<DeviceSimTransport>(new DeviceSimTransport(*this, r)));
  }
  DeviceSimWorld(const DeviceSimWorld&) = delete;
  DeviceSimWorld& operator=(const DeviceSimWorld&) = delete;
  /// Waits for the ranks' streams before releasing them and their buffers.
  ~DeviceSimWorld() {
    for (const cuda::Stream& s : streams_) (void)cudaStreamSynchronize(s.get());
    for (const cuda::Stream& s : comm_streams_) (void)cudaStreamSynchronize(s.get());
    (void)cudaGetLastError();
  }

  using World::world_size;
  int device() const noexcept { return options_.device; }
  const DeviceSimOptions& options() const noexcept { return options_; }
  cudaStream_t stream(int rank) const { return streams_.at(static_cast<std::size_t>(rank)).get(); }
  /// Rank `rank`'s communication stream (its posted exchanges).
  cudaStream_t comm_stream(int rank) const { return comm_streams_.at(static_cast<std::size_t>(rank)).get(); }

  /// Waits until every rank's streams have finished their work.
  void synchronize() const {
    for (const cuda::Stream& s : streams_) s.synchronize();
    for (const cuda::Stream& s : comm_streams_) s.synchronize();
  }

  /// Runs per_rank(DeviceSimTransport&) on world_size() threads (rank r on
  /// thread r, its device set) and returns when all have returned; their GPU
  /// work may still run (synchronize()). Rethrows the first exception of any
  /// rank, with the rank named.
  template <class F>
  void run(F&& per_rank) {
    run_threads(per_rank, [](int) {}, [](int) {});
  }

  /// The same, but everything the ranks enqueue is recorded into one CUDA
  /// graph instead of being run: replay it with launch(). Ranks must not
  /// synchronise with their streams, allocate or free inside (see the header).
  template <class F>
  DeviceSimGraph capture(F&& per_rank) {
    CPDISPATCH_CUDA_CHECK(cudaSetDevice(options_.device));
    cuda::Stream origin;
    cuda::Event fork;
    CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(origin.get(), cudaStreamCaptureModeRelaxed));
    cudaGraph_t graph = nullptr;
    try {
      fork.record(origin.get());
      // Each rank's stream joins the capture by waiting on the fork, and is
      // joined back by the origin waiting on the rank's last event.
      run_threads(per_rank, [&](int r) { fork.wait_on(stream(r)); },
                  [&](int r) { joined_[static_cast<std::size_t>(r)].record(stream(r)); });
      for (const cuda::Event& j : joined_) j.wait_on(origin.get());
    } catch (...) {
      // End the (now failed) capture so that the streams are usable again.
      for (const cuda::Event& j : joined_) (void)cudaStreamWaitEvent(origin.get(), j.get(), 0);
      (void)cudaStreamEndCapture(origin.get(), &graph);
      if (graph) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    CPDISPATCH_CUDA_CHECK(cudaStreamEndCapture(origin.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t rc = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    CPDISPATCH_CUDA_CHECK(rc);
    return DeviceSimGraph(exec);
  }

 private:
  friend class DeviceSimTransport;

  /// `enter(r)` runs on rank r's thread before per_rank, `leave(r)` after it
  /// (also when it threw, so a capture's streams are always joined back).
  template <class F, class Enter, class Leave>
  void run_threads(F& per_rank, Enter&& enter, Leave&& leave) {
    run_ranks(
        [this] {
          slots_.assign(transports_.size(), {});
          for (auto& t : transports_) t->requests_.clear();  // left over from a failed run
        },
        [&](int r) {
          CPDISPATCH_CUDA_CHECK(cudaSetDevice(options_.device));
          enter(r);
          try {
            per_rank(*transports_[static_cast<std::size_t>(r)]);
          } catch (...) {
            abort(r, std::current_exception());  // the first error is the news; leave() still joins the stream back
          }
          leave(r);
        });
  }

  DeviceSimOptions options_;
  std::vector<cuda::Stream> streams_;
  std::vector<cuda::Stream> comm_streams_;  // per rank: its posted exchanges
  std::vector<cuda::Event> published_;  // per rank: its stream at the start of the collective
  std::vector<cuda::Event> read_;       // per rank: its stream after its reads of the collective
  std::vector<cuda::Event> joined_;     // per rank: its stream at the end of a capture
  std::vector<cuda::DeviceBuffer<std::byte>> scratch_;       // all_reduce results before they are written back
  std::vector<cuda::DeviceBuffer<std::byte>> accumulators_;  // sums over more than kernels::sum_sources_per_pass ranks
  std::vector<cuda::DeviceBuffer<std::byte>> outgrown_;      // replaced scratch and accumulators: captured graphs may still use them
  std::mutex outgrown_mutex_;
  std::vector<detail::device_sim::SimSlot> slots_;     // guarded by the world's mutex
  std::vector<std::unique_ptr<DeviceSimTransport>> transports_;  // last: made from the members above
};

// ---- DeviceSimTransport ------------------------------------------------------

inline int DeviceSimTransport::world_size() const noexcept { return world_.world_size(); }
inline cudaStream_t DeviceSimTransport::stream() const noexcept { return world_.streams_[static_cast<std::size_t>(rank_)].get(); }
inline cudaStream_t DeviceSimTransport::comm_stream() const noexcept { return world_.comm_streams_[static_cast<std::size_t>(rank_)].get(); }

inline void DeviceSimTransport::fail(const char* op, const std::string& what) { world_.raise_invalid(rank_, op, what); }

template <class Read>
void DeviceSimTransport::collective(const detail::sim::Call& call, detail::device_sim::SimSlot slot, cudaStream_t on, Read&& read) {
  const auto me = static_cast<std::size_t>(rank_);
  try {
    world_.published_[me].record(on);
  } catch (...) {
    world_.abort(rank_, std::current_exception());
    throw;
  }
  {
    std::lock_guard lock(world_.mutex_);
    world_.slots_[me] = slot;
  }
  world_.arrive_and_wait(rank_, call);
  try {
    read();
    world_.read_[me].record(on);
  } catch (...) {
    world_.abort(rank_, std::current_exception());
    throw;
  }
  world_.arrive_and_wait(rank_, call);  // every rank has enqueued its reads and recorded read_
  try {
    for (std::size_t s = 0; s < world_.read_.size(); ++s) {
      if (s != me) world_.read_[s].wait_on(on);
    }
  } catch (...) {
    world_.abort(rank_, std::current_exception());
    throw;
  }
  // read_ and published_ are recorded again only in the next collective,
  // after its first meeting, which every rank reaches after these waits.
}

inline void DeviceSimTransport::after_publish_of(std::size_t s, cudaStream_t on) {
  if (s != static_cast<std::size_t>(rank_)) world_.published_[s].wait_on(on);
}

inline void DeviceSimTransport::all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                             std::span<const std::size_t> send_displs, void* recv, std::span<const std::size_t> recv_counts,
                                             std::span<const std::size_t> recv_displs) {
  exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, stream());
}

inline void DeviceSimTransport::exchange(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                                         void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                                         cudaStream_t on) {
  const char* op = "all_to_all_v";
  const auto W = static_cast<std::size_t>(world_size());
  for (auto [name, s] : {std::pair{"send_counts", send_counts}, std::pair{"send_displs", send_displs}, std::pair{"recv_counts", recv_counts},
                         std::pair{"recv_displs", recv_displs}}) {
    if (s.size() != W) fail(op, detail::concat(name, " has ", s.size(), " entries, world_size is ", W));
  }
  collective({op}, {.send = send, .recv = recv, .send_counts = send_counts, .send_displs = send_displs}, on, [&] {
    const auto me = static_cast<std::size_t>(rank_);
    for (std::size_t s = 0; s < W; ++s) {
      const detail::device_sim::SimSlot& from = world_.slots_[s];
      const std::size_t bytes = from.send_counts[me];
      if (bytes != recv_counts[s]) {
        fail(op, detail::concat("rank ", s, " sends ", bytes, " bytes to rank ", rank_, ", which expects recv_counts[", s,
                                            "] = ", recv_counts[s]));
      }
      if (bytes == 0) continue;
      after_publish_of(s, on);
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(recv) + recv_displs[s],
                                            static_cast<const std::byte*>(from.send) + from.send_displs[me], bytes,
                                            cudaMemcpyDeviceToDevice, on));
    }
  });
}

inline void DeviceSimTransport::barrier() {
  collective({"barrier"}, {}, stream(), [&] {
    for (std::size_t s = 0; s < world_.published_.size(); ++s) after_publish_of(s, stream());
  });
}

inline void DeviceSimTransport::broadcast(void* buf, std::size_t bytes, int root) {
  const char* op = "broadcast";
  if (root < 0 || root >= world_size()) fail(op, detail::concat("root ", root, " is outside [0, ", world_size(), ")"));
  collective({op, bytes, -1, root}, {.send = buf, .recv = buf}, stream(), [&] {
    if (rank_ == root || bytes == 0) return;
    const auto r = static_cast<std::size_t>(root);
    after_publish_of(r, stream());
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(buf, world_.slots_[r].send, bytes, cudaMemcpyDeviceToDevice, stream()));
  });
}

inline void DeviceSimTransport::grow(cuda::DeviceBuffer<std::byte>& buffer, std::size_t bytes) {
  if (buffer.size() >= bytes) return;
  cuda::DeviceBuffer<std::byte> bigger(bytes);
  {
    std::lock_guard lock(world_.outgrown_mutex_);
    world_.outgrown_.push_back(std::move(buffer));  // a graph captured before may still read and write it
  }
  buffer = std::move(bigger);
}

inline std::size_t DeviceSimTransport::bytes_of(const char* op, std::size_t count, ElementType type) {
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(count, element_size(type), &bytes)) {
    fail(op, detail::concat(count, " elements of ", element_name(type), " overflow the size type"));
  }
  return bytes;
}

inline void DeviceSimTransport::sum(ElementType type, void* out, std::span<const void* const> sources, std::size_t count) {
  void* acc = nullptr;
  if (sources.size() > cuda::kernels::sum_sources_per_pass) {
    cuda::DeviceBuffer<std::byte>& a = world_.accumulators_[static_cast<std::size_t>(rank_)];
    grow(a, count * 8);  // count * element size did not overflow, and elements are at least 1 byte: checked below 2^61
    acc = a.data();
  }
  cuda::launch_sum(type, out, acc, sources, count, stream());
}

inline void DeviceSimTransport::all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp) {
  const char* op = "all_reduce";
  const std::size_t bytes = bytes_of(op, count, type);
  if (count > (std::size_t{1} << 60)) fail(op, detail::concat(count, " elements are more than the accumulators can hold"));
  cuda::DeviceBuffer<std::byte>& scratch = world_.scratch_[static_cast<std::size_t>(rank_)];
  collective({op, count, static_cast<int>(type), -1}, {.send = buf, .recv = buf}, stream(), [&] {
    grow(scratch, bytes);
    sources_.assign(world_.slots_.size(), nullptr);
    for (std::size_t s = 0; s < sources_.size(); ++s) {
      after_publish_of(s, stream());
      sources_[s] = world_.slots_[s].send;
    }
    sum(type, scratch.data(), sources_, count);
  });
  // Every rank has read every buffer (the collective's second meeting and
  // the waits on read_): now our own may be overwritten.
  if (bytes) CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(buf, scratch.data(), bytes, cudaMemcpyDeviceToDevice, stream()));
}

inline void DeviceSimTransport::all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type) {
  const char* op = "all_gather";
  const std::size_t bytes = bytes_of(op, count_per_rank, type);
  if (bytes > static_cast<std::size_t>(-1) / static_cast<std::size_t>(world_size())) {
    fail(op, detail::concat(world_size(), " ranks x ", bytes, " bytes overflow the size type"));
  }
  collective({op, count_per_rank, static_cast<int>(type), -1}, {.send = send, .recv = recv}, stream(), [&] {
    if (bytes == 0) return;
    for (std::size_t s = 0; s < world_.slots_.size(); ++s) {
      after_publish_of(s, stream());
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(recv) + s * bytes, world_.slots_[s].send, bytes,
                                            cudaMemcpyDeviceToDevice, stream()));
    }
  });
}

inline void DeviceSimTransport::reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp) {
  const char* op = "reduce_scatter";
  const std::size_t bytes = bytes_of(op, count_per_rank, type);
  if (count_per_rank > (std::size_t{1} << 60)) fail(op, detail::concat(count_per_rank, " elements are more than the accumulators can hold"));
  if (bytes > static_cast<std::size_t>(-1) / static_cast<std::size_t>(world_size())) {
    fail(op, detail::concat(world_size(), " ranks x ", bytes, " bytes overflow the size type"));
  }
  collective({op, count_per_rank, static_cast<int>(type), -1}, {.send = send, .recv = recv}, stream(), [&] {
    sources_.assign(world_.slots_.size(), nullptr);
    for (std::size_t s = 0; s < sources_.size(); ++s) {
      after_publish_of(s, stream());
      sources_[s] = static_cast<const std::byte*>(world_.slots_[s].send) + static_cast<std::size_t>(rank_) * bytes;
    }
    sum(type, recv, sources_, count_per_rank);
  });
}

inline Request DeviceSimTransport::post(const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer, int tag) {
  auto msg = world_.new_message(rank_, op, is_send, send, recv, bytes, peer, tag);
  try {
    msg->done.emplace();
    if (is_send) {
      msg->ready.emplace();
      msg->ready->record(stream());
    }
  } catch (...) {
    world_.abort(rank_, std::current_exception());
    throw;
  }
  // Paired: enqueue the copy on the receiver's stream, now, after the
  // sender's stream has reached its isend.
  world_.post(rank_, op, msg, [this](detail::device_sim::Message& s, detail::device_sim::Message& r) {
    try {
      const cudaStream_t receiver = world_.streams_[static_cast<std::size_t>(r.dst)].get();
      s.ready->wait_on(receiver);
      if (s.bytes) CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(r.recv, s.send, s.bytes, cudaMemcpyDeviceToDevice, receiver));
      s.done->record(receiver);  // the sender's wait() orders its stream after this
      r.done->record(receiver);
    } catch (const std::exception& e) {
      s.error = r.error = e.what();
    }
  });
  return requests_.add(std::move(msg));
}

inline Request DeviceSimTransport::isend(const void* buf, std::size_t bytes, int peer, int tag) {
  return post("isend", true, buf, nullptr, bytes, peer, tag);
}

inline Request DeviceSimTransport::irecv(void* buf, std::size_t bytes, int peer, int tag) {
  return post("irecv", false, nullptr, buf, bytes, peer, tag);
}

inline Request DeviceSimTransport::post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                                                     std::span<const std::size_t> send_displs, void* recv,
                                                     std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  const cudaEvent_t done = take_event();
  try {
    inputs_ready_.record(stream());
    inputs_ready_.wait_on(comm_stream());
  } catch (...) {
    free_events_.push_back(done);
    world_.abort(rank_, std::current_exception());
    throw;
  }
  try {
    exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, comm_stream());
  } catch (...) {
    free_events_.push_back(done);
    throw;  // the collective has aborted the world where it had to
  }
  try {
    // After the collective's waits on the other ranks' reads: our send buffer is free again too.
    CPDISPATCH_CUDA_CHECK(cudaEventRecord(done, comm_stream()));
  } catch (...) {
    free_events_.push_back(done);
    world_.abort(rank_, std::current_exception());
    throw;
  }
  const std::uint64_t id = posted_bit | next_posted_++;
  posted_.push_back({id, done});
  return Request{id};
}

inline cudaEvent_t DeviceSimTransport::take_event() {
  if (free_events_.empty()) {
    events_.emplace_back();
    free_events_.reserve(events_.size());  // giving events back never allocates
    posted_.reserve(events_.size());
    return events_.back().get();
  }
  const cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

inline void DeviceSimTransport::wait(Request request) {
  if (request.id & posted_bit) {  // a posted exchange: running on comm_stream()
    const auto it = std::find_if(posted_.begin(), posted_.end(), [&](const PostedExchange& p) { return p.id == request.id; });
    if (it == posted_.end()) fail("wait", detail::concat("request ", request.id, " is not a pending posted exchange on this rank"));
    CPDISPATCH_CUDA_CHECK(cudaStreamWaitEvent(stream(), it->done, 0));
    free_events_.push_back(it->done);
    posted_.erase(it);
    return;
  }
  const std::shared_ptr<detail::device_sim::Message> msg = world_.wait_request(rank_, requests_, request);
  try {
    msg->done->wait_on(stream());  // the copy (on the receiver's stream) comes before our later work
  } catch (...) {
    world_.abort(rank_, std::current_exception());
    throw;
  }
}

}  // namespace cpdispatch
