#pragma once
// ContextParallelAttention on device transports (the device sim, NCCL): the
// one op of attention/context_parallel.hpp, with its device data path
// (cuda/attention_data_path.hpp) and cuda::CudaAttentionKernel as the default
// kernel. docs/attention.md, "On device transports".
//
//   #include "cpdispatch/cuda/context_parallel.hpp"   // from a .cu file
//   cpdispatch::NcclTransport t(comm, stream);
//   cpdispatch::ContextParallelAttention<cpdispatch::NcclTransport, cpdispatch::bfloat16> attn(t, share, shape, {.dedup = true, .stages = 2});
//   attn.forward(q, k, v, out);          // cuda::DeviceSpan<const E> in the MLP layout -> cuda::DeviceSpan<E>
//   attn.backward(dout, dq, dk, dv);
//
// Every buffer lives in device memory the object owns (grown, never shrunk);
// the kernel, the merges, the fan-outs and the copies run on the transport's
// stream (the default kernel is built on it; a kernel on another stream is
// refused), posted exchanges on the transport's communication stream. A step
// only enqueues work: no host synchronisation, so its exchanges overlap the
// kernel with stages > 1, and results are there once the stream has run.
// replan uploads the plan's piece lists and the kernel's entry lists.
//
// Requires nvcc (kernels): include from a .cu translation unit (the tests
// also compile it against the cuda-cpu harness, CPDISPATCH_CUDA_HOST_HARNESS).

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/context_parallel.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/cuda/attention.hpp"
#include "cpdispatch/cuda/attention_data_path.hpp"

namespace cpdispatch {

template <class T>
struct default_attention_kernel<T, MemorySpace::device> {
  using type = cuda::CudaAttentionKernel;
};

}  // namespace cpdispatch
