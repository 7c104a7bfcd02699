#pragma once
// Device memory for cpdispatch: DeviceSpan (a view, the buffer type of
// dispatchers over device transports), DeviceBuffer (an owned allocation),
// and owned CUDA streams and events.
//
// DeviceSpan is deliberately not constructible from host containers or
// std::span: a device dispatcher can only be handed memory the caller has
// declared to be device memory (and a host dispatcher never takes a
// DeviceSpan). Nothing here dereferences device memory on the host.
//
// Plain C++ over the CUDA runtime API: compiles with the host compiler too.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/error.hpp"

namespace cpdispatch::cuda {

/// `size` elements of device memory at `data` (a view; owns nothing).
template <class T>
class DeviceSpan {
 public:
  using element_type = T;

  constexpr DeviceSpan() noexcept = default;
  constexpr DeviceSpan(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// Mutable -> const, as std::span.
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_convertible_v<U (*)[], T (*)[]>)
  constexpr DeviceSpan(DeviceSpan<U> other) noexcept : data_(other.data()), size_(other.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }

  /// The first `n` elements (n <= size(); checked: invalid_input).
  DeviceSpan first(std::size_t n) const {
    if (n > size_) detail::fail("DeviceSpan::first(", n, ") of a span of ", size_, " elements");
    return {data_, n};
  }
  /// `n` elements from `offset` (checked: invalid_input).
  DeviceSpan subspan(std::size_t offset, std::size_t n) const {
    if (offset > size_ || n > size_ - offset) detail::fail("DeviceSpan::subspan(", offset, ", ", n, ") of a span of ", size_, " elements");
    return {data_ + offset, n};
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

using DeviceBytes = DeviceSpan<std::byte>;
using DeviceConstBytes = DeviceSpan<const std::byte>;

/// The bytes of a typed device span.
template <class T>
DeviceSpan<std::conditional_t<std::is_const_v<T>, const std::byte, std::byte>> as_bytes(DeviceSpan<T> s) noexcept {
  using B = std::conditional_t<std::is_const_v<T>, const std::byte, std::byte>;
  return {reinterpret_cast<B*>(s.data()), s.size_bytes()};
}

/// `count` elements of T in device memory (cudaMalloc), freed on destruction.
/// The memory is uninitialised. Freeing (cudaFree) waits for the device's
/// pending work, so a buffer may be dropped while kernels still use it.
template <class T>
class DeviceBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "DeviceBuffer holds trivially copyable elements");

 public:
  DeviceBuffer() noexcept = default;
  explicit DeviceBuffer(std::size_t count) { allocate(count); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  DeviceSpan<T> span() const noexcept { return {data_, size_}; }
  DeviceSpan<std::byte> bytes() const noexcept { return as_bytes(span()); }

  /// Replaces the contents by a fresh allocation of `count` elements.
  void allocate(std::size_t count) {
    release();
    if (count == 0) return;
    if (count > static_cast<std::size_t>(-1) / sizeof(T)) detail::fail("DeviceBuffer: ", count, " elements do not fit in memory");
    void* p = nullptr;
    CPDISPATCH_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
    data_ = static_cast<T*>(p);
    size_ = count;
  }

  /// Stream-ordered copy of `host` into the first host.size() elements. The
  /// host memory must stay valid until the copy has run (the uploads in this
  /// library keep their host copy for the device buffer's lifetime).
  void upload(std::span<const T> host, cudaStream_t stream) {
    if (host.size() > size_) detail::fail("DeviceBuffer::upload: ", host.size(), " elements into a buffer of ", size_);
    if (host.empty()) return;
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream));
  }

 private:
  void release() noexcept {
    if (data_) {
      (void)cudaFree(data_);     // nothing sensible to do with a failure in a destructor
      (void)cudaGetLastError();  // ... but do not leave it for the next check to report
    }
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// An owned non-blocking stream (does not synchronise with the legacy default stream).
class Stream {
 public:
  Stream() { CPDISPATCH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      release();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { release(); }

  cudaStream_t get() const noexcept { return stream_; }
  void synchronize() const { CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  void release() noexcept {
    if (stream_) {
      (void)cudaStreamDestroy(stream_);  // pending work still completes
      (void)cudaGetLastError();
    }
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

/// An owned event without timing (the cheap kind, for ordering streams).
class Event {
 public:
  explicit Event(unsigned flags = cudaEventDisableTiming) { CPDISPATCH_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags)); }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      release();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { release(); }

  cudaEvent_t get() const noexcept { return event_; }
  void record(cudaStream_t stream) const { CPDISPATCH_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  /// Makes later work on `stream` wait for the work before the last record().
  void wait_on(cudaStream_t stream) const { CPDISPATCH_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

 private:
  void release() noexcept {
    if (event_) {
      (void)cudaEventDestroy(event_);
      (void)cudaGetLastError();
    }
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

}  // namespace cpdispatch::cuda
