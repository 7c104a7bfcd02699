#pragma once
// Attention masks (docs/plan-format.md, section 2d): which keys a query sees.
// One mask holds for a whole plan; it decides which key-value shards each
// query shard needs, and so the whole KV exchange.

#include <cstdint>
#include <string>

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

}  // namespace cpdispatch
