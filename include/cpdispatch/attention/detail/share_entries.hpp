#pragma once
// A rank's kernel entries and, in the invariant mode, their phases on the
// grid, from its share of a plan: what the attention op lays out at replan,
// and what the Python front asks for (one implementation for both).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cpdispatch::detail {

/// Entry e of query shard g (in the shard's rows and its group's columns) in the buffers' rows.
inline AttentionEntry entry_in_buffers(const RankAttentionLayout& layout, const AttentionEntry& e, std::size_t g) {
  const std::int64_t lq = layout.cu_seqlens_q[g + 1] - layout.cu_seqlens_q[g], lk = layout.cu_seqlens_kv[g + 1] - layout.cu_seqlens_kv[g];
  if (e.q_start < 0 || e.q_len < 0 || e.q_len > lq - e.q_start || e.kv_start < 0 || e.kv_len < 0 || e.kv_len > lk - e.kv_start) {
    fail("share.attn.entries[", g, "] has query rows [", e.q_start, ", +", e.q_len, ") and columns [", e.kv_start, ", +", e.kv_len,
         ") outside its ", lq, " rows and ", lk, " columns");
  }
  const std::int64_t dq = layout.cu_seqlens_q[g], dk = layout.cu_seqlens_kv[g];
  return {e.q_start + dq, e.q_len, e.kv_start + dk, e.kv_len, e.band.shifted(dk - dq)};
}

/// The kernel's entries in the attention buffers' rows, and where each query
/// shard's start (entry_begin: one past the last at the end): the plan's own
/// where it has them (section 2e's attn.entries: per query shard, in the
/// shard's rows and its KV group's columns) moved by the shard's
/// cu_seqlens, so their bands shift by cu_kv - cu_q; else one entry per KV
/// group under the plan's mask (layout_entries). Returns whether they are
/// the plan's own (which may leave rows or keys uncovered).
inline bool share_entries(const RankAttentionLayout& layout, std::vector<AttentionEntry>& entries, std::vector<std::size_t>& entry_begin) {
  entry_begin.assign(1, 0);
  if (layout.entries.empty()) {
    layout_entries(layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.mask, entries);
    for (std::size_t g = 0; g < entries.size(); ++g) entry_begin.push_back(g + 1);
    return false;
  }
  entries.clear();
  for (std::size_t g = 0; g < layout.entries.size(); ++g) {
    for (const AttentionEntry& e : layout.entries[g]) entries.push_back(entry_in_buffers(layout, e, g));
    entry_begin.push_back(entries.size());
  }
  return true;
}

/// Each entry's phase on a grid of G tokens (phases, one per entry), given
/// where every rank's MLP tokens start in the packed sequence (starts: W + 1
/// values, leading 0), and the cuts this rank's share shows checked: a
/// key-value shard that does not start its KV group, and (causal and window
/// masks without slices) a query shard whose KV group starts before it, i.e.
/// one that starts inside its document, must start on the grid. Throws
/// invalid_input naming the shard and its packed position. kv_at: scratch.
inline void unit_phases(std::int64_t G, std::span<const std::int64_t> starts, const RankAttentionLayout& layout,
                        std::span<const AttentionEntry> entries, std::span<const std::size_t> entry_begin, const RankMetadata& q_rev,
                        const RankMetadata& kv_rev, const char* who, std::vector<UnitPhase>& phases, std::vector<std::int64_t>& kv_at) {
  const auto packed = [&](std::int64_t rank, std::int64_t offset) { return starts[static_cast<std::size_t>(rank)] + offset; };
  // Each key-value shard's first row in the attention layout.
  kv_at.assign(1, 0);
  for (std::int64_t len : kv_rev.seq_len) kv_at.push_back(kv_at.back() + len);
  // The phase of attention-layout key row `row`: its shard's packed start plus the row's offset in it.
  const auto key_phase = [&](std::int64_t row) -> std::int64_t {
    const auto it = std::upper_bound(kv_at.begin(), kv_at.end() - 1, row);
    if (it == kv_at.begin()) return 0;  // no key rows at all
    const auto m = static_cast<std::size_t>(it - kv_at.begin() - 1);
    if (m >= kv_rev.seq_len.size()) return 0;  // an empty entry at the end
    return (packed(kv_rev.dst_rank[m], kv_rev.dst_offset[m]) + row - kv_at[m]) % G;
  };
  const bool check_queries = layout.entries.empty() && layout.mask.type != MaskType::full;
  phases.clear();
  std::size_t m = 0;
  for (std::size_t g = 0; g + 1 < layout.cu_seqlens_q.size(); ++g) {
    const std::int64_t q_packed = packed(q_rev.dst_rank[g], q_rev.dst_offset[g]);
    const std::int64_t lq = layout.cu_seqlens_q[g + 1] - layout.cu_seqlens_q[g], lk = layout.cu_seqlens_kv[g + 1] - layout.cu_seqlens_kv[g];
    if (check_queries && lk > lq && q_packed % G != 0) {
      fail(who, ": options.invariant: query shard ", g, " starts inside its document at packed position ", q_packed, ", off the grid of ", G,
           " tokens (plan with BalanceOptions.grid = ", G, " and an MLP layout cut on it)");
    }
    for (; m < kv_rev.seq_len.size() && kv_at[m] < layout.cu_seqlens_kv[g + 1]; ++m) {
      const std::int64_t p = packed(kv_rev.dst_rank[m], kv_rev.dst_offset[m]);
      if (kv_at[m] != layout.cu_seqlens_kv[g] && p % G != 0) {
        fail(who, ": options.invariant: key-value shard ", m, " of KV group ", g, " starts at packed position ", p, ", off the grid of ", G,
             " tokens (plan with BalanceOptions.grid = ", G, " and an MLP layout cut on it)");
      }
    }
    phases.resize(entry_begin[g + 1]);
    for (std::size_t e = entry_begin[g]; e < entry_begin[g + 1]; ++e) {
      const AttentionEntry& x = entries[e];
      phases[e] = {(q_packed + x.q_start - layout.cu_seqlens_q[g]) % G, key_phase(x.kv_start)};
    }
  }
  phases.resize(entries.size());
}

}  // namespace cpdispatch::detail
