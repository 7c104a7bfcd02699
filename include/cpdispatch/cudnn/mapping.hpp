#pragma once
// How CudnnAttentionKernel (cudnn/attention.hpp) maps a call's entries onto
// cuDNN's ragged (THD) sequences: pure host functions, no cuDNN, no CUDA.
//
// cuDNN's fused attention takes a batch of sequences, each with its own query
// and key-value lengths (seq_len_q, seq_len_kv) and start rows (ragged
// offsets), and one mask for the whole batch, aligned bottom-right in every
// sequence: query row i of a sequence of sq queries and skv keys sees key c
// when (padding) i < sq and c < skv, and for a band
//   right bound:  c <= i + (skv - sq) + R
//   left bound:   c >  i + (skv - sq) - L
// with R and L scalars of the whole execution. An entry's rule is its band,
// lo <= t - j <= hi (either end may be open), one band per entry: on the
// sequence's own rows i and keys c it is lo' <= c - i <= hi', the band
// shifted by q_start - kv_start, so R = hi' - (skv - sq) and
// L = (skv - sq) - lo' + 1.
//
// trim_entry cuts an entry down to the query rows that see a key and the keys
// some row sees (the rest are "dead": out = 0, lse = -inf, dq = 0 for dead
// query rows, dk = dv = 0 for dead keys, written by the kernel without cuDNN).
// After trimming, every row sees at least one key and the upper end's offset
// from bottom-right alignment, R, is >= 0. Entries whose every row sees
// every key become the `full` band; a band whose lower end binds no live row
// becomes `causal`; one whose upper end binds none (an inverse causal band)
// is a `window` with R clamped to free_shift; the others are windows with
// both bounds. They are grouped by (band, R, L), one cuDNN execution per
// group. cuDNN writes each sequence's rows on its own, so the entries of a
// call must share no row (the kernel checks; attention/kernel.hpp's
// folds_shared_rows).

#include <algorithm>
#include <bit>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch::cudnn {

/// The mask of one cuDNN execution: none (every row sees every key of its
/// sequence), a right bound (causal), or a right and a left bound (window).
enum class Band : std::uint8_t { full, causal, window };

/// One cuDNN sequence: rows of the call's buffers.
struct Sequence {
  std::int64_t q_start = 0, q_len = 0;
  std::int64_t kv_start = 0, kv_len = 0;
  friend bool operator==(const Sequence&, const Sequence&) = default;
};

/// Rows [start, start + len) of a buffer.
struct RowRange {
  std::int64_t start = 0, len = 0;
  friend bool operator==(const RowRange&, const RowRange&) = default;
};

/// Sequences that share a band and a shift: one cuDNN execution.
struct Group {
  Band band = Band::full;
  std::int64_t shift = 0;               ///< R: the band's diagonal is (kv_len - q_len) + R in every sequence
  std::int64_t left = 0;                ///< L (window): keys c > i + (kv_len - q_len) - L are seen
  std::vector<Sequence> sequences;      ///< by q_start
  std::int64_t max_q = 0, max_kv = 0;   ///< longest sequence
};

/// A call's entries as cuDNN executions plus the rows cuDNN must not see.
struct EntryMap {
  std::vector<Group> groups;        ///< by (band, shift)
  std::vector<RowRange> dead_q;     ///< query rows that see no key: out = 0, lse = -inf; dq = 0
  std::vector<RowRange> dead_kv;    ///< key rows no query of their entry sees: dk = dv = 0
};

/// What trim_entry keeps of an entry.
struct Trimmed {
  bool live = false;             ///< some row sees some key
  Sequence sequence;             ///< the live rows and keys (when live)
  cpdispatch::Band live_band;    ///< the entry's band on c - i of the live rows and keys
  Band band = Band::full;        ///< full when every live row sees every live key
  std::int64_t shift = 0;        ///< R = hi' - (kv_len - q_len) >= 0 (0 for full; see free_shift)
  std::int64_t left = 0;         ///< window: L = (kv_len - q_len) - lo' + 1, in (1 - q_len, kv_len)
};

/// The shift of a window sequence whose right bound binds no row (R >=
/// q_len - 1, or an open upper end): any such R gives the same mask, so it
/// is clamped here (L stays exact), which keeps R + i + skv - sq within int32.
inline constexpr std::int64_t free_shift = std::int64_t{1} << 30;

namespace detail {

inline std::int64_t clamp(std::int64_t x, std::int64_t lo, std::int64_t hi) noexcept { return x < lo ? lo : (x > hi ? hi : x); }

inline void push_range(std::vector<RowRange>& out, std::int64_t start, std::int64_t len) {
  if (len <= 0) return;
  if (!out.empty() && out.back().start + out.back().len == start) {
    out.back().len += len;  // back to back with the previous range: one range
  } else {
    out.push_back({start, len});
  }
}

}  // namespace detail

/// The cuDNN band, R and L of a live trimmed entry (its sequence and live_band set).
inline void classify(Trimmed& t) {
  const std::int64_t lq = t.sequence.q_len, lk = t.sequence.kv_len, skew = lk - lq;
  const cpdispatch::Band& b = t.live_band;
  // Every row sees every key: row 0 reaches the last key, and the last row still sees key 0.
  const bool right_free = !b.bounded_above() || b.hi >= lk - 1;
  const bool left_free = !b.bounded_below() || b.lo <= 1 - lq;
  t.band = right_free && left_free ? Band::full : (left_free ? Band::causal : Band::window);
  t.shift = 0;
  t.left = 0;
  if (t.band == Band::full) return;
  if (t.band == Band::window) t.left = skew - b.lo + 1;
  t.shift = right_free ? (b.bounded_above() ? std::min(b.hi - skew, free_shift) : free_shift) : b.hi - skew;
}

/// The live part of entry `e` (see the file comment); its dead query rows
/// and keys are appended to dead_q and dead_kv. Band ends within 2^62 and
/// rows below 2^56 (the kernel's call checks) keep the arithmetic in 64 bits.
inline Trimmed trim_entry(const AttentionEntry& e, std::vector<RowRange>& dead_q, std::vector<RowRange>& dead_kv) {
  using detail::clamp;
  const std::int64_t L = e.q_len, K = e.kv_len;
  Trimmed t;
  auto all_dead = [&] {
    detail::push_range(dead_q, e.q_start, L);
    detail::push_range(dead_kv, e.kv_start, K);
    return t;
  };
  if (L <= 0 || K <= 0 || e.band.lo > e.band.hi) return all_dead();
  const cpdispatch::Band b = e.band.shifted(e.q_start - e.kv_start);  // on c - i: the entry's own rows and keys
  const bool open_lo = !b.bounded_below(), open_hi = !b.bounded_above();
  // Row i sees keys [i + lo, i + hi] within [0, K).
  const std::int64_t ia = open_hi ? 0 : clamp(-b.hi, 0, L);      // first row with i + hi >= 0
  const std::int64_t ib = open_lo ? L : clamp(K - b.lo, ia, L);  // rows with i + lo <= K - 1
  if (ia >= ib) return all_dead();
  const std::int64_t ta = open_lo ? 0 : clamp(ia + b.lo, 0, K);  // row ia's first key
  const std::int64_t tb = open_hi ? K : clamp(ib + b.hi, 0, K);  // one past row ib - 1's last key
  detail::push_range(dead_q, e.q_start, ia);
  detail::push_range(dead_q, e.q_start + ib, L - ib);
  detail::push_range(dead_kv, e.kv_start, ta);
  detail::push_range(dead_kv, e.kv_start + tb, K - tb);
  t.live = true;
  t.sequence = {e.q_start + ia, ib - ia, e.kv_start + ta, tb - ta};
  t.live_band = b.shifted(ia - ta);
  classify(t);
  return t;
}

/// All entries of a call: groups of sequences (by band, then shift; each by
/// q_start) and the dead rows. `out` keeps its storage between calls.
inline void map_entries(std::span<const AttentionEntry> entries, EntryMap& out) {
  std::vector<Group>& groups = out.groups;
  for (Group& g : groups) g.sequences.clear();
  std::size_t used = 0;
  out.dead_q.clear();
  out.dead_kv.clear();
  for (const AttentionEntry& e : entries) {
    const Trimmed t = trim_entry(e, out.dead_q, out.dead_kv);
    if (!t.live) continue;
    std::size_t g = 0;
    while (g < used && !(groups[g].band == t.band && groups[g].shift == t.shift && groups[g].left == t.left)) ++g;
    if (g == used) {
      if (used == groups.size()) groups.emplace_back();
      groups[g].band = t.band;
      groups[g].shift = t.shift;
      groups[g].left = t.left;
      groups[g].max_q = groups[g].max_kv = 0;
      ++used;
    }
    groups[g].sequences.push_back(t.sequence);
    groups[g].max_q = std::max(groups[g].max_q, t.sequence.q_len);
    groups[g].max_kv = std::max(groups[g].max_kv, t.sequence.kv_len);
  }
  groups.resize(used);
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    if (a.band != b.band) return a.band < b.band;
    return a.shift != b.shift ? a.shift < b.shift : a.left < b.left;
  });
  for (Group& g : groups) {
    std::sort(g.sequences.begin(), g.sequences.end(),
              [](const Sequence& a, const Sequence& b) { return a.q_start < b.q_start; });
  }
  auto by_start = [](const RowRange& a, const RowRange& b) { return a.start < b.start; };
  std::sort(out.dead_q.begin(), out.dead_q.end(), by_start);
  std::sort(out.dead_kv.begin(), out.dead_kv.end(), by_start);
}

inline EntryMap map_entries(std::span<const AttentionEntry> entries) {
  EntryMap out;
  map_entries(entries, out);
  return out;
}

/// The two scalars of a group's band, the graph's by-value int32 inputs:
/// right = R (causal and window), left = L (window).
struct BandBounds {
  std::int32_t right = 0, left = 0;
  friend bool operator==(const BandBounds&, const BandBounds&) = default;
};

inline BandBounds band_bounds(const Group& g) {
  BandBounds b;
  if (g.band == Band::full) return b;
  const std::int64_t limit = std::numeric_limits<std::int32_t>::max();
  if (g.shift > limit || g.left > limit || g.left < -limit) {
    cpdispatch::detail::fail<capacity_error>("CudnnAttentionKernel: band bounds R = ", g.shift, ", L = ", g.left,
                                             " exceed int32");
  }
  b.right = static_cast<std::int32_t>(g.shift);
  b.left = static_cast<std::int32_t>(g.left);
  return b;
}

/// cuDNN's rule for one sequence of a group (the file comment): whether query
/// row i sees key c. What the graph computes; the tests hold it against
/// AttentionEntry::allows.
inline bool cudnn_sees(Band band, const BandBounds& b, std::int64_t sq, std::int64_t skv, std::int64_t i, std::int64_t c) {
  if (i < 0 || c < 0 || i >= sq || c >= skv) return false;  // padding mask
  if (band == Band::full) return true;
  if (!(i + skv - sq + b.right >= c)) return false;  // right bound: CMP_GE(row + skv - sq + R, col)
  if (band == Band::window && !(c + b.left - skv + sq > i)) return false;  // left bound: CMP_GT(col + L - skv + sq, row)
  return true;
}

/// Capacity bucket of a size: the next power of two at least max(x, floor).
/// Graph shapes (sequences, longest sequence, lse pitch) are bucketed so that
/// calls of nearby sizes reuse one execution plan; the real lengths travel in
/// the per-call sequence-length tensors.
inline std::int64_t bucket(std::int64_t x, std::int64_t floor = 1) {
  const auto v = static_cast<std::uint64_t>(std::max(x, floor));
  return static_cast<std::int64_t>(std::bit_ceil(v));
}

/// The int32 device metadata of one group: sequence lengths and ragged
/// offsets in elements (cuDNN's THD: a sequence's query row r of head h, dim
/// k is element offset_q + r * heads_q * head_dim + h * head_dim + k), each
/// array starting on 16 bytes. `batch` >= the group's sequences; the extra
/// sequences have length 0 and sit at the end of the last real one.
struct GroupMetadata {
  std::int64_t batch = 0;
  // int32 indices into `values` of each array
  std::size_t seq_q = 0, seq_kv = 0, offset_q = 0, offset_kv = 0, offset_stats = 0;
};

/// Appends a group's metadata to `values` (aligned to 4 int32 first) and
/// says where each array is. offset_stats is in rows (the lse layout's
/// pitch-1 axis, see stats_strides in cudnn/detail/graph.hpp).
inline GroupMetadata append_metadata(const Group& g, std::int64_t batch, std::int64_t heads_q, std::int64_t heads_kv,
                                     std::int64_t head_dim, std::vector<std::int32_t>& values) {
  const std::int64_t n = static_cast<std::int64_t>(g.sequences.size());
  if (batch < n) cpdispatch::detail::fail("append_metadata: batch ", batch, " < ", n, " sequences");
  const std::int64_t limit = std::numeric_limits<std::int32_t>::max();
  auto i32 = [&](std::int64_t x, const char* what) {
    if (x < 0 || x > limit) {
      cpdispatch::detail::fail<capacity_error>("CudnnAttentionKernel: ", what, " = ", x,
                                               " does not fit cuDNN's int32 sequence metadata");
    }
    return static_cast<std::int32_t>(x);
  };
  auto align = [&] { values.resize((values.size() + 3) / 4 * 4, 0); };
  GroupMetadata m;
  m.batch = batch;
  const std::int64_t row_q = heads_q * head_dim, row_kv = heads_kv * head_dim;
  const Sequence last = n > 0 ? g.sequences.back() : Sequence{};
  auto array = [&](std::size_t& where, std::int64_t count, auto&& value_of) {
    align();
    where = values.size();
    for (std::int64_t s = 0; s < count; ++s) values.push_back(value_of(s));
  };
  array(m.seq_q, batch, [&](std::int64_t s) { return s < n ? i32(g.sequences[s].q_len, "a sequence's query length") : 0; });
  array(m.seq_kv, batch, [&](std::int64_t s) { return s < n ? i32(g.sequences[s].kv_len, "a sequence's key length") : 0; });
  auto q_row = [&](std::int64_t s) { return s < n ? g.sequences[s].q_start : last.q_start + last.q_len; };
  auto kv_row = [&](std::int64_t s) { return s < n ? g.sequences[s].kv_start : last.kv_start + last.kv_len; };
  array(m.offset_q, batch + 1, [&](std::int64_t s) { return i32(cpdispatch::detail::checked_mul(q_row(s), row_q, "ragged offset"), "a query ragged offset"); });
  array(m.offset_kv, batch + 1, [&](std::int64_t s) { return i32(cpdispatch::detail::checked_mul(kv_row(s), row_kv, "ragged offset"), "a key ragged offset"); });
  array(m.offset_stats, batch + 1, [&](std::int64_t s) { return i32(q_row(s), "an lse ragged offset"); });
  align();
  return m;
}

/// The query rows of a group merged into runs of back-to-back sequences:
/// the lse rows copied between the caller's lse and cuDNN's statistics.
inline void query_runs(const Group& g, std::vector<RowRange>& runs) {
  runs.clear();
  for (const Sequence& s : g.sequences) detail::push_range(runs, s.q_start, s.q_len);
}

}  // namespace cpdispatch::cudnn
