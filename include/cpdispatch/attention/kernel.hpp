#pragma once
// The attention kernel concept: what ContextParallelAttention calls on each
// rank's attention layout. A kernel attends a batch of entries, each a range
// of query rows against a range of key-value rows, under the plan's mask.
//
// Buffers are THD, as flash-attention's varlen API: q, out, dout, dq are
// [tokens_q][heads_q][head_dim]; k, v, dk, dv are [tokens_kv][heads_kv][head_dim];
// lse (log-sum-exp, natural logarithm, fp32) is [heads_q][tokens_q].

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// Heads and scale of one attention layer. heads_q is a multiple of heads_kv
/// (grouped-query attention: query head h reads key-value head
/// h / (heads_q / heads_kv)).
struct AttentionShape {
  std::int64_t heads_q = 1;
  std::int64_t heads_kv = 1;
  std::int64_t head_dim = 0;
  float softmax_scale = 0.0f;
};

/// One entry: query rows [q_start, q_start + q_len) attend key-value rows
/// [kv_start, kv_start + kv_len). `diagonal` is the document position of query
/// row 0 minus that of key row 0, so the mask allows (j, t) when
/// mask.allows(j, t, diagonal). For a whole KV group of the attention layout
/// it is kv_len - q_len (bottom-right alignment, as flash-attention >= 2.1).
/// Within one call, no two entries share a query row or a key-value row.
struct AttentionEntry {
  std::int64_t q_start = 0, q_len = 0;
  std::int64_t kv_start = 0, kv_len = 0;
  std::int64_t diagonal = 0;
};

/// The entries of a rank's attention layout, one per KV group, from its
/// flash-attention style prefix sums (leading 0, total last), written into
/// `entries` (its storage reused).
inline void layout_entries(std::span<const std::int64_t> cu_seqlens_q, std::span<const std::int64_t> cu_seqlens_kv,
                           std::vector<AttentionEntry>& entries) {
  if (cu_seqlens_q.size() != cu_seqlens_kv.size()) {
    detail::fail("layout_entries: cu_seqlens_q has ", cu_seqlens_q.size(), " values but cu_seqlens_kv has ",
                 cu_seqlens_kv.size());
  }
  entries.clear();
  for (std::size_t e = 0; e + 1 < cu_seqlens_q.size(); ++e) {
    const std::int64_t lq = cu_seqlens_q[e + 1] - cu_seqlens_q[e], lk = cu_seqlens_kv[e + 1] - cu_seqlens_kv[e];
    entries.push_back({cu_seqlens_q[e], lq, cu_seqlens_kv[e], lk, lk - lq});
  }
}

/// The same, as a new vector.
inline std::vector<AttentionEntry> layout_entries(std::span<const std::int64_t> cu_seqlens_q,
                                                  std::span<const std::int64_t> cu_seqlens_kv) {
  std::vector<AttentionEntry> entries;
  layout_entries(cu_seqlens_q, cu_seqlens_kv, entries);
  return entries;
}

/// A kernel K attends elements of type E:
///   forward writes out and lse for the query rows of the entries (a row that
///   sees no key gets out = 0 and lse = -infinity); other rows are untouched.
///   backward takes the forward's out and lse (those of the whole attention
///   when a caller attends in parts: each part's gradients are then exact
///   shares of the whole) and writes dq for the query rows and dk, dv for the
///   key-value rows of the entries (overwritten, not accumulated). Rows whose
///   lse is -infinity contribute nothing.
template <class K, class E>
concept AttentionKernel = requires(K& kernel, const AttentionShape& shape, const AttentionMask& mask,
                                   std::span<const AttentionEntry> entries, std::span<const E> in,
                                   std::span<E> out, std::span<float> lse, std::span<const float> lse_in) {
  kernel.forward(shape, mask, entries, in, in, in, out, lse);                          // q, k, v -> out, lse
  kernel.backward(shape, mask, entries, in, in, in, in, lse_in, in, out, out, out);  // q, k, v, out, lse, dout -> dq, dk, dv
};

/// Optional: a kernel that can be told, outside a step, every entry list its
/// next calls will pass. The caller (the op, when it replans) calls
///   kernel.prepare(calls)
/// with each entry list that forward and backward will receive until the next
/// prepare. A call recognises a prepared list by its address and size and
/// must then confirm the contents (a list changed in place after prepare,
/// or a new list at a freed one's address, gives correct results, only not
/// the fast path), so the spans need not outlive prepare. prepare may
/// allocate and synchronise; a call on a prepared list should do neither (a
/// device kernel uploads every list once here, not once per call, so a step
/// makes no host-synchronising call and can be captured into a CUDA graph).
/// Calls on lists never announced stay correct, perhaps slower. A kernel
/// without prepare (HostAttentionKernel) is called without it.
template <class K>
concept PreparedAttentionKernel = requires(K& kernel, std::span<const std::span<const AttentionEntry>> calls) {
  kernel.prepare(calls);
};

/// Where a kernel's buffers live: K::memory_space where K declares it (a
/// device kernel does), else host memory. ContextParallelAttention takes a
/// kernel of its transport's memory space only.
template <class K>
constexpr MemorySpace attention_kernel_memory_space() {
  if constexpr (requires { K::memory_space; }) {
    return K::memory_space;
  } else {
    return MemorySpace::host;
  }
}

}  // namespace cpdispatch
