#pragma once
// Bounded planning: what a plan will allocate, worked out from its sizes
// before anything of that size is allocated, and refused beyond a budget.
//
// A plan file of a hundred bytes can name a world of a billion ranks; the
// global metadata is dense ([W][W+1] count matrices, [W][S][C] tensors), so
// such a plan would allocate far more than any node has before it failed.
// Every planner takes a PlanLimits (default: 4 GiB) and checks the estimate
// of its allocations against it first: a plan beyond the budget is an
// invalid_input naming the plan's sizes and the budget, raised within
// microseconds and before the large allocations. The estimates are upper
// bounds of the outputs and working memory (within a small factor), not
// exact counts.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// The default budget of one planning call: 4 GiB.
inline constexpr std::uint64_t default_plan_max_bytes = std::uint64_t{4} << 30;

/// The deepest JSON nesting a reader accepts: plans and metadata nest at
/// most six deep, so this leaves room without allowing a nesting bomb.
inline constexpr std::size_t default_max_json_depth = 64;

/// Bounds on what planning and the JSON readers may allocate.
struct PlanLimits {
  /// The most bytes one planning call (or one JSON document read) may
  /// allocate: its outputs and working memory, estimated from the plan's
  /// sizes before they are allocated.
  std::uint64_t max_bytes = default_plan_max_bytes;
  /// Bytes each integer of the output metadata costs: 8 (std::int64_t). A
  /// caller that also keeps another copy of the output (as JSON, say) adds
  /// that copy's cost per integer, so the budget covers both.
  std::uint64_t bytes_per_element = 8;
  /// The deepest nesting of arrays and objects a JSON reader accepts.
  std::size_t max_json_depth = default_max_json_depth;
};

/// The estimated allocations of one planning call: integers of output
/// metadata (each bytes_per_element) and working bytes.
struct PlanFootprint {
  std::uint64_t elements = 0;
  std::uint64_t work_bytes = 0;
};

namespace detail {

inline constexpr std::uint64_t saturated = std::numeric_limits<std::uint64_t>::max();

/// a * b, saturating: an estimate beyond 64 bits is simply "too large".
inline std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? saturated : out;
}

inline std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? saturated : out;
}

template <class... Ts>
std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b, Ts... more) noexcept {
  return sat_mul(sat_mul(a, b), static_cast<std::uint64_t>(more)...);
}

template <class... Ts>
std::uint64_t sat_add(std::uint64_t a, std::uint64_t b, Ts... more) noexcept {
  return sat_add(sat_add(a, b), static_cast<std::uint64_t>(more)...);
}

/// "4.0 GiB (4294967296 bytes)"; "more than 16 EiB" for a saturated estimate.
inline std::string bytes_text(std::uint64_t bytes) {
  if (bytes == saturated) return "more than 16 EiB";
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  std::size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(units)) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return concat(bytes, " bytes");
  const auto tenths = static_cast<std::uint64_t>(v * 10 + 0.5);
  return concat(tenths / 10, '.', tenths % 10, ' ', units[u], " (", bytes, " bytes)");
}

}  // namespace detail

/// The bytes a footprint costs under `limits`.
inline std::uint64_t footprint_bytes(const PlanFootprint& f, const PlanLimits& limits) noexcept {
  return detail::sat_add(detail::sat_mul(f.elements, limits.bytes_per_element), f.work_bytes);
}

/// Footprints of each planner, from the sizes that decide them: W ranks, N
/// shards, S the most shards of one rank, C the copy dimension, Mq and M the
/// most query and KV entries one rank receives.
namespace footprint {

/// plan_query: forward and reverse count matrices [W][W+1], the forward
/// [W][S][C] tensors, the reverse [W][Mq] ones, working [W][S] prefix sums.
inline PlanFootprint query(std::uint64_t W, std::uint64_t S, std::uint64_t C, std::uint64_t Mq) {
  using detail::sat_mul;
  return {detail::sat_add(sat_mul(2, W, W + 1), sat_mul(4, W, S, C), sat_mul(3, W, Mq), sat_mul(2, W, S), sat_mul(8, W)), sat_mul(16, W, S + 1)};
}

/// plan_qkv's shard table and KV groups (O(N + W)), built before the sizes
/// of the dense outputs are known; per-rank planning of the documents form
/// builds the same.
inline PlanFootprint shard_tables(std::uint64_t W, std::uint64_t N) {
  return {0, detail::sat_add(detail::sat_mul(160, N), detail::sat_mul(64, W + 1))};
}

/// plan_qkv: four count matrices [W][W+1], the KV forward [W][S][C] tensors
/// and copy mask, the [W][S] query tensors, the reverse [W][Mq] and [W][M]
/// ones, the attention layout, plus the shard tables.
inline PlanFootprint qkv(std::uint64_t W, std::uint64_t N, std::uint64_t S, std::uint64_t C, std::uint64_t Mq, std::uint64_t M) {
  using detail::sat_mul;
  PlanFootprint f = shard_tables(W, N);
  f.elements = detail::sat_add(sat_mul(4, W, W + 1), sat_mul(3, W, S, C), sat_mul(8, W, S), sat_mul(3, W, Mq), sat_mul(3, W, M), sat_mul(4, N),
                               sat_mul(32, W));  // the last: per-rank rows of the attention layout and totals
  return f;
}

/// One rank's share (plan_qkv_for_rank, with its dedup slices): O(W)
/// per-rank arrays and rows, the rank's S_R x C forward entries, and the Q_R
/// query and M_R KV entries it receives; for the documents form also the
/// shard tables.
inline PlanFootprint rank_share(std::uint64_t W, std::uint64_t N, std::uint64_t S_R, std::uint64_t C, std::uint64_t Q_R,
                                std::uint64_t M_R) {
  using detail::sat_mul;
  PlanFootprint f = shard_tables(W, N);
  f.elements = detail::sat_add(sat_mul(16, W + 1), sat_mul(8, S_R, C), sat_mul(8, S_R), sat_mul(8, Q_R), sat_mul(8, M_R));
  return f;
}

/// Section 2e's slice tables of a documents-form plan (built by plan_qkv
/// and by per-rank planning alike): the slices copied, each (slice, query
/// shard) piece, and per attention entry its needed-set and user records,
/// with the same again as one document's working copy.
inline PlanFootprint slice_tables(std::uint64_t slices, std::uint64_t pieces, std::uint64_t entries) {
  using detail::sat_mul;
  return {0, detail::sat_add(sat_mul(48, slices), sat_mul(96, pieces), sat_mul(96, entries))};
}

/// Section 2e's attn.entries: seven integers an entry.
inline PlanFootprint attention_entries(std::uint64_t entries) { return {detail::sat_mul(7, entries), 0}; }

/// plan_query_for_rank: O(W) rows and working arrays plus at most the
/// input's own entries.
inline PlanFootprint query_rank_share(std::uint64_t W, std::uint64_t entries) {
  return {detail::sat_add(detail::sat_mul(8, W + 1), detail::sat_mul(4, entries)), detail::sat_mul(16, W + 1)};
}

/// plan_balanced: per-rank loads, capacities and piece lists (about 16
/// words a rank across its candidate plans), per-piece state, and the plan
/// it returns, counted at up to `shards_per_piece` shards a piece (the
/// balancer cuts a document into at most C shards, and in practice into far
/// fewer, so at most 64 are counted; zig-zag cuts it into 2W).
inline PlanFootprint balance(std::uint64_t W, std::uint64_t pieces, std::uint64_t shards_per_piece) {
  using detail::sat_mul;
  return {0, detail::sat_add(sat_mul(128, W), sat_mul(256, pieces), sat_mul(48, pieces, shards_per_piece))};
}

/// plan_cost: the [W][W] byte matrix and per-rank totals.
inline PlanFootprint plan_cost(std::uint64_t W) { return {detail::sat_add(detail::sat_mul(W, W), detail::sat_mul(4, W)), 0}; }

/// A parsed JSON document from `text_bytes` of text: each value is a 16-byte
/// node plus container storage; the worst case ("[[],[],...]", objects with
/// one-letter keys) is a few dozen bytes per character of text.
inline PlanFootprint json_document(std::uint64_t text_bytes) { return {0, detail::sat_mul(48, text_bytes)}; }

}  // namespace footprint

namespace detail {

/// Throws invalid_input when `f` exceeds the budget: "`who`: `sizes` needs
/// about X, more than the limit of Y (PlanLimits::max_bytes)".
inline void check_footprint(const PlanLimits& limits, const PlanFootprint& f, std::string_view who, std::string_view sizes) {
  const std::uint64_t need = footprint_bytes(f, limits);
  if (need <= limits.max_bytes) return;
  fail(who, ": ", sizes, " needs about ", bytes_text(need), " of memory, more than the limit of ", bytes_text(limits.max_bytes),
       " (PlanLimits::max_bytes)");
}

/// The same, with the sizes' description made only when the check fails:
/// hot planning loops check once per document.
template <class Describe>
  requires std::is_invocable_r_v<std::string, Describe&>
void check_footprint(const PlanLimits& limits, const PlanFootprint& f, std::string_view who, Describe&& describe) {
  if (footprint_bytes(f, limits) <= limits.max_bytes) return;
  const std::string sizes = describe();
  check_footprint(limits, f, who, std::string_view(sizes));
}

/// A JSON text's size and nesting, checked before it is parsed: a scan that
/// tracks strings, so brackets inside them do not count.
inline void check_json_text(std::string_view text, const PlanLimits& limits) {
  check_footprint(limits, footprint::json_document(text.size()), "invalid JSON", concat("a document of ", text.size(), " bytes"));
  std::size_t depth = 0, line = 1;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (c == '\n') ++line;
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == ']' || c == '}') depth -= depth > 0 ? 1 : 0;
    else if ((c == '[' || c == '{') && ++depth > limits.max_json_depth) {
      fail("invalid JSON: nesting deeper than ", limits.max_json_depth, " levels at line ", line, " (PlanLimits::max_json_depth)");
    }
  }
}

/// The sizes of one rank's share of a QKV plan in either form, counted in
/// one pass over the (validated) plan without allocating: shards in all,
/// the rank's own shards, and the query and KV entries it receives.
struct RankShareSizes {
  std::uint64_t shards = 0, own = 0, queries = 0, kv_entries = 0;

  /// `needed`: the KV shards the query shard needs, at most (i + 1 under
  /// the causal mask, the document's shard count under any mask).
  void add(std::uint64_t home, std::uint64_t dst, std::uint64_t needed, std::uint64_t R) {
    ++shards;
    own += home == R ? 1 : 0;
    if (dst != R) return;
    ++queries;
    kv_entries = sat_add(kv_entries, needed);
  }
};

/// Works on both QKV plan forms: `ranks` (each document on one rank) or
/// `documents` (each shard with its home).
template <class QkvPlanForm>
RankShareSizes rank_share_sizes(const QkvPlanForm& plan, std::uint64_t R) {
  RankShareSizes s;
  const bool causal = plan.mask == decltype(plan.mask)::causal();  // other masks: counted as if each shard needed all
  const auto needed = [&](std::size_t k, std::size_t n, bool sliced = false) { return static_cast<std::uint64_t>(causal && !sliced ? k + 1 : n); };
  if constexpr (requires { plan.ranks; }) {
    for (std::size_t r = 0; r < plan.ranks.size(); ++r)
      for (const auto& doc : plan.ranks[r].docs)
        for (std::size_t k = 0; k < doc.shard_len.size(); ++k) s.add(r, static_cast<std::uint64_t>(doc.dst[k]), needed(k, doc.shard_len.size()), R);
  } else {
    for (const auto& doc : plan.documents)
      for (std::size_t k = 0; k < doc.shards.size(); ++k) {
        // A document with slices (section 2e) needs any set: counted as all.
        s.add(static_cast<std::uint64_t>(doc.shards[k].rank), static_cast<std::uint64_t>(doc.shards[k].dst),
              needed(k, doc.shards.size(), !doc.slices.empty()), R);
      }
  }
  return s;
}

/// Checks rank R's share of a validated QKV plan with copy dimension C.
template <class QkvPlanForm>
void check_rank_share(const QkvPlanForm& plan, std::size_t R, std::size_t C, const PlanLimits& limits, std::string_view who) {
  const auto W = static_cast<std::uint64_t>(plan.world_size);
  const RankShareSizes s = rank_share_sizes(plan, R);
  check_footprint(limits, footprint::rank_share(W, s.shards, s.own, C, s.queries, s.kv_entries), who,
                  concat("rank ", R, "'s share of a plan of world_size = ", W, ", ", s.shards, " shards, max_cp_degree = ", C, " (",
                         s.own, " shards at home, ", s.queries, " query and ", s.kv_entries, " key-value entries received)"));
}

}  // namespace detail

}  // namespace cpdispatch
