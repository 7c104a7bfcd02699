#pragma once
// The CUDA kernels of the device data path, and their launchers:
//
//   launch_copy     the copy pieces of a plan (pack into one segment per peer,
//                   unpack into the attention layout, traffic to oneself, KV
//                   copies): one warp per chunk (plan.hpp)
//   launch_combine  the KV-gradient combine: per element, the sum of the
//                   returned copies in ascending copy order; fp32 accumulation
//                   for bf16/fp16, rounding as cpdispatch::bfloat16/float16 do
//   launch_fan_in   the deduplicated exchange's fan-in: per received KV shard,
//                   the sum of its copies' gradients in fan-list order, with
//                   the combine's arithmetic (its fan-out is launch_copy);
//                   in place too, each sum over its shard's first copy
//
// (The device sim's reduction kernel lives with the device sim, transports/device_sim.hpp.)
//
// Every kernel reads and writes each byte once, with 16-byte accesses where
// the addresses allow and narrower ones (down to single bytes) where they do
// not; the choice is made on the device from the actual addresses, so the
// same launch serves any buffer. Launches are asynchronous on the caller's
// stream and need no host synchronisation (graph-capturable).
//
// The per-warp work (copy_chunk, sum_copies) is __host__ __device__: the
// lanes of a warp never talk to each other, so running lane 0, 1, ..., 31
// one after another on the host does exactly what the warp does, which lets
// the tests check the kernels' logic on any CPU. The 16-bit conversions are
// float16.hpp's own (__host__ __device__ under nvcc): device and host round
// alike by construction.
//
// Bit-identical results need IEEE arithmetic: --use_fast_math (which implies
// --ftz=true) flushes subnormal fp32 values, and so bf16/fp16 subnormals in
// the combine's fp32 accumulation, to zero. Do not build device code with
// it. It is refused at compile time where the compiler says so (__FAST_MATH__,
// __USE_FAST_MATH__; nvcc 13 defines neither, so the project's CMake refuses
// --use_fast_math and -ftz=true in CMAKE_CUDA_FLAGS); define
// CPDISPATCH_ALLOW_FAST_MATH to accept results that differ from the host's
// for subnormal values.
//
// Requires nvcc (kernels): include from a .cu translation unit. (The
// project's tests also compile it with the host compiler against a CUDA
// runtime double, CPDISPATCH_CUDA_HOST_HARNESS, which runs launches as host
// loops over the grid.)

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/kernels.hpp holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#if (defined(__USE_FAST_MATH__) || defined(__FAST_MATH__)) && !defined(CPDISPATCH_ALLOW_FAST_MATH)
#error "cpdispatch/cuda/kernels.hpp: compiled with fast math, which flushes bf16/fp16 subnormals to zero and breaks the combine's bit-identical results; build without it, or define CPDISPATCH_ALLOW_FAST_MATH to accept the difference"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>

#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::cuda {

/// One warp's share of a fan-in: `bytes` bytes of fan entry `entry`,
/// starting `offset` bytes into each of its copies, summed into the output
/// at byte `dst`.
struct FanInChunk {
  std::uint64_t dst = 0;
  std::uint64_t offset = 0;
  std::uint32_t bytes = 0;
  std::uint32_t entry = 0;
  friend bool operator==(const FanInChunk&, const FanInChunk&) = default;
};
static_assert(std::is_trivially_copyable_v<FanInChunk> && sizeof(FanInChunk) == 24);

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

/// Integers: a wrapping sum (in the unsigned type), as the host's combine.
template <class S, class U>
struct combine_integer {
  using storage = S;
  using acc = U;
  static constexpr bool starts_from_copy = true;
  __host__ __device__ static acc load(storage x) { return static_cast<acc>(x); }
  __host__ __device__ static storage store(acc a) { return static_cast<storage>(a); }
};
template <>
struct combine_element<ElementType::int8> : combine_integer<std::int8_t, std::uint8_t> {};
template <>
struct combine_element<ElementType::uint8> : combine_integer<std::uint8_t, std::uint8_t> {};
template <>
struct combine_element<ElementType::int32> : combine_integer<std::int32_t, std::uint32_t> {};
template <>
struct combine_element<ElementType::int64> : combine_integer<std::int64_t, std::uint64_t> {};

template <class Traits>
__host__ __device__ __forceinline__ void accumulate(typename Traits::acc& a, typename Traits::storage x, bool first) {
  if (Traits::starts_from_copy && first) a = Traits::load(x);
  else a = static_cast<typename Traits::acc>(a + Traits::load(x));
}

/// A copy's load: through the read-only cache where nothing in the kernel
/// writes the copies (Copies::read_only), else a coherent one.
template <bool ReadOnly, class T>
__host__ __device__ __forceinline__ T load_copy(const T* p) {
  if constexpr (ReadOnly) return load_once(p);
  else return *p;
}

/// Lane `lane`'s share of summing n elements of the regions `copies.at(c)`,
/// c = 0, 1, ..., copies.count() - 1, those with copies.included(c), in that
/// order, into `out`, with the combine's arithmetic. `out` is disjoint from
/// the copies or (the fan-in in place) is copy 0 itself: each element of it
/// is stored by the lane that loaded every copy of that element, after the
/// loads, so no lane reads what another wrote. Not __restrict__ for that
/// reason. The combine and the fan-in differ only in where the copies are:
/// 16-byte accesses when every region is congruent to `out` modulo 16.
template <ElementType E, class Copies>
__host__ __device__ __forceinline__ void sum_copies(const Copies& copies, typename combine_element<E>::storage* out, std::uint64_t n,
                                                    unsigned lane) {
  constexpr bool read_only = Copies::read_only;
  using Traits = combine_element<E>;
  using T = typename Traits::storage;
  using A = typename Traits::acc;
  auto scalar = [&](std::uint64_t i) {
    A a = A(0);
    bool first = true;
    for (std::uint64_t c = 0; c < copies.count(); ++c) {
      if (!copies.included(c)) continue;
      accumulate<Traits>(a, load_copy<read_only>(copies.at(c) + i), first);
      first = false;
    }
    out[i] = Traits::store(a);
  };
  const auto out_at = reinterpret_cast<std::uintptr_t>(out);
  std::uintptr_t misaligned = 0;
  for (std::uint64_t c = 0; c < copies.count(); ++c) misaligned |= reinterpret_cast<std::uintptr_t>(copies.at(c)) - out_at;
  if (misaligned % 16 != 0) {
    for (std::uint64_t i = lane; i < n; i += 32) scalar(i);
    return;
  }
  constexpr unsigned per_vec = 16 / sizeof(T);
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
    for (std::uint64_t c = 0; c < copies.count(); ++c) {
      if (!copies.included(c)) continue;
      Vec x;
      x.v = load_copy<read_only>(reinterpret_cast<const uint4*>(copies.at(c) + i));
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

/// The combine's copies: copy c at in + c * slab, where mask[c] is set.
template <class T>
struct SlabCopies {
  static constexpr bool read_only = true;  // the replica buffer, never grad
  const T* in;
  std::uint64_t slab;
  const std::uint8_t* mask;
  std::uint32_t copies;
  __host__ __device__ std::uint64_t count() const { return copies; }
  __host__ __device__ bool included(std::uint64_t c) const { return mask[c] != 0; }
  __host__ __device__ const T* at(std::uint64_t c) const { return in + c * slab; }
};

/// The fan-in's copies: copy c at base + at[c] + offset, every one.
template <class T>
struct ListedCopies {
  static constexpr bool read_only = false;  // the fan-in may write its sums over copy 0
  const unsigned char* base;
  const std::uint64_t* offsets;
  std::uint64_t copies;
  std::uint64_t offset;
  __host__ __device__ std::uint64_t count() const { return copies; }
  __host__ __device__ bool included(std::uint64_t) const { return true; }
  __host__ __device__ const T* at(std::uint64_t c) const { return reinterpret_cast<const T*>(base + offsets[c] + offset); }
};

/// Lane `lane`'s share of one combine chunk.
template <ElementType E>
__host__ __device__ __forceinline__ void combine_chunk(const unsigned char* replica, unsigned char* grad, const CombineChunk& chunk,
                                                       std::uint64_t slab_bytes, const std::uint8_t* mask, std::uint32_t copies,
                                                       unsigned lane) {
  using T = typename combine_element<E>::storage;
  const SlabCopies<T> from{reinterpret_cast<const T*>(replica + chunk.start), slab_bytes / sizeof(T), mask + std::uint64_t{chunk.shard} * copies,
                           copies};
  sum_copies<E>(from, reinterpret_cast<T*>(grad + chunk.start), chunk.bytes / sizeof(T), lane);
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


// ---- fan-in (deduplicated KV exchange) ------------------------------------------

/// Warp w sums fan-in chunks w, w + (warps in the grid), ...: chunk k's
/// entry has copies at attention + copy_at[splits[entry] ..
/// splits[entry + 1]), and its sum goes to out + chunk.dst: a region
/// disjoint from every copy, or the entry's first copy itself (in place,
/// out == attention with wire offsets at first copies; see sum_copies).
/// Hence attention and out are not __restrict__, nor read through the
/// read-only cache.
template <ElementType E, unsigned Warps>
__global__ void __launch_bounds__(Warps * 32) fan_in_kernel(const unsigned char* attention, unsigned char* out,
                                                           const FanInChunk* __restrict__ chunks, std::uint64_t count,
                                                           const std::uint64_t* __restrict__ copy_at,
                                                           const std::uint64_t* __restrict__ splits) {
  using T = typename combine_element<E>::storage;
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * Warps;
  for (std::uint64_t c = blockIdx.x * std::uint64_t{Warps} + threadIdx.x / 32; c < count; c += stride) {
    const FanInChunk chunk = chunks[c];
    const std::uint64_t first = splits[chunk.entry];
    const ListedCopies<T> from{attention, copy_at + first, splits[chunk.entry + 1] - first, chunk.offset};
    sum_copies<E>(from, reinterpret_cast<T*>(out + chunk.dst), chunk.bytes / sizeof(T), lane);
  }
}

/// Thread i of the grid sets p[i], p[i + threads], ...
template <class = void>
__global__ void fill_kernel(float* p, std::uint64_t n, float value) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) p[i] = value;
}

}  // namespace kernels

/// Blocks of block_threads threads for one thread per element.
constexpr unsigned blocks_for_elements(std::uint64_t n) noexcept {
  const std::uint64_t blocks = n / block_threads + (n % block_threads != 0);
  return static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
}

/// Sets n floats (device memory) to `value` on `stream`.
inline void launch_fill(float* p, std::size_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel("fill_kernel", &kernels::fill_kernel<>, blocks_for_elements(n), block_threads, stream, p, std::uint64_t{n}, value);
}

/// Copies `count` chunks (device array) from src to dst on `stream`.
inline void launch_copy(const std::byte* src, std::byte* dst, const CopyChunk* chunks, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  launch_kernel("copy_chunks_kernel", &kernels::copy_chunks_kernel<warps_per_block>, static_cast<unsigned>(blocks_for(count)), block_threads,
                stream, reinterpret_cast<const unsigned char*>(src), reinterpret_cast<unsigned char*>(dst), chunks, std::uint64_t{count});
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
  auto run = [&](auto kernel) {
    launch_kernel("combine_kernel", kernel, blocks, block_threads, stream, in, out, chunks, std::uint64_t{count}, slab_bytes, mask, copies);
  };
  switch (type) {
    case ElementType::int8: run(&kernels::combine_kernel<ElementType::int8, warps_per_block>); break;
    case ElementType::uint8: run(&kernels::combine_kernel<ElementType::uint8, warps_per_block>); break;
    case ElementType::int32: run(&kernels::combine_kernel<ElementType::int32, warps_per_block>); break;
    case ElementType::int64: run(&kernels::combine_kernel<ElementType::int64, warps_per_block>); break;
    case ElementType::float32: run(&kernels::combine_kernel<ElementType::float32, warps_per_block>); break;
    case ElementType::float64: run(&kernels::combine_kernel<ElementType::float64, warps_per_block>); break;
    case ElementType::bfloat16: run(&kernels::combine_kernel<ElementType::bfloat16, warps_per_block>); break;
    case ElementType::float16: run(&kernels::combine_kernel<ElementType::float16, warps_per_block>); break;
  }
}

/// The fan-in over `count` chunks (device array): see fan_in_kernel.
/// `copy_at` and `splits` are the fan list's copy byte offsets and entry
/// splits on the device; both buffers must be aligned to the element size.
inline void launch_fan_in(ElementType type, const std::byte* attention, std::byte* out, const FanInChunk* chunks, std::size_t count,
                          const std::uint64_t* copy_at, const std::uint64_t* splits, cudaStream_t stream) {
  if (count == 0) return;
  const auto blocks = static_cast<unsigned>(blocks_for(count));
  const auto* in = reinterpret_cast<const unsigned char*>(attention);
  auto* o = reinterpret_cast<unsigned char*>(out);
  auto run = [&](auto kernel) { launch_kernel("fan_in_kernel", kernel, blocks, block_threads, stream, in, o, chunks, std::uint64_t{count}, copy_at, splits); };
  switch (type) {
    case ElementType::int8: run(&kernels::fan_in_kernel<ElementType::int8, warps_per_block>); break;
    case ElementType::uint8: run(&kernels::fan_in_kernel<ElementType::uint8, warps_per_block>); break;
    case ElementType::int32: run(&kernels::fan_in_kernel<ElementType::int32, warps_per_block>); break;
    case ElementType::int64: run(&kernels::fan_in_kernel<ElementType::int64, warps_per_block>); break;
    case ElementType::float32: run(&kernels::fan_in_kernel<ElementType::float32, warps_per_block>); break;
    case ElementType::float64: run(&kernels::fan_in_kernel<ElementType::float64, warps_per_block>); break;
    case ElementType::bfloat16: run(&kernels::fan_in_kernel<ElementType::bfloat16, warps_per_block>); break;
    case ElementType::float16: run(&kernels::fan_in_kernel<ElementType::float16, warps_per_block>); break;
  }
}

}  // namespace cpdispatch::cuda
