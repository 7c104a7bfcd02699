#pragma once
// A CUDA runtime double for running the library's CUDA code on the CPU, in
// tests only (never installed). It stands in for <cuda_runtime.h> when the
// kernels header is compiled by the host compiler
// (CPDISPATCH_CUDA_HOST_HARNESS), so the kernels, the device data path, the
// device sim and NcclTransport execute in CI machines without a GPU.
//
// What it models, strictly enough to find the bugs a GPU would show:
// - Device memory is host memory with 256 guard bytes on each side, checked
//   at cudaFree, after every test and at exit; fresh memory is poisoned
//   (0xCB), freed memory too (0xDD) and kept in quarantine, so a copy or a
//   kernel argument into freed memory is reported (a violation).
// - Streams are ordered queues. Nothing runs when it is enqueued: work runs
//   at synchronisation points (cudaStreamSynchronize, cudaDeviceSynchronize,
//   cudaEventSynchronize, synchronous copies, cudaFree), where a scheduler
//   seeded by CPDISPATCH_CUDA_CPU_SEED picks, again and again, a random
//   stream whose next operation may run (event waits and the legacy stream's
//   implicit ordering honoured). A missing event wait therefore shows up as
//   wrong bytes under some seed.
// - Kernel launches check the configuration (block and grid limits) and the
//   stream's device; at run time every pointer argument must be null or
//   point into live device memory. Blocks run in a random order, the
//   threads of a block one after another: races between threads of one
//   kernel (and anything needing __syncthreads or warp intrinsics) cannot be
//   found this way.
// - Stream capture builds a dependency graph: streams join by waiting on an
//   event recorded in the capture; ending a capture with a joined stream not
//   joined back fails (cudaErrorStreamCaptureUnjoined); synchronising during
//   a capture fails and invalidates it, as do allocations in global mode. A
//   launched graph runs its nodes in a random order that respects the
//   dependencies.
// - Synchronising calls (stream, device and event synchronisation, the
//   synchronous cudaMemcpy and cudaMemset, cudaMalloc, cudaFree) are counted
//   (cuda_harness::synchronizing_calls(), in total and per thread), so a
//   test can show that a piece of code makes none. cudaStreamQuery and
//   cudaEventQuery do not block, and are not counted.
// - cuda_harness::set_seed reseeds the scheduler, so one test can try many
//   interleavings.
// Violations are collected (cuda_harness::take_violations()); the harness's
// main() fails the program when any remain.

#define CPDISPATCH_CUDA_HOST_HARNESS 1

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- the CUDA language, as the host compiler sees it ---------------------------
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) noexcept : x(x_), y(y_), z(z_) {}
};

// The threads of a kernel run one after another on the host: an atomic is a plain update (atomic_ref for other host threads).
inline unsigned atomicXor(unsigned* address, unsigned value) { return std::atomic_ref<unsigned>(*address).fetch_xor(value); }

namespace cuda_harness {
inline thread_local uint3 thread_index{0, 0, 0};
inline thread_local uint3 block_index{0, 0, 0};
inline thread_local dim3 block_dim{1, 1, 1};
inline thread_local dim3 grid_dim{1, 1, 1};
}  // namespace cuda_harness
#define threadIdx (::cuda_harness::thread_index)
#define blockIdx (::cuda_harness::block_index)
#define blockDim (::cuda_harness::block_dim)
#define gridDim (::cuda_harness::grid_dim)

// ---- the runtime API's types -------------------------------------------------------
enum cudaError_t : int {  // a fixed type: any code converts (as from a real runtime)
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchTimeout = 702,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureImplicit = 906,
};
using cudaError = cudaError_t;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1, cudaStreamCaptureModeRelaxed = 2 };
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1, cudaStreamCaptureStatusInvalidated = 2 };
inline constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
inline constexpr unsigned cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2;
struct cudaDeviceProp {
  char name[256];
  int multiProcessorCount;
  int major, minor;
};

namespace cuda_harness {
struct Stream;
struct Event;
struct Graph;
struct GraphExec;
}  // namespace cuda_harness
using cudaStream_t = cuda_harness::Stream*;
using cudaEvent_t = cuda_harness::Event*;
using cudaGraph_t = cuda_harness::Graph*;
using cudaGraphExec_t = cuda_harness::GraphExec*;

namespace cuda_harness {

/// A point in a stream's order: reached when `stream` has completed `seq` operations.
struct Dep {
  Stream* stream;
  std::uint64_t seq;
};

/// One enqueued operation. step() runs it and returns true when it is
/// complete; an operation that needs others (a collective) may return
/// false, and is asked again later.
struct Op {
  std::string name;
  std::function<bool()> step;
  std::vector<Dep> deps;
};

struct Capture;
struct Node {
  std::string name;
  std::function<bool()> step;
  std::vector<std::size_t> deps;  // earlier nodes of the same graph
};
struct Graph {
  std::vector<Node> nodes;
};
struct GraphExec {
  std::vector<Node> nodes;
};
struct Capture {
  Graph graph;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  Stream* origin = nullptr;
  bool invalidated = false;
  std::vector<Stream*> members;
};

struct Stream {
  int device = 0;
  bool blocking = true;
  bool legacy = false;
  std::deque<Op> queue;
  std::uint64_t enqueued = 0, completed = 0;
  Capture* capture = nullptr;
  std::vector<std::size_t> tail;  // the nodes the next captured node depends on
};

struct Event {
  int device = 0;
  bool recorded = false;
  Dep at{nullptr, 0};
  Capture* capture = nullptr;  // recorded in a capture: at `nodes`
  std::vector<std::size_t> nodes;
};

struct Allocation {
  unsigned char* base = nullptr;  // the guard before, the user bytes, the guard after
  std::size_t size = 0;
  int device = 0;
  bool live = true;
};

inline constexpr std::size_t guard_bytes = 256;
inline constexpr unsigned char guard_value = 0xFD, fresh_value = 0xCB, freed_value = 0xDD;

/// The one runtime of the process. Every API call takes `mutex`; work runs
/// on the thread that synchronises, under the mutex.
class Runtime {
 public:
  static Runtime& get() {
    static Runtime runtime;
    return runtime;
  }

  std::mutex mutex;
  std::condition_variable progress;
  std::mt19937_64 rng;
  int devices = 8;
  std::chrono::milliseconds stall_limit{20000};
  Stream legacy;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::unique_ptr<Event>> events;
  std::map<std::uintptr_t, Allocation> allocations;  // by user address
  std::size_t quarantined = 0;
  std::vector<std::string> violations;
  std::vector<Capture*> captures;  // active
  std::uint64_t seed = 1;

  Runtime() {
    if (const char* s = std::getenv("CPDISPATCH_CUDA_CPU_SEED")) seed = std::strtoull(s, nullptr, 10);
    if (const char* d = std::getenv("CPDISPATCH_CUDA_CPU_DEVICES")) devices = std::atoi(d);
    if (const char* t = std::getenv("CPDISPATCH_CUDA_CPU_STALL_MS")) stall_limit = std::chrono::milliseconds(std::atoll(t));
    rng.seed(seed);
    legacy.legacy = true;
  }
  ~Runtime() {
    for (auto& [at, a] : allocations) std::free(a.base);
  }

  void violation(std::string what) {
    std::fprintf(stderr, "cuda-cpu harness: %s\n", what.c_str());
    violations.push_back(std::move(what));
  }

  // ---- memory ----
  /// The allocation holding [p, p + n), or null.
  Allocation* find(const void* p, std::size_t n = 1) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    auto it = allocations.upper_bound(at);
    if (it == allocations.begin()) return nullptr;
    --it;
    Allocation& a = it->second;
    const std::uintptr_t off = at - it->first;
    if (off > a.size || n > a.size - off) return nullptr;
    return &a;
  }
  bool is_device(const void* p) { return find(p, 0) != nullptr; }

  std::string check_guards(std::uintptr_t at, const Allocation& a) {
    for (std::size_t i = 0; i < guard_bytes; ++i) {
      if (a.base[i] != guard_value) return "guard byte " + std::to_string(guard_bytes - i) + " before an allocation of " + std::to_string(a.size) + " bytes overwritten";
      if (a.base[guard_bytes + a.size + i] != guard_value) {
        return "guard byte " + std::to_string(i) + " after an allocation of " + std::to_string(a.size) + " bytes (at 0x" + hex(at) + ") overwritten";
      }
    }
    return {};
  }
  void check_all_guards(const char* when) {
    for (auto& [at, a] : allocations) {
      if (!a.live) continue;
      if (std::string bad = check_guards(at, a); !bad.empty()) violation(std::string(when) + ": " + bad);
    }
  }
  static std::string hex(std::uintptr_t v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(v));
    return buf;
  }

  /// Checks at run time that [p, p + n) is live device memory.
  bool device_range(const char* op, const char* what, const void* p, std::size_t n) {
    if (n == 0) return true;
    Allocation* a = find(p, n);
    if (a && a->live) return true;
    if (a) violation(std::string(op) + ": " + what + " is in freed device memory");
    else violation(std::string(op) + ": " + what + " [0x" + hex(reinterpret_cast<std::uintptr_t>(p)) + ", +" + std::to_string(n) +
                   ") is not inside one device allocation");
    return false;
  }

  // ---- ordering ----
  Stream* resolve(cudaStream_t s) { return s ? s : &legacy; }
  static bool reached(const Dep& d) { return d.stream->completed >= d.seq; }

  /// Enqueues (or captures) an operation on `s`.
  cudaError_t enqueue(Stream* s, std::string name, std::function<bool()> step) {
    if (s->capture) {
      if (s->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
      Graph& g = s->capture->graph;
      g.nodes.push_back({std::move(name), std::move(step), s->tail});
      s->tail = {g.nodes.size() - 1};
      return cudaSuccess;
    }
    if (s->legacy || s->blocking) {
      for (Capture* c : captures) {
        for (Stream* m : c->members) {
          if (m != s && (s->legacy ? m->blocking : m->legacy)) return invalidate_all(cudaErrorStreamCaptureImplicit);
        }
      }
    }
    Op op{std::move(name), std::move(step), {}};
    if (s->legacy) {
      for (auto& other : streams) {
        if (other->blocking) op.deps.push_back({other.get(), other->enqueued});
      }
    } else if (s->blocking) {
      op.deps.push_back({&legacy, legacy.enqueued});
    }
    s->queue.push_back(std::move(op));
    ++s->enqueued;
    progress.notify_all();
    return cudaSuccess;
  }

  /// Runs one runnable operation, picked at random; false when none could progress.
  bool step_any() {
    std::vector<Stream*> ready;
    auto consider = [&](Stream* s) {
      if (s->queue.empty()) return;
      for (const Dep& d : s->queue.front().deps) {
        if (!reached(d)) return;
      }
      ready.push_back(s);
    };
    consider(&legacy);
    for (auto& s : streams) consider(s.get());
    std::shuffle(ready.begin(), ready.end(), rng);
    for (Stream* s : ready) {
      Op& op = s->queue.front();
      if (!op.step()) continue;
      s->queue.pop_front();
      ++s->completed;
      progress.notify_all();
      return true;
    }
    return false;
  }

  /// Runs work until `done()`; a violation or a stall is an error.
  cudaError_t drain(std::unique_lock<std::mutex>& lock, const std::function<bool()>& done) {
    const std::size_t before = violations.size();
    auto last = std::chrono::steady_clock::now();
    while (!done()) {
      if (step_any()) {
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last > stall_limit) {
        violation("no operation could run for " + std::to_string(stall_limit.count()) + " ms: " + pending());
        return cudaErrorLaunchTimeout;
      }
      progress.wait_for(lock, std::chrono::milliseconds(2));
    }
    return violations.size() == before ? cudaSuccess : cudaErrorIllegalAddress;
  }
  std::string pending() {
    std::string out;
    auto add = [&](Stream* s, const char* which) {
      if (!s->queue.empty()) out += std::string(which) + " stream waits in " + s->queue.front().name + "; ";
    };
    add(&legacy, "the legacy");
    for (auto& s : streams) add(s.get(), "a");
    return out;
  }
  /// Runs the work of `device`'s streams (and the legacy stream) to the end.
  cudaError_t drain_device(std::unique_lock<std::mutex>& lock, int device) {
    return drain(lock, [this, device] {
      if (!legacy.queue.empty()) return false;
      for (auto& s : streams) {
        if (s->device == device && !s->queue.empty()) return false;
      }
      return true;
    });
  }

  // ---- capture ----
  cudaError_t invalidate_all(cudaError_t code) {
    for (Capture* c : captures) c->invalidated = true;
    return code;
  }
  /// A call that synchronises: illegal while any capture is active.
  bool syncing_during_capture() {
    if (captures.empty()) return false;
    invalidate_all(cudaErrorStreamCaptureUnsupported);
    return true;
  }
  bool global_capture_active() {
    for (Capture* c : captures) {
      if (c->mode == cudaStreamCaptureModeGlobal) return true;
    }
    return false;
  }
};

inline thread_local int current_device = 0;
inline thread_local cudaError_t last_error = cudaSuccess;
inline std::atomic<std::uint64_t> synchronizing_total{0};
inline thread_local std::uint64_t synchronizing_here = 0;

/// Counts one synchronising call (made by the calling thread).
inline void count_synchronizing() {
  synchronizing_total.fetch_add(1, std::memory_order_relaxed);
  ++synchronizing_here;
}

/// Synchronising calls so far, by every thread.
inline std::uint64_t synchronizing_calls() { return synchronizing_total.load(std::memory_order_relaxed); }
/// Synchronising calls so far by the calling thread (other ranks' threads may synchronise meanwhile).
inline std::uint64_t synchronizing_calls_on_this_thread() { return synchronizing_here; }

inline cudaError_t fail(cudaError_t code) {
  if (code != cudaSuccess) last_error = code;
  return code;
}

/// The violations so far, cleared (for tests of the harness itself).
inline std::vector<std::string> take_violations() {
  Runtime& rt = Runtime::get();
  std::lock_guard lock(rt.mutex);
  return std::exchange(rt.violations, {});
}

inline std::uint64_t seed() { return Runtime::get().seed; }

/// Reseeds the scheduler (and the kernels' block order): the interleavings that follow are those of `seed`.
inline void set_seed(std::uint64_t seed) {
  Runtime& rt = Runtime::get();
  std::lock_guard lock(rt.mutex);
  rt.seed = seed;
  rt.rng.seed(seed);
}

/// Restores the scheduler's seed when a scope that reseeds ends.
class SeedGuard {
 public:
  SeedGuard() : seed_(seed()) {}
  SeedGuard(const SeedGuard&) = delete;
  SeedGuard& operator=(const SeedGuard&) = delete;
  ~SeedGuard() { set_seed(seed_); }

 private:
  std::uint64_t seed_;
};

/// Events created so far (cudaEventCreate*), by every thread.
inline std::size_t events_created() {
  Runtime& rt = Runtime::get();
  std::lock_guard lock(rt.mutex);
  return rt.events.size();
}

/// Live device allocations: how many, and their bytes.
inline std::pair<std::size_t, std::size_t> live_allocations() {
  Runtime& rt = Runtime::get();
  std::lock_guard lock(rt.mutex);
  std::pair<std::size_t, std::size_t> out{0, 0};
  for (const auto& [at, a] : rt.allocations) {
    if (a.live) {
      ++out.first;
      out.second += a.size;
    }
  }
  return out;
}

/// How long the scheduler waits for work that cannot run before calling it a deadlock.
inline void set_stall_limit(std::chrono::milliseconds limit) {
  Runtime& rt = Runtime::get();
  std::lock_guard lock(rt.mutex);
  rt.stall_limit = limit;
}

/// Locks the runtime for an API call.
inline std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(Runtime::get().mutex); }

/// Copies a kernel argument: pointers are checked when the kernel runs.
template <class T>
void check_argument(Runtime& rt, const char* kernel, std::size_t index, const T& value) {
  if constexpr (std::is_pointer_v<T>) {
    if (value == nullptr) return;
    Allocation* a = rt.find(value, 0);
    if (a && a->live) return;
    rt.violation(std::string(kernel) + ": argument " + std::to_string(index) +
                 (a ? " points into freed device memory" : " is not a device pointer"));
  }
}

/// The host grid loop: `kernel(args...)` for every thread of every block,
/// blocks in a random order, the threads of a block one after another.
template <class... P, class... A>
cudaError_t launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launch: wrong number of arguments");
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || shared_bytes > 48 * 1024) {
    return fail(cudaErrorInvalidConfiguration);
  }
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (!s->legacy && s->device != current_device) return fail(cudaErrorInvalidResourceHandle);
  auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
  const cudaError_t rc = rt.enqueue(s, name, [&rt, name, kernel, grid, block, params] {
    std::size_t i = 0;
    std::apply([&](const auto&... v) { (check_argument(rt, name, i++, v), ...); }, *params);
    std::vector<std::uint64_t> order(std::uint64_t{grid.x} * grid.y * grid.z);
    for (std::uint64_t b = 0; b < order.size(); ++b) order[b] = b;
    std::shuffle(order.begin(), order.end(), rt.rng);
    grid_dim = grid;
    block_dim = block;
    for (std::uint64_t b : order) {
      block_index = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y), static_cast<unsigned>(b / grid.x / grid.y)};
      for (unsigned z = 0; z < block.z; ++z)
        for (unsigned y = 0; y < block.y; ++y)
          for (unsigned x = 0; x < block.x; ++x) {
            thread_index = {x, y, z};
            std::apply(kernel, *params);
          }
    }
    return true;
  });
  return fail(rc);
}

}  // namespace cuda_harness

// ---- the runtime API ---------------------------------------------------------------

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
  }
  return "cudaError?";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered (cuda-cpu harness: see the violations printed)";
    case cudaErrorLaunchTimeout: return "no progress (cuda-cpu harness: a wait that can never be met)";
    case cudaErrorStreamCaptureUnjoined: return "capture was not joined back to the origin stream";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return cudaGetErrorName(e);
  }
}
inline cudaError_t cudaGetLastError() { return std::exchange(cuda_harness::last_error, cudaSuccess); }
inline cudaError_t cudaPeekAtLastError() { return cuda_harness::last_error; }

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = cuda_harness::Runtime::get().devices;
  return *count > 0 ? cudaSuccess : cuda_harness::fail(cudaErrorNoDevice);
}
inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= cuda_harness::Runtime::get().devices) return cuda_harness::fail(cudaErrorInvalidDevice);
  cuda_harness::current_device = device;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = cuda_harness::current_device;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= cuda_harness::Runtime::get().devices) return cuda_harness::fail(cudaErrorInvalidDevice);
  *prop = {};
  std::snprintf(prop->name, sizeof prop->name, "cpdispatch cuda-cpu harness (device %d)", device);
  prop->multiProcessorCount = 1;
  prop->major = 9;
  return cudaSuccess;
}

inline cudaError_t cudaMalloc(void** p, std::size_t n) {
  using namespace cuda_harness;
  count_synchronizing();
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (rt.global_capture_active()) return fail(rt.invalidate_all(cudaErrorStreamCaptureUnsupported));
  *p = nullptr;
  if (n == 0) return cudaSuccess;
  if (n > (std::size_t{1} << 40)) return fail(cudaErrorMemoryAllocation);
  const std::size_t total = (n + 2 * guard_bytes + guard_bytes - 1) / guard_bytes * guard_bytes;
  auto* base = static_cast<unsigned char*>(std::aligned_alloc(guard_bytes, total));
  if (!base) return fail(cudaErrorMemoryAllocation);
  std::memset(base, guard_value, guard_bytes);
  std::memset(base + guard_bytes, fresh_value, n);
  std::memset(base + guard_bytes + n, guard_value, total - guard_bytes - n);
  rt.allocations[reinterpret_cast<std::uintptr_t>(base + guard_bytes)] = {base, n, current_device, true};
  *p = base + guard_bytes;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, std::size_t n) {
  return cudaMalloc(reinterpret_cast<void**>(p), n);
}

inline cudaError_t cudaFree(void* p) {
  using namespace cuda_harness;
  if (!p) return cudaSuccess;
  count_synchronizing();
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (rt.syncing_during_capture()) return fail(cudaErrorStreamCaptureUnsupported);
  const cudaError_t rc = rt.drain_device(l, current_device);  // cudaFree waits for the device
  auto it = rt.allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == rt.allocations.end() || !it->second.live) {
    rt.violation(it == rt.allocations.end() ? "cudaFree of a pointer cudaMalloc did not return" : "cudaFree of freed device memory");
    return fail(cudaErrorInvalidValue);
  }
  Allocation& a = it->second;
  if (std::string bad = rt.check_guards(it->first, a); !bad.empty()) rt.violation("cudaFree: " + bad);
  std::memset(a.base + guard_bytes, freed_value, a.size);
  a.live = false;
  rt.quarantined += a.size;
  while (rt.quarantined > (std::size_t{512} << 20)) {  // keep the quarantine bounded: release the oldest-addressed freed blocks
    auto old = std::find_if(rt.allocations.begin(), rt.allocations.end(), [](const auto& e) { return !e.second.live; });
    rt.quarantined -= old->second.size;
    std::free(old->second.base);
    rt.allocations.erase(old);
  }
  return fail(rc);
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  rt.streams.push_back(std::make_unique<Stream>());
  rt.streams.back()->device = current_device;
  rt.streams.back()->blocking = (flags & cudaStreamNonBlocking) == 0;
  *s = rt.streams.back().get();
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
/// Streams stay allocated (their pending work still runs); destroying one only forbids its use.
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { return s ? cudaSuccess : cuda_harness::fail(cudaErrorInvalidResourceHandle); }

namespace cuda_harness {
/// cudaStreamSynchronize, not counted (the synchronous copies count once).
inline cudaError_t stream_synchronize(cudaStream_t stream) {
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (s->capture) {
    rt.invalidate_all(cudaErrorStreamCaptureUnsupported);
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (s->legacy && rt.syncing_during_capture()) return fail(cudaErrorStreamCaptureUnsupported);
  const std::uint64_t target = s->enqueued;
  return fail(rt.drain(l, [s, target] { return s->completed >= target; }));
}
}  // namespace cuda_harness

inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  cuda_harness::count_synchronizing();
  return cuda_harness::stream_synchronize(stream);
}
/// Runs what can run now, then says whether the stream's work is done.
inline cudaError_t cudaStreamQuery(cudaStream_t stream) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (s->capture) return fail(rt.invalidate_all(cudaErrorStreamCaptureUnsupported));
  const std::size_t before = rt.violations.size();
  while (!s->queue.empty() && rt.step_any()) {
  }
  if (rt.violations.size() != before) return fail(cudaErrorIllegalAddress);
  return s->queue.empty() ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaDeviceSynchronize() {
  using namespace cuda_harness;
  count_synchronizing();
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (rt.syncing_during_capture()) return fail(cudaErrorStreamCaptureUnsupported);
  return fail(rt.drain_device(l, current_device));
}

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  rt.events.push_back(std::make_unique<Event>());
  rt.events.back()->device = current_device;
  *e = rt.events.back().get();
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { return e ? cudaSuccess : cuda_harness::fail(cudaErrorInvalidResourceHandle); }

inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream = nullptr) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  e->recorded = true;
  if (s->capture) {
    if (s->capture->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    e->capture = s->capture;
    e->nodes = s->tail;
    e->at = {nullptr, 0};
    return cudaSuccess;
  }
  e->capture = nullptr;
  e->nodes.clear();
  // The legacy stream's position includes the blocking streams' work before it.
  if (s->legacy) rt.enqueue(s, "cudaEventRecord", [] { return true; });
  e->at = {s, s->enqueued};
  return cudaSuccess;
}

inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned = 0) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (!e->recorded) return cudaSuccess;
  if (e->capture) {
    if (e->capture->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    if (s->capture && s->capture != e->capture) return fail(rt.invalidate_all(cudaErrorStreamCaptureIsolation));
    if (!s->capture) {  // s joins the capture
      s->capture = e->capture;
      s->tail.clear();
      e->capture->members.push_back(s);
    }
    for (std::size_t n : e->nodes) {
      if (std::find(s->tail.begin(), s->tail.end(), n) == s->tail.end()) s->tail.push_back(n);
    }
    return cudaSuccess;
  }
  if (s->capture) {  // a dependency on work outside the capture
    s->capture->invalidated = true;
    return fail(cudaErrorStreamCaptureIsolation);
  }
  Op op{"cudaStreamWaitEvent", [] { return true; }, {e->at}};
  if (s->blocking && !s->legacy) op.deps.push_back({&rt.legacy, rt.legacy.enqueued});
  s->queue.push_back(std::move(op));
  ++s->enqueued;
  rt.progress.notify_all();
  return cudaSuccess;
}

inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  using namespace cuda_harness;
  count_synchronizing();
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (e->capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (!e->recorded) return cudaSuccess;
  const Dep at = e->at;
  return fail(rt.drain(l, [at] { return Runtime::reached(at); }));
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto l = cuda_harness::lock();
  if (e->capture) return cuda_harness::fail(cudaErrorStreamCaptureUnsupported);
  return !e->recorded || cuda_harness::Runtime::reached(e->at) ? cudaSuccess : cudaErrorNotReady;
}
/// No clock: the harness measures nothing.
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0;
  return cudaSuccess;
}

namespace cuda_harness {
/// Checks the ranges of a copy when it is enqueued (invalid value) and again when it runs (violation).
inline bool copy_ranges_ok(Runtime& rt, void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, bool at_run) {
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (n == 0) return true;
  if (at_run) {
    bool ok = true;
    if (dst_dev) ok = rt.device_range("cudaMemcpy", "the destination", dst, n) && ok;
    if (src_dev) ok = rt.device_range("cudaMemcpy", "the source", src, n) && ok;
    return ok;
  }
  if (dst_dev && !rt.find(dst, n)) return false;
  if (src_dev && !rt.find(src, n)) return false;
  if (!dst_dev && kind != cudaMemcpyDefault && rt.is_device(dst)) return false;
  if (!src_dev && kind != cudaMemcpyDefault && rt.is_device(src)) return false;
  return true;
}
}  // namespace cuda_harness

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, cudaStream_t stream = nullptr) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (!copy_ranges_ok(rt, dst, src, n, kind, false)) return fail(cudaErrorInvalidValue);
  return fail(rt.enqueue(rt.resolve(stream), "cudaMemcpyAsync", [&rt, dst, src, n, kind] {
    if (copy_ranges_ok(rt, dst, src, n, kind, true) && n) std::memmove(dst, src, n);
    return true;
  }));
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t n, cudaStream_t stream = nullptr) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  if (n && !rt.find(dst, n)) return fail(cudaErrorInvalidValue);
  return fail(rt.enqueue(rt.resolve(stream), "cudaMemsetAsync", [&rt, dst, value, n] {
    if (rt.device_range("cudaMemset", "the destination", dst, n) && n) std::memset(dst, value, n);
    return true;
  }));
}
/// Synchronous: on the legacy stream, then waits for it.
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  cuda_harness::count_synchronizing();
  {
    auto l = cuda_harness::lock();
    if (cuda_harness::Runtime::get().syncing_during_capture()) return cuda_harness::fail(cudaErrorStreamCaptureUnsupported);
  }
  if (const cudaError_t rc = cudaMemcpyAsync(dst, src, n, kind, nullptr); rc != cudaSuccess) return rc;
  return cuda_harness::stream_synchronize(nullptr);
}
inline cudaError_t cudaMemset(void* dst, int value, std::size_t n) {
  cuda_harness::count_synchronizing();
  {
    auto l = cuda_harness::lock();
    if (cuda_harness::Runtime::get().syncing_during_capture()) return cuda_harness::fail(cudaErrorStreamCaptureUnsupported);
  }
  if (const cudaError_t rc = cudaMemsetAsync(dst, value, n, nullptr); rc != cudaSuccess) return rc;
  return cuda_harness::stream_synchronize(nullptr);
}

// ---- graphs ----

inline cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (s->legacy || s->capture) return fail(cudaErrorStreamCaptureUnsupported);
  auto* c = new Capture;
  c->mode = mode;
  c->origin = s;
  c->members.push_back(s);
  s->capture = c;
  s->tail.clear();
  rt.captures.push_back(c);
  return cudaSuccess;
}

namespace cuda_harness {
/// The nodes `from` depends on, transitively, and themselves.
inline std::set<std::size_t> ancestors(const Graph& g, const std::vector<std::size_t>& from) {
  std::set<std::size_t> seen;
  std::vector<std::size_t> todo = from;
  while (!todo.empty()) {
    const std::size_t n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    for (std::size_t d : g.nodes[n].deps) todo.push_back(d);
  }
  return seen;
}
}  // namespace cuda_harness

inline cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  using namespace cuda_harness;
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  *graph = nullptr;
  Capture* c = s->capture;
  if (!c) return fail(cudaErrorIllegalState);
  if (c->origin != s) {
    c->invalidated = true;
    return fail(cudaErrorStreamCaptureUnmatched);
  }
  // Every stream that joined must have joined back: its last node is before the origin's.
  const std::set<std::size_t> before_end = ancestors(c->graph, s->tail);
  bool unjoined = false;
  for (Stream* m : c->members) {
    for (std::size_t n : m->tail) unjoined = unjoined || !before_end.count(n);
  }
  for (Stream* m : c->members) {
    m->capture = nullptr;
    m->tail.clear();
  }
  rt.captures.erase(std::find(rt.captures.begin(), rt.captures.end(), c));
  const bool invalidated = c->invalidated;
  if (!invalidated && !unjoined) *graph = new Graph(std::move(c->graph));
  delete c;
  if (invalidated) return fail(cudaErrorStreamCaptureInvalidated);
  if (unjoined) return fail(cudaErrorStreamCaptureUnjoined);
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  auto l = cuda_harness::lock();
  cuda_harness::Stream* s = cuda_harness::Runtime::get().resolve(stream);
  *status = !s->capture ? cudaStreamCaptureStatusNone : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long = 0) {
  if (!graph) return cuda_harness::fail(cudaErrorInvalidValue);
  auto l = cuda_harness::lock();
  *exec = new cuda_harness::GraphExec{graph->nodes};
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
/// Enqueues the graph's nodes on `stream` in a random order that respects their dependencies.
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  using namespace cuda_harness;
  if (!exec) return fail(cudaErrorInvalidValue);
  auto l = lock();
  Runtime& rt = Runtime::get();
  Stream* s = rt.resolve(stream);
  if (s->capture) return fail(cudaErrorStreamCaptureUnsupported);
  const std::size_t n = exec->nodes.size();
  std::vector<std::size_t> waiting(n, 0);
  std::vector<std::vector<std::size_t>> users(n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t d : exec->nodes[i].deps) {
      ++waiting[i];
      users[d].push_back(i);
    }
  }
  std::vector<std::size_t> ready;
  for (std::size_t i = 0; i < n; ++i) {
    if (waiting[i] == 0) ready.push_back(i);
  }
  while (!ready.empty()) {
    std::uniform_int_distribution<std::size_t> pick(0, ready.size() - 1);
    const std::size_t k = pick(rt.rng);
    const std::size_t i = ready[k];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(k));
    if (const cudaError_t rc = rt.enqueue(s, exec->nodes[i].name, exec->nodes[i].step); rc != cudaSuccess) return fail(rc);
    for (std::size_t u : users[i]) {
      if (--waiting[u] == 0) ready.push_back(u);
    }
  }
  return cudaSuccess;
}
