#pragma once
// The attention kernel concept: what ContextParallelAttention calls on each
// rank's attention layout. A kernel attends a batch of entries, each a range
// of query rows against a range of key-value rows inside its own band
// (AttentionEntry, plan/mask.hpp); the plan's mask reaches a kernel only
// through the bands of its entries (layout_entries).
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

/// The entries of a rank's attention layout, one per KV group, from its
/// flash-attention style prefix sums (leading 0, total last), written into
/// `entries` (its storage reused). Each group gets `mask` bottom-right
/// aligned (as flash-attention >= 2.1): its keys end where its queries end
/// in the document, so group query i (of lq) sits lk - lq positions after
/// group key i (of lk), and in buffer rows j = q_start + i, t = kv_start + c
/// the mask's band on t - j is mask.band() shifted by
/// (lk - lq) + (kv_start - q_start). A window of at least lk keys cuts
/// nothing off the group, so its lower end is left open (the causal band:
/// the same pairs, and a window near 2^63 cannot overflow the shift). Throws
/// invalid_input on a window below 1.
inline void layout_entries(std::span<const std::int64_t> cu_seqlens_q, std::span<const std::int64_t> cu_seqlens_kv,
                           const AttentionMask& mask, std::vector<AttentionEntry>& entries) {
  if (cu_seqlens_q.size() != cu_seqlens_kv.size()) {
    detail::fail("layout_entries: cu_seqlens_q has ", cu_seqlens_q.size(), " values but cu_seqlens_kv has ",
                 cu_seqlens_kv.size());
  }
  if (mask.type == MaskType::sliding_window && mask.window < 1) {
    detail::fail("layout_entries: mask.window is ", mask.window, "; a sliding window must be >= 1");
  }
  entries.clear();
  for (std::size_t e = 0; e + 1 < cu_seqlens_q.size(); ++e) {
    const std::int64_t q0 = cu_seqlens_q[e], kv0 = cu_seqlens_kv[e];
    const std::int64_t lq = cu_seqlens_q[e + 1] - q0, lk = cu_seqlens_kv[e + 1] - kv0;
    Band band = mask.band();
    if (mask.type == MaskType::sliding_window && mask.window >= lk) band.lo = Band::unbounded_lo;
    entries.push_back({q0, lq, kv0, lk, band.shifted((lk - lq) + (kv0 - q0))});
  }
}

/// The same, as a new vector.
inline std::vector<AttentionEntry> layout_entries(std::span<const std::int64_t> cu_seqlens_q,
                                                  std::span<const std::int64_t> cu_seqlens_kv, const AttentionMask& mask) {
  std::vector<AttentionEntry> entries;
  layout_entries(cu_seqlens_q, cu_seqlens_kv, mask, entries);
  return entries;
}

/// A kernel K attends elements of type E:
///   forward writes out and lse for the query rows of the entries; each row's
///   softmax runs over every key of every entry covering it (entries may
///   share query rows and key rows; a row that sees no key gets out = 0 and
///   lse = -infinity); other rows are untouched.
///   backward takes the forward's out and lse (those of the whole attention
///   when a caller attends in parts: each part's gradients are then exact
///   shares of the whole) and writes dq for the query rows and dk, dv for the
///   key-value rows of the entries (overwritten, not accumulated; a row
///   covered by several entries gets the sum over them). Rows whose lse is
///   -infinity contribute nothing.
/// Entry e lets its query row j see key row t when e.allows(j, t), i.e.
/// e.band.contains(t - j), j and t being rows of the call's buffers (a pair
/// two entries allow is attended twice: a layout's entries keep their pairs
/// apart). A band with lo > hi is allowed and lets nothing through; a
/// bounded end must lie within +-2^62 (the kernels' call checks refuse others).
template <class K, class E>
concept AttentionKernel = requires(K& kernel, const AttentionShape& shape, std::span<const AttentionEntry> entries,
                                   std::span<const E> in, std::span<E> out, std::span<float> lse,
                                   std::span<const float> lse_in) {
  kernel.forward(shape, entries, in, in, in, out, lse);                          // q, k, v -> out, lse
  kernel.backward(shape, entries, in, in, in, in, lse_in, in, out, out, out);  // q, k, v, out, lse, dout -> dq, dk, dv
};

/// Optional: a kernel that cannot fold entries sharing a row into one
/// softmax (cuDNN's fused attention writes each sequence's rows on its own)
/// declares
///   static constexpr bool folds_shared_rows = false;
/// and is then called only with entries that share no query row and no
/// key-value row (ContextParallelAttention attends a stage's parts in passes
/// and merges them through the log-sum-exp instead, and refuses a plan whose
/// own entries share rows); it refuses other calls. Kernels without the
/// declaration fold shared rows, as the concept says.
template <class K>
constexpr bool attention_kernel_folds_shared_rows() {
  if constexpr (requires { K::folds_shared_rows; }) {
    return K::folds_shared_rows;
  } else {
    return true;
  }
}

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
