#pragma once
// The table of every cuDNN and CUDA runtime call CudnnAttentionKernel makes.
// The kernel and the graph builder call through a `const Api&` only, so a
// test substitutes a table of mocks (tests/cudnn) and checks the graph built,
// the uploads and the executions without a GPU; real_api() is the table of
// the real functions.

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// A cuDNN call failed; code() is the cudnnStatus_t.
class cudnn_error : public backend_error {
 public:
  using backend_error::backend_error;
};

namespace cudnn::detail {

struct Api {
  // cuDNN (cudnn_graph.h)
  std::size_t (*get_version)();
  cudnnStatus_t (*create)(cudnnHandle_t*);
  cudnnStatus_t (*destroy)(cudnnHandle_t);
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
  cudnnStatus_t (*create_descriptor)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*);
  cudnnStatus_t (*destroy_descriptor)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*set_attribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
                                 std::int64_t, const void*);
  cudnnStatus_t (*get_attribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
                                 std::int64_t, std::int64_t*, void*);
  cudnnStatus_t (*finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
  const char* (*error_string)(cudnnStatus_t);
  void (*last_error)(char*, std::size_t);
  // CUDA runtime (stream-ordered memory, pinned staging, events)
  cudaError_t (*get_device)(int*);
  cudaError_t (*malloc_async)(void**, std::size_t, cudaStream_t);
  cudaError_t (*free_async)(void*, cudaStream_t);
  cudaError_t (*memcpy_async)(void*, const void*, std::size_t, cudaMemcpyKind, cudaStream_t);
  cudaError_t (*memcpy2d_async)(void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t, cudaMemcpyKind,
                                cudaStream_t);
  cudaError_t (*memset_async)(void*, int, std::size_t, cudaStream_t);
  cudaError_t (*host_alloc)(void**, std::size_t, unsigned);
  cudaError_t (*free_host)(void*);
  cudaError_t (*event_create)(cudaEvent_t*, unsigned);
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t);
  cudaError_t (*event_query)(cudaEvent_t);
  cudaError_t (*event_destroy)(cudaEvent_t);
};

/// The real functions (libcudnn, libcudart).
inline const Api& real_api() {
  static const Api api{
      &cudnnGetVersion,
      &cudnnCreate,
      &cudnnDestroy,
      &cudnnSetStream,
      &cudnnBackendCreateDescriptor,
      &cudnnBackendDestroyDescriptor,
      &cudnnBackendSetAttribute,
      &cudnnBackendGetAttribute,
      &cudnnBackendFinalize,
      &cudnnBackendExecute,
      &cudnnGetErrorString,
      &cudnnGetLastErrorString,
      &cudaGetDevice,
      [](void** p, std::size_t n, cudaStream_t s) { return cudaMallocAsync(p, n, s); },
      [](void* p, cudaStream_t s) { return cudaFreeAsync(p, s); },
      [](void* d, const void* s, std::size_t n, cudaMemcpyKind k, cudaStream_t st) { return cudaMemcpyAsync(d, s, n, k, st); },
      [](void* d, std::size_t dp, const void* s, std::size_t sp, std::size_t w, std::size_t h, cudaMemcpyKind k,
         cudaStream_t st) { return cudaMemcpy2DAsync(d, dp, s, sp, w, h, k, st); },
      [](void* d, int v, std::size_t n, cudaStream_t s) { return cudaMemsetAsync(d, v, n, s); },
      [](void** p, std::size_t n, unsigned f) { return cudaHostAlloc(p, n, f); },
      &cudaFreeHost,
      [](cudaEvent_t* e, unsigned f) { return cudaEventCreateWithFlags(e, f); },
      [](cudaEvent_t e, cudaStream_t s) { return cudaEventRecord(e, s); },
      &cudaEventQuery,
      &cudaEventDestroy,
  };
  return api;
}

/// Throws cudnn_error: `<call> failed: <status name> (<code>) [<what>]; <cuDNN's last error message>`.
inline void check(const Api& api, cudnnStatus_t status, const char* call, const std::string& what = {}) {
  if (status == CUDNN_STATUS_SUCCESS) [[likely]] return;
  char last[512] = {0};
  if (api.last_error) api.last_error(last, sizeof last);
  const char* name = api.error_string ? api.error_string(status) : nullptr;
  std::string message = cpdispatch::detail::concat(call, " failed: ", name ? name : "cuDNN error", " (",
                                                   static_cast<int>(status), ")");
  if (!what.empty()) message += " [" + what + "]";
  if (last[0] != '\0') message += cpdispatch::detail::concat("; ", last);
  throw cudnn_error(message, static_cast<int>(status));
}

/// Throws cuda_error for a failed CUDA runtime call made through the table.
inline void check_cuda(cudaError_t code, const char* call) {
  if (code == cudaSuccess) [[likely]] return;
  throw cpdispatch::detail::make_cuda_error(code, call, "cudnn/attention.hpp", 0);
}

}  // namespace cudnn::detail
}  // namespace cpdispatch
