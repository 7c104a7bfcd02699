#pragma once
// CudaAttentionKernel: varlen attention forward and backward on the device,
// satisfying AttentionKernel (attention/kernel.hpp) for float, bfloat16 and
// float16 with fp32 accumulation. docs/attention-kernel.md.
//
// Correctness first: one thread per (query row, query head) attends the
// visible keys of every entry covering the row, entries in index order, with
// one online softmax (forward) or accumulates its dq over them (backward);
// one thread per (key row, key-value head) accumulates dk and dv over the
// rows of every query head of its group that see the key, in every entry
// covering the key. The rows covered are cut into segments covered by the
// same entries (attention/detail/row_cover.hpp), built on the host with the
// entry list; a thread finds its segment by binary search. Threads never
// cooperate (no shared memory, no atomics), so results are the same run to
// run, and the kernels run unchanged in the cuda-cpu test harness, which
// executes a block's threads one after another. Flash-attention's tiled
// kernels are the fast path on a GPU (the adapter in the docs).
//
// Buffers (q, k, v, out, lse, dout, dq, dk, dv) are device memory; the
// entries are host memory. prepare(calls) (PreparedAttentionKernel) uploads
// every entry list the next calls will pass, with their row segments, in
// one go and keeps host copies; a call whose list matches a prepared one
// (same address and size, then the same bytes: a host memcmp) launches on
// that device copy with no upload and no synchronisation, so a step of
// prepared calls can be captured into a CUDA graph (valid until the next
// prepare, which rewrites the copies). A list that was not prepared (or was
// changed in place since) is cut into segments and uploaded on the kernel's
// stream after synchronising it, so that the host copy of the previous
// upload may be reused: correct, but a host synchronisation per call.
// The invariant mode (forward_invariant, backward_invariant; attention/invariant.hpp)
// runs the same thread layout with an exact maximum pass and per-unit fp32
// sums added exactly; its calls upload the grid's phases and synchronise.
// Backward's fp32 scratch (heads_q x the entries' last query row) is sized
// by prepare for the most query heads of any earlier backward; a backward
// that needs more (the first one of a kernel, say) allocates it (cudaMalloc)
// and keeps the smaller buffer until the next prepare, since cudaFree waits
// for the device. Launches are asynchronous on the stream: synchronise it
// before reading the results on the host.
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
#include "cpdispatch/attention/detail/exact_sum.hpp"
#include "cpdispatch/attention/detail/row_cover.hpp"
#include "cpdispatch/attention/invariant.hpp"
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

using detail::attention::RowSegment;

/// What every thread of a launch needs, by value.
struct Params {
  std::int64_t heads_q, heads_kv, head_dim;
  float scale;
  std::int64_t tokens_q;
  std::int64_t rows;      // rows of the launch's cover (query or key rows): its x extent
  std::int64_t segments;  // segments of that cover
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

// A bounded band end is within 2^62 (the call checks) and a row below 2^56,
// so a row plus a band end never overflows below.

/// Key rows [lo, hi) of entry e that query row j sees: lo <= t - j <= hi
/// in its band (attention/kernel.hpp's rule).
__host__ __device__ inline void visible_keys(const AttentionEntry& e, std::int64_t j, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t end = e.kv_start + e.kv_len;
  lo = e.band.lo == Band::unbounded_lo ? e.kv_start : clamp64(j + e.band.lo, e.kv_start, end);
  hi = e.band.hi == Band::unbounded_hi ? end : clamp64(j + e.band.hi + 1, lo, end);
}

/// Query rows [lo, hi) of entry e that see its key row t: t - hi <= j <= t - lo.
__host__ __device__ inline void rows_seeing(const AttentionEntry& e, std::int64_t t, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t end = e.q_start + e.q_len;
  lo = e.band.hi == Band::unbounded_hi ? e.q_start : clamp64(t - e.band.hi, e.q_start, end);
  hi = e.band.lo == Band::unbounded_lo ? end : clamp64(t - e.band.lo + 1, lo, end);
}

/// The segment holding launch row i: the last s with segments[s].offset <= i.
__host__ __device__ inline const RowSegment& segment_of(const RowSegment* segments, std::int64_t count, std::int64_t i) {
  std::int64_t lo = 0, hi = count;  // segments[lo].offset <= i < segments[hi].offset
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (segments[mid].offset <= i) lo = mid; else hi = mid;
  }
  return segments[lo];
}

/// Launch row i's place: its segment and the buffer row it stands for
/// (a query row or a key row, as the launch's cover is).
struct LaunchRow {
  RowSegment seg;
  std::int64_t row;
};

__host__ __device__ inline LaunchRow launch_row(const RowSegment* segments, std::int64_t count, std::int64_t i) {
  const RowSegment seg = segment_of(segments, count, i);
  return {seg, seg.begin + (i - seg.offset)};
}

/// Calls f(kr) for each key row that query row `at.row` sees, over every
/// entry of its segment in index order; kr is the first element of that
/// key row's head g in k and v. Forward and dq walk the keys alike.
template <class F>
__device__ inline void for_each_visible_key(const Params& p, const AttentionEntry* entries, const std::int64_t* ids, const LaunchRow& at,
                                            std::int64_t g, F&& f) {
  for (std::int64_t n = 0; n < at.seg.count; ++n) {
    std::int64_t lo = 0, hi = 0;
    visible_keys(entries[ids[at.seg.first + n]], at.row, lo, hi);
    for (std::int64_t t = lo; t < hi; ++t) f((t * p.heads_kv + g) * p.head_dim);
  }
}

template <class E>
__host__ __device__ inline float dot(const E* a, const E* b, std::int64_t n) {
  float s = 0.0f;
  for (std::int64_t d = 0; d < n; ++d) s += load(a, d) * load(b, d);
  return s;
}

/// Thread (query row, query head): one online softmax over the keys of
/// every entry covering the row.
template <class E>
__global__ void __launch_bounds__(block_threads)
    forward_kernel(Params p, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                   const E* q, const E* k, const E* v, E* out, float* lse) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const std::int64_t row = at.row, D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const E* qr = q + (row * p.heads_q + h) * D;
  float acc[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for_each_visible_key(p, entries, ids, at, g, [&](std::int64_t kr) {
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
  });
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (std::int64_t d = 0; d < D; ++d) store(out, (row * p.heads_q + h) * D + d, acc[d] * inv);
  lse[h * p.tokens_q + row] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/// Thread (query row, query head): D = rowsum(dout * out), the softmax gradient's shift.
template <class E>
__global__ void __launch_bounds__(block_threads)
    delta_kernel(Params p, const RowSegment* segments, const E* out, const E* dout, float* delta) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const std::int64_t row = launch_row(segments, p.segments, i).row, base = (row * p.heads_q + h) * p.head_dim;
  delta[h * p.delta_pitch + row] = dot(out + base, dout + base, p.head_dim);
}

/// Thread (query row, query head): dq = scale * sum_t dS_t k_t over the keys
/// of every entry covering the row.
template <class E>
__global__ void __launch_bounds__(block_threads)
    query_grad_kernel(Params p, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                      const E* q, const E* k, const E* v, const float* lse, const E* dout, const float* delta, E* dq) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const std::int64_t row = at.row, D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const std::int64_t qi = (row * p.heads_q + h) * D;
  float acc[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  const float row_lse = lse[h * p.tokens_q + row], shift = delta[h * p.delta_pitch + row];
  // A row whose lse is -infinity saw nothing in the whole attention: dq = 0.
  if (row_lse != -INFINITY) {
    for_each_visible_key(p, entries, ids, at, g, [&](std::int64_t kr) {
      const float prob = expf(dot(q + qi, k + kr, D) * p.scale - row_lse);
      const float ds = prob * (dot(dout + qi, v + kr, D) - shift) * p.scale;
      for (std::int64_t d = 0; d < D; ++d) acc[d] += ds * load(k, kr + d);
    });
  }
  for (std::int64_t d = 0; d < D; ++d) store(dq, qi + d, acc[d]);
}

/// Thread (key row, key-value head): dv = sum P dout, dk = scale * sum dS q
/// over the rows of every query head of the group that see the key, in every
/// entry covering the key.
template <class E>
__global__ void __launch_bounds__(block_threads)
    key_value_grad_kernel(Params p, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                          const E* q, const E* k, const E* v, const float* lse, const E* dout, const float* delta, E* dk,
                          E* dv) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, g = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const RowSegment& seg = at.seg;
  const std::int64_t t = at.row, D = p.head_dim, group = p.heads_q / p.heads_kv;
  const std::int64_t kr = (t * p.heads_kv + g) * D;
  float acc_k[max_head_dim], acc_v[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) acc_k[d] = acc_v[d] = 0.0f;
  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (std::int64_t n = 0; n < seg.count; ++n) {
      const AttentionEntry e = entries[ids[seg.first + n]];
      std::int64_t lo = 0, hi = 0;
      rows_seeing(e, t, lo, hi);
      for (std::int64_t row = lo; row < hi; ++row) {
        const std::int64_t qi = (row * p.heads_q + h) * D;
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
  }
  for (std::int64_t d = 0; d < D; ++d) {
    store(dk, kr + d, acc_k[d]);
    store(dv, kr + d, acc_v[d]);
  }
}

// ---- The invariant mode (attention/invariant.hpp): per row (or key), each
// unit's terms summed in fp32 in increasing order, the units added exactly
// (attention/detail/exact_sum.hpp). A term that is not finite or too large
// for its exact sum is reported in `fault` (what, then row and head) and the
// host call throws after the launch.

using detail::attention::add_exact;
using detail::attention::exact_exponent;
using detail::attention::from_fixed;

/// What an invariant launch needs beyond Params: the grid, each entry's
/// phase on it (device memory) and where to report a fault.
struct GridParams {
  std::int64_t size;
  const UnitPhase* phases;
  std::int64_t* fault;  // [3]: what (0: none, 1: scores, 2: output, 3: dq, 4: dk or dv), row, head
};

__host__ __device__ inline void report(const GridParams& g, std::int64_t what, std::int64_t row, std::int64_t head) {
  g.fault[1] = row;
  g.fault[2] = head;
  g.fault[0] = what;
}

/// The first row after t of the unit holding t (rows from `start`, the grid shifted by `phase`), at most `end`.
__host__ __device__ inline std::int64_t unit_end(std::int64_t t, std::int64_t start, std::int64_t phase, std::int64_t G, std::int64_t end) {
  const std::int64_t u = t + G - (phase + t - start) % G;
  return u < end ? u : end;
}

/// For each entry covering launch row `at` (index order) and each unit of
/// the keys the row sees in it (the grid shifted by the entry's key phase):
/// begin(), key(kr) for each key in increasing order (kr: the key's first
/// element of head g in k and v), then end(); stops, returning false, where
/// end() returns false. The forward and dq walk the units alike.
template <class Begin, class Key, class End>
__device__ inline bool for_each_key_unit(const Params& p, const GridParams& gp, const AttentionEntry* entries, const std::int64_t* ids,
                                         const LaunchRow& at, std::int64_t g, Begin&& begin, Key&& key, End&& end) {
  for (std::int64_t c = 0; c < at.seg.count; ++c) {
    const std::int64_t id = ids[at.seg.first + c];
    const AttentionEntry& e = entries[id];
    std::int64_t lo = 0, hi = 0;
    visible_keys(e, at.row, lo, hi);
    for (std::int64_t u0 = lo; u0 < hi;) {
      const std::int64_t u1 = unit_end(u0, e.kv_start, gp.phases[id].kv, gp.size, hi);
      begin();
      for (std::int64_t t = u0; t < u1; ++t) key((t * p.heads_kv + g) * p.head_dim);
      if (!end()) return false;
      u0 = u1;
    }
  }
  return true;
}

template <class E>
__host__ __device__ inline float max_abs_row(const E* x, std::int64_t n) {
  float m = 0.0f;
  for (std::int64_t d = 0; d < n; ++d) m = fmaxf(m, fabsf(load(x, d)));
  return m;
}

/// Thread (query row, query head): pass 1 the row's largest score (exact),
/// key count and largest |v|; pass 2 per unit the softmax sum and output
/// terms in fp32, added exactly across units; out and lse rounded once.
template <class E>
__global__ void __launch_bounds__(block_threads)
    invariant_forward_kernel(Params p, GridParams gp, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                             const E* q, const E* k, const E* v, E* out, float* lse) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const std::int64_t row = at.row, D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const E* qr = q + (row * p.heads_q + h) * D;
  float m = -INFINITY, b = 0.0f;
  std::int64_t n = 0;
  for_each_visible_key(p, entries, ids, at, g, [&](std::int64_t kr) {
    m = fmaxf(m, dot(qr, k + kr, D) * p.scale);
    b = fmaxf(b, max_abs_row(v + kr, D));
    ++n;
  });
  E* o = out + (row * p.heads_q + h) * D;
  if (n == 0) {  // the row sees no key
    for (std::int64_t d = 0; d < D; ++d) store(o, d, 0.0f);
    lse[h * p.tokens_q + row] = -INFINITY;
    return;
  }
  if (!isfinite(m)) return report(gp, 1, row, h);
  const int el = exact_exponent(2.0 * static_cast<double>(n), 1), eo = exact_exponent(2.0 * static_cast<double>(n) * b, 1);
  std::int64_t exact[max_head_dim + 1];
  float acc[max_head_dim + 1];
  for (std::int64_t d = 0; d <= D; ++d) exact[d] = 0;
  const bool fits = for_each_key_unit(
      p, gp, entries, ids, at, g, [&] { for (std::int64_t d = 0; d <= D; ++d) acc[d] = 0.0f; },
      [&](std::int64_t kr) {
        const float w = expf(dot(qr, k + kr, D) * p.scale - m);
        acc[D] += w;
        for (std::int64_t d = 0; d < D; ++d) acc[d] += w * load(v, kr + d);
      },
      [&] {
        bool in_scale = add_exact(exact[D], acc[D], el);
        for (std::int64_t d = 0; d < D; ++d) in_scale = add_exact(exact[d], acc[d], eo) && in_scale;
        return in_scale;
      });
  if (!fits) return report(gp, 2, row, h);
  const double l = from_fixed(exact[D], el);
  for (std::int64_t d = 0; d < D; ++d) store(o, d, static_cast<float>(from_fixed(exact[d], eo) / l));
  lse[h * p.tokens_q + row] = static_cast<float>(static_cast<double>(m) + log(l));
}

/// Thread (query row, query head): dq = scale * sum_t dS_t k_t, per key unit
/// in fp32, exactly across units at the row's bound ((|dout|_1 max|v| + |D|)
/// max|k| over the keys it sees, twice to spare), rounded once.
template <class E>
__global__ void __launch_bounds__(block_threads)
    invariant_query_grad_kernel(Params p, GridParams gp, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                                const E* q, const E* k, const E* v, const float* lse, const E* dout, const float* delta, E* dq) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, h = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const std::int64_t row = at.row, D = p.head_dim, g = h / (p.heads_q / p.heads_kv);
  const std::int64_t qi = (row * p.heads_q + h) * D;
  const float row_lse = lse[h * p.tokens_q + row], shift = delta[h * p.delta_pitch + row];
  if (row_lse == -INFINITY) {  // the row saw nothing in the whole attention: dq = 0
    for (std::int64_t d = 0; d < D; ++d) store(dq, qi + d, 0.0f);
    return;
  }
  float km = 0.0f, vm = 0.0f;
  for_each_visible_key(p, entries, ids, at, g, [&](std::int64_t kr) {
    km = fmaxf(km, max_abs_row(k + kr, D));
    vm = fmaxf(vm, max_abs_row(v + kr, D));
  });
  double d1 = 0;
  for (std::int64_t d = 0; d < D; ++d) d1 += fabs(static_cast<double>(load(dout, qi + d)));
  const int e_dq = exact_exponent(2.0 * (d1 * vm + fabs(static_cast<double>(shift))) * km, 1);
  std::int64_t exact[max_head_dim];
  float acc[max_head_dim];
  for (std::int64_t d = 0; d < D; ++d) exact[d] = 0;
  const bool fits = for_each_key_unit(
      p, gp, entries, ids, at, g, [&] { for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f; },
      [&](std::int64_t kr) {
        const float prob = expf(dot(q + qi, k + kr, D) * p.scale - row_lse);
        const float ds = prob * (dot(dout + qi, v + kr, D) - shift);
        for (std::int64_t d = 0; d < D; ++d) acc[d] += ds * load(k, kr + d);
      },
      [&] {
        bool in_scale = true;
        for (std::int64_t d = 0; d < D; ++d) in_scale = add_exact(exact[d], acc[d], e_dq) && in_scale;
        return in_scale;
      });
  if (!fits) return report(gp, 3, row, h);
  const double scale = p.scale;
  for (std::int64_t d = 0; d < D; ++d) store(dq, qi + d, static_cast<float>(scale * from_fixed(exact[d], e_dq)));
}

/// Thread (key row, key-value head): per query head of the group, entry and
/// query unit (the grid shifted by the entry's query phase), dv = sum P dout
/// and dk = scale * sum dS q in fp32, added exactly into dk_exact, dv_exact
/// (which the caller sums over calls, copies and ranks).
template <class E>
__global__ void __launch_bounds__(block_threads)
    invariant_key_value_grad_kernel(Params p, GridParams gp, const AttentionEntry* entries, const RowSegment* segments, const std::int64_t* ids,
                                    const E* q, const E* k, const E* v, const float* lse, const E* dout, const float* delta,
                                    std::int64_t* dk_exact, std::int64_t* dv_exact, int dk_exponent, int dv_exponent) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, g = blockIdx.y;
  if (i >= p.rows) return;
  const LaunchRow at = launch_row(segments, p.segments, i);
  const std::int64_t t = at.row, D = p.head_dim, group = p.heads_q / p.heads_kv;
  const std::int64_t kr = (t * p.heads_kv + g) * D;
  const double scale = p.scale;
  float acc_k[max_head_dim], acc_v[max_head_dim];
  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (std::int64_t c = 0; c < at.seg.count; ++c) {
      const std::int64_t id = ids[at.seg.first + c];
      const AttentionEntry& e = entries[id];
      std::int64_t lo = 0, hi = 0;
      rows_seeing(e, t, lo, hi);
      for (std::int64_t w0 = lo; w0 < hi;) {
        const std::int64_t w1 = unit_end(w0, e.q_start, gp.phases[id].q, gp.size, hi);
        for (std::int64_t d = 0; d < D; ++d) acc_k[d] = acc_v[d] = 0.0f;
        for (std::int64_t row = w0; row < w1; ++row) {
          const std::int64_t qi = (row * p.heads_q + h) * D;
          const float row_lse = lse[h * p.tokens_q + row];
          if (row_lse == -INFINITY) continue;
          const float prob = expf(dot(q + qi, k + kr, D) * p.scale - row_lse);
          const float ds = prob * (dot(dout + qi, v + kr, D) - delta[h * p.delta_pitch + row]);
          for (std::int64_t d = 0; d < D; ++d) {
            acc_v[d] += prob * load(dout, qi + d);
            acc_k[d] += ds * load(q, qi + d);
          }
        }
        bool fits = true;
        for (std::int64_t d = 0; d < D; ++d) {
          fits = add_exact(dk_exact[kr + d], acc_k[d] * scale, dk_exponent) && fits;
          fits = add_exact(dv_exact[kr + d], acc_v[d], dv_exponent) && fits;
        }
        if (!fits) return report(gp, 4, t, g);
        w0 = w1;
      }
    }
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
  void forward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
               std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    const auto z = check_.forward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    check_head_dim(shape);
    const OnDevice d = on_device(entries);
    attention_kernels::Params p = params(shape, z, d.query_rows, d.query_segment_count);
    if (p.rows == 0) return;
    launch_kernel("attention forward_kernel", &attention_kernels::forward_kernel<E>, grid(p.rows, shape.heads_q),
                  dim3(attention_kernels::block_threads), stream_, p, d.entries, d.query_segments, d.query_ids, q.data(),
                  k.data(), v.data(), out.data(), lse.data());
  }

  template <class E>
  void backward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
                std::span<const E> k, std::span<const E> v, std::span<const E> out, std::span<const float> lse,
                std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    const auto z = check_.backward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                   dout.size(), dq.size(), dk.size(), dv.size());
    check_head_dim(shape);
    const OnDevice d = on_device(entries);
    if (d.query_rows == 0 && d.key_rows == 0) return;
    grow_delta(static_cast<std::size_t>(shape.heads_q * d.query_end));
    heads_q_seen_ = std::max(heads_q_seen_, shape.heads_q);
    const dim3 block(attention_kernels::block_threads);
    attention_kernels::Params p = params(shape, z, d.query_rows, d.query_segment_count);
    p.delta_pitch = d.query_end;
    if (p.rows > 0) {
      launch_kernel("attention delta_kernel", &attention_kernels::delta_kernel<E>, grid(p.rows, shape.heads_q), block,
                    stream_, p, d.query_segments, out.data(), dout.data(), delta_.data());
      launch_kernel("attention query_grad_kernel", &attention_kernels::query_grad_kernel<E>, grid(p.rows, shape.heads_q),
                    block, stream_, p, d.entries, d.query_segments, d.query_ids, q.data(), k.data(), v.data(), lse.data(),
                    dout.data(), delta_.data(), dq.data());
    }
    p.rows = d.key_rows;
    p.segments = d.key_segment_count;
    if (p.rows > 0) {
      launch_kernel("attention key_value_grad_kernel", &attention_kernels::key_value_grad_kernel<E>,
                    grid(p.rows, shape.heads_kv), block, stream_, p, d.entries, d.key_segments, d.key_ids, q.data(),
                    k.data(), v.data(), lse.data(), dout.data(), delta_.data(), dk.data(), dv.data());
    }
  }

  /// Invariant mode (attention/invariant.hpp): out and lse bitwise the same
  /// for every split of a row's keys on the grid (entries, calls), as the
  /// host kernel promises. A synchronising call: it uploads the grid's
  /// phases and waits for the stream, then throws invalid_input where a
  /// score or sum was not finite or left its exact sum's scale.
  template <class E>
  void forward_invariant(const AttentionShape& shape, const InvariantGrid& g, std::span<const AttentionEntry> entries,
                         std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    const auto z = check_.forward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    check_head_dim(shape);
    detail::check_invariant_grid(name, g, entries.size());
    const OnDevice d = on_device(entries);
    const attention_kernels::Params p = params(shape, z, d.query_rows, d.query_segment_count);
    if (p.rows == 0) return;
    const attention_kernels::GridParams gp = upload_grid(g, entries.size());
    launch_kernel("attention invariant_forward_kernel", &attention_kernels::invariant_forward_kernel<E>, grid(p.rows, shape.heads_q),
                  dim3(attention_kernels::block_threads), stream_, p, gp, d.entries, d.query_segments, d.query_ids, q.data(), k.data(),
                  v.data(), out.data(), lse.data());
    check_fault();
  }

  /// Invariant mode: dq (rounded once per element) bitwise the same for
  /// every split on the grid; dk and dv added as exact sums into `kv`
  /// (device memory), which callers sum over calls, copies and ranks as
  /// integers and round once. Synchronising, as forward_invariant.
  template <class E>
  void backward_invariant(const AttentionShape& shape, const InvariantGrid& g, std::span<const AttentionEntry> entries,
                          std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<const E> out,
                          std::span<const float> lse, std::span<const E> dout, std::span<E> dq, ExactKvGradients kv) {
    const auto z = check_.backward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size(), dout.size(), dq.size(),
                                   kv.dk.size(), kv.dv.size());
    check_head_dim(shape);
    detail::check_invariant_grid(name, g, entries.size());
    const OnDevice d = on_device(entries);
    if (d.query_rows == 0 && d.key_rows == 0) return;
    grow_delta(static_cast<std::size_t>(shape.heads_q * d.query_end));
    heads_q_seen_ = std::max(heads_q_seen_, shape.heads_q);
    const attention_kernels::GridParams gp = upload_grid(g, entries.size());
    const dim3 block(attention_kernels::block_threads);
    attention_kernels::Params p = params(shape, z, d.query_rows, d.query_segment_count);
    p.delta_pitch = d.query_end;
    if (p.rows > 0) {
      launch_kernel("attention delta_kernel", &attention_kernels::delta_kernel<E>, grid(p.rows, shape.heads_q), block, stream_, p,
                    d.query_segments, out.data(), dout.data(), delta_.data());
      launch_kernel("attention invariant_query_grad_kernel", &attention_kernels::invariant_query_grad_kernel<E>, grid(p.rows, shape.heads_q),
                    block, stream_, p, gp, d.entries, d.query_segments, d.query_ids, q.data(), k.data(), v.data(), lse.data(), dout.data(),
                    delta_.data(), dq.data());
    }
    p.rows = d.key_rows;
    p.segments = d.key_segment_count;
    if (p.rows > 0) {
      launch_kernel("attention invariant_key_value_grad_kernel", &attention_kernels::invariant_key_value_grad_kernel<E>,
                    grid(p.rows, shape.heads_kv), block, stream_, p, gp, d.entries, d.key_segments, d.key_ids, q.data(), k.data(), v.data(),
                    lse.data(), dout.data(), delta_.data(), kv.dk.data(), kv.dv.data(), kv.dk_exponent, kv.dv_exponent);
    }
    check_fault();
  }

  /// Uploads every entry list the calls until the next prepare will pass
  /// (PreparedAttentionKernel): one copy of all lists and their row
  /// segments, kept with host copies so that a call can confirm its list.
  /// Waits for the stream first (the previous prepare's copy reads the host
  /// copies being replaced) and may allocate: call it outside a step.
  void prepare(std::span<const std::span<const AttentionEntry>> calls) {
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    retired_.clear();  // nothing on the stream reads them any more
    prepared_.clear();
    prepared_host_.clear();
    std::int64_t query_end = 0;
    for (const std::span<const AttentionEntry> list : calls) {
      if (list.empty() || find_prepared(list)) continue;  // an empty call uploads nothing anyway
      const std::size_t entry_at = prepared_host_.entries.size();
      prepared_host_.entries.insert(prepared_host_.entries.end(), list.begin(), list.end());
      const ListCover c = append_cover(list, prepared_host_);
      prepared_.push_back({list.data(), list.size(), entry_at, c});
      query_end = std::max(query_end, c.query_end);
    }
    // Backward's scratch for these lists at the most query heads seen so far
    // (the shape is not known here), so that a step allocates nothing.
    const auto need = static_cast<std::size_t>(heads_q_seen_ * query_end);
    if (delta_.size() < need) delta_.allocate(need);
    prepared_device_.upload(prepared_host_, stream_);
  }

 private:
  static constexpr const char* name = "CudaAttentionKernel";
  using RowSegment = detail::attention::RowSegment;

  static void check_head_dim(const AttentionShape& s) {
    if (s.head_dim > attention_kernels::max_head_dim) {
      detail::fail(name, ": shape.head_dim is ", s.head_dim, "; the device kernel takes at most ",
                   attention_kernels::max_head_dim);
    }
  }

  static attention_kernels::Params params(const AttentionShape& s, const detail::attention::CallSizes& z,
                                          std::int64_t rows, std::int64_t segments) {
    return {s.heads_q, s.heads_kv, s.head_dim, s.softmax_scale, z.tokens_q, rows, segments, 0};
  }

  static dim3 grid(std::int64_t rows, std::int64_t heads) {
    const std::int64_t blocks = (rows + attention_kernels::block_threads - 1) / attention_kernels::block_threads;
    if (blocks > 0x7fffffff) detail::fail(name, ": ", rows, " rows exceed one launch");
    return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(heads));
  }

  // memcmp compares the entries' bytes: no padding may differ between equal lists.
  static_assert(std::has_unique_object_representations_v<AttentionEntry>);

  /// Entry lists with their covers, one list after another: host copies, or
  /// the device buffers they are uploaded to.
  struct HostLists {
    std::vector<AttentionEntry> entries;
    std::vector<RowSegment> segments;  // per list: its query segments, then its key segments
    std::vector<std::int64_t> ids;     // per list: its query cover's entry ids, then its key cover's
    void clear() {
      entries.clear();
      segments.clear();
      ids.clear();
    }
  };
  struct DeviceLists {
    DeviceBuffer<AttentionEntry> entries;
    DeviceBuffer<RowSegment> segments;
    DeviceBuffer<std::int64_t> ids;
    /// Grows the buffers to fit `host` (allocating) and copies it on the stream.
    void upload(const HostLists& host, cudaStream_t stream) {
      if (entries.size() < host.entries.size()) entries.allocate(host.entries.size());
      if (segments.size() < host.segments.size()) segments.allocate(host.segments.size());
      if (ids.size() < host.ids.size()) ids.allocate(host.ids.size());
      entries.upload(host.entries, stream);
      segments.upload(host.segments, stream);
      ids.upload(host.ids, stream);
    }
  };

  /// Where one list's cover lies in its HostLists / DeviceLists (segment
  /// `first`s count from the list's own query ids, or key ids), and its sizes.
  struct ListCover {
    std::size_t segment_at = 0, id_at = 0;
    std::int64_t query_segments = 0, key_segments = 0, query_ids = 0;
    std::int64_t query_rows = 0, key_rows = 0;
    std::int64_t query_end = 0;  // one past the last query row of any entry
  };

  /// A call's entries and covers on the device.
  struct OnDevice {
    const AttentionEntry* entries = nullptr;
    const RowSegment* query_segments = nullptr;
    const RowSegment* key_segments = nullptr;
    const std::int64_t* query_ids = nullptr;
    const std::int64_t* key_ids = nullptr;
    std::int64_t query_segment_count = 0, key_segment_count = 0;
    std::int64_t query_rows = 0, key_rows = 0, query_end = 0;
  };

  /// A list of the last prepare: where its copies start.
  struct Prepared {
    const AttentionEntry* data;
    std::size_t size, entry_at;
    ListCover cover;
  };

  /// Appends the query cover, then the key cover, of `entries` to `lists`.
  ListCover append_cover(std::span<const AttentionEntry> entries, HostLists& lists) {
    ListCover c{lists.segments.size(), lists.ids.size()};
    cover_.build(entries, detail::attention::CoverSide::query);
    append(cover_, lists);
    c.query_segments = static_cast<std::int64_t>(cover_.segments().size());
    c.query_ids = static_cast<std::int64_t>(cover_.ids().size());
    c.query_rows = cover_.rows();
    c.query_end = cover_.end();
    cover_.build(entries, detail::attention::CoverSide::key);
    append(cover_, lists);
    c.key_segments = static_cast<std::int64_t>(cover_.segments().size());
    c.key_rows = cover_.rows();
    return c;
  }

  static void append(const detail::attention::RowCover& cover, HostLists& lists) {
    lists.segments.insert(lists.segments.end(), cover.segments().begin(), cover.segments().end());
    lists.ids.insert(lists.ids.end(), cover.ids().begin(), cover.ids().end());
  }

  /// The device pointers of a list whose entries start at `entry_at`.
  static OnDevice located(const DeviceLists& lists, std::size_t entry_at, const ListCover& c) {
    const RowSegment* segments = lists.segments.data() + c.segment_at;
    const std::int64_t* ids = lists.ids.data() + c.id_at;
    return {lists.entries.data() + entry_at, segments, segments + c.query_segments, ids, ids + c.query_ids,
            c.query_segments, c.key_segments, c.query_rows, c.key_rows, c.query_end};
  }

  /// The prepared list with this address, size and contents, if any. The
  /// contents are compared because the caller's list may have changed (or
  /// been freed and its address reused) since prepare.
  const Prepared* find_prepared(std::span<const AttentionEntry> entries) const noexcept {
    for (const Prepared& p : prepared_) {
      if (p.data != entries.data() || p.size != entries.size()) continue;
      if (std::memcmp(prepared_host_.entries.data() + p.entry_at, entries.data(), entries.size_bytes()) == 0) return &p;
    }
    return nullptr;
  }

  /// The call's entries on the device: the prepared copy when there is one
  /// (no copy, no synchronisation), else an upload on the stream from a host
  /// copy the next call may overwrite only once this upload has run (the
  /// stream is synchronised first).
  OnDevice on_device(std::span<const AttentionEntry> entries) {
    if (entries.empty()) return {};
    if (const Prepared* p = find_prepared(entries)) return located(prepared_device_, p->entry_at, p->cover);
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    host_.clear();
    host_.entries.assign(entries.begin(), entries.end());
    const ListCover c = append_cover(entries, host_);
    device_.upload(host_, stream_);
    return located(device_, 0, c);
  }

  /// The grid's phases on the device (every entry at phase 0 when it gives
  /// none) and a cleared fault record, after the stream's earlier work.
  attention_kernels::GridParams upload_grid(const InvariantGrid& g, std::size_t entries) {
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the last upload's host copy may be read until then
    phases_host_.assign(g.phases.begin(), g.phases.end());
    phases_host_.resize(entries);
    if (phases_.size() < entries) phases_.allocate(entries);
    phases_.upload(phases_host_, stream_);
    if (fault_.empty()) fault_.allocate(3);
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(fault_.data(), 0, fault_.size_bytes(), stream_));
    return {g.size, phases_.data(), fault_.data()};
  }

  /// Waits for the stream; throws what an invariant launch reported.
  void check_fault() {
    std::int64_t f[3] = {0, 0, 0};
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(f, fault_.data(), sizeof f, cudaMemcpyDeviceToHost));
    if (f[0] == 0) return;
    static constexpr const char* what[] = {"", "score maximum", "output", "dq", "dk or dv"};
    detail::fail(name, ": invariant ", what[f[0] < 5 ? f[0] : 0], " of ", f[0] == 4 ? "key row " : "row ", f[1], ", head ", f[2],
                 " is not finite or exceeds its exact sum's scale (a NaN or infinity in the inputs?)");
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
  detail::attention::RowCover cover_;  // scratch of append_cover
  // Host copies first: destroyed after the device buffers, whose cudaFree
  // waits for the copies that read them.
  HostLists host_;           // the last unprepared call's
  std::vector<Prepared> prepared_;
  HostLists prepared_host_;  // every prepared list, one after another
  DeviceLists device_;
  DeviceLists prepared_device_;
  DeviceBuffer<float> delta_;
  std::vector<DeviceBuffer<float>> retired_;
  std::vector<UnitPhase> phases_host_;  // the invariant mode's: the last call's phases, and their device copy
  DeviceBuffer<UnitPhase> phases_;
  DeviceBuffer<std::int64_t> fault_;
  std::int64_t heads_q_seen_ = 0;  // the most query heads of a backward so far
};

static_assert(AttentionKernel<CudaAttentionKernel, float>);
static_assert(AttentionKernel<CudaAttentionKernel, bfloat16>);
static_assert(AttentionKernel<CudaAttentionKernel, float16>);
static_assert(PreparedAttentionKernel<CudaAttentionKernel>);
static_assert(InvariantAttentionKernel<CudaAttentionKernel, float>);
static_assert(InvariantAttentionKernel<CudaAttentionKernel, bfloat16>);
static_assert(InvariantAttentionKernel<CudaAttentionKernel, float16>);

}  // namespace cpdispatch::cuda
