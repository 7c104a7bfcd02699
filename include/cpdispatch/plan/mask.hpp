#pragma once
// Attention masks (docs/plan-format.md, section 2d): which keys a query sees.
// One mask holds for a whole plan; it decides which key-value shards each
// query shard needs, and so the whole KV exchange.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"

namespace cpdispatch {

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

  /// The kernel's view of one attention entry: query row j and key column t
  /// count from 0 inside the entry, and `diagonal` is the document position
  /// of query row 0 minus that of key column 0. For a whole KV group this is
  /// lk - lq (bottom-right alignment, as flash-attention >= 2.1).
  constexpr bool allows(std::int64_t j, std::int64_t t, std::int64_t diagonal) const {
    return sees(j + diagonal, t);
  }

  friend constexpr bool operator==(const AttentionMask&, const AttentionMask&) = default;
};

/// "causal", "full" or "sliding_window(4096)": for messages and summaries.
inline std::string to_string(const AttentionMask& mask) {
  switch (mask.type) {
    case MaskType::full: return "full";
    case MaskType::sliding_window: return "sliding_window(" + std::to_string(mask.window) + ")";
    case MaskType::causal: break;
  }
  return "causal";
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

}  // namespace cpdispatch
