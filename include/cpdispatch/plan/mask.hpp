#pragma once
// Attention masks (docs/plan-format.md, section 2d): which keys a query sees.
// One mask holds for a whole plan; it decides which key-value shards each
// query shard needs, and so the whole KV exchange.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// A band on (key index - query index): the pair (j, t) is inside when
/// lo <= t - j <= hi, j and t counted in one frame (document positions for a
/// slice; the entry's own coordinates for an attention entry). An end at
/// unbounded_lo / unbounded_hi is open. Moving the query frame by dq and the
/// key frame by dk shifts a band by dk - dq (shifted()).
struct Band {
  static constexpr std::int64_t unbounded_lo = std::numeric_limits<std::int64_t>::min();
  static constexpr std::int64_t unbounded_hi = std::numeric_limits<std::int64_t>::max();
  std::int64_t lo = unbounded_lo;
  std::int64_t hi = unbounded_hi;

  constexpr bool contains(std::int64_t d) const noexcept { return lo <= d && d <= hi; }
  constexpr bool bounded_below() const noexcept { return lo != unbounded_lo; }
  constexpr bool bounded_above() const noexcept { return hi != unbounded_hi; }

  /// The band after adding s to t - j; open ends stay open. Throws
  /// invalid_input when a bounded end leaves 64 bits.
  Band shifted(std::int64_t s) const;

  /// The pairs both bands let through (empty when lo > hi).
  constexpr Band intersect(const Band& other) const noexcept {
    return {std::max(lo, other.lo), std::min(hi, other.hi)};
  }

  friend constexpr bool operator==(const Band&, const Band&) = default;
};

enum class MaskType { causal, full, sliding_window };

/// The mask of a plan. Positions count from 0 inside a document: the query at
/// position p sees the key at position t when
///   causal:          t <= p
///   full:            always
///   sliding window:  p - window < t <= p   (flash-attention's window_size = (window - 1, 0))
struct AttentionMask {
  MaskType type = MaskType::causal;
  std::int64_t window = 0;  ///< tokens a query sees, itself included; sliding_window only

  static constexpr AttentionMask causal() { return {}; }
  static constexpr AttentionMask full() { return {MaskType::full, 0}; }
  /// Refuses a window below 1: a query always sees at least itself.
  static AttentionMask sliding_window(std::int64_t window) {
    if (window < 1) detail::fail("mask.window is ", window, "; a sliding window must be at least 1 token");
    return {MaskType::sliding_window, window};
  }

  /// Whether the query at document position p sees the key at position t.
  constexpr bool sees(std::int64_t p, std::int64_t t) const {
    switch (type) {
      case MaskType::full: return true;
      case MaskType::sliding_window: return t <= p && t > p - window;
      case MaskType::causal: break;
    }
    return t <= p;
  }

  /// The mask over one KV group: query row j and key column t count from 0
  /// inside the group, and `diagonal` is the document position of query row
  /// 0 minus that of key column 0 (lk - lq for a whole group: bottom-right
  /// alignment, as flash-attention >= 2.1). Kernels read an entry's band
  /// (AttentionEntry, layout_entries) instead.
  constexpr bool allows(std::int64_t j, std::int64_t t, std::int64_t diagonal) const {
    return sees(j + diagonal, t);
  }

  /// The mask as a band on t - p over the whole document (section 2e):
  /// causal (-inf, 0], full unbounded, a window w [-(w - 1), 0].
  constexpr Band band() const noexcept {
    switch (type) {
      case MaskType::full: return {};
      case MaskType::sliding_window: return {1 - window, 0};
      case MaskType::causal: break;
    }
    return {Band::unbounded_lo, 0};
  }

  friend constexpr bool operator==(const AttentionMask&, const AttentionMask&) = default;
};

inline Band Band::shifted(std::int64_t s) const {
  Band out = *this;
  if (bounded_below() && __builtin_add_overflow(lo, s, &out.lo)) detail::fail("Band::shifted: ", lo, " + ", s, " overflows 64 bits");
  if (bounded_above() && __builtin_add_overflow(hi, s, &out.hi)) detail::fail("Band::shifted: ", hi, " + ", s, " overflows 64 bits");
  // A shift must not turn a bounded end into the open marker.
  if (out.lo == Band::unbounded_lo && bounded_below()) detail::fail("Band::shifted: lo reaches the open marker");
  if (out.hi == Band::unbounded_hi && bounded_above()) detail::fail("Band::shifted: hi reaches the open marker");
  return out;
}

/// "causal", "full" or "sliding_window(4096)": for messages and summaries.
inline std::string to_string(const AttentionMask& mask) {
  switch (mask.type) {
    case MaskType::full: return "full";
    case MaskType::sliding_window: return "sliding_window(" + std::to_string(mask.window) + ")";
    case MaskType::causal: break;
  }
  return "causal";
}

/// The four shapes of a slice (docs/plan-format.md, section 2e), each a band
/// on t - p in document positions over its rectangle [qa, qb) x [ka, kb):
///   full        unbounded
///   causal      t - p <= kb - qb          (bottom-right aligned)
///   inv_causal  t - p >= ka - qa          (top-left aligned)
///   bi_causal   ka - qa <= t - p <= kb - qb
enum class SliceType { full, causal, inv_causal, bi_causal };

/// "full", "causal", "inv_causal" or "bi_causal": the JSON spelling.
constexpr const char* to_string(SliceType type) noexcept {
  switch (type) {
    case SliceType::causal: return "causal";
    case SliceType::inv_causal: return "inv_causal";
    case SliceType::bi_causal: return "bi_causal";
    case SliceType::full: break;
  }
  return "full";
}

/// One slice of a document's mask: queries [q_begin, q_end) see keys
/// [k_begin, k_end) inside the band of `type` (document positions).
struct AttentionSlice {
  std::int64_t q_begin = 0, q_end = 0;
  std::int64_t k_begin = 0, k_end = 0;
  SliceType type = SliceType::full;

  /// The band of `type` on t - p, document positions.
  constexpr Band band() const noexcept {
    switch (type) {
      case SliceType::causal: return {Band::unbounded_lo, k_end - q_end};
      case SliceType::inv_causal: return {k_begin - q_begin, Band::unbounded_hi};
      case SliceType::bi_causal: return {k_begin - q_begin, k_end - q_end};
      case SliceType::full: break;
    }
    return {};
  }

  friend constexpr bool operator==(const AttentionSlice&, const AttentionSlice&) = default;
};

/// One attention entry: query rows [q_start, q_start + q_len) attend
/// key-value rows [kv_start, kv_start + kv_len), row j seeing row t when
/// band.contains(t - j), j and t counted in the same frame as q_start and
/// kv_start (so moving an entry's rows by dq and its keys by dk shifts its
/// band by dk - dq). In a plan's attention layout (section 2e's
/// attn.entries) the frame is the query shard's own rows and its KV group's
/// columns; a kernel gets them in its buffers' rows.
struct AttentionEntry {
  std::int64_t q_start = 0, q_len = 0;
  std::int64_t kv_start = 0, kv_len = 0;
  Band band{};

  constexpr bool allows(std::int64_t row, std::int64_t column) const noexcept { return band.contains(column - row); }

  friend constexpr bool operator==(const AttentionEntry&, const AttentionEntry&) = default;
};

/// Whether the rectangle [p0, p1) x [k0, k1) holds a pair inside `band`:
/// both ranges non-empty and [k0 - (p1 - 1), (k1 - 1) - p0] meets [lo, hi].
constexpr bool band_meets(std::int64_t p0, std::int64_t p1, std::int64_t k0, std::int64_t k1, const Band& band) noexcept {
  if (p0 >= p1 || k0 >= k1 || band.lo > band.hi) return false;
  // Differences of positions below 2^62 cannot overflow (planning refuses larger documents).
  return band.lo <= (k1 - 1) - p0 && band.hi >= k0 - (p1 - 1);
}

namespace detail {

/// a * b, refusing a product beyond 64 bits.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* who) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) fail(who, ": ", a, " x ", b, " overflows 64 bits");
  return out;
}

/// Causal pairs of the queries at positions a..b-1: sum of (p + 1), as
/// (b - a)(a + b + 1) / 2 with the even factor halved first.
inline std::int64_t causal_pairs(std::int64_t a, std::int64_t b, const char* who) {
  std::int64_t n = b - a, m = 0;
  if (__builtin_add_overflow(a + 1, b, &m)) fail(who, ": positions up to ", b, " overflow 64 bits");
  if (n % 2 == 0) n /= 2; else m /= 2;  // n and m = a + b + 1 differ in parity
  return checked_mul(n, m, who);
}

}  // namespace detail

/// Section 2d's attention cost: the (query, key) pairs the mask lets through
/// for a query shard at document positions [context, context + len) of a
/// document of `doc_len` tokens. Causal: sum of (p + 1); full: len x doc_len;
/// sliding window: sum of min(w, p + 1). Throws invalid_input on overflow.
inline std::int64_t attention_pairs(const AttentionMask& mask, std::int64_t context, std::int64_t len, std::int64_t doc_len) {
  const char* who = "attention_pairs";
  if (context < 0 || len < 0 || doc_len < 0) detail::fail(who, ": context = ", context, ", len = ", len, " and doc_len = ", doc_len, " must not be negative");
  std::int64_t end = 0;
  if (__builtin_add_overflow(context, len, &end)) detail::fail(who, ": ", context, " + ", len, " tokens overflow 64 bits");
  switch (mask.type) {
    case MaskType::full: return detail::checked_mul(len, doc_len, who);
    case MaskType::sliding_window: {
      const std::int64_t grow = std::min(std::max(mask.window, context), end);  // positions below w see p + 1 keys
      std::int64_t total = 0;
      if (__builtin_add_overflow(detail::causal_pairs(context, grow, who), detail::checked_mul(end - grow, mask.window, who), &total)) {
        detail::fail(who, ": the pair count overflows 64 bits");
      }
      return total;
    }
    case MaskType::causal: break;
  }
  return detail::causal_pairs(context, end, who);
}

namespace detail {

__extension__ using wide_int = __int128;  // pair counts of 64-bit rectangles, before the overflow check

/// Sum over p in [0, n) of max(0, a + slope * p), slope in {-1, 0, 1}, in 128 bits.
inline wide_int clipped_ramp_sum(wide_int a, int slope, wide_int n) {
  if (n <= 0) return 0;
  if (slope == 0) return a > 0 ? a * n : 0;
  if (slope < 0) {  // a, a - 1, ..., positive while p < a
    const wide_int m = std::min(n, std::max<wide_int>(a, 0));
    return m * a - m * (m - 1) / 2;
  }
  const wide_int start = std::max<wide_int>(0, 1 - a);  // first p with a + p >= 1
  if (start >= n) return 0;
  const wide_int first = a + start, last = a + n - 1;
  return (first + last) * (n - start) / 2;
}

}  // namespace detail

/// The pairs of the rectangle [p0, p1) x [k0, k1) inside `band`, in closed
/// form (O(1), not O(pairs)). Throws invalid_input when the count leaves 64 bits.
inline std::int64_t band_pairs(std::int64_t p0, std::int64_t p1, std::int64_t k0, std::int64_t k1, const Band& band) {
  if (!band_meets(p0, p1, k0, k1, band)) return 0;
  using detail::wide_int;
  // Ends beyond the rectangle's reach change nothing: clamp them, so the
  // arithmetic below stays finite.
  const wide_int lo = std::max<wide_int>(band.lo, wide_int{k0} - p1), hi = std::min<wide_int>(band.hi, wide_int{k1} - p0);
  // Row p sees t in [max(k0, p + lo), min(k1 - 1, p + hi)]: split [p0, p1) where either end stops moving with p.
  const wide_int b1 = wide_int{k0} - lo;      // p + lo >= k0 from here on
  const wide_int b2 = wide_int{k1} - 1 - hi;  // p + hi >= k1 - 1 from here on
  wide_int cuts[4] = {p0, std::clamp<wide_int>(std::min(b1, b2), p0, p1), std::clamp<wide_int>(std::max(b1, b2), p0, p1), p1};
  wide_int total = 0;
  for (int s = 0; s < 3; ++s) {
    const wide_int from = cuts[s], to = cuts[s + 1];
    if (from >= to) continue;
    const bool low_moves = from >= b1, high_fixed = from >= b2;
    const wide_int upper = high_fixed ? wide_int{k1} - 1 : from + hi;
    const wide_int lower = low_moves ? from + lo : wide_int{k0};
    const int slope = (high_fixed ? 0 : 1) - (low_moves ? 1 : 0);
    total += detail::clipped_ramp_sum(upper - lower + 1, slope, to - from);
  }
  if (total > std::numeric_limits<std::int64_t>::max()) detail::fail("band_pairs: the pair count overflows 64 bits");
  return static_cast<std::int64_t>(total);
}

/// Whether some slice holds a pair of queries [p0, p1) x keys [k0, k1)
/// (document positions) inside its band: query positions [p0, p1) need the
/// keys [k0, k1) (section 2e).
inline bool slices_meet(const std::vector<AttentionSlice>& slices, std::int64_t p0, std::int64_t p1, std::int64_t k0, std::int64_t k1) {
  return std::any_of(slices.begin(), slices.end(), [&](const AttentionSlice& s) {
    return band_meets(std::max(p0, s.q_begin), std::min(p1, s.q_end), std::max(k0, s.k_begin), std::min(k1, s.k_end), s.band());
  });
}

/// The allowed pairs of queries [p0, p1) x keys [k0, k1) under a document's
/// slices (which share no pair): section 2e's attention cost of that cut.
inline std::int64_t slice_pairs(const std::vector<AttentionSlice>& slices, std::int64_t p0, std::int64_t p1, std::int64_t k0, std::int64_t k1) {
  std::int64_t total = 0;
  for (const AttentionSlice& s : slices) {
    const std::int64_t n = band_pairs(std::max(p0, s.q_begin), std::min(p1, s.q_end), std::max(k0, s.k_begin), std::min(k1, s.k_end), s.band());
    if (__builtin_add_overflow(total, n, &total)) detail::fail("slice_pairs: the pair count overflows 64 bits");
  }
  return total;
}

/// The pairs one attention entry computes: lq query rows against lk key
/// columns, the mask applied bottom-right aligned (diagonal lk - lq), as a
/// kernel given that entry of a layout does. For a planned KV group it equals
/// attention_pairs of its query shard.
inline std::int64_t entry_pairs(const AttentionMask& mask, std::int64_t lq, std::int64_t lk) {
  if (lq < 0 || lk < lq) detail::fail("entry_pairs: lq = ", lq, " and lk = ", lk, " (an entry has at least its own queries' keys)");
  if (mask.type == MaskType::full) return detail::checked_mul(lq, lk, "entry_pairs");
  return attention_pairs(mask, lk - lq, lq, lk);  // keys before the group are out of the window anyway
}

namespace detail {

/// Section 2d's ranges for one document of n shards (lengths len[0..n)):
/// query shard i needs KV shards lo[i] .. hi[i] (inclusive), and KV shard k
/// is needed by query shards first[k] .. end[k] - 1, its users in increasing
/// order (copy c of k goes to query shard first[k] + c). Both ranges are
/// contiguous for these masks because lo and hi never decrease with i.
struct DocumentRanges {
  std::vector<std::size_t> lo, hi, first, end;

  std::size_t users(std::size_t k) const noexcept { return end[k] - first[k]; }

  /// O(n); the vectors keep their memory between documents.
  void compute(const AttentionMask& mask, const std::int64_t* len, std::size_t n) {
    for (auto* v : {&lo, &hi, &first, &end}) v->resize(n);
    if (mask.type != MaskType::sliding_window) {  // closed forms: planning's hot path
      const bool full = mask.type == MaskType::full;
      for (std::size_t i = 0; i < n; ++i) {
        lo[i] = 0;
        hi[i] = full ? n - 1 : i;
        first[i] = full ? 0 : i;
        end[i] = n;
      }
      return;
    }
    needed(mask, len, n);
    std::size_t i = 0;  // first[k]: the first query shard whose range reaches k
    for (std::size_t k = 0; k < n; ++k) {
      while (hi[i] < k) ++i;
      first[k] = i;
    }
    i = 0;  // end[k]: one past the last query shard whose range starts at or before k
    for (std::size_t k = 0; k < n; ++k) {
      while (i < n && lo[i] <= k) ++i;
      end[k] = i;
    }
  }

 private:
  void needed(const AttentionMask& mask, const std::int64_t* len, std::size_t n) {
    if (mask.type != MaskType::sliding_window) {
      for (std::size_t i = 0; i < n; ++i) {
        lo[i] = 0;
        hi[i] = mask.type == MaskType::full ? n - 1 : i;
      }
      return;
    }
    // lo(i): the first k with b_k >= a_i - w + 2 (its last key t = b_k - 1
    // satisfies t > a_i - w, so the first query of shard i sees it).
    // Positions saturate rather than overflow: planning refuses such a
    // document by its total anyway.
    std::size_t k = 0;
    std::int64_t a = 0, b = n > 0 ? len[0] : 0;  // a = a_i, b = b_k
    for (std::size_t i = 0; i < n; ++i) {
      while (k < i && b - a < 2 - mask.window) b = saturated_add(b, len[++k]);  // b_i - a_i >= 1 >= 2 - w
      lo[i] = k;
      hi[i] = i;
      a = saturated_add(a, len[i]);
    }
  }

  static std::int64_t saturated_add(std::int64_t x, std::int64_t y) noexcept {
    std::int64_t sum = 0;
    return __builtin_add_overflow(x, y, &sum) ? std::numeric_limits<std::int64_t>::max() : sum;
  }
};

}  // namespace detail

// ---- section 2e: slices as bands

/// Whether a slice lets any (query, key) pair through: its rectangle meets its band.
constexpr bool slice_has_pair(const AttentionSlice& s) noexcept {
  return band_meets(s.q_begin, s.q_end, s.k_begin, s.k_end, s.band());
}

/// Whether two slices let a common pair through: the intersection of their
/// rectangles meets the intersection of their bands (section 2e's rule; every
/// allowed pair must belong to exactly one slice).
constexpr bool slices_share_pair(const AttentionSlice& a, const AttentionSlice& b) noexcept {
  return band_meets(std::max(a.q_begin, b.q_begin), std::min(a.q_end, b.q_end), std::max(a.k_begin, b.k_begin),
                    std::min(a.k_end, b.k_end), a.band().intersect(b.band()));
}

/// One pair (query p, key t) of the rectangle [p0, p1) x [k0, k1) inside
/// `band`, for messages: the smallest t - p, then the first query. Only
/// where band_meets(p0, p1, k0, k1, band) holds, which keeps t below k1.
constexpr std::pair<std::int64_t, std::int64_t> first_pair(std::int64_t p0, std::int64_t p1, std::int64_t k0, const Band& band) noexcept {
  const std::int64_t d = std::max(band.lo, k0 - (p1 - 1));  // feasible: band_meets bounds it by hi and by (k1 - 1) - p0
  const std::int64_t p = std::max(p0, k0 - d);
  return {p, p + d};
}

/// "[-3, 0]", "(-inf, 0]" or "(-inf, +inf)": a band in messages.
inline std::string to_string(const Band& band) {
  std::string out;  // appended piece by piece: g++ 12 misreads "[" + std::to_string(...) as an overflow
  if (band.bounded_below()) {
    out += '[';
    out += std::to_string(band.lo);
  } else {
    out += "(-inf";
  }
  out += ", ";
  if (band.bounded_above()) {
    out += std::to_string(band.hi);
    out += ']';
  } else {
    out += "+inf)";
  }
  return out;
}

namespace detail {

/// The smallest x in [lo, hi) with pred(x), pred being false then true over
/// the range; hi when none (also when lo > hi).
template <class T, class Pred>
T first_where(T lo, T hi, const Pred& pred) {
  while (lo < hi) {
    const T mid = lo + (hi - lo) / 2;
    if (pred(mid)) hi = mid;
    else lo = mid + 1;
  }
  return hi;
}

/// What a run of a document costs and needs, for the cost model and the
/// balancer alike.
/// Causal pairs of tokens [a, b) of a document: sum over t of (t + 1).
/// Callers keep b*(b+1) within 64 bits (checked once per document).
inline std::int64_t pairs(std::int64_t a, std::int64_t b) noexcept { return (b - a) * (a + b + 1) / 2; }

/// Whether queries [p0, p1) of a document need its keys [k0, k1): under
/// its slices (section 2e), else under the plan's mask, which is a band over
/// the whole document. A needed set is not a range under slices.
inline bool needs(const std::vector<AttentionSlice>& slices, const AttentionMask& mask, std::int64_t p0, std::int64_t p1,
                  std::int64_t k0, std::int64_t k1) {
  return slices.empty() ? band_meets(p0, p1, k0, k1, mask.band()) : slices_meet(slices, p0, p1, k0, k1);
}

/// The (query, key) pairs of queries [a, b) of a document of `len` tokens:
/// its slices' allowed pairs, else its mask's.
inline std::int64_t query_pairs(const std::vector<AttentionSlice>& slices, const AttentionMask& mask, std::int64_t a, std::int64_t b,
                                std::int64_t len) {
  return slices.empty() ? attention_pairs(mask, a, b - a, len) : slice_pairs(slices, a, b, 0, len);
}

/// Refuses a slice of document d that reaches outside its `len` tokens
/// (`who`: the caller, for the message). Planning checks the rest of a
/// slice (section 2e); costs and needed sets are only defined inside.
inline void check_slices_inside(const std::vector<AttentionSlice>& slices, std::int64_t len, std::size_t d, const char* who) {
  for (std::size_t j = 0; j < slices.size(); ++j) {
    const AttentionSlice& s = slices[j];
    const bool empty = s.q_begin >= s.q_end || s.k_begin >= s.k_end;
    if (empty || s.q_begin < 0 || s.k_begin < 0 || s.q_end > len || s.k_end > len) {
      fail(who, ": documents[", d, "].slices[", j, "] (q [", s.q_begin, ", ", s.q_end, "), k [", s.k_begin, ", ", s.k_end, ")) ",
           empty ? "is empty" : "reaches outside the document", " (", len, " tokens)");
    }
  }
}

}  // namespace detail

}  // namespace cpdispatch
