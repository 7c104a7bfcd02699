#pragma once
// CudaAttentionKernel: varlen attention forward and backward on the device,
// satisfying AttentionKernel (attention/kernel.hpp) for float, bfloat16 and
// float16 with fp32 accumulation. docs/attention-kernel.md.
//
// Correctness first: one thread per (query row, query head) attends the
// row's visible keys with an online softmax (forward) or accumulates its dq
// (backward); one thread per (key row, key-value head) accumulates dk and dv
// over the rows of every query head of its group that see the key. Threads
// never cooperate (no shared memory, no atomics), so results are the same
// run to run, and the kernels run unchanged in the cuda-cpu test harness,
// which executes a block's threads one after another. Flash-attention's
// tiled kernels are the fast path on a GPU (the adapter in the docs).
//
// Buffers (q, k, v, out, lse, dout, dq, dk, dv) are device memory; the
// entries are host memory. prepare(calls) (PreparedAttentionKernel) uploads
// every entry list the next calls will pass, with their row prefix sums, in
// one go and keeps host copies; a call whose list matches a prepared one
// (same address and size, then the same bytes: a host memcmp) launches on
// that device copy with no upload and no synchronisation, so a step of
// prepared calls can be captured into a CUDA graph (valid until the next
// prepare, which rewrites the copies). A list that was not prepared (or was
// changed in place since) is uploaded on the kernel's stream after
// synchronising it, so that the host copy of the previous upload may be
// reused: correct, but a host synchronisation per call. Backward's fp32
// scratch (heads_q x the entries' last query row) is sized by prepare for
// the most query heads of any earlier backward; a backward that needs more
// (the first one of a kernel, say) allocates it (cudaMalloc) and keeps the
// smaller buffer until the next prepare, since cudaFree waits for the
// device. Launches are asynchronous on the stream: synchronise it before
// reading the results on the host.
// head_dim is at most 256 (per-thread accumulators).
//
// Requires nvcc (kernels): include from a .cu translation unit (the tests
// also compile it against the cuda-cpu harness, CPDISPATCH_CUDA_HOST_HARNESS).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/call_check.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch::cuda {

namespace attention_kernels {

inline constexpr int max_head_dim = 256;
inline constexpr unsigned block_threads = 128;

/// What every thread of a launch needs, by value.
struct Params {
  std::int64_t heads_q, heads_kv, head_dim;
  float scale;
  int mask_type;        // 0 causal, 1 full, 2 sliding window
  std::int64_t window;  // sliding window only, at most 2^62
  std::int64_t tokens_q;
  std::int64_t rows;     // query rows (or key rows) of all entries: the launch's x extent
  std::int64_t entries;  // number of entries
  std::int64_t delta_pitch;  // backward's scratch is [heads_q][delta_pitch]: the entries' last query row + 1
};

template <class E>
__host__ __device__ inline float load(const E* p, std::int64_t i) {
  if constexpr (std::is_same_v<E, float>) {
    return p[i];
  } else {
    return E::to_float(p[i].bits);
  }
}

template <class E>
__host__ __device__ inline void store(E* p, std::int64_t i, float x) {
  if constexpr (std::is_same_v<E, float>) {
    p[i] = x;
  } else {
    E e;
    e.bits = E::from_float(x);
    p[i] = e;
  }
}

__host__ __device__ inline std::int64_t clamp64(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

/// Keys [lo, hi) that query row j of an entry sees (attention/kernel.hpp's rule).
__host__ __device__ inline void visible_keys(const Params& p, std::int64_t j, std::int64_t diagonal, std::int64_t kv_len,
                                             std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t pos = j + diagonal;
  lo = 0;
  hi = p.mask_type == 1 ? kv_len : clamp64(pos + 1, 0, kv_len);
  if (p.mask_type == 2) lo = clamp64(pos - p.window + 1, 0, hi);
}

/// Query rows [lo, hi) of an entry that see its key t.
__host__ __device__ inline void rows_seeing(const Params& p, std::int64_t t, std::int64_t diagonal, std::int64_t q_len,
                                            std::int64_t& lo, std::int64_t& hi) {
  if (p.mask_type == 1) {
    lo = 0;
    hi = q_len;
    return;
  }
  lo = clamp64(t - diagonal, 0, q_len);  // j + diagonal >= t
  hi = p.mask_type == 2 ? clamp64(t - diagonal + p.window, lo, q_len) : q_len;  // j + diagonal - window < t
}

/// The entry holding launch row i: the last e with offsets[e] <= i.
__host__ __device__ inline std::int64_t entry_of(const std::int64_t* offsets, std::int64_t entries, std::int64_t i) {
  std::int64_t lo = 0, hi = entries;  // offsets[lo] <= i < offsets[hi]
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

template <class E>
__host__ __device__ inline float dot(const E* a, const E* b, std::int64_t n) {
  float s = 0.0f;
  for (std::int64_t d = 0; d < n; ++d) s += load(a, d) * load(b, d);
  return s;
}

/// Thread (query row, query head): online softmax over the row's keys.
template <class E>
__global__ void __launch_bounds__(block_threads)
    forward_kernel(Params p, const AttentionEntry* entries, const std::int64_t* offsets, const E* q, const E* k,
                   const E* v, E* out, float* lse) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const std::int64_t ei = entry_of(offsets, p.entries, i);
  const AttentionEntry e = entries[ei];
  const std::int64_t j = i - offsets[ei], row = e.q_start + j;
  const std::int64_t D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const E* qr = q + (row * p.heads_q + h) * D;
  float acc[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  std::int64_t lo = 0, hi = 0;
  visible_keys(p, j, e.diagonal, e.kv_len, lo, hi);
  for (std::int64_t t = lo; t < hi; ++t) {
    const std::int64_t kr = ((e.kv_start + t) * p.heads_kv + g) * D;
    const float s = dot(qr, k + kr, D) * p.scale;
    if (s > m) {  // a new maximum: rescale what was summed against the old one
      const float c = expf(m - s);
      l *= c;
      for (std::int64_t d = 0; d < D; ++d) acc[d] *= c;
      m = s;
    }
    const float w = expf(s - m);
    l += w;
    for (std::int64_t d = 0; d < D; ++d) acc[d] += w * load(v, kr + d);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (std::int64_t d = 0; d < D; ++d) store(out, (row * p.heads_q + h) * D + d, acc[d] * inv);
  lse[h * p.tokens_q + row] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/// Thread (query row, query head): D = rowsum(dout * out), the softmax gradient's shift.
template <class E>
__global__ void __launch_bounds__(block_threads)
    delta_kernel(Params p, const AttentionEntry* entries, const std::int64_t* offsets, const E* out, const E* dout,
                 float* delta) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const std::int64_t e = entry_of(offsets, p.entries, i);
  const std::int64_t row = entries[e].q_start + i - offsets[e], base = (row * p.heads_q + h) * p.head_dim;
  delta[h * p.delta_pitch + row] = dot(out + base, dout + base, p.head_dim);
}

/// Thread (query row, query head): dq = scale * sum_t dS_t k_t.
template <class E>
__global__ void __launch_bounds__(block_threads)
    query_grad_kernel(Params p, const AttentionEntry* entries, const std::int64_t* offsets, const E* q, const E* k,
                      const E* v, const float* lse, const E* dout, const float* delta, E* dq) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const std::int64_t ei = entry_of(offsets, p.entries, i);
  const AttentionEntry e = entries[ei];
  const std::int64_t j = i - offsets[ei], row = e.q_start + j, D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const std::int64_t qi = (row * p.heads_q + h) * D;
  float acc[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  const float row_lse = lse[h * p.tokens_q + row], shift = delta[h * p.delta_pitch + row];
  std::int64_t lo = 0, hi = 0;
  visible_keys(p, j, e.diagonal, e.kv_len, lo, hi);
  if (row_lse == -INFINITY) hi = lo;  // the row saw nothing in the whole attention
  for (std::int64_t t = lo; t < hi; ++t) {
    const std::int64_t kr = ((e.kv_start + t) * p.heads_kv + g) * D;
    const float prob = expf(dot(q + qi, k + kr, D) * p.scale - row_lse);
    const float ds = prob * (dot(dout + qi, v + kr, D) - shift) * p.scale;
    for (std::int64_t d = 0; d < D; ++d) acc[d] += ds * load(k, kr + d);
  }
  for (std::int64_t d = 0; d < D; ++d) store(dq, qi + d, acc[d]);
}

/// Thread (key row, key-value head): dv = sum P dout, dk = scale * sum dS q
/// over the rows of every query head of the group that see the key.
template <class E>
__global__ void __launch_bounds__(block_threads)
    key_value_grad_kernel(Params p, const AttentionEntry* entries, const std::int64_t* offsets, const E* q,
                          const E* k, const E* v, const float* lse, const E* dout, const float* delta, E* dk, E* dv) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, g = blockIdx.y;
  if (i >= p.rows) return;
  const std::int64_t ei = entry_of(offsets, p.entries, i);
  const AttentionEntry e = entries[ei];
  const std::int64_t t = i - offsets[ei], D = p.head_dim, group = p.heads_q / p.heads_kv;
  const std::int64_t kr = ((e.kv_start + t) * p.heads_kv + g) * D;
  float acc_k[max_head_dim], acc_v[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc_k[d] = acc_v[d] = 0.0f;
  std::int64_t lo = 0, hi = 0;
  rows_seeing(p, t, e.diagonal, e.q_len, lo, hi);
  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (std::int64_t j = lo; j < hi; ++j) {
      const std::int64_t row = e.q_start + j, qi = (row * p.heads_q + h) * D;
      const float row_lse = lse[h * p.tokens_q + row];
      if (row_lse == -INFINITY) continue;
      const float prob = expf(dot(q + qi, k + kr, D) * p.scale - row_lse);
      const float ds = prob * (dot(dout + qi, v + kr, D) - delta[h * p.delta_pitch + row]) * p.scale;
      for (std::int64_t d = 0; d < D; ++d) {
        acc_v[d] += prob * load(dout, qi + d);
        acc_k[d] += ds * load(q, qi + d);
      }
    }
  }
  for (std::int64_t d = 0; d < D; ++d) {
    store(dk, kr + d, acc_k[d]);
    store(dv, kr + d, acc_v[d]);
  }
}

}  // namespace attention_kernels

/// Varlen attention on the device; see the file comment.
class CudaAttentionKernel {
 public:
  /// Its buffers are device memory (attention_kernel_memory_space).
  static constexpr MemorySpace memory_space = MemorySpace::device;

  /// Launches on the legacy default stream.
  CudaAttentionKernel() = default;
  /// Launches on `stream` (the legacy default stream when null).
  explicit CudaAttentionKernel(cudaStream_t stream) : stream_(stream) {}

  cudaStream_t stream() const noexcept { return stream_; }

  template <class E>
  void forward(const AttentionShape& shape, const AttentionMask& mask, std::span<const AttentionEntry> entries,
               std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out,
               std::span<float> lse) {
    const auto z = check_.forward(name, shape, mask, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    check_head_dim(shape);
    attention_kernels::Params p = params(shape, mask, z);
    const OnDevice d = on_device(entries);
    p.rows = d.query_rows;
    p.entries = static_cast<std::int64_t>(entries.size());
    if (p.rows == 0) return;
    launch_kernel("attention forward_kernel", &attention_kernels::forward_kernel<E>, grid(p.rows, shape.heads_q),
                  dim3(attention_kernels::block_threads), stream_, p, d.entries, d.q_offsets, q.data(), k.data(),
                  v.data(), out.data(), lse.data());
  }

  template <class E>
  void backward(const AttentionShape& shape, const AttentionMask& mask, std::span<const AttentionEntry> entries,
                std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<const E> out,
                std::span<const float> lse, std::span<const E> dout, std::span<E> dq, std::span<E> dk,
                std::span<E> dv) {
    const auto z = check_.backward(name, shape, mask, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                   dout.size(), dq.size(), dk.size(), dv.size());
    check_head_dim(shape);
    attention_kernels::Params p = params(shape, mask, z);
    const OnDevice d = on_device(entries);
    p.entries = static_cast<std::int64_t>(entries.size());
    if (d.query_rows == 0 && d.key_rows == 0) return;
    p.delta_pitch = d.query_end;
    grow_delta(static_cast<std::size_t>(shape.heads_q * d.query_end));
    heads_q_seen_ = std::max(heads_q_seen_, shape.heads_q);
    const dim3 block(attention_kernels::block_threads);
    p.rows = d.query_rows;
    if (p.rows > 0) {
      launch_kernel("attention delta_kernel", &attention_kernels::delta_kernel<E>, grid(p.rows, shape.heads_q), block,
                    stream_, p, d.entries, d.q_offsets, out.data(), dout.data(), delta_.data());
      launch_kernel("attention query_grad_kernel", &attention_kernels::query_grad_kernel<E>, grid(p.rows, shape.heads_q),
                    block, stream_, p, d.entries, d.q_offsets, q.data(), k.data(), v.data(), lse.data(), dout.data(),
                    delta_.data(), dq.data());
    }
    p.rows = d.key_rows;
    if (p.rows > 0) {
      launch_kernel("attention key_value_grad_kernel", &attention_kernels::key_value_grad_kernel<E>,
                    grid(p.rows, shape.heads_kv), block, stream_, p, d.entries, d.kv_offsets, q.data(), k.data(),
                    v.data(), lse.data(), dout.data(), delta_.data(), dk.data(), dv.data());
    }
  }

  /// Uploads every entry list the calls until the next prepare will pass
  /// (PreparedAttentionKernel): one copy of all lists and their row prefix
  /// sums, kept with host copies so that a call can confirm its list. Waits
  /// for the stream first (the previous prepare's copy reads the host copies
  /// being replaced) and may allocate: call it outside a step.
  void prepare(std::span<const std::span<const AttentionEntry>> calls) {
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    retired_.clear();  // nothing on the stream reads them any more
    prepared_.clear();
    prepared_host_entries_.clear();
    prepared_host_offsets_.clear();
    std::int64_t query_end = 0;
    for (const std::span<const AttentionEntry> list : calls) {
      if (list.empty() || find_prepared(list)) continue;  // an empty call uploads nothing anyway
      OnDevice d;
      const std::size_t entry_at = prepared_host_entries_.size(), offset_at = prepared_host_offsets_.size();
      prepared_host_entries_.insert(prepared_host_entries_.end(), list.begin(), list.end());
      append_offsets(list, prepared_host_offsets_, d);
      prepared_.push_back({list.data(), list.size(), entry_at, offset_at, d.query_rows, d.key_rows, d.query_end});
      query_end = std::max(query_end, d.query_end);
    }
    // Backward's scratch for these lists at the most query heads seen so far
    // (the shape is not known here), so that a step allocates nothing.
    const auto need = static_cast<std::size_t>(heads_q_seen_ * query_end);
    if (delta_.size() < need) delta_.allocate(need);
    if (prepared_entries_.size() < prepared_host_entries_.size()) prepared_entries_.allocate(prepared_host_entries_.size());
    if (prepared_offsets_.size() < prepared_host_offsets_.size()) prepared_offsets_.allocate(prepared_host_offsets_.size());
    prepared_entries_.upload(prepared_host_entries_, stream_);
    prepared_offsets_.upload(prepared_host_offsets_, stream_);
  }

 private:
  static constexpr const char* name = "CudaAttentionKernel";

  static void check_head_dim(const AttentionShape& s) {
    if (s.head_dim > attention_kernels::max_head_dim) {
      detail::fail(name, ": shape.head_dim is ", s.head_dim, "; the device kernel takes at most ",
                   attention_kernels::max_head_dim);
    }
  }

  static attention_kernels::Params params(const AttentionShape& s, const AttentionMask& mask,
                                          const detail::attention::CallSizes& z) {
    const int type = mask.type == MaskType::causal ? 0 : (mask.type == MaskType::full ? 1 : 2);
    const std::int64_t window = std::min(mask.window, detail::attention::CallCheck::max_diagonal);
    return {s.heads_q, s.heads_kv, s.head_dim, s.softmax_scale, type, window, z.tokens_q, 0, 0, 0};
  }

  static dim3 grid(std::int64_t rows, std::int64_t heads) {
    const std::int64_t blocks = (rows + attention_kernels::block_threads - 1) / attention_kernels::block_threads;
    if (blocks > 0x7fffffff) detail::fail(name, ": ", rows, " rows exceed one launch");
    return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(heads));
  }

  // memcmp compares the entries' bytes: no padding may differ between equal lists.
  static_assert(std::has_unique_object_representations_v<AttentionEntry>);

  /// A call's entries on the device, with the prefix sums of their query and key rows.
  struct OnDevice {
    const AttentionEntry* entries = nullptr;
    const std::int64_t* q_offsets = nullptr;
    const std::int64_t* kv_offsets = nullptr;
    std::int64_t query_rows = 0, key_rows = 0;
    std::int64_t query_end = 0;  // one past the last query row of any entry
  };

  /// A list of the last prepare: where its copies start (entries, offsets).
  struct Prepared {
    const AttentionEntry* data;
    std::size_t size, entry_at, offset_at;
    std::int64_t query_rows, key_rows, query_end;
  };

  /// Appends the prefix sums of the query rows (n + 1), then of the key rows
  /// (n + 1); the row counts and the query end go to `d`.
  static void append_offsets(std::span<const AttentionEntry> entries, std::vector<std::int64_t>& offsets, OnDevice& d) {
    const std::size_t q0 = offsets.size(), n = entries.size();
    offsets.resize(q0 + 2 * (n + 1), 0);
    const std::size_t k0 = q0 + n + 1;
    d.query_end = 0;
    for (std::size_t e = 0; e < n; ++e) {
      offsets[q0 + e + 1] = offsets[q0 + e] + entries[e].q_len;
      offsets[k0 + e + 1] = offsets[k0 + e] + entries[e].kv_len;
      if (entries[e].q_len > 0) d.query_end = std::max(d.query_end, entries[e].q_start + entries[e].q_len);
    }
    d.query_rows = offsets[q0 + n];
    d.key_rows = offsets[k0 + n];
  }

  /// The prepared list with this address, size and contents, if any. The
  /// contents are compared because the caller's list may have changed (or
  /// been freed and its address reused) since prepare.
  const Prepared* find_prepared(std::span<const AttentionEntry> entries) const noexcept {
    for (const Prepared& p : prepared_) {
      if (p.data != entries.data() || p.size != entries.size()) continue;
      if (std::memcmp(prepared_host_entries_.data() + p.entry_at, entries.data(), entries.size_bytes()) == 0) return &p;
    }
    return nullptr;
  }

  /// The call's entries on the device: the prepared copy when there is one
  /// (no copy, no synchronisation), else an upload on the stream from a host
  /// copy the next call may overwrite only once this upload has run (the
  /// stream is synchronised first).
  OnDevice on_device(std::span<const AttentionEntry> entries) {
    if (entries.empty()) return {};
    if (const Prepared* p = find_prepared(entries)) {
      const std::int64_t* offsets = prepared_offsets_.data() + p->offset_at;
      return {prepared_entries_.data() + p->entry_at, offsets, offsets + p->size + 1, p->query_rows, p->key_rows,
              p->query_end};
    }
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::size_t n = entries.size();
    host_entries_.assign(entries.begin(), entries.end());
    host_offsets_.clear();
    OnDevice d;
    append_offsets(entries, host_offsets_, d);
    if (entries_.size() < n) entries_.allocate(n);
    if (offsets_.size() < host_offsets_.size()) offsets_.allocate(host_offsets_.size());
    entries_.upload(host_entries_, stream_);
    offsets_.upload(host_offsets_, stream_);
    d.entries = entries_.data();
    d.q_offsets = offsets_.data();
    d.kv_offsets = offsets_.data() + n + 1;
    return d;
  }

  /// Backward's scratch of at least `need` floats. Launches already on the
  /// stream may still read the old buffer, and cudaFree would wait for them:
  /// it is kept until the next prepare (or the kernel's end) instead.
  void grow_delta(std::size_t need) {
    if (delta_.size() >= need) return;
    DeviceBuffer<float> bigger(std::max(need, delta_.size() + delta_.size() / 2));  // by half at least: fewer of them
    if (!delta_.empty()) retired_.push_back(std::move(delta_));
    delta_ = std::move(bigger);
  }

  cudaStream_t stream_ = nullptr;
  detail::attention::CallCheck check_;
  // Host copies first: destroyed after the device buffers, whose cudaFree
  // waits for the copies that read them.
  std::vector<AttentionEntry> host_entries_;  // the last unprepared call's
  std::vector<std::int64_t> host_offsets_;    // query row offsets (n + 1), then key row offsets (n + 1)
  std::vector<Prepared> prepared_;
  std::vector<AttentionEntry> prepared_host_entries_;  // every prepared list, one after another
  std::vector<std::int64_t> prepared_host_offsets_;    // per list, as host_offsets_
  DeviceBuffer<AttentionEntry> entries_;
  DeviceBuffer<std::int64_t> offsets_;
  DeviceBuffer<AttentionEntry> prepared_entries_;
  DeviceBuffer<std::int64_t> prepared_offsets_;
  DeviceBuffer<float> delta_;
  std::vector<DeviceBuffer<float>> retired_;
  std::int64_t heads_q_seen_ = 0;  // the most query heads of a backward so far
};

static_assert(AttentionKernel<CudaAttentionKernel, float>);
static_assert(AttentionKernel<CudaAttentionKernel, bfloat16>);
static_assert(AttentionKernel<CudaAttentionKernel, float16>);
static_assert(PreparedAttentionKernel<CudaAttentionKernel>);

}  // namespace cpdispatch::cuda
