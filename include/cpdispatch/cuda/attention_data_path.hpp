#pragma once
// ContextParallelAttention's data path for device transports
// (AttentionDataPath<MemorySpace::device>; the interface and the host path
// are in attention/data_path.hpp). Include it, from a CUDA translation
// unit, wherever the op runs over a device transport.
//
// The lists (copies, fan-ins, combines), fill and zero are the device data
// path's (cuda::DeviceDataPath, cpdispatch/cuda/data_path.hpp); this adds
// the op's arithmetic: the log-sum-exp merge of staged passes, the fp32 sum
// of dq (accumulate, store), and the invariant mode's bound (max_abs, which
// waits for its value) and rounding (round_exact). All on the transport's
// stream; per call only kernels are enqueued (graph-capturable but for
// max_abs).
//
// Results equal the host path's: accumulate and store bit for bit (16-bit
// values round as float16.hpp does); the log-sum-exp merge up to the
// device's expf/logf (products and sums are not fused into FMAs, as on the
// host).

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/attention_data_path.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/data_path.hpp"
#include "cpdispatch/attention/detail/exact_sum.hpp"
#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/grid.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/float16.hpp"

namespace cpdispatch::cuda {

namespace attention_path_kernels {

template <class E>
__host__ __device__ __forceinline__ float to_float(E x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return E::to_float(x.bits);
  }
}

template <class E>
__host__ __device__ __forceinline__ E from_float(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    E e;
    e.bits = E::from_float(x);
    return e;
  }
}

// Separately rounded products and sums: nvcc would fuse a * b + c into one
// FMA, which the host path does not do.
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

/// A row's merge: its new log-sum-exp and the weights of the running
/// output and of the part (detail::merge_partial's arithmetic).
struct MergeWeights {
  float merged, keep, take;
};
__host__ __device__ __forceinline__ MergeWeights merge_weights(float run, float part) {
  const float m = fmaxf(run, part);
  const float merged = m + logf(expf(run - m) + expf(part - m));
  return {merged, expf(run - merged), expf(part - merged)};
}

/// acc[i] += part[i], in fp32.
template <class E>
__global__ void accumulate_kernel(float* acc, const E* part, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) {
    acc[i] = acc[i] + to_float(part[i]);
  }
}

/// out[i] = acc[i] rounded to E.
template <class E>
__global__ void store_kernel(const float* acc, E* out, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) {
    out[i] = from_float<E>(acc[i]);
  }
}

/// The merge's outputs: warp w folds rows w, w + (warps in the grid), ...
/// of the [tokens][heads][head_dim] layout, its lanes over head_dim. The
/// running lse ([heads][tokens]) is only read here: merge_lse_kernel, the
/// next launch, updates it, so no thread reads an lse another one wrote.
template <class E, unsigned Warps>
__global__ void __launch_bounds__(Warps * 32) merge_output_kernel(float* acc, const float* lse, const E* part, const float* lse_part,
                                                                  std::uint64_t tokens, std::uint64_t heads, std::uint64_t head_dim) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t rows = tokens * heads, stride = std::uint64_t{gridDim.x} * Warps;
  for (std::uint64_t r = blockIdx.x * std::uint64_t{Warps} + threadIdx.x / 32; r < rows; r += stride) {
    const std::uint64_t l = (r % heads) * tokens + r / heads;
    const float p = lse_part[l];
    if (p == -INFINITY) continue;  // the part saw no key of this row
    const MergeWeights w = merge_weights(lse[l], p);
    float* a = acc + r * head_dim;
    const E* x = part + r * head_dim;
    for (std::uint64_t d = lane; d < head_dim; d += 32) a[d] = add_rn(mul_rn(w.keep, a[d]), mul_rn(w.take, to_float(x[d])));
  }
}

/// The merge's log-sum-exp: lse[l] = the merged one, where the part has a row.
__global__ void merge_lse_kernel(float* lse, const float* lse_part, std::uint64_t rows) {
  for (std::uint64_t l = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; l < rows; l += std::uint64_t{gridDim.x} * blockDim.x) {
    const float p = lse_part[l];
    if (p != -INFINITY) lse[l] = merge_weights(lse[l], p).merged;
  }
}

/// The invariant mode's bound, first pass: partial[t] = the largest |x| of
/// thread t's elements x[t], x[t + threads], ... (a NaN met once stays).
template <class E>
__global__ void max_abs_kernel(const E* x, std::uint64_t n, float* partial) {
  const std::uint64_t t = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x, threads = std::uint64_t{gridDim.x} * blockDim.x;
  float m = 0;
  for (std::uint64_t i = t; i < n; i += threads) m = detail::attention::max_keeping_nan(m, fabsf(to_float(x[i])));
  partial[t] = m;
}

/// Second pass: partial[t] for t < threads folds partial[t], partial[t + threads], ... of n.
__global__ void max_fold_kernel(float* partial, std::uint64_t n) {
  const std::uint64_t t = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x, threads = std::uint64_t{gridDim.x} * blockDim.x;
  float m = partial[t];
  for (std::uint64_t i = t + threads; i < n; i += threads) m = detail::attention::max_keeping_nan(m, partial[i]);
  partial[t] = m;
}

/// out[i] = exact[i] * 2^exponent, rounded once to E (round_exact's arithmetic).
template <class E>
__global__ void round_exact_kernel(const std::int64_t* exact, int exponent, E* out, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) {
    out[i] = from_float<E>(static_cast<float>(detail::attention::from_fixed(exact[i], exponent)));
  }
}

}  // namespace attention_path_kernels

}  // namespace cpdispatch::cuda

namespace cpdispatch {

template <>
class AttentionDataPath<MemorySpace::device> : public cuda::DeviceDataPath {
 public:
  using cuda::DeviceDataPath::DeviceDataPath;

  /// The largest |x| (NaN when x holds one): the invariant mode's bound.
  /// Waits for the stream (the value is read on the host).
  template <class E>
  double max_abs(const E* x, std::size_t n) const {
    check_element<E>();
    if (n == 0) return 0;
    const unsigned blocks = std::min(cuda::blocks_for_elements(n), 1024u);  // enough to fill a GPU's memory bandwidth
    const std::size_t threads = std::size_t{blocks} * cuda::block_threads;
    if (max_partial_.size() < threads) max_partial_.allocate(threads);
    cuda::launch_kernel("max_abs_kernel", &cuda::attention_path_kernels::max_abs_kernel<E>, blocks, cuda::block_threads, stream(), x, std::uint64_t{n},
                        max_partial_.data());
    const std::size_t folded = std::min<std::size_t>(threads, cuda::block_threads);
    if (threads > folded) {
      cuda::launch_kernel("max_fold_kernel", &cuda::attention_path_kernels::max_fold_kernel, 1u, cuda::block_threads, stream(), max_partial_.data(),
                          std::uint64_t{threads});
    }
    max_host_.resize(folded);
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(max_host_.data(), max_partial_.data(), folded * sizeof(float), cudaMemcpyDeviceToHost, stream()));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream()));
    float m = 0;
    for (float a : max_host_) m = detail::attention::max_keeping_nan(m, a);
    return m;
  }

  /// out = exact * 2^exponent, rounded once to E (round_exact).
  template <class E>
  void round_exact(const std::int64_t* exact, int exponent, E* out, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("round_exact_kernel", &cuda::attention_path_kernels::round_exact_kernel<E>, cuda::blocks_for_elements(n),
                        cuda::block_threads, stream(), exact, exponent, out, std::uint64_t{n});
  }

  /// Folds a pass's output into the running fp32 one over the whole layout;
  /// rows the pass did not attend carry lse_part = -inf and are left alone.
  template <class E>
  void merge(float* acc, float* lse, const E* part, const float* lse_part, std::int64_t tokens, std::int64_t heads, std::int64_t head_dim) const {
    check_element<E>();
    if (tokens < 0 || heads < 0 || head_dim < 0) detail::fail(who, ": merge of ", tokens, " x ", heads, " x ", head_dim, " elements");
    const auto t = static_cast<std::uint64_t>(tokens), h = static_cast<std::uint64_t>(heads), d = static_cast<std::uint64_t>(head_dim);
    const std::uint64_t rows = t * h;
    if (rows == 0) return;
    if (d > 0) {
      cuda::launch_kernel("merge_output_kernel", &cuda::attention_path_kernels::merge_output_kernel<E, cuda::warps_per_block>,
                          static_cast<unsigned>(cuda::blocks_for(rows)), cuda::block_threads, stream(), acc, static_cast<const float*>(lse), part,
                          lse_part, t, h, d);
    }
    cuda::launch_kernel("merge_lse_kernel", &cuda::attention_path_kernels::merge_lse_kernel, cuda::blocks_for_elements(rows),
                        cuda::block_threads, stream(), lse, lse_part, rows);
  }

  /// acc += part, element by element.
  template <class E>
  void accumulate(float* acc, const E* part, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("accumulate_kernel", &cuda::attention_path_kernels::accumulate_kernel<E>,
                        cuda::blocks_for_elements(n), cuda::block_threads, stream(), acc, part, std::uint64_t{n});
  }

  /// out = acc, rounded to E.
  template <class E>
  void store(const float* acc, E* out, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("store_kernel", &cuda::attention_path_kernels::store_kernel<E>, cuda::blocks_for_elements(n),
                        cuda::block_threads, stream(), acc, out, std::uint64_t{n});
  }

 private:
  template <class E>
  static constexpr void check_element() noexcept {
    static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                  "cpdispatch: the attention data path's element type is float, bfloat16 or float16");
  }

  mutable cuda::DeviceBuffer<float> max_partial_;  // max_abs's partial maxima
  mutable std::vector<float> max_host_;
};

}  // namespace cpdispatch
