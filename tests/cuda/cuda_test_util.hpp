#pragma once
// Shared by the CUDA tests: skipping without a GPU, and moving test bytes
// between host vectors and device buffers (synchronously: tests only).

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <initializer_list>
#include <string>
#include <vector>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"

namespace cptest {

/// True when the tests run on the CPU against the CUDA runtime double
/// (tests/cuda_cpu): there every test runs under three scheduler seeds, on
/// one core, so the tests pick smaller sizes (the same cases, fewer bytes).
#ifdef CPDISPATCH_CUDA_HOST_HARNESS
inline constexpr bool cpu_harness = true;
#else
inline constexpr bool cpu_harness = false;
#endif

/// `gpu` on a GPU, `cpu` under the harness.
template <class T>
std::vector<T> sizes(std::initializer_list<T> gpu, std::initializer_list<T> cpu) {
  return cpu_harness ? std::vector<T>(cpu) : std::vector<T>(gpu);
}

/// Empty when a CUDA device can be used; otherwise why not, starting with
/// "no CUDA device" (the reason CI machines, which have nvcc but no GPU, give).
inline std::string cuda_device_missing() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();
  if (rc != cudaSuccess) return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorName(rc) + ")";
  if (count == 0) return "no CUDA device (cudaGetDeviceCount: 0 devices)";
  return {};
}

/// Skips the test, with the reason, when there is no usable CUDA device.
#define CPDISPATCH_REQUIRE_CUDA_DEVICE()                                          \
  do {                                                                            \
    if (const std::string why = ::cptest::cuda_device_missing(); !why.empty()) { \
      GTEST_SKIP() << why;                                                        \
    }                                                                             \
  } while (0)

/// Waits for all work on the current device. Needed after the synchronous
/// cudaMemcpy / cudaMemset before work on non-blocking streams (the sims'
/// and the tests'): those calls may return before the device is done, and
/// non-blocking streams do not wait for the legacy stream they run on.
inline void device_sync() { CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize()); }

/// A device copy of `host`, `extra` bytes larger (the tail left unset),
/// complete when this returns.
inline cpdispatch::cuda::DeviceBuffer<std::byte> to_device(const std::vector<std::byte>& host, std::size_t extra = 0) {
  cpdispatch::cuda::DeviceBuffer<std::byte> d(host.size() + extra);
  if (!host.empty()) CPDISPATCH_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size(), cudaMemcpyHostToDevice));
  device_sync();
  return d;
}

/// The first `n` bytes at `device` (waits for all device work first).
inline std::vector<std::byte> to_host(const std::byte* device, std::size_t n) {
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::byte> host(n);
  if (n) CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), device, n, cudaMemcpyDeviceToHost));
  return host;
}

inline cpdispatch::cuda::DeviceConstBytes cbytes(const cpdispatch::cuda::DeviceBuffer<std::byte>& b) { return b.span(); }
inline cpdispatch::cuda::DeviceBytes mbytes(const cpdispatch::cuda::DeviceBuffer<std::byte>& b) { return b.span(); }

}  // namespace cptest
