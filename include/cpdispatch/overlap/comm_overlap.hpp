#pragma once
// Communication-GEMM overlap: the collective types and
// overlap methods, the communication buffer, and the id-based buffer API.
// Names, supported combinations and error messages follow Transformer
// Engine's communication-GEMM overlap (its CommOverlap classes and the
// buffer functions of its JAX extension).
//
//   CommOverlapType    NONE, RS (reduce-scatter), AG (all-gather)
//   CommOverlapMethod  NONE, BULK, PIPELINE, RING_EXCHANGE
//   ScalingMode        NO_SCALING (supported); the FP8 modes are rejected
//   CommOverlapBuffer  RAII: one buffer for a method + type + shape + dtype + tp_size
//   CommOverlapRegistry / create_comm_overlap_buffer / destroy_comm_overlap_buffer /
//   destroy_all_comm_overlap_buffers: Transformer Engine's id-based API, for callers that
//   pass handles through C interfaces
//
// The supported combinations and what the buffer holds (the overlapped GEMM
// itself is in comm_gemm.hpp; M is the buffer's rows):
//
//   RS BULK           the caller's data to reduce-scatter while an unrelated GEMM runs;   M % tp_size == 0
//   RS PIPELINE       the GEMM output, in num_splits row chunks;                          M % (tp_size * num_splits) == 0
//   RS RING_EXCHANGE  the GEMM output, one row block of partial sums per destination rank; M % tp_size == 0
//   AG RING_EXCHANGE  the all-gathered input op(A), one shard per rank;                    M % tp_size == 0
//   AG BULK           rejected: "AllGather with bulk overlap not supported"
//   AG PIPELINE       rejected: "pipeline overlap is only supported for ReduceScatter"
//   NONE NONE         a plain GEMM: it needs no buffer, so none can be created for it
//
// Buffers live in host memory (256-byte aligned, zero-filled). Every error is
// an exception of the cpdispatch::error family whose message carries the
// expected and the actual values.

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::overlap {

/// The collective a GEMM is overlapped with (seed: CommOverlapType).
enum class CommOverlapType { NONE, RS, AG };

/// How the communication is overlapped with the GEMM (seed: CommOverlapMethod).
enum class CommOverlapMethod { NONE, BULK, PIPELINE, RING_EXCHANGE };

/// Quantisation scaling of the GEMM inputs (seed: JAXX_Scaling_Mode). Only
/// NO_SCALING is implemented; the others are rejected when a buffer is created.
enum class ScalingMode { NO_SCALING, DELAYED_TENSOR_SCALING, CURRENT_TENSOR_SCALING, MXFP8_1D_SCALING };

/// Which side of an overlapped call runs on the helper thread (the other
/// runs on the calling thread). `communication`, the default, makes every
/// transport call on the helper: under MPI that needs MPI_THREAD_SERIALIZED.
/// `gemm` keeps the transport on the calling thread, which MPI_THREAD_FUNNELED
/// allows when the caller is the main thread.
enum class HelperThread { communication, gemm };

inline std::string to_string(CommOverlapType t) {
  switch (t) {
    case CommOverlapType::NONE: return "NONE";
    case CommOverlapType::RS: return "RS";
    case CommOverlapType::AG: return "AG";
  }
  return cpdispatch::detail::concat("CommOverlapType(", static_cast<int>(t), ")");
}

inline std::string to_string(CommOverlapMethod m) {
  switch (m) {
    case CommOverlapMethod::NONE: return "NONE";
    case CommOverlapMethod::BULK: return "BULK";
    case CommOverlapMethod::PIPELINE: return "PIPELINE";
    case CommOverlapMethod::RING_EXCHANGE: return "RING_EXCHANGE";
  }
  return cpdispatch::detail::concat("CommOverlapMethod(", static_cast<int>(m), ")");
}

inline std::string to_string(ScalingMode s) {
  switch (s) {
    case ScalingMode::NO_SCALING: return "NO_SCALING";
    case ScalingMode::DELAYED_TENSOR_SCALING: return "DELAYED_TENSOR_SCALING";
    case ScalingMode::CURRENT_TENSOR_SCALING: return "CURRENT_TENSOR_SCALING";
    case ScalingMode::MXFP8_1D_SCALING: return "MXFP8_1D_SCALING";
  }
  return cpdispatch::detail::concat("ScalingMode(", static_cast<int>(s), ")");
}

/// The "..." of Transformer Engine's CreateCommOverlapBuffer: everything but the type,
/// method, shape, dtype and tp_size.
struct CommOverlapOptions {
  /// Atomic GEMM (the GEMM signals finished output tiles to the communication).
  /// Needs a CUDA backend, which cpdispatch does not have yet: every overlapped
  /// call with it throws "atomic GEMM requires the CUDA backend".
  bool atomic_gemm = false;
  ScalingMode scaling_mode = ScalingMode::NO_SCALING;
  /// PIPELINE: the number of chunks the GEMM output rows are split into.
  int num_splits = 4;
  /// RING_EXCHANGE: the point-to-point tag of the ring's messages (MPI takes
  /// tags up to MPI_TAG_UB, at least 32767).
  int tag = 6006;
  HelperThread helper_thread = HelperThread::communication;
};

namespace detail {

struct AlignedDelete {
  std::size_t alignment;
  void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{alignment}); }
};

/// Rows of the buffer a method splits evenly: tp_size, or tp_size * num_splits for PIPELINE.
inline std::size_t row_divisor(CommOverlapMethod method, int tp_size, int num_splits) {
  const auto tp = static_cast<std::size_t>(tp_size);
  return method == CommOverlapMethod::PIPELINE ? tp * static_cast<std::size_t>(num_splits) : tp;
}

/// Throws for every (type, method) pair Transformer Engine does not support; the messages are Transformer Engine's.
inline void check_combination(const char* who, CommOverlapType type, CommOverlapMethod method) {
  const bool type_known = type == CommOverlapType::NONE || type == CommOverlapType::RS || type == CommOverlapType::AG;
  if (!type_known) {
    cpdispatch::detail::fail(who, ": Invalid collective type: expected NONE, RS or AG, got ", to_string(type));
  }
  const bool method_known = method == CommOverlapMethod::NONE || method == CommOverlapMethod::BULK ||
                            method == CommOverlapMethod::PIPELINE || method == CommOverlapMethod::RING_EXCHANGE;
  if (!method_known) {
    cpdispatch::detail::fail(who, ": invalid overlap method: expected NONE, BULK, PIPELINE or RING_EXCHANGE, got ", to_string(method));
  }
  if (method == CommOverlapMethod::NONE && type != CommOverlapType::NONE) {
    cpdispatch::detail::fail(who, ": Invalid collective type: method NONE runs a plain GEMM, so the collective type must be NONE, got ",
         to_string(type));
  }
  if (method != CommOverlapMethod::NONE && type == CommOverlapType::NONE) {
    cpdispatch::detail::fail(who, ": Invalid collective type: method ", to_string(method), " overlaps a collective, expected RS or AG, got NONE");
  }
  if (type == CommOverlapType::AG && method == CommOverlapMethod::BULK) {
    cpdispatch::detail::fail(who, ": AllGather with bulk overlap not supported (comm_type AG, method BULK; AG takes RING_EXCHANGE)");
  }
  if (type == CommOverlapType::AG && method == CommOverlapMethod::PIPELINE) {
    cpdispatch::detail::fail(who, ": pipeline overlap is only supported for ReduceScatter (comm_type AG, method PIPELINE; expected comm_type RS, "
              "or RING_EXCHANGE for AG)");
  }
}

/// The helper thread of one buffer: started on the first overlapped call and
/// reused by every later one (a thread per call would cost a thread start
/// per GEMM). run(task) hands it one task; the caller then waits for it with
/// wait(). Tasks must not throw (comm_gemm's catch everything).
class HelperWorker {
 public:
  HelperWorker() : thread_([this] { loop(); }) {}
  HelperWorker(const HelperWorker&) = delete;
  HelperWorker& operator=(const HelperWorker&) = delete;
  ~HelperWorker() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void run(std::function<void()> task) {
    {
      const std::lock_guard lock(mutex_);
      task_ = std::move(task);
      busy_ = true;
    }
    cv_.notify_all();
  }

  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return !busy_; });
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || task_; });
      if (stop_) return;
      std::function<void()> task = std::move(task_);
      task_ = nullptr;
      lock.unlock();
      task();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> task_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the state it reads
};

}  // namespace detail

/// One communication buffer: Transformer Engine's CommOverlap object, owning its
/// memory (RAII; movable, not copyable). See the table at the top of this
/// header for what it holds per (type, method). Creation validates
/// everything that does not depend on the GEMM operands.
class CommOverlapBuffer {
 public:
  static constexpr std::size_t alignment = 256;

  CommOverlapBuffer(CommOverlapType type, CommOverlapMethod method, std::span<const std::size_t> buffer_shape,
                    ElementType dtype, int tp_size, const CommOverlapOptions& options = {})
      : type_(type), method_(method), dtype_(dtype), tp_size_(tp_size), options_(options) {
    const char* who = "CommOverlapBuffer";
    detail::check_combination(who, type, method);
    if (method == CommOverlapMethod::NONE) {
      cpdispatch::detail::fail(who, ": Invalid collective type: method NONE runs a plain GEMM and needs no buffer (expected RS or AG, got ",
                   to_string(type), ")");
    }
    if (options.scaling_mode != ScalingMode::NO_SCALING) {
      cpdispatch::detail::fail(who, ": scaling mode ", to_string(options.scaling_mode), " is not supported (expected NO_SCALING)");
    }
    if (dtype != ElementType::float32 && dtype != ElementType::float64) {
      cpdispatch::detail::fail(who, ": dtype ", element_name(dtype),
                   " is not supported (expected float32 or float64, the element types of the GEMM backends)");
    }
    if (tp_size < 1) cpdispatch::detail::fail(who, ": tp_size = ", tp_size, " must be at least 1");
    if (method == CommOverlapMethod::PIPELINE && options.num_splits < 1) {
      cpdispatch::detail::fail(who, ": num_splits = ", options.num_splits, " must be at least 1 for PIPELINE");
    }
    if (buffer_shape.size() != 2) {
      cpdispatch::detail::fail(who, ": buffer_shape has ", buffer_shape.size(), " dimensions, expected 2 (rows, cols)");
    }
    rows_ = buffer_shape[0];
    cols_ = buffer_shape[1];
    if (rows_ == 0 || cols_ == 0) cpdispatch::detail::fail(who, ": buffer_shape [", rows_, ", ", cols_, "] has an empty dimension");
    const std::size_t divisor = detail::row_divisor(method, tp_size, options.num_splits);
    if (rows_ % divisor != 0) {
      if (method == CommOverlapMethod::PIPELINE) {
        cpdispatch::detail::fail(who, ": buffer_shape[0] = ", rows_, " is not divisible by tp_size * num_splits = ", tp_size, " * ",
                     options.num_splits, " = ", divisor, " (", to_string(type), " PIPELINE splits the rows into that many blocks)");
      }
      cpdispatch::detail::fail(who, ": buffer_shape[0] = ", rows_, " is not divisible by tp_size = ", tp_size, " (", to_string(type), " ",
                   to_string(method), " splits the rows into one block per rank)");
    }
    if (__builtin_mul_overflow(rows_, cols_, &size_)) {
      cpdispatch::detail::fail(who, ": buffer_shape [", rows_, ", ", cols_, "] has more elements than memory can address");
    }
    // RS RING_EXCHANGE also receives the tp_size - 1 partial blocks of its peers.
    std::size_t staging = 0;
    if (type == CommOverlapType::RS && method == CommOverlapMethod::RING_EXCHANGE) {
      staging = (rows_ / static_cast<std::size_t>(tp_size)) * cols_ * static_cast<std::size_t>(tp_size - 1);
    }
    std::size_t bytes = 0;
    if (__builtin_add_overflow(size_, staging, &bytes) || __builtin_mul_overflow(bytes, element_size(dtype), &bytes)) {
      cpdispatch::detail::fail(who, ": buffer_shape [", rows_, ", ", cols_, "] of ", element_name(dtype), " has more bytes than memory can address");
    }
    staging_ = staging;
    storage_.reset(static_cast<std::byte*>(::operator new[](bytes == 0 ? 1 : bytes, std::align_val_t{alignment})));
    if (bytes) std::memset(storage_.get(), 0, bytes);
  }

  CommOverlapBuffer(CommOverlapType type, CommOverlapMethod method, std::initializer_list<std::size_t> buffer_shape,
                    ElementType dtype, int tp_size, const CommOverlapOptions& options = {})
      : CommOverlapBuffer(type, method, std::span<const std::size_t>(buffer_shape.begin(), buffer_shape.size()), dtype,
                          tp_size, options) {}

  CommOverlapBuffer(CommOverlapBuffer&&) noexcept = default;
  CommOverlapBuffer& operator=(CommOverlapBuffer&&) noexcept = default;
  CommOverlapBuffer(const CommOverlapBuffer&) = delete;
  CommOverlapBuffer& operator=(const CommOverlapBuffer&) = delete;
  ~CommOverlapBuffer() = default;

  CommOverlapType type() const noexcept { return type_; }
  CommOverlapMethod method() const noexcept { return method_; }
  ElementType dtype() const noexcept { return dtype_; }
  int tp_size() const noexcept { return tp_size_; }
  const CommOverlapOptions& options() const noexcept { return options_; }
  bool atomic_gemm() const noexcept { return options_.atomic_gemm; }
  ScalingMode scaling_mode() const noexcept { return options_.scaling_mode; }
  int num_splits() const noexcept { return options_.num_splits; }

  std::array<std::size_t, 2> shape() const noexcept { return {rows_, cols_}; }
  std::size_t rows() const noexcept { return rows_; }
  std::size_t cols() const noexcept { return cols_; }
  /// Elements of the buffer proper (rows x cols), without the staging.
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * element_size(dtype_); }

  /// The buffer's helper thread, started on first use (see CommOverlapOptions::helper_thread).
  detail::HelperWorker& helper() {
    if (!helper_) {
      try {
        helper_ = std::make_unique<detail::HelperWorker>();
      } catch (const std::system_error& e) {
        cpdispatch::detail::fail<error>("comm_gemm: could not start the helper thread: ", e.what());
      }
    }
    return *helper_;
  }

  void* data() noexcept { return storage_.get(); }
  const void* data() const noexcept { return storage_.get(); }

  /// The buffer as elements of T; T must be the buffer's dtype.
  template <class T>
  std::span<T> view() {
    check_element_type<T>("view");
    return {reinterpret_cast<T*>(storage_.get()), size_};
  }
  template <class T>
  std::span<const T> view() const {
    check_element_type<T>("view");
    return {reinterpret_cast<const T*>(storage_.get()), size_};
  }

  /// Fills the whole buffer (e.g. the data an RS BULK call reduce-scatters).
  template <class T>
  void copy_into(std::span<const T> source) {
    check_element_type<T>("copy_into");
    if (source.size() != size_) {
      cpdispatch::detail::fail("CommOverlapBuffer::copy_into: Buffer size is incorrect: expected ", size_, " elements (", rows_, " x ",
                   cols_, "), got ", source.size());
    }
    if (size_) std::memcpy(storage_.get(), source.data(), bytes());
  }

  /// Copies the whole buffer out (e.g. the gathered input after AG RING_EXCHANGE).
  template <class T>
  void copy_out(std::span<T> destination) const {
    check_element_type<T>("copy_out");
    if (destination.size() != size_) {
      cpdispatch::detail::fail("CommOverlapBuffer::copy_out: Buffer size is incorrect: expected ", size_, " elements (", rows_, " x ",
                   cols_, "), got ", destination.size());
    }
    if (size_) std::memcpy(destination.data(), storage_.get(), bytes());
  }

  /// Where the peers' partial blocks land (RS RING_EXCHANGE): (tp_size - 1)
  /// blocks of rows / tp_size x cols elements after the buffer proper.
  template <class T>
  std::span<T> staging() {
    check_element_type<T>("staging");
    return {reinterpret_cast<T*>(storage_.get()) + size_, staging_};
  }

  /// Throws unless T is the buffer's dtype.
  template <class T>
  void check_element_type(const char* what) const {
    constexpr ElementType wanted = std::is_same_v<T, double> ? ElementType::float64 : ElementType::float32;
    static_assert(std::is_same_v<std::remove_const_t<T>, float> || std::is_same_v<std::remove_const_t<T>, double>,
                  "cpdispatch: a CommOverlapBuffer holds float (float32) or double (float64)");
    if (wanted != dtype_) {
      cpdispatch::detail::fail("CommOverlapBuffer::", what, ": the buffer's dtype is ", element_name(dtype_),
                   ", the element type asked for is ", element_name(wanted));
    }
  }

 private:
  CommOverlapType type_;
  CommOverlapMethod method_;
  ElementType dtype_;
  int tp_size_;
  CommOverlapOptions options_;
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
  std::size_t size_ = 0;
  std::size_t staging_ = 0;
  std::unique_ptr<std::byte[], detail::AlignedDelete> storage_{nullptr, detail::AlignedDelete{alignment}};
  std::unique_ptr<detail::HelperWorker> helper_;  // started by the first overlapped call
};

/// Buffers by id: Transformer Engine's CreateCommOverlapBuffer / DestroyCommOverlapBuffer /
/// DestroyAllCommOverlapBuffers. Thread-safe. Ids start at 1 and are never
/// reused, so a destroyed id is told apart from one never issued. get()
/// hands out shared ownership: a buffer destroyed while a call still uses it
/// lives until that call returns.
class CommOverlapRegistry {
 public:
  std::int64_t create(CommOverlapType type, CommOverlapMethod method, std::span<const std::size_t> buffer_shape,
                      ElementType dtype, int tp_size, const CommOverlapOptions& options = {}) {
    auto buffer = std::make_shared<CommOverlapBuffer>(type, method, buffer_shape, dtype, tp_size, options);
    const std::lock_guard lock(mutex_);
    const std::int64_t id = next_id_++;
    buffers_.emplace(id, std::move(buffer));
    return id;
  }
  std::int64_t create(CommOverlapType type, CommOverlapMethod method, std::initializer_list<std::size_t> buffer_shape,
                      ElementType dtype, int tp_size, const CommOverlapOptions& options = {}) {
    return create(type, method, std::span<const std::size_t>(buffer_shape.begin(), buffer_shape.size()), dtype, tp_size,
                  options);
  }

  /// The buffer of `id`; throws for an id destroyed or never issued.
  std::shared_ptr<CommOverlapBuffer> get(std::int64_t id) const {
    const std::lock_guard lock(mutex_);
    const auto it = buffers_.find(id);
    if (it == buffers_.end()) fail_missing("get", id);
    return it->second;
  }

  void destroy(std::int64_t id) {
    std::shared_ptr<CommOverlapBuffer> doomed;  // freed outside the lock
    const std::lock_guard lock(mutex_);
    const auto it = buffers_.find(id);
    if (it == buffers_.end()) fail_missing("destroy", id);
    doomed = std::move(it->second);
    buffers_.erase(it);
  }

  void destroy_all() {
    std::map<std::int64_t, std::shared_ptr<CommOverlapBuffer>> doomed;
    const std::lock_guard lock(mutex_);
    doomed.swap(buffers_);
  }

  bool contains(std::int64_t id) const {
    const std::lock_guard lock(mutex_);
    return buffers_.count(id) != 0;
  }
  std::size_t size() const {
    const std::lock_guard lock(mutex_);
    return buffers_.size();
  }

 private:
  [[noreturn]] void fail_missing(const char* op, std::int64_t id) const {
    if (id >= 1 && id < next_id_) {
      cpdispatch::detail::fail("CommOverlapRegistry::", op, ": buffer id ", id, " was destroyed (", buffers_.size(), " buffers live)");
    }
    cpdispatch::detail::fail("CommOverlapRegistry::", op, ": buffer id ", id, " is unknown (ids issued so far: ",
                 next_id_ == 1 ? std::string("none") : cpdispatch::detail::concat("1 to ", next_id_ - 1), ")");
  }

  mutable std::mutex mutex_;
  std::map<std::int64_t, std::shared_ptr<CommOverlapBuffer>> buffers_;
  std::int64_t next_id_ = 1;
};

/// The process-wide registry behind the free functions below: hidden global
/// state, kept for callers of the id-based API. Buffers it holds live until
/// destroyed (or until the process ends); code that can hold its buffers
/// itself should use CommOverlapBuffer or its own CommOverlapRegistry and the
/// comm_gemm overloads that take them.
inline CommOverlapRegistry& default_comm_overlap_registry() {
  static CommOverlapRegistry registry;
  return registry;
}

/// Transformer Engine's CreateCommOverlapBuffer. Returns the new buffer's id.
inline std::int64_t create_comm_overlap_buffer(CommOverlapType type, CommOverlapMethod method,
                                               const std::vector<std::size_t>& buffer_shape, ElementType dtype, int tp_size,
                                               const CommOverlapOptions& options = {}) {
  return default_comm_overlap_registry().create(type, method, buffer_shape, dtype, tp_size, options);
}

/// Transformer Engine's DestroyCommOverlapBuffer.
inline void destroy_comm_overlap_buffer(std::int64_t id) { default_comm_overlap_registry().destroy(id); }

/// Transformer Engine's DestroyAllCommOverlapBuffers.
inline void destroy_all_comm_overlap_buffers() { default_comm_overlap_registry().destroy_all(); }

}  // namespace cpdispatch::overlap
