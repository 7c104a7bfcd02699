#pragma once
// ContextParallelAttention's data path for device transports
// (AttentionDataPath<MemorySpace::device>; the interface and the host path
// are in attention/data_path.hpp). Include it, from a CUDA translation
// unit, wherever the op runs over a device transport.
//
// Everything is ordered on the transport's stream (`cudaStream_t stream()
// const`). Per plan (clear, add_*, commit) the piece lists are split into
// copy chunks, the fan lists and the home combines planned, and all of it
// uploaded; earlier plans' device lists are freed then (cudaFree waits for
// the work still using them). Per call (copy, fan_in, combine, fill, zero,
// merge, accumulate, store) only kernels and cudaMemsetAsync are enqueued:
// no allocation, no host synchronisation, graph-capturable.
//
// Results equal the host path's: copies, fan-in, combine, accumulate and
// store bit for bit (16-bit values round as float16.hpp does, the sums
// accumulate in fp32 in the same order); the log-sum-exp merge up to the
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
#include <deque>
#include <optional>
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
#include "cpdispatch/plan/dedup.hpp"
#include "cpdispatch/plan/metadata.hpp"

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

/// Thread i of the grid sets p[i], p[i + threads], ...
__global__ void fill_kernel(float* p, std::uint64_t n, float value) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) p[i] = value;
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

/// Blocks of block_threads threads for one thread per element.
constexpr unsigned blocks_for_elements(std::uint64_t n) noexcept {
  const std::uint64_t blocks = n / block_threads + (n % block_threads != 0);
  return static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
}

}  // namespace attention_path_kernels

}  // namespace cpdispatch::cuda

namespace cpdispatch {

template <>
class AttentionDataPath<MemorySpace::device> {
 public:
  static constexpr bool available = true;

  template <class Transport>
  explicit AttentionDataPath(Transport& transport) : stream_(detail::stream_of(transport)) {}

  /// The stream everything here is ordered on (the transport's).
  cudaStream_t stream() const noexcept { return stream_; }

  template <class U>
  using span = cuda::DeviceSpan<U>;

  /// Owned device memory of U: a fresh allocation when it grows (the old
  /// contents are not kept, new elements are uninitialised), never a
  /// zero-byte one, so data() is a live device pointer once sized at all.
  template <class U>
  class buffer {
   public:
    void resize(std::size_t n) {
      reserve(n);
      size_ = n;
    }
    void reserve(std::size_t n) {
      if (mem_.empty() || mem_.size() < n) mem_.allocate(std::max<std::size_t>(n, 1));
    }
    U* data() noexcept { return mem_.data(); }
    const U* data() const noexcept { return mem_.data(); }
    std::size_t size() const noexcept { return size_; }

   private:
    cuda::DeviceBuffer<U> mem_;
    std::size_t size_ = 0;
  };

  /// Forgets the last plan's lists, freeing their device memory.
  void clear() noexcept {
    copies_.reset();
    copy_pieces_.clear();
    fans_.clear();
    combines_.clear();
    committed_ = false;
  }

  std::size_t add_copies(std::span<const detail::CopyPiece> pieces) {
    if (!copies_) copies_.emplace(stream_);
    const std::size_t id = copy_pieces_.size();
    copies_->add(id, std::vector<detail::CopyPiece>(pieces.begin(), pieces.end()));
    copy_pieces_.push_back(pieces.size());
    committed_ = false;
    return id;
  }

  /// Uploaded at once. Entries whose fan-in does nothing (one copy, at its
  /// own wire offset; or no tokens) are left out: in place, they would be
  /// copies onto themselves.
  std::size_t add_fan_in(const KvFanList& fan, std::size_t token_bytes) {
    fans_.emplace_back(without_no_ops(fan), token_bytes, stream_);
    return fans_.size() - 1;
  }

  /// Uploaded at once (`rev` need not outlive the call).
  std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes) {
    combines_.emplace_back(rev, token_bytes, stream_);
    return combines_.size() - 1;
  }

  void commit() {
    if (copies_) copies_->upload();
    committed_ = true;
  }

  void copy(std::size_t id, const std::byte* src, std::byte* dst) const {
    if (!committed_ || id >= copy_pieces_.size()) {
      detail::fail(who, ": copy list ", id, " of ", copy_pieces_.size(), committed_ ? "" : " (not committed)");
    }
    copies_->run(id, copy_pieces_[id], src, dst, who);
  }
  /// The exchange engine's form: a list added here, by its id.
  void copy(detail::PieceList list, const std::byte* src, std::byte* dst) const { copy(list.id, src, dst); }

  /// Sums each entry's copies at its wire offset: in place when the wire
  /// offsets are the entries' first copies (the fan-in kernel allows that).
  void fan_in(std::size_t id, ElementType type, std::byte* attention) const {
    const Fan& f = at(fans_, id, "fan-in");
    aligned(type, f.token_bytes, attention, "fan-in");
    f.run(type, attention, attention);
  }

  void combine(std::size_t id, ElementType type, const std::byte* replica, std::size_t replica_bytes, std::byte* grad, std::size_t grad_bytes) const {
    const Combine& c = at(combines_, id, "combine");
    c.run(cuda::DeviceConstBytes(replica, replica_bytes), cuda::DeviceBytes(grad, grad_bytes), c.token_bytes, type);
  }

  void fill(float* p, std::size_t n, float value) const {
    if (n == 0) return;
    cuda::launch_kernel("fill_kernel", &cuda::attention_path_kernels::fill_kernel, cuda::attention_path_kernels::blocks_for_elements(n),
                        cuda::block_threads, stream_, p, std::uint64_t{n}, value);
  }
  void zero(std::byte* p, std::size_t bytes) const {
    if (bytes > 0) CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }

  /// The largest |x| (NaN when x holds one): the invariant mode's bound.
  /// Waits for the stream (the value is read on the host).
  template <class E>
  double max_abs(const E* x, std::size_t n) const {
    check_element<E>();
    if (n == 0) return 0;
    const unsigned blocks = std::min(cuda::attention_path_kernels::blocks_for_elements(n), 1024u);  // enough to fill a GPU's memory bandwidth
    const std::size_t threads = std::size_t{blocks} * cuda::block_threads;
    if (max_partial_.size() < threads) max_partial_.allocate(threads);
    cuda::launch_kernel("max_abs_kernel", &cuda::attention_path_kernels::max_abs_kernel<E>, blocks, cuda::block_threads, stream_, x, std::uint64_t{n},
                        max_partial_.data());
    const std::size_t folded = std::min<std::size_t>(threads, cuda::block_threads);
    if (threads > folded) {
      cuda::launch_kernel("max_fold_kernel", &cuda::attention_path_kernels::max_fold_kernel, 1u, cuda::block_threads, stream_, max_partial_.data(),
                          std::uint64_t{threads});
    }
    max_host_.resize(folded);
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(max_host_.data(), max_partial_.data(), folded * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    float m = 0;
    for (float a : max_host_) m = detail::attention::max_keeping_nan(m, a);
    return m;
  }

  /// out = exact * 2^exponent, rounded once to E (round_exact).
  template <class E>
  void round_exact(const std::int64_t* exact, int exponent, E* out, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("round_exact_kernel", &cuda::attention_path_kernels::round_exact_kernel<E>, cuda::attention_path_kernels::blocks_for_elements(n),
                        cuda::block_threads, stream_, exact, exponent, out, std::uint64_t{n});
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
                          static_cast<unsigned>(cuda::blocks_for(rows)), cuda::block_threads, stream_, acc, static_cast<const float*>(lse), part,
                          lse_part, t, h, d);
    }
    cuda::launch_kernel("merge_lse_kernel", &cuda::attention_path_kernels::merge_lse_kernel, cuda::attention_path_kernels::blocks_for_elements(rows),
                        cuda::block_threads, stream_, lse, lse_part, rows);
  }

  /// acc += part, element by element.
  template <class E>
  void accumulate(float* acc, const E* part, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("accumulate_kernel", &cuda::attention_path_kernels::accumulate_kernel<E>,
                        cuda::attention_path_kernels::blocks_for_elements(n), cuda::block_threads, stream_, acc, part, std::uint64_t{n});
  }

  /// out = acc, rounded to E.
  template <class E>
  void store(const float* acc, E* out, std::size_t n) const {
    check_element<E>();
    if (n == 0) return;
    cuda::launch_kernel("store_kernel", &cuda::attention_path_kernels::store_kernel<E>, cuda::attention_path_kernels::blocks_for_elements(n),
                        cuda::block_threads, stream_, acc, out, std::uint64_t{n});
  }

 private:
  static constexpr const char* who = "device attention data path";

  struct Fan {
    Fan(const KvFanList& fan, std::size_t bytes, cudaStream_t stream) : run(fan, bytes, stream), token_bytes(bytes) {}
    detail::DeviceFanIn run;
    std::size_t token_bytes;
  };
  struct Combine {
    Combine(const RankMetadata& rev, std::size_t bytes, cudaStream_t stream) : run(rev, bytes, stream), token_bytes(bytes) {}
    detail::DeviceCombine run;
    std::size_t token_bytes;
  };

  template <class E>
  static constexpr void check_element() noexcept {
    static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                  "cpdispatch: the attention data path's element type is float, bfloat16 or float16");
  }

  template <class X>
  static const X& at(const std::deque<X>& lists, std::size_t id, const char* what) {
    if (id >= lists.size()) detail::fail(who, ": ", what, " list ", id, " of ", lists.size());
    return lists[id];
  }

  static void aligned(ElementType type, std::size_t token_bytes, const std::byte* p, const char* what) {
    const std::size_t es = element_size(type);
    if (token_bytes % es != 0 || reinterpret_cast<std::uintptr_t>(p) % es != 0) {
      detail::fail(who, ": the ", what, " of ", element_name(type), " needs token_bytes and the buffer aligned to ", es, " bytes");
    }
  }

  /// `fan` without the entries whose fan-in changes nothing.
  static KvFanList without_no_ops(const KvFanList& fan) {
    KvFanList out;
    out.wire_tokens = fan.wire_tokens;
    out.attention_tokens = fan.attention_tokens;
    out.copy_splits.push_back(0);
    for (std::size_t e = 0; e < fan.num_entries(); ++e) {
      const std::span<const std::int64_t> copies = fan.copies(e);
      if (fan.seq_len[e] == 0 || copies.empty() || (copies.size() == 1 && copies[0] == fan.wire_offset[e])) continue;
      out.wire_offset.push_back(fan.wire_offset[e]);
      out.seq_len.push_back(fan.seq_len[e]);
      if (e < fan.src_rank.size()) out.src_rank.push_back(fan.src_rank[e]);
      if (e < fan.src_shard.size()) out.src_shard.push_back(fan.src_shard[e]);
      out.attn_offset.insert(out.attn_offset.end(), copies.begin(), copies.end());
      out.copy_splits.push_back(out.attn_offset.size());
    }
    return out;
  }

  cudaStream_t stream_;
  std::optional<detail::DeviceCopyLists> copies_;
  std::vector<std::size_t> copy_pieces_;  // each copy list's piece count
  std::deque<Fan> fans_;                  // a deque: the pending uploads read host arrays that must not move
  std::deque<Combine> combines_;
  bool committed_ = false;
  mutable cuda::DeviceBuffer<float> max_partial_;  // max_abs's partial maxima
  mutable std::vector<float> max_host_;
};

}  // namespace cpdispatch
