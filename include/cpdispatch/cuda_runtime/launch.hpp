#pragma once
// Kernel launches for every CUDA user of cpdispatch, the device transports
// and the device data path alike: launch_kernel (the one place with <<<>>>)
// and CPDISPATCH_UNROLL.
//
// Requires nvcc: include from a .cu translation unit. (The project's tests
// also compile it with the host compiler against a CUDA runtime double,
// CPDISPATCH_CUDA_HOST_HARNESS, whose cuda_harness::launch runs a launch as
// host loops over the grid.)

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda_runtime/launch.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <utility>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/grid.hpp"

// `#pragma unroll` in __host__ __device__ code, for the device pass only
// (host compilers warn about the pragma).
#ifdef __CUDA_ARCH__
#define CPDISPATCH_UNROLL _Pragma("unroll")
#else
#define CPDISPATCH_UNROLL
#endif

namespace cpdispatch::cuda {

/// Launches `kernel` on `stream` (no dynamic shared memory) and reports a
/// failed launch as cuda_error naming `name`.
template <class... Params, class... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
#if defined(__CUDACC__)
  kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
#else
  (void)cuda_harness::launch(name, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
#endif
  ::cpdispatch::detail::cuda_check(cudaGetLastError(), name, __FILE__, __LINE__);
}

}  // namespace cpdispatch::cuda
