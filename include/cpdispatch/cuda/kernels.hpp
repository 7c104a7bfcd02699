#pragma once
// The CUDA kernels of the device data path, and their launchers:
//
//   launch_copy     the copy pieces of a plan (pack into one segment per peer,
//                   unpack into the attention layout, traffic to oneself, KV
//                   copies): one warp per chunk (plan.hpp)
//   launch_combine  the KV-gradient combine: per element, the sum of the
//                   returned copies in ascending copy order; fp32 accumulation
//                   for bf16/fp16, rounding as cpdispatch::bfloat16/float16 do
//   launch_sum      element-wise sum of W buffers in rank order (the device
//                   sim's reductions), with the sim transport's semantics
//
// Every kernel reads and writes each byte once, with 16-byte accesses where
// the addresses allow and narrower ones (down to single bytes) where they do
// not; the choice is made on the device from the actual addresses, so the
// same launch serves any buffer. Launches are asynchronous on the caller's
// stream and need no host synchronisation (graph-capturable).
//
// The per-warp work (copy_chunk, combine_range) is __host__ __device__: the
// lanes of a warp never talk to each other, so running lane 0, 1, ..., 31
// one after another on the host does exactly what the warp does, which lets
// the tests check the kernels' logic on any CPU. The 16-bit conversions are
// float16.hpp's own (__host__ __device__ under nvcc): device and host round
// alike by construction.
//
// Requires nvcc (kernels): include from a .cu translation unit.

#if !defined(__CUDACC__)
#error "cpdispatch/cuda/kernels.hpp holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "cpdispatch/cuda/error.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/transport.hpp"

// `#pragma unroll` in __host__ __device__ code, for the device pass only
// (host compilers warn about the pragma).
#ifdef __CUDA_ARCH__
#define CPDISPATCH_UNROLL _Pragma("unroll")
#else
#define CPDISPATCH_UNROLL
#endif

namespace cpdispatch::cuda {
namespace kernels {

// ---- host and device ------------------------------------------------------------

/// A load through the read-only data cache on the device (every byte is read
/// once and nothing in the same kernel writes it).
template <class T>
__host__ __device__ __forceinline__ T load_once(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// ---- 16-bit floats: the host types' own conversions (float16.hpp) ----------

/// Converts n floats to bf16 (or fp16) bits: exposes the conversions to tests.
template <bool Bf16>
__global__ void convert_from_float_kernel(const float* in, std::uint16_t* out, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) {
    out[i] = Bf16 ? bfloat16::from_float(in[i]) : float16::from_float(in[i]);
  }
}

// ---- copy --------------------------------------------------------------------

/// One warp copies n bytes in words of sizeof(Word) bytes. `src` and `dst`
/// are congruent modulo sizeof(Word): a byte head brings dst (and so src) to
/// a word boundary, words follow (4 loads in flight per lane), a byte tail ends.
template <class Word>
__host__ __device__ __forceinline__ void copy_words(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, std::uint64_t n,
                                           unsigned lane) {
  constexpr std::uint64_t w = sizeof(Word);
  constexpr unsigned unroll = 4;
  std::uint64_t head = (w - reinterpret_cast<std::uintptr_t>(dst) % w) % w;
  if (head > n) head = n;
  if (lane < head) dst[lane] = load_once(src + lane);
  const std::uint64_t words = (n - head) / w;
  const Word* __restrict__ s = reinterpret_cast<const Word*>(src + head);
  Word* __restrict__ d = reinterpret_cast<Word*>(dst + head);
  std::uint64_t i = lane;
  for (; i + 32 * (unroll - 1) < words; i += 32 * unroll) {
    Word r[unroll];
CPDISPATCH_UNROLL
    for (unsigned u = 0; u < unroll; ++u) r[u] = load_once(s + i + 32 * u);
CPDISPATCH_UNROLL
    for (unsigned u = 0; u < unroll; ++u) d[i + 32 * u] = r[u];
  }
  for (; i < words; i += 32) d[i] = load_once(s + i);
  const std::uint64_t tail = head + words * w;
  if (lane < n - tail) dst[tail + lane] = load_once(src + tail + lane);
}

/// Lane `lane`'s share of copying n bytes from s to d (regions disjoint).
__host__ __device__ __forceinline__ void copy_chunk(const unsigned char* s, unsigned char* d, std::uint64_t n, unsigned lane) {
  // The widest word both addresses can reach together: the lowest set bit
  // of (s ^ d), which is that of (s - d), capped at 16 bytes.
  const auto rel = static_cast<unsigned>((reinterpret_cast<std::uintptr_t>(s) ^ reinterpret_cast<std::uintptr_t>(d)) & 15u);
  if (rel == 0) copy_words<uint4>(s, d, n, lane);
  else if ((rel & 7u) == 0) copy_words<uint2>(s, d, n, lane);
  else if ((rel & 3u) == 0) copy_words<unsigned int>(s, d, n, lane);
  else if ((rel & 1u) == 0) copy_words<unsigned short>(s, d, n, lane);
  else copy_words<unsigned char>(s, d, n, lane);
}

/// Warp w of the grid copies chunks w, w + (warps in the grid), ... The
/// source and destination regions of one launch must not overlap.
template <unsigned Warps>
__global__ void __launch_bounds__(Warps * 32) copy_chunks_kernel(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                                                const CopyChunk* __restrict__ chunks, std::uint64_t count) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * Warps;
  for (std::uint64_t c = blockIdx.x * std::uint64_t{Warps} + threadIdx.x / 32; c < count; c += stride) {
    const CopyChunk chunk = chunks[c];
    copy_chunk(src + chunk.src, dst + chunk.dst, chunk.bytes, lane);
  }
}

// ---- combine -----------------------------------------------------------------

template <ElementType E>
struct combine_element;
template <>
struct combine_element<ElementType::float32> {
  using storage = float;
  using acc = float;
  static constexpr bool starts_from_copy = true;  // the first copy is taken as is, as the host does
  __host__ __device__ static acc load(storage x) { return x; }
  __host__ __device__ static storage store(acc a) { return a; }
};
template <>
struct combine_element<ElementType::float64> {
  using storage = double;
  using acc = double;
  static constexpr bool starts_from_copy = true;
  __host__ __device__ static acc load(storage x) { return x; }
  __host__ __device__ static storage store(acc a) { return a; }
};
template <>
struct combine_element<ElementType::bfloat16> {
  using storage = std::uint16_t;
  using acc = float;
  static constexpr bool starts_from_copy = false;  // 0.0f + each copy, as the host's fp32 accumulator
  __host__ __device__ static acc load(storage x) { return bfloat16::to_float(x); }
  __host__ __device__ static storage store(acc a) { return bfloat16::from_float(a); }
};
template <>
struct combine_element<ElementType::float16> {
  using storage = std::uint16_t;
  using acc = float;
  static constexpr bool starts_from_copy = false;
  __host__ __device__ static acc load(storage x) { return float16::to_float(x); }
  __host__ __device__ static storage store(acc a) { return float16::from_float(a); }
};

template <class Traits>
__host__ __device__ __forceinline__ void accumulate(typename Traits::acc& a, typename Traits::storage x, bool first) {
  if (Traits::starts_from_copy && first) a = Traits::load(x); else a += Traits::load(x);
}

/// Combines `n` elements at `in` (copy c at in + c * slab) into `out`.
template <ElementType E>
__host__ __device__ __forceinline__ void combine_range(const typename combine_element<E>::storage* __restrict__ in,
                                              typename combine_element<E>::storage* __restrict__ out, std::uint64_t n,
                                              std::uint64_t slab, const std::uint8_t* __restrict__ mask, std::uint32_t copies,
                                              unsigned lane) {
  using Traits = combine_element<E>;
  using T = typename Traits::storage;
  using A = typename Traits::acc;
  auto scalar = [&](std::uint64_t i) {
    A a = A(0);
    bool first = true;
    for (std::uint32_t c = 0; c < copies; ++c) {
      if (!mask[c]) continue;
      accumulate<Traits>(a, in[c * slab + i], first);
      first = false;
    }
    out[i] = Traits::store(a);
  };
  constexpr unsigned per_vec = 16 / sizeof(T);
  const auto in_at = reinterpret_cast<std::uintptr_t>(in), out_at = reinterpret_cast<std::uintptr_t>(out);
  // 16-byte accesses when every copy's elements are congruent to out's modulo 16.
  if (((in_at - out_at) | (slab * sizeof(T))) % 16 != 0) {
    for (std::uint64_t i = lane; i < n; i += 32) scalar(i);
    return;
  }
  std::uint64_t head = ((16 - out_at % 16) % 16) / sizeof(T);  // out is aligned to sizeof(T)
  if (head > n) head = n;
  if (lane < head) scalar(lane);
  const std::uint64_t vecs = (n - head) / per_vec;
  union Vec {
    uint4 v;
    T e[per_vec];
  };
  for (std::uint64_t v = lane; v < vecs; v += 32) {
    const std::uint64_t i = head + v * per_vec;
    A a[per_vec];
CPDISPATCH_UNROLL
    for (unsigned k = 0; k < per_vec; ++k) a[k] = A(0);
    bool first = true;
    for (std::uint32_t c = 0; c < copies; ++c) {
      if (!mask[c]) continue;
      Vec x;
      x.v = load_once(reinterpret_cast<const uint4*>(in + c * slab + i));
CPDISPATCH_UNROLL
      for (unsigned k = 0; k < per_vec; ++k) accumulate<Traits>(a[k], x.e[k], first);
      first = false;
    }
    Vec y;
CPDISPATCH_UNROLL
    for (unsigned k = 0; k < per_vec; ++k) y.e[k] = Traits::store(a[k]);
    *reinterpret_cast<uint4*>(out + i) = y.v;
  }
  const std::uint64_t tail = head + vecs * per_vec;
  if (lane < n - tail) scalar(tail + lane);
}

/// Lane `lane`'s share of one combine chunk.
template <ElementType E>
__host__ __device__ __forceinline__ void combine_chunk(const unsigned char* replica, unsigned char* grad, const CombineChunk& chunk,
                                                       std::uint64_t slab_bytes, const std::uint8_t* mask, std::uint32_t copies,
                                                       unsigned lane) {
  using T = typename combine_element<E>::storage;
  combine_range<E>(reinterpret_cast<const T*>(replica + chunk.start), reinterpret_cast<T*>(grad + chunk.start), chunk.bytes / sizeof(T),
                   slab_bytes / sizeof(T), mask + std::uint64_t{chunk.shard} * copies, copies, lane);
}

template <ElementType E, unsigned Warps>
__global__ void __launch_bounds__(Warps * 32) combine_kernel(const unsigned char* __restrict__ replica, unsigned char* __restrict__ grad,
                                                            const CombineChunk* __restrict__ chunks, std::uint64_t count,
                                                            std::uint64_t slab_bytes, const std::uint8_t* __restrict__ mask,
                                                            std::uint32_t copies) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * Warps;
  for (std::uint64_t c = blockIdx.x * std::uint64_t{Warps} + threadIdx.x / 32; c < count; c += stride) {
    const CombineChunk chunk = chunks[c];
    combine_chunk<E>(replica, grad, chunk, slab_bytes, mask, copies, lane);
  }
}

// ---- sum (the device sim's reductions) ----------------------------------------

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
struct sum_element<ElementType::bfloat16> {
  using storage = std::uint16_t;
  using acc = float;
  __host__ __device__ static acc first(storage x) { return bfloat16::to_float(x); }
  __host__ __device__ static acc add(acc a, storage x) { return a + bfloat16::to_float(x); }
  __host__ __device__ static storage store(acc a) { return bfloat16::from_float(a); }
};
template <>
struct sum_element<ElementType::float16> {
  using storage = std::uint16_t;
  using acc = float;
  __host__ __device__ static acc first(storage x) { return float16::to_float(x); }
  __host__ __device__ static acc add(acc a, storage x) { return a + float16::to_float(x); }
  __host__ __device__ static storage store(acc a) { return float16::from_float(a); }
};

/// Sources per sum pass (kernel parameters); more ranks take several passes
/// through an accumulator buffer, which keeps the order and the rounding.
inline constexpr unsigned sum_sources_per_pass = 8;
struct SumSources {
  const void* at[sum_sources_per_pass];
};

/// acc = (first ? src[0] : acc) + src[first ? 1 : 0] + ... ; on the last
/// pass the result goes to `out` (rounded once for 16-bit types).
template <ElementType D>
__host__ __device__ __forceinline__ void sum_at(void* out, void* acc_buffer, const SumSources& src, unsigned sources, bool first, bool last,
                                                std::uint64_t i) {
  using S = sum_element<D>;
  using T = typename S::storage;
  using A = typename S::acc;
  unsigned s = 0;
  A a = first ? S::first(static_cast<const T*>(src.at[s++])[i]) : static_cast<const A*>(acc_buffer)[i];
  for (; s < sources; ++s) a = S::add(a, static_cast<const T*>(src.at[s])[i]);
  if (last) static_cast<T*>(out)[i] = S::store(a); else static_cast<A*>(acc_buffer)[i] = a;
}

template <ElementType D>
__global__ void sum_kernel(void* out, void* acc_buffer, SumSources src, unsigned sources, bool first, bool last, std::uint64_t count) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < count; i += std::uint64_t{gridDim.x} * blockDim.x) {
    sum_at<D>(out, acc_buffer, src, sources, first, last, i);
  }
}

}  // namespace kernels

/// Copies `count` chunks (device array) from src to dst on `stream`.
inline void launch_copy(const std::byte* src, std::byte* dst, const CopyChunk* chunks, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  kernels::copy_chunks_kernel<warps_per_block><<<static_cast<unsigned>(blocks_for(count)), block_threads, 0, stream>>>(
      reinterpret_cast<const unsigned char*>(src), reinterpret_cast<unsigned char*>(dst), chunks, count);
  CPDISPATCH_CUDA_CHECK_LAUNCH("copy_chunks_kernel");
}

/// The combine over `count` chunks (device array); `mask` is the device
/// seq_recv_mask ([shards][copies]). replica and grad must be aligned to
/// the element size (the dispatcher checks).
inline void launch_combine(ElementType type, const std::byte* replica, std::byte* grad, const CombineChunk* chunks, std::size_t count,
                           std::uint64_t slab_bytes, const std::uint8_t* mask, std::uint32_t copies, cudaStream_t stream) {
  if (count == 0) return;
  const auto blocks = static_cast<unsigned>(blocks_for(count));
  const auto* in = reinterpret_cast<const unsigned char*>(replica);
  auto* out = reinterpret_cast<unsigned char*>(grad);
  switch (type) {
    case ElementType::float32:
      kernels::combine_kernel<ElementType::float32, warps_per_block><<<blocks, block_threads, 0, stream>>>(in, out, chunks, count, slab_bytes, mask, copies);
      break;
    case ElementType::float64:
      kernels::combine_kernel<ElementType::float64, warps_per_block><<<blocks, block_threads, 0, stream>>>(in, out, chunks, count, slab_bytes, mask, copies);
      break;
    case ElementType::bfloat16:
      kernels::combine_kernel<ElementType::bfloat16, warps_per_block><<<blocks, block_threads, 0, stream>>>(in, out, chunks, count, slab_bytes, mask, copies);
      break;
    case ElementType::float16:
      kernels::combine_kernel<ElementType::float16, warps_per_block><<<blocks, block_threads, 0, stream>>>(in, out, chunks, count, slab_bytes, mask, copies);
      break;
    default: return;  // integer gradients: refused on the host by the data path
  }
  CPDISPATCH_CUDA_CHECK_LAUNCH("combine_kernel");
}

/// out[i] = sources[0][i] + sources[1][i] + ... in this order, for `count`
/// elements of `type` (the sim transport's semantics: fp32 accumulation and
/// one rounding for 16-bit floats, wrap-around for integers). With more than
/// sum_sources_per_pass sources, `acc_buffer` holds count accumulators
/// (count * 8 bytes suffice); otherwise it may be null. `out` must not be one
/// of the sources.
inline void launch_sum(ElementType type, void* out, void* acc_buffer, std::span<const void* const> sources, std::size_t count,
                       cudaStream_t stream) {
  if (count == 0 || sources.empty()) return;
  constexpr unsigned threads = 256;
  const std::size_t wanted = (count + threads - 1) / threads;
  const auto blocks = static_cast<unsigned>(wanted < max_blocks ? wanted : max_blocks);
  for (std::size_t at = 0; at < sources.size(); at += kernels::sum_sources_per_pass) {
    kernels::SumSources src{};
    const std::size_t n = std::min<std::size_t>(kernels::sum_sources_per_pass, sources.size() - at);
    for (std::size_t s = 0; s < n; ++s) src.at[s] = sources[at + s];
    const bool first = at == 0, last = at + n == sources.size();
    const auto m = static_cast<unsigned>(n);
    switch (type) {
#define CPDISPATCH_SUM_CASE(D) \
  case D: kernels::sum_kernel<D><<<blocks, threads, 0, stream>>>(out, acc_buffer, src, m, first, last, count); break;
      CPDISPATCH_SUM_CASE(ElementType::int8)
      CPDISPATCH_SUM_CASE(ElementType::uint8)
      CPDISPATCH_SUM_CASE(ElementType::int32)
      CPDISPATCH_SUM_CASE(ElementType::int64)
      CPDISPATCH_SUM_CASE(ElementType::float32)
      CPDISPATCH_SUM_CASE(ElementType::float64)
      CPDISPATCH_SUM_CASE(ElementType::bfloat16)
      CPDISPATCH_SUM_CASE(ElementType::float16)
#undef CPDISPATCH_SUM_CASE
    }
    CPDISPATCH_CUDA_CHECK_LAUNCH("sum_kernel");
  }
}

}  // namespace cpdispatch::cuda
