#pragma once
// Coverage verification (docs/plan-format.md, section 2e): a plan's attention
// layout must attend every allowed (query, key) pair of every document exactly
// once, and nothing else. The check reads only where the metadata put things
// (q_fwd, kv_fwd and the attention layout), so it judges any planner's output,
// a plan read back from JSON or one edited by hand alike, and it counts pairs
// in closed form (band_pairs) instead of enumerating them.
//
// How: each entry of each query shard is cut along its KV group's columns
// into pieces, one per KV copy it reaches. A piece is a rectangle of document
// positions with a band, inside one (query shard, KV shard) cell of one
// document. The allowed region of a document is its slices, or the plan's mask
// over the whole document. The layout is an exact cover when
//   (a) every piece lies inside the allowed region: its pairs inside the
//       slices, summed, equal its own pairs (slices share no pair, checked);
//   (b) no two pieces share a pair (only pieces of one cell can); and
//   (c) the pieces' pairs add up to the allowed pairs.
// (a) and (b) make the pieces a disjoint union inside the allowed region, so
// (c) leaves no allowed pair out.
//
// Cost: O(N + G + K log K + P log P + X) for N shards, G query shards, K KV
// copies, P pieces and X candidate pairs: pieces of one cell whose query rows
// overlap, pieces against the allowed regions that share rows with their query
// shard, and slices whose query ranges overlap. Planned layouts keep X small (a
// cell holds one piece per slice it meets, and slices rarely stack on the same
// rows). X grows quadratically where many pieces of one cell share rows but not
// keys (entries cutting one pair of shards into many column strips) or many
// slices share rows (a document cut along the key axis by hundreds of slices).
// Memory: O(N + G + K + P + slices); K and P are checked against PlanLimits
// before they are allocated.
//
// One rank (verify_coverage_for_rank) runs the same check on that rank's
// share: its query shards, KV copies and entries, read from where its q_rev
// and kv_rev rows send them home, with each document's allowed region cut to
// the query rows the rank holds. A shard's queries attend on one rank only
// (its dst, checked), so the shares of all ranks add up to the whole check.
//
// Head-parallel documents (section 2f) have no place in q_fwd and kv_fwd
// (checked: no destination there). Each rank of a document's group holds it
// whole in its head-parallel layout and attends all its pairs for its share
// of the heads, so the check runs once per (rank, document): the rank's
// hp_attn lists the document once, at its full length; hp_fwd (globally) or
// hp_rev (one rank) puts each shard at the document's start there plus the
// shard's offset in it; and the document's entries, cut at its shards' rows
// into pieces, cover its allowed pairs exactly once by (a) to (c) above.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cpdispatch {

/// The longest document verify_coverage handles: 2^31 tokens, so that any
/// count of its pairs fits 64 bits.
inline constexpr std::int64_t max_verified_document_tokens = std::int64_t{1} << 31;

/// The most tokens one rank's query or KV layout may hold for verify_coverage
/// (2^62), so that column - row differences and their shifts stay exact.
inline constexpr std::int64_t max_verified_layout_tokens = std::int64_t{1} << 62;

namespace detail::coverage {

using I = std::int64_t;

inline constexpr std::size_t none = static_cast<std::size_t>(-1);
/// Differences t - p of document positions lie inside (-reach, reach).
inline constexpr I document_reach = 2 * max_verified_document_tokens;
/// Differences column - row inside one query shard's entries lie inside (-reach, reach).
inline constexpr I layout_reach = max_verified_layout_tokens;
/// The most pair tests spent looking for an example pair for a message.
inline constexpr I example_budget = I{1} << 20;

/// Query positions [p0, p1) x key positions [k0, k1) of one document, the
/// pairs inside `band` (on t - p).
struct PairRegion {
  I p0 = 0, p1 = 0, k0 = 0, k1 = 0;
  Band band{};

  bool holds(I p, I t) const noexcept { return p0 <= p && p < p1 && k0 <= t && t < k1 && band.contains(t - p); }
};

inline I pairs_in(const PairRegion& r) { return band_pairs(r.p0, r.p1, r.k0, r.k1, r.band); }

/// "1 pair", "3 pairs": counts in messages.
inline std::string count_of(wide_int n, const char* what) { return concat(static_cast<I>(n), ' ', what, n == 1 ? "" : "s"); }

inline PairRegion common_part(const PairRegion& a, const PairRegion& b) {
  return {std::max(a.p0, b.p0), std::min(a.p1, b.p1), std::max(a.k0, b.k0), std::min(a.k1, b.k1), a.band.intersect(b.band)};
}

/// Calls found(p, t) on the pairs of `r`, by query then key, until it returns
/// true; returns whether it did. Only rows that hold pairs are visited, so
/// the cost is O(pairs visited).
template <class Found>
bool find_pair(const PairRegion& r, Found found) {
  if (!band_meets(r.p0, r.p1, r.k0, r.k1, r.band)) return false;
  const wide_int lo = r.band.lo, hi = r.band.hi;
  const I first = static_cast<I>(std::max<wide_int>(r.p0, wide_int{r.k0} - hi));
  const I last = static_cast<I>(std::min<wide_int>(r.p1 - 1, wide_int{r.k1} - 1 - lo));
  for (I p = first; p <= last; ++p) {
    const I t0 = static_cast<I>(std::max<wide_int>(r.k0, p + lo)), t1 = static_cast<I>(std::min<wide_int>(r.k1 - 1, p + hi));
    for (I t = t0; t <= t1; ++t)
      if (found(p, t)) return true;
  }
  return false;
}

/// ", e.g. query p key t" for the first pair of `r` that `wanted` accepts,
/// when the search fits the example budget (`tests_per_pair` tests a pair);
/// else empty.
template <class Wanted>
std::string example_pair(const PairRegion& r, std::size_t tests_per_pair, Wanted wanted) {
  if (static_cast<wide_int>(pairs_in(r)) * static_cast<wide_int>(std::max<std::size_t>(tests_per_pair, 1)) > example_budget) return {};
  I p = 0, t = 0;
  const bool found = find_pair(r, [&](I q, I k) {
    p = q;
    t = k;
    return wanted(q, k);
  });
  return found ? concat(", e.g. query ", p, " key ", t) : std::string{};
}

/// `band` moved by `shift`, each bounded end then clamped to what it means
/// for differences inside (-reach, reach): an end beyond reach on its open
/// side opens, one beyond reach on the other side stops at reach (admitting
/// nothing either way). Exact in 128 bits whatever the input's ends.
inline Band shifted_within(const Band& band, wide_int shift, I reach) {
  Band out;
  if (band.bounded_below()) {
    const wide_int lo = band.lo + shift;
    out.lo = lo <= -reach ? Band::unbounded_lo : static_cast<I>(std::min<wide_int>(lo, reach));
  }
  if (band.bounded_above()) {
    const wide_int hi = band.hi + shift;
    out.hi = hi >= reach ? Band::unbounded_hi : static_cast<I>(std::max<wide_int>(hi, -reach));
  }
  return out;
}

/// Calls meet(a, b), a < b, for the regions (region(i) for i < n, sorted by
/// p0) whose rectangles overlap. A sweep over the query axis: it costs n plus
/// the pairs whose query ranges overlap (more than the overlapping rectangles
/// where regions share rows but not keys). `active` is working storage.
template <class RegionOf, class Meet>
void for_each_meeting_pair(std::size_t n, RegionOf region, Meet meet, std::vector<std::size_t>& active) {
  active.clear();
  for (std::size_t x = 0; x < n; ++x) {
    const PairRegion& r = region(x);
    std::erase_if(active, [&](std::size_t y) { return region(y).p1 <= r.p0; });
    for (std::size_t y : active)
      if (region(y).k0 < r.k1 && r.k0 < region(y).k1) meet(y, x);
    active.push_back(x);
  }
}

/// The plan's shards, numbered in document order (the ids of one document are
/// consecutive), with their document positions and MLP layout places.
struct ShardPlaces {
  std::vector<std::size_t> doc_begin{0};      // [D + 1]: first id of each document
  std::vector<std::size_t> doc, home, local;  // [N]: document, home rank, index on the home
  std::vector<I> start, len;                  // [N]: document positions [start, start + len)
  std::vector<std::size_t> held;              // [W]: shards on each home rank

  std::size_t size() const noexcept { return len.size(); }
  I doc_length(std::size_t d) const { return start[doc_begin[d + 1] - 1] + len[doc_begin[d + 1] - 1]; }
  std::string name(std::size_t id) const { return concat("documents[", doc[id], "].shards[", id - doc_begin[doc[id]], "]"); }
};

/// Where an entry sits: destination rank, query shard on that rank (for a
/// head-parallel one: the document's index in the rank's hp_attn), entry
/// index (none for the implicit entry of a layout without entries).
struct EntrySite {
  std::size_t rank = 0, shard = 0, entry = 0;
  bool head_parallel = false;
};

/// The columns [c0, c1) of a KV group that copy `copy` of KV shard `shard` fills.
struct KeyRun {
  std::size_t group = 0;
  I c0 = 0, c1 = 0;
  std::size_t shard = 0, copy = 0;
};

/// One entry's pairs within one KV copy, in document positions.
struct Piece {
  PairRegion region;
  std::size_t query_shard = 0, kv_shard = 0;  // shard ids: the piece's cell
  EntrySite site;
};

/// An allowed region of a document: one slice (its index) or, for a
/// document without slices, the plan's mask over all of it (slice = none).
struct AllowedRegion {
  PairRegion region;
  std::size_t slice = none;
};

/// The prefix sums of a rank without query shards.
inline constexpr I no_rows[1] = {0};

/// One rank's row of an attention layout as the check reads it (a rank
/// outside the check holds no query shard).
struct LayoutRow {
  std::span<const I> seqlens_q, seqlens_kv, cu_q, cu_kv;
  std::span<const std::vector<AttentionEntry>> entries;  // empty: each query shard's implicit entry
};

/// One rank's row of hp_attn as the check reads it.
struct HeadParallelRow {
  std::span<const I> documents, seqlens, cu;
  I group_rank = 0;
  std::span<const std::vector<AttentionEntry>> entries;  // empty: each document's whole-document entry under hp_attn.mask
};

/// A head-parallel shard reaching a rank's head-parallel layout at `row`:
/// copy `source` of hp_fwd (globally) or entry `source` of hp_rev (one rank).
struct Arrival {
  std::size_t rank = 0;
  I row = 0;
  std::size_t shard = 0, source = 0;
};

/// Where a shard's tokens sit on its home rank: the shard ids of each home
/// in MLP-layout order, their starts there, and each home's token count.
struct HomePlaces {
  std::vector<std::size_t> begin;  // [W + 1] into ids
  std::vector<std::size_t> ids;    // [N]
  std::vector<I> start;            // [N], by position in ids
  std::vector<I> total;            // [W]
};

/// One verification: reads the layout, the plan and the metadata into
/// tables, cuts entries into pieces, then checks each document's cover over
/// the rows of the query shards the layout holds. Globally that is every
/// shard; for one rank, the query shards that attend there.
class CoverageCheck {
 public:
  CoverageCheck(const QkvDocumentsPlan& plan, const PlanLimits& limits, const char* name) : plan_(plan), limits_(limits), who_(name) {}

  /// The whole plan: where q_fwd and kv_fwd put things.
  void run(const QkvMetadata& m) {
    read_world();
    read_layout(m.attn);
    read_plan();
    place_queries(m.q_fwd);
    place_key_values(m.kv_fwd);
    check_cover();
    if (!read_head_parallel_plan(m.hp_attn.degree)) return;
    read_head_parallel_layout(m.hp_attn);
    place_head_parallel_copies(m.hp_fwd);
    check_head_parallel(0, W_);
  }

  /// Rank R's share: where q_rev and kv_rev send its rows and columns back.
  void run(std::int64_t rank, const RankQkvMetadata& m) {
    read_world();
    if (rank < 0 || rank >= plan_.world_size) fail(who_, ": rank = ", rank, " is outside [0, ", W_, ")");
    const auto R = static_cast<std::size_t>(rank);
    read_rank_layout(R, m.attn);
    read_plan();
    index_homes();
    place_returned_queries(R, m.q_rev);
    place_returned_key_values(R, m.kv_rev);
    check_cover();
    if (!read_head_parallel_plan(m.hp_attn.degree)) return;
    read_rank_head_parallel_layout(R, m.hp_attn);
    place_returned_head_parallel(R, m.hp_rev);
    check_head_parallel(R, R + 1);
  }

 private:
  const QkvDocumentsPlan& plan_;
  const PlanLimits& limits_;
  const char* who_;
  std::size_t W_ = 0;
  std::vector<LayoutRow> rows_;           // [W]
  AttentionMask layout_mask_;             // applied by implicit entries
  std::vector<std::size_t> group_begin_;  // [W + 1]: query shards of rank d are group ids group_begin_[d]..
  ShardPlaces shards_;
  HomePlaces homes_;                      // per rank only
  std::vector<std::size_t> owner_;        // [G]: the shard whose queries fill each query shard
  std::vector<char> attended_;            // [N]: whether the shard's queries fill a query shard here
  std::vector<KeyRun> runs_;              // sorted by (group, c0)
  std::vector<std::size_t> run_begin_;    // [G + 1]
  std::vector<Piece> pieces_;             // sorted by (cell, p0, k0)
  std::vector<std::size_t> active_;       // sweep storage
  std::vector<std::pair<I, I>> rows_here_;  // one document's attended query rows
  // Section 2f, read only when some document is head-parallel.
  std::size_t u_ = 0;                        // ranks of a group
  std::vector<HeadParallelRow> hp_rows_;     // [W]
  AttentionMask hp_mask_;                    // applied by whole-document entries
  std::vector<Arrival> arrivals_;            // sorted by (rank, row)
  bool returned_ = false;                    // arrivals_ read from hp_rev, not hp_fwd
  std::vector<std::size_t> hp_count_;        // [W / u]: head-parallel documents of each group
  std::vector<std::size_t> listed_on_;       // [D]: the last rank whose hp_attn lists the document
  std::vector<std::size_t> slot_;            // [D]: its index there
  std::vector<std::size_t> arrived_on_;      // [N]: the last rank the shard reached

  // ------------------------------------------------------------ the layout

  void read_world() {
    if (plan_.world_size <= 0) fail(who_, ": world_size = ", plan_.world_size, " must be at least 1");
    W_ = static_cast<std::size_t>(plan_.world_size);
  }

  /// row(d) of each rank of a global layout (`field`: "attn" or "hp_attn"), its per-rank lists (`sizes`)
  /// compared with world_size before anything of size W is allocated; entries: empty (every item has its
  /// implicit entry) or one list per item of `items` (key `items_key`) of every rank.
  template <class Row, class MakeRow>
  void read_rows(std::vector<Row>& rows, const char* field, std::initializer_list<std::pair<std::size_t, const char*>> sizes,
                 const std::vector<std::vector<std::vector<AttentionEntry>>>& entries, const std::vector<std::vector<I>>& items,
                 const char* items_key, const char* item, MakeRow row) {
    for (const auto& [n, name] : sizes)
      if (n != W_) fail(who_, ": ", field, ".", name, " has ", n, " ranks, but world_size = ", W_);
    if (!entries.empty() && entries.size() != W_) fail(who_, ": ", field, ".entries has ", entries.size(), " ranks, but world_size = ", W_);
    rows.resize(W_);
    for (std::size_t d = 0; d < W_; ++d) {
      rows[d] = row(d);
      if (entries.empty()) continue;
      if (entries[d].size() != items[d].size()) {
        fail(who_, ": ", field, ".entries[", d, "] has ", entries[d].size(), " ", item, ", ", field, ".", items_key, "[", d, "] has ", items[d].size());
      }
      rows[d].entries = entries[d];
    }
  }

  void read_layout(const AttentionLayout& a) {
    read_rows(rows_, "attn", {{a.seqlens_q.size(), "seqlens_q"}, {a.seqlens_kv.size(), "seqlens_kv"}, {a.cu_seqlens_q.size(), "cu_seqlens_q"},
                              {a.cu_seqlens_kv.size(), "cu_seqlens_kv"}}, a.entries, a.seqlens_q, "seqlens_q", "query shards",
              [&](std::size_t d) { return LayoutRow{a.seqlens_q[d], a.seqlens_kv[d], a.cu_seqlens_q[d], a.cu_seqlens_kv[d], {}}; });
    finish_layout(a.mask);
  }

  /// Rank R's row only; the other ranks hold no query shard here.
  void read_rank_layout(std::size_t R, const RankAttentionLayout& a) {
    if (!a.entries.empty() && a.entries.size() != a.seqlens_q.size()) {
      fail(who_, ": attn.entries has ", a.entries.size(), " query shards, attn.seqlens_q has ", a.seqlens_q.size());
    }
    rows_.assign(W_, LayoutRow{{}, {}, no_rows, no_rows, {}});
    rows_[R] = {a.seqlens_q, a.seqlens_kv, a.cu_seqlens_q, a.cu_seqlens_kv, a.entries};
    finish_layout(a.mask);
  }

  /// Checks each row's sizes and prefix sums and numbers the query shards.
  void finish_layout(const AttentionMask& mask) {
    group_begin_.assign(1, 0);
    for (std::size_t d = 0; d < W_; ++d) {
      const LayoutRow& row = rows_[d];
      const std::size_t n = row.seqlens_q.size();
      if (row.seqlens_kv.size() != n) fail(who_, ": attn.seqlens_kv[", d, "] has ", row.seqlens_kv.size(), " query shards, attn.seqlens_q[", d, "] has ", n);
      check_prefix_sums(row.seqlens_q, row.cu_q, "attn.seqlens_q", "attn.cu_seqlens_q", "query shard", d);
      check_prefix_sums(row.seqlens_kv, row.cu_kv, "attn.seqlens_kv", "attn.cu_seqlens_kv", "query shard", d);
      group_begin_.push_back(group_begin_.back() + n);
    }
    check_window(mask, "attn.mask");
    layout_mask_ = mask;
  }

  /// cu (field `cu_name`) = exclusive prefix sums of len (`len_name`, one
  /// per `item`) with the total last; every value stays within
  /// [0, max_verified_layout_tokens].
  void check_prefix_sums(std::span<const I> len, std::span<const I> cu, const char* len_name, const char* cu_name, const char* item, std::size_t d) const {
    if (cu.size() != len.size() + 1) {
      fail(who_, ": ", cu_name, "[", d, "] has ", cu.size(), " entries, expected ", len.size() + 1, " (a leading 0, then one per ", item, ")");
    }
    if (cu[0] != 0) fail(who_, ": ", cu_name, "[", d, "][0] = ", cu[0], ", expected 0");
    for (std::size_t g = 0; g < len.size(); ++g) {
      if (len[g] < 0 || len[g] > max_verified_layout_tokens - cu[g]) {
        fail(who_, ": ", len_name, "[", d, "][", g, "] = ", len[g], " is negative or takes rank ", d, "'s layout past ", max_verified_layout_tokens, " tokens");
      }
      if (cu[g + 1] != cu[g] + len[g]) {
        fail(who_, ": ", cu_name, "[", d, "][", g + 1, "] = ", cu[g + 1], ", expected ", cu[g] + len[g], " (the prefix sum of ", len_name, ")");
      }
    }
  }

  /// A window below 1 has no band (AttentionMask::band would overflow).
  void check_window(const AttentionMask& mask, const char* name) const {
    if (mask.type == MaskType::sliding_window && mask.window < 1) fail(who_, ": ", name, ".window = ", mask.window, " must be at least 1");
  }

  // -------------------------------------------------------------- the plan

  void read_plan() {
    check_window(plan_.mask, "mask");
    shards_.held.assign(W_, 0);
    for (std::size_t i = 0; i < plan_.documents.size(); ++i) {
      const PackedDocument& doc = plan_.documents[i];
      if (doc.shards.empty()) fail(who_, ": documents[", i, "] has no shards");
      I at = 0;
      for (std::size_t k = 0; k < doc.shards.size(); ++k) at = add_shard(i, k, at);
      shards_.doc_begin.push_back(shards_.size());
      check_slice_bounds(i, at);
    }
  }

  /// Records shard k of document i starting at position `at`; returns its end.
  I add_shard(std::size_t i, std::size_t k, I at) {
    const DocumentShard& s = plan_.documents[i].shards[k];
    if (s.rank < 0 || s.rank >= plan_.world_size) fail(who_, ": documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", W_, ")");
    if (s.len <= 0) fail(who_, ": documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
    if (s.len > max_verified_document_tokens - at) {
      fail(who_, ": documents[", i, "] is longer than ", max_verified_document_tokens, " tokens (its pair counts would leave 64 bits)");
    }
    const auto home = static_cast<std::size_t>(s.rank);
    shards_.doc.push_back(i);
    shards_.home.push_back(home);
    shards_.local.push_back(shards_.held[home]++);
    shards_.start.push_back(at);
    shards_.len.push_back(s.len);
    return at + s.len;
  }

  void check_slice_bounds(std::size_t i, I length) const {
    const auto& slices = plan_.documents[i].slices;
    for (std::size_t s = 0; s < slices.size(); ++s) {
      const AttentionSlice& x = slices[s];
      if (0 <= x.q_begin && x.q_begin < x.q_end && x.q_end <= length && 0 <= x.k_begin && x.k_begin < x.k_end && x.k_end <= length) continue;
      fail(who_, ": documents[", i, "].slices[", s, "] (q [", x.q_begin, ", ", x.q_end, "), k [", x.k_begin, ", ", x.k_end,
           ")) is empty or leaves the document's ", length, " positions");
    }
  }

  // ----------------------------------------------------- where things went

  /// The (non-empty) group of `cu` whose columns hold `column`, or none.
  static std::size_t group_at(std::span<const I> cu, I column) {
    if (column < 0 || column >= cu.back()) return none;
    return static_cast<std::size_t>(std::upper_bound(cu.begin(), cu.end(), column) - cu.begin()) - 1;
  }

  /// Rank-major metadata: [W][S] (or [W][S][C] where copies are allowed),
  /// room for every rank's shards, seq_len [W][S].
  void check_rank_major(const Metadata& m, const char* name, bool copies) const {
    const bool dims = m.dst_rank.dim() == 2 || (copies && m.dst_rank.dim() == 3);
    if (!dims || m.dst_rank.size(0) != W_) {
      fail(who_, ": ", name, ".dst_rank has shape ", shape_str(m.dst_rank.shape()), ", expected [", W_, ", S]", copies ? " or [W, S, C]" : "");
    }
    const std::size_t S = m.dst_rank.size(1);
    if (m.dst_offset.shape() != m.dst_rank.shape()) {
      fail(who_, ": ", name, ".dst_offset has shape ", shape_str(m.dst_offset.shape()), ", but dst_rank has ", shape_str(m.dst_rank.shape()));
    }
    if (m.seq_len.dim() != 2 || m.seq_len.size(0) != W_ || m.seq_len.size(1) != S) {
      fail(who_, ": ", name, ".seq_len has shape ", shape_str(m.seq_len.shape()), ", expected [", W_, ", ", S, "]");
    }
    for (std::size_t r = 0; r < W_; ++r) {
      if (shards_.held[r] > S) fail(who_, ": ", name, " has room for ", S, " shards a rank, but rank ", r, " holds ", shards_.held[r]);
    }
  }

  /// Entries beyond a rank's shards send nothing (their tokens would land
  /// on someone's rows).
  void check_padding(const Metadata& m, const char* name) const {
    const std::size_t C = m.dst_rank.dim() == 3 ? m.dst_rank.size(2) : 1;
    for (std::size_t r = 0; r < W_; ++r) {
      const auto row = m.dst_rank.row(r);
      for (std::size_t x = shards_.held[r] * C; x < row.size(); ++x) {
        if (row[x] < 0) continue;
        fail(who_, ": ", name, ".dst_rank[", r, "][", x / C, "]", C > 1 ? index_str(x % C) : "", " = ", row[x], " sends a padding entry (rank ", r,
             " holds ", shards_.held[r], " shards)");
      }
    }
  }

  void place_queries(const Metadata& q) {
    check_rank_major(q, "q_fwd", false);
    check_padding(q, "q_fwd");
    owner_.assign(group_begin_.back(), none);
    for (std::size_t id = 0; id < shards_.size(); ++id) claim_query_shard(q, id);
    check_query_shards_filled("q_fwd sends none there");
  }

  /// Every query shard of the layout holds some shard's queries; marks those shards.
  void check_query_shards_filled(const char* why) {
    for (std::size_t d = 0; d < W_; ++d) {
      for (std::size_t g = 0; g < rows_[d].seqlens_q.size(); ++g) {
        if (owner_[group_begin_[d] + g] == none) fail(who_, ": rank ", d, " query shard ", g, " receives no document shard's queries (", why, ")");
      }
    }
    attended_.assign(shards_.size(), 0);
    for (std::size_t id : owner_) attended_[id] = 1;
  }

  /// The query shard of the layout that shard `id`'s queries fill, exactly.
  void claim_query_shard(const Metadata& q, std::size_t id) {
    const std::size_t r = shards_.home[id], j = shards_.local[id];
    const I d = q.dst_rank(r, j), row = q.dst_offset(r, j), len = q.seq_len(r, j);
    const auto at = [&] { return concat("q_fwd[", r, "][", j, "] (", shards_.name(id), ")"); };
    if (len != shards_.len[id]) fail(who_, ": ", at(), " has seq_len ", len, ", but the shard has ", shards_.len[id], " tokens");
    if (head_parallel(id)) {  // section 2f: it reaches its group through hp_fwd only
      if (d != -1) fail(who_, ": ", at(), " has dst_rank ", d, ", but documents[", shards_.doc[id], "] is head-parallel (expected -1, no destination)");
      return;
    }
    if (d < 0 || d >= plan_.world_size) fail(who_, ": ", at(), " has dst_rank ", d, ", outside [0, ", W_, ")");
    claim(id, static_cast<std::size_t>(d), row, at);
  }

  bool head_parallel(std::size_t id) const { return plan_.documents[shards_.doc[id]].head_parallel; }

  /// Shard `id`'s queries fill rows [row, row + len) of rank d: exactly one
  /// query shard there, which no other shard fills.
  template <class Name>
  void claim(std::size_t id, std::size_t d, I row, Name at) {
    const LayoutRow& layout = rows_[d];
    const I len = shards_.len[id];
    const std::size_t g = group_at(layout.cu_q, row);
    if (g == none || layout.cu_q[g] != row || layout.seqlens_q[g] != len) {
      fail(who_, ": ", at(), " lands at rank ", d, " row ", row, ", which does not start a query shard of ", len, " rows there (attn.cu_seqlens_q)");
    }
    std::size_t& claimed = owner_[group_begin_[d] + g];
    if (claimed != none) fail(who_, ": rank ", d, " query shard ", g, " receives the queries of both ", shards_.name(claimed), " and ", shards_.name(id));
    claimed = id;
  }

  void place_key_values(const Metadata& kv) {
    check_rank_major(kv, "kv_fwd", true);
    check_padding(kv, "kv_fwd");
    reserve_within_limits(runs_, copies_in(kv), "KV copies");
    for (std::size_t id = 0; id < shards_.size(); ++id) place_copies(kv, id);
    sort_copies();
  }

  /// The copies `m` sends: padding sends none (checked), so its destinations.
  static std::size_t copies_in(const Metadata& m) {
    const auto destinations = m.dst_rank.flat();
    return static_cast<std::size_t>(std::count_if(destinations.begin(), destinations.end(), [](I d) { return d >= 0; }));
  }

  /// Empties `table` and makes room for n rows once PlanLimits allows them.
  template <class Row>
  void reserve_within_limits(std::vector<Row>& table, std::size_t n, const char* what) {
    check_footprint(limits_, {0, sat_mul(n, sizeof(Row))}, who_, concat(n, " ", what));
    table.clear();
    table.reserve(n);
  }

  void sort_copies() {
    std::sort(runs_.begin(), runs_.end(), [](const KeyRun& a, const KeyRun& b) { return std::tie(a.group, a.c0) < std::tie(b.group, b.c0); });
    run_begin_.assign(group_begin_.back() + 1, 0);
    for (const KeyRun& run : runs_) ++run_begin_[run.group + 1];
    for (std::size_t g = 0; g + 1 < run_begin_.size(); ++g) run_begin_[g + 1] += run_begin_[g];
    check_copies_apart();
  }

  void place_copies(const Metadata& kv, std::size_t id) {
    const std::size_t r = shards_.home[id], j = shards_.local[id];
    for_each_copy(kv, "kv_fwd", id, [&](std::size_t c, std::size_t d, I column) {
      if (head_parallel(id)) {
        fail(who_, ": kv_fwd.dst_rank[", r, "][", j, "][", c, "] (", shards_.name(id), ") = ", d, ", but documents[", shards_.doc[id],
             "] is head-parallel (expected -1, no KV copy)");
      }
      place_copy(id, c, d, column, [&] { return concat("copy ", c, " of ", shards_.name(id), " (kv_fwd.dst_offset[", r, "][", j, "][", c, "])"); });
    });
  }

  /// Checks shard id's seq_len in `m` (kv_fwd or hp_fwd, `name`), then calls
  /// f(c, destination, offset) for each copy c it sends (dst_rank -1: none).
  template <class F>
  void for_each_copy(const Metadata& m, const char* name, std::size_t id, F f) const {
    const std::size_t r = shards_.home[id], j = shards_.local[id], C = m.num_copies();
    if (m.seq_len(r, j) != shards_.len[id]) {
      fail(who_, ": ", name, ".seq_len[", r, "][", j, "] (", shards_.name(id), ") = ", m.seq_len(r, j), ", but the shard has ", shards_.len[id], " tokens");
    }
    const auto dst = m.dst_rank.row(r).subspan(j * C, C), offset = m.dst_offset.row(r).subspan(j * C, C);
    for (std::size_t c = 0; c < C; ++c) {
      if (dst[c] == -1) continue;
      if (dst[c] < -1 || dst[c] >= plan_.world_size) {
        fail(who_, ": ", name, ".dst_rank[", r, "][", j, "][", c, "] (", shards_.name(id), ") = ", dst[c], " is outside [0, ", W_, ") (-1: no copy)");
      }
      f(c, static_cast<std::size_t>(dst[c]), offset[c]);
    }
  }

  /// Copy c of KV shard id fills columns [column, column + len) of rank d's
  /// KV layout: inside one KV group, of a query shard of its own document.
  template <class Name>
  void place_copy(std::size_t id, std::size_t c, std::size_t d, I column, Name copy) {
    const auto cu = rows_[d].cu_kv;
    const I len = shards_.len[id];
    const std::size_t g = group_at(cu, column);
    if (g == none) fail(who_, ": ", copy(), " lands at rank ", d, " column ", column, ", outside its KV layout of ", cu.back(), " columns");
    if (column + len > cu[g + 1]) {
      fail(who_, ": ", copy(), " fills rank ", d, " columns [", column, ", ", column + len, "), which cross the end of KV group ", g, " at ", cu[g + 1]);
    }
    const std::size_t gid = group_begin_[d] + g, q = owner_[gid];
    if (shards_.doc[q] != shards_.doc[id]) {
      fail(who_, ": ", copy(), " lands in the KV group of rank ", d, " query shard ", g, ", which holds ", shards_.name(q), " (another document)");
    }
    runs_.push_back({gid, column - cu[g], column - cu[g] + len, id, c});
  }

  // ------------------------------------------ one rank: where its rows return

  /// Each home rank's shards in MLP-layout order with their starts: what
  /// q_rev and kv_rev name a shard by.
  void index_homes() {
    homes_.begin.assign(W_ + 1, 0);
    for (std::size_t r = 0; r < W_; ++r) homes_.begin[r + 1] = homes_.begin[r] + shards_.held[r];
    homes_.ids.resize(shards_.size());
    homes_.start.resize(shards_.size());
    for (std::size_t id = 0; id < shards_.size(); ++id) homes_.ids[homes_.begin[shards_.home[id]] + shards_.local[id]] = id;
    homes_.total.assign(W_, 0);
    for (std::size_t r = 0; r < W_; ++r) {
      for (std::size_t x = homes_.begin[r]; x < homes_.begin[r + 1]; ++x) {
        homes_.start[x] = homes_.total[r];
        homes_.total[r] += shards_.len[homes_.ids[x]];
      }
    }
  }

  /// Entry x of a reverse row (`name` of rank R) returns seq_len[x] tokens to
  /// slab c of its home's replica buffer at offset c * T + start: the shard
  /// that starts there with that length, and c. A row without copies has c = 0.
  std::pair<std::size_t, std::size_t> returned_shard(const RankMetadata& m, std::size_t x, const char* name, std::size_t R, bool copies) const {
    const I home = m.dst_rank[x], offset = m.dst_offset[x], len = m.seq_len[x];
    const auto at = [&] { return concat(name, "[", R, "][", x, "]"); };
    if (home < 0 || home >= plan_.world_size) fail(who_, ": ", at(), " has dst_rank ", home, ", outside [0, ", W_, ")");
    const auto h = static_cast<std::size_t>(home);
    const I total = homes_.total[h];
    const I c = total > 0 && offset >= 0 ? offset / total : -1;
    const auto first = homes_.start.begin() + static_cast<std::ptrdiff_t>(homes_.begin[h]), last = homes_.start.begin() + static_cast<std::ptrdiff_t>(homes_.begin[h + 1]);
    const auto found = std::lower_bound(first, last, c >= 0 ? offset - c * total : -1);
    const std::size_t id = found == last ? none : homes_.ids[static_cast<std::size_t>(found - homes_.start.begin())];
    if (c < 0 || (c > 0 && !copies) || id == none || *found != offset - c * total || shards_.len[id] != len) {
      fail(who_, ": ", at(), " returns ", len, " tokens to rank ", home, " offset ", offset, ", where no shard of ", len, " tokens starts",
           copies ? " (in any slab of its replica buffer)" : "");
    }
    return {id, static_cast<std::size_t>(c)};
  }

  /// A reverse row of rank R: one destination and one offset per entry.
  void check_return_row(const RankMetadata& m, const char* name, std::size_t R) const {
    if (m.rank != static_cast<I>(R)) fail(who_, ": ", name, ".rank = ", m.rank, ", expected ", R);
    if (m.dst_rank.size() != m.seq_len.size() || m.dst_offset.size() != m.seq_len.size()) {
      fail(who_, ": ", name, " has ", m.dst_rank.size(), " dst_rank, ", m.dst_offset.size(), " dst_offset and ", m.seq_len.size(),
           " seq_len entries; expected one of each per entry");
    }
  }

  /// q_rev sends rank R's query rows home in row order, entry by entry: each
  /// names the shard whose queries fill those rows. The shards must be the
  /// plan's shards that attend on R (their dst), so that each shard is
  /// attended on exactly one rank.
  void place_returned_queries(std::size_t R, const RankMetadata& q) {
    check_return_row(q, "q_rev", R);
    owner_.assign(group_begin_.back(), none);
    I row = 0;
    for (std::size_t x = 0; x < q.seq_len.size(); ++x) {
      const std::size_t id = returned_shard(q, x, "q_rev", R, false).first;
      claim(id, R, row, [&] { return concat("q_rev[", R, "][", x, "] (", shards_.name(id), ")"); });
      row += shards_.len[id];
    }
    check_query_shards_filled("q_rev returns none from there");
    for (std::size_t id = 0; id < shards_.size(); ++id) {
      if (head_parallel(id) && attended_[id]) {
        fail(who_, ": documents[", shards_.doc[id], "] is head-parallel, yet rank ", R, " attends the queries of ", shards_.name(id), " (q_rev)");
      }
      if (head_parallel(id)) continue;  // its dst is ignored (section 2f)
      const I dst = plan_.documents[shards_.doc[id]].shards[id - shards_.doc_begin[shards_.doc[id]]].dst;
      if ((dst == static_cast<I>(R)) == (attended_[id] != 0)) continue;
      fail(who_, ": ", shards_.name(id), ".dst = ", dst, attended_[id] ? ", but rank " : ", yet rank ", R, attended_[id] ? " attends" : " does not attend",
           " its queries (q_rev)");
    }
  }

  /// kv_rev sends rank R's KV columns home in column order, entry by entry:
  /// each names a KV shard and its copy.
  void place_returned_key_values(std::size_t R, const RankMetadata& kv) {
    check_return_row(kv, "kv_rev", R);
    reserve_within_limits(runs_, kv.seq_len.size(), "KV copies");
    I column = 0;
    for (std::size_t x = 0; x < kv.seq_len.size(); ++x) {
      const std::pair<std::size_t, std::size_t> copy = returned_shard(kv, x, "kv_rev", R, true);
      const std::size_t id = copy.first, c = copy.second;
      place_copy(id, c, R, column, [&] { return concat("copy ", c, " of ", shards_.name(id), " (kv_rev[", R, "][", x, "])"); });
      column += shards_.len[id];
    }
    sort_copies();
  }

  void check_copies_apart() const {
    for (std::size_t x = 1; x < runs_.size(); ++x) {
      const KeyRun &a = runs_[x - 1], &b = runs_[x];
      if (a.group != b.group || a.c1 <= b.c0) continue;
      const auto [d, g] = group_site(a.group);
      fail(who_, ": rank ", d, " KV group ", g, ": copy ", a.copy, " of ", shards_.name(a.shard), " fills columns [", a.c0, ", ", a.c1, ") and copy ", b.copy,
           " of ", shards_.name(b.shard), " fills [", b.c0, ", ", b.c1, "); they overlap");
    }
  }

  /// (rank, query shard on it) of a group id.
  std::pair<std::size_t, std::size_t> group_site(std::size_t gid) const {
    const auto d = static_cast<std::size_t>(std::upper_bound(group_begin_.begin(), group_begin_.end(), gid) - group_begin_.begin()) - 1;
    return {d, gid - group_begin_[d]};
  }

  // ---------------------------------------------------- entries into pieces

  std::string describe(const EntrySite& s) const {
    if (s.head_parallel) {
      const std::string entry =
          s.entry == none ? std::string("whole-document entry under hp_attn.mask") : concat("hp_attn.entries[", s.rank, "][", s.shard, "][", s.entry, "]");
      return concat("rank ", s.rank, " head-parallel document ", s.shard, " (hp_attn.documents[", s.rank, "][", s.shard, "]) ", entry);
    }
    const std::size_t q = owner_[group_begin_[s.rank] + s.shard];
    const std::string entry = s.entry == none ? std::string("implicit entry") : concat("entries[", s.entry, "]");
    return concat("rank ", s.rank, " query shard ", s.shard, " (", shards_.name(q), ") ", entry);
  }

  /// Counts the pieces walk(visit) visits, checks the budget, then keeps
  /// them sorted by cell.
  template <class Walk>
  void collect_pieces(Walk walk) {
    std::size_t count = 0;
    walk([&](const Piece&) { ++count; });
    check_footprint(limits_, {0, sat_mul(count, sizeof(Piece))}, who_, concat(count, " pieces of attention entries"));
    pieces_.clear();
    pieces_.reserve(count);
    walk([&](const Piece& p) { pieces_.push_back(p); });
    const auto order = [](const Piece& x) { return std::tie(x.query_shard, x.kv_shard, x.region.p0, x.region.k0, x.site.entry); };
    // By cell, then rows; the entry last, so the first failure reported does not depend on the sort.
    std::sort(pieces_.begin(), pieces_.end(), [&](const Piece& a, const Piece& b) { return order(a) < order(b); });
  }

  template <class Visit>
  void walk_entries(Visit&& visit) const {
    for (std::size_t d = 0; d < W_; ++d) {
      const LayoutRow& row = rows_[d];
      for (std::size_t g = 0; g < row.seqlens_q.size(); ++g) {
        const I lq = row.seqlens_q[g], lk = row.seqlens_kv[g];
        if (row.entries.empty()) {  // spec 2e: the 2d mask, bottom-right aligned in the group
          const Band band = shifted_within(layout_mask_.band(), lk - lq, layout_reach);
          const AttentionEntry whole{.q_start = 0, .q_len = lq, .kv_start = 0, .kv_len = lk, .band = band};
          split_entry(whole, {d, g, none, false}, visit);
          continue;
        }
        const auto& list = row.entries[g];
        for (std::size_t e = 0; e < list.size(); ++e) split_entry(list[e], {d, g, e, false}, visit);
      }
    }
  }

  /// Cuts one entry along its group's KV copies; a column it attends that no
  /// copy fills is an error.
  template <class Visit>
  void split_entry(const AttentionEntry& e, const EntrySite& site, Visit& visit) const {
    check_entry_bounds(e, rows_[site.rank].seqlens_q[site.shard], rows_[site.rank].seqlens_kv[site.shard], site);
    const std::size_t gid = group_begin_[site.rank] + site.shard;
    const auto end = runs_.begin() + static_cast<std::ptrdiff_t>(run_begin_[gid + 1]);
    auto run = std::partition_point(runs_.begin() + static_cast<std::ptrdiff_t>(run_begin_[gid]), end, [&](const KeyRun& x) { return x.c1 <= e.kv_start; });
    const I k_end = e.kv_start + e.kv_len;
    I at = e.kv_start;
    for (; run != end && run->c0 < k_end; ++run) {
      if (run->c0 > at) check_unfilled(e, at, run->c0, site);
      const Piece piece = piece_of(e, *run, std::max(at, run->c0), std::min(k_end, run->c1), site);
      if (band_meets(piece.region.p0, piece.region.p1, piece.region.k0, piece.region.k1, piece.region.band)) visit(piece);
      at = run->c1;
    }
    if (at < k_end) check_unfilled(e, at, k_end, site);
  }

  /// The entry's rows lie in [0, lq) (its query shard, or its document when
  /// head-parallel) and its columns in [0, lk) (KV group, or document).
  void check_entry_bounds(const AttentionEntry& e, I lq, I lk, const EntrySite& site) const {
    const char* rows = site.head_parallel ? "the document's " : "the query shard's ";
    const char* columns = site.head_parallel ? "the document's " : "the KV group's ";
    if (e.q_start < 0 || e.q_len < 0 || e.q_len > lq - e.q_start) {
      fail(who_, ": ", describe(site), " has q_start = ", e.q_start, ", q_len = ", e.q_len, ", rows outside ", rows, lq);
    }
    if (e.kv_start < 0 || e.kv_len < 0 || e.kv_len > lk - e.kv_start) {
      fail(who_, ": ", describe(site), " has kv_start = ", e.kv_start, ", kv_len = ", e.kv_len, ", columns outside ", columns, lk);
    }
  }

  void check_unfilled(const AttentionEntry& e, I c0, I c1, const EntrySite& site) const {
    if (!band_meets(e.q_start, e.q_start + e.q_len, c0, c1, e.band)) return;  // it attends nothing there
    fail(who_, ": ", describe(site), " attends columns [", c0, ", ", c1, ") of its KV group, which no KV copy fills");
  }

  /// Columns [c0, c1) of `run` under entry e, in document positions: row j
  /// is position row0 + j, column c is col0 + c, so the band moves by col0 - row0.
  Piece piece_of(const AttentionEntry& e, const KeyRun& run, I c0, I c1, const EntrySite& site) const {
    const std::size_t q = owner_[run.group];
    const I row0 = shards_.start[q], col0 = shards_.start[run.shard] - run.c0;
    const PairRegion region{row0 + e.q_start, row0 + e.q_start + e.q_len, col0 + c0, col0 + c1,
                            shifted_within(e.band, wide_int{col0} - row0, document_reach)};
    return {region, q, run.shard, site};
  }

  // ------------------------------------------------------ one document's cover

  std::span<const Piece> pieces_of(std::size_t doc) const {
    const auto below = [&](std::size_t id) {
      return std::partition_point(pieces_.begin(), pieces_.end(), [&](const Piece& p) { return p.query_shard < id; }) - pieces_.begin();
    };
    const auto first = below(shards_.doc_begin[doc]), last = below(shards_.doc_begin[doc + 1]);
    return std::span<const Piece>(pieces_).subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(last - first));
  }

  /// Cuts pieces, then checks the documents whose queries the layout holds.
  void check_cover() {
    collect_pieces([&](auto&& visit) { walk_entries(visit); });
    for (std::size_t doc = 0; doc < plan_.documents.size(); ++doc) {
      if (attended_rows(doc)) check_document(doc, pieces_of(doc));
    }
  }

  /// The document's query rows this layout holds, as maximal runs of
  /// attended shards in rows_here_; false when there are none.
  bool attended_rows(std::size_t doc) {
    rows_here_.clear();
    for (std::size_t id = shards_.doc_begin[doc]; id < shards_.doc_begin[doc + 1]; ++id) {
      if (!attended_[id]) continue;
      const I a = shards_.start[id], b = a + shards_.len[id];
      if (!rows_here_.empty() && rows_here_.back().second == a) rows_here_.back().second = b;
      else rows_here_.emplace_back(a, b);
    }
    return !rows_here_.empty();
  }

  /// The slices, or the plan's mask over the whole document, cut to the rows
  /// in rows_here_ (all of them when the layout holds every shard); sorted by p0.
  std::vector<AllowedRegion> allowed_regions(std::size_t doc) const {
    const auto& slices = plan_.documents[doc].slices;
    const I length = shards_.doc_length(doc);
    std::vector<AllowedRegion> out;
    const auto add = [&](const PairRegion& r, std::size_t slice) {
      auto run = std::partition_point(rows_here_.begin(), rows_here_.end(), [&](const auto& x) { return x.second <= r.p0; });
      for (; run != rows_here_.end() && run->first < r.p1; ++run) {
        out.push_back({{std::max(r.p0, run->first), std::min(r.p1, run->second), r.k0, r.k1, r.band}, slice});
      }
    };
    if (slices.empty()) add({0, length, 0, length, plan_.mask.band()}, none);
    for (std::size_t s = 0; s < slices.size(); ++s) {
      const AttentionSlice& x = slices[s];
      add({x.q_begin, x.q_end, x.k_begin, x.k_end, x.band()}, s);
    }
    std::stable_sort(out.begin(), out.end(), [](const AllowedRegion& a, const AllowedRegion& b) { return a.region.p0 < b.region.p0; });
    return out;
  }

  /// (a) to (c) for the pieces of one document over the rows in rows_here_;
  /// `scope` says where, when one document is checked on several ranks.
  void check_document(std::size_t doc, std::span<const Piece> pieces, const std::string& scope = {}) {
    const std::vector<AllowedRegion> allowed = allowed_regions(doc);
    check_slices_apart(doc, allowed);
    std::vector<wide_int> covered(allowed.size(), 0);  // pairs of each allowed region the pieces attend
    check_inside(doc, pieces, allowed, covered);
    check_apart(doc, pieces);
    check_complete(doc, pieces, allowed, covered, scope);
  }

  /// Slices share no pair (section 2e's validation; the counting in
  /// check_inside relies on it).
  void check_slices_apart(std::size_t doc, const std::vector<AllowedRegion>& allowed) {
    const auto region = [&](std::size_t x) -> const PairRegion& { return allowed[x].region; };
    for_each_meeting_pair(allowed.size(), region, [&](std::size_t x, std::size_t y) {
      const PairRegion shared = common_part(allowed[x].region, allowed[y].region);
      const I n = pairs_in(shared);
      if (n == 0) return;
      fail(who_, ": documents[", doc, "].slices[", std::min(allowed[x].slice, allowed[y].slice), "] and slices[", std::max(allowed[x].slice, allowed[y].slice),
           "] share ", count_of(n, "pair"), example_pair(shared, 1, [](I, I) { return true; }));
    }, active_);
  }

  /// (a): every piece's pairs lie in the allowed regions. Pieces come by
  /// query shard, so the regions sharing rows with it are kept as a sweep.
  void check_inside(std::size_t doc, std::span<const Piece> pieces, const std::vector<AllowedRegion>& allowed, std::vector<wide_int>& covered) {
    std::vector<std::size_t>& rows_meet = active_;
    rows_meet.clear();
    std::size_t next = 0;
    for (std::size_t x = 0; x < pieces.size(); ++x) {
      const std::size_t q = pieces[x].query_shard;
      if (x == 0 || q != pieces[x - 1].query_shard) {
        const I a = shards_.start[q], b = a + shards_.len[q];
        while (next < allowed.size() && allowed[next].region.p0 < b) rows_meet.push_back(next++);
        std::erase_if(rows_meet, [&](std::size_t s) { return allowed[s].region.p1 <= a; });
      }
      check_piece_inside(doc, pieces[x], allowed, rows_meet, covered);
    }
  }

  void check_piece_inside(std::size_t doc, const Piece& piece, const std::vector<AllowedRegion>& allowed, const std::vector<std::size_t>& candidates,
                          std::vector<wide_int>& covered) const {
    wide_int inside = 0;
    for (std::size_t s : candidates) {
      const I n = pairs_in(common_part(piece.region, allowed[s].region));
      inside += n;
      covered[s] += n;
    }
    const I own = pairs_in(piece.region);
    if (inside == own) return;
    const auto outside = [&](I p, I t) {
      return std::none_of(candidates.begin(), candidates.end(), [&](std::size_t s) { return allowed[s].region.holds(p, t); });
    };
    fail(who_, ": documents[", doc, "]: ", describe(piece.site), " attends ", count_of(own - inside, "pair"), " the mask does not allow",
         example_pair(piece.region, candidates.size(), outside));
  }

  /// (b): no two pieces of one cell share a pair.
  void check_apart(std::size_t doc, std::span<const Piece> pieces) {
    for (std::size_t first = 0, last = 0; first < pieces.size(); first = last) {
      while (last < pieces.size() && pieces[last].query_shard == pieces[first].query_shard && pieces[last].kv_shard == pieces[first].kv_shard) ++last;
      if (last - first < 2) continue;
      const auto cell = pieces.subspan(first, last - first);
      const auto region = [&](std::size_t x) -> const PairRegion& { return cell[x].region; };
      for_each_meeting_pair(cell.size(), region, [&](std::size_t x, std::size_t y) { report_shared(doc, cell[x], cell[y]); }, active_);
    }
  }

  void report_shared(std::size_t doc, const Piece& a, const Piece& b) const {
    const PairRegion shared = common_part(a.region, b.region);
    const I n = pairs_in(shared);
    if (n == 0) return;
    I p = 0, t = 0;
    find_pair(shared, [&](I q, I k) {
      p = q;
      t = k;
      return true;
    });
    fail(who_, ": documents[", doc, "]: query ", p, " key ", t, n > 1 ? concat(" and ", count_of(n - 1, "more pair")) : std::string{}, " attended twice, by ",
         describe(a.site), " and by ", describe(b.site));
  }

  /// (c): with (a) and (b), covered[x] counts the distinct pairs of region x
  /// attended, so any shortfall is a pair no entry attends.
  void check_complete(std::size_t doc, std::span<const Piece> pieces, const std::vector<AllowedRegion>& allowed, const std::vector<wide_int>& covered,
                      const std::string& scope) const {
    wide_int missing = 0;
    std::size_t first = none;  // the region with missing pairs and the lowest slice index
    for (std::size_t x = 0; x < allowed.size(); ++x) {
      const wide_int short_by = pairs_in(allowed[x].region) - covered[x];
      if (short_by <= 0) continue;
      missing += short_by;
      if (first == none || allowed[x].slice < allowed[first].slice) first = x;
    }
    if (missing == 0) return;
    const AllowedRegion& r = allowed[first];
    const auto unattended = [&](I p, I t) {
      return std::none_of(pieces.begin(), pieces.end(), [&](const Piece& piece) { return piece.region.holds(p, t); });
    };
    fail(who_, ": documents[", doc, "]: no entry attends ", count_of(missing, "allowed pair"), scope,
         r.slice == none ? std::string{} : concat(" (", static_cast<I>(pairs_in(r.region) - covered[first]), " in slices[", r.slice, "])"),
         example_pair(r.region, pieces.size(), unattended));
  }

  // --------------------------------------------- head-parallel documents (2f)

  /// u and how many head-parallel documents each group holds; false when
  /// the plan has none and hp_attn is absent (degree 0): nothing to check.
  bool read_head_parallel_plan(I degree) {
    if (degree == 0 && !has_head_parallel(plan_)) return false;
    const I u = plan_.head_parallel_degree == 0 ? plan_.world_size : plan_.head_parallel_degree;
    if (u < 1 || u > plan_.world_size || plan_.world_size % u != 0) {
      fail(who_, ": head_parallel_degree = ", plan_.head_parallel_degree, " must divide world_size = ", W_, " (0 means world_size)");
    }
    if (degree != u) fail(who_, ": hp_attn.degree = ", degree, ", but head_parallel_degree = ", plan_.head_parallel_degree, " makes groups of ", u, " ranks");
    u_ = static_cast<std::size_t>(u);
    hp_count_.assign(W_ / u_, 0);
    for (std::size_t i = 0; i < plan_.documents.size(); ++i) {
      if (!plan_.documents[i].head_parallel) continue;
      check_within_group(i);
      ++hp_count_[group_of(i)];
    }
    return true;
  }

  /// The group of ranks a head-parallel document lives in: its first shard's.
  std::size_t group_of(std::size_t doc) const { return static_cast<std::size_t>(plan_.documents[doc].shards.front().rank) / u_; }

  void check_within_group(std::size_t doc) const {
    const auto& shards = plan_.documents[doc].shards;
    for (std::size_t k = 1; k < shards.size(); ++k) {
      if (static_cast<std::size_t>(shards[k].rank) / u_ == group_of(doc)) continue;
      fail(who_, ": documents[", doc, "] is head-parallel but its shards live on ranks ", shards[0].rank, " (shards[0]) and ", shards[k].rank, " (shards[", k,
           "]), in different groups of ", u_, " ranks");
    }
  }

  void read_head_parallel_layout(const HeadParallelLayout& a) {
    read_rows(hp_rows_, "hp_attn",
              {{a.documents.size(), "documents"}, {a.seqlens.size(), "seqlens"}, {a.cu_seqlens.size(), "cu_seqlens"}, {a.group_rank.size(), "group_rank"}},
              a.entries, a.documents, "documents", "documents",
              [&](std::size_t d) { return HeadParallelRow{a.documents[d], a.seqlens[d], a.cu_seqlens[d], a.group_rank[d], {}}; });
    finish_head_parallel_layout(a.mask, 0, W_);
  }

  /// Rank R's row only; the other ranks are not checked.
  void read_rank_head_parallel_layout(std::size_t R, const RankHeadParallelLayout& a) {
    if (!a.entries.empty() && a.entries.size() != a.documents.size()) {
      fail(who_, ": hp_attn.entries has ", a.entries.size(), " documents, hp_attn.documents has ", a.documents.size());
    }
    hp_rows_.assign(W_, HeadParallelRow{{}, {}, no_rows, 0, {}});
    hp_rows_[R] = {a.documents, a.seqlens, a.cu_seqlens, a.group_rank, a.entries};
    finish_head_parallel_layout(a.mask, R, R + 1);
  }

  /// Rows [lo, hi): one length per document, their prefix sums, and
  /// group_rank = rank mod u (the rank's share of the heads).
  void finish_head_parallel_layout(const AttentionMask& mask, std::size_t lo, std::size_t hi) {
    for (std::size_t d = lo; d < hi; ++d) {
      const HeadParallelRow& row = hp_rows_[d];
      if (row.seqlens.size() != row.documents.size()) {
        fail(who_, ": hp_attn.seqlens[", d, "] has ", row.seqlens.size(), " documents, hp_attn.documents[", d, "] has ", row.documents.size());
      }
      check_prefix_sums(row.seqlens, row.cu, "hp_attn.seqlens", "hp_attn.cu_seqlens", "document", d);
      if (row.group_rank == static_cast<I>(d % u_)) continue;
      fail(who_, ": hp_attn.group_rank[", d, "] = ", row.group_rank, ", expected ", d % u_, " (rank mod ", u_, ")");
    }
    check_window(mask, "hp_attn.mask");
    hp_mask_ = mask;
  }

  /// hp_fwd: where each copy of each shard lands. A dispatched shard's copy
  /// reaches a rank whose hp_attn cannot list its document, so it fails there.
  void place_head_parallel_copies(const Metadata& hp) {
    check_rank_major(hp, "hp_fwd", true);
    check_padding(hp, "hp_fwd");
    reserve_within_limits(arrivals_, copies_in(hp), "head-parallel copies");
    for (std::size_t id = 0; id < shards_.size(); ++id) {
      for_each_copy(hp, "hp_fwd", id, [&](std::size_t c, std::size_t d, I row) { arrivals_.push_back({d, row, id, c}); });
    }
    returned_ = false;
    const auto order = [](const Arrival& a) { return std::tie(a.rank, a.row, a.shard, a.source); };
    std::sort(arrivals_.begin(), arrivals_.end(), [&](const Arrival& a, const Arrival& b) { return order(a) < order(b); });
  }

  /// hp_rev sends rank R's head-parallel layout home row by row, entry by
  /// entry, to slab R mod u of each home's replica buffer: each entry names
  /// the shard that fills those rows.
  void place_returned_head_parallel(std::size_t R, const RankMetadata& hp) {
    check_return_row(hp, "hp_rev", R);
    reserve_within_limits(arrivals_, hp.seq_len.size(), "head-parallel copies");
    I row = 0;
    for (std::size_t x = 0; x < hp.seq_len.size(); ++x) {
      const auto [id, slab] = returned_shard(hp, x, "hp_rev", R, true);
      if (slab != R % u_) {
        fail(who_, ": hp_rev[", R, "][", x, "] (", shards_.name(id), ") returns to slab ", slab, " of rank ", shards_.home[id],
             "'s replica buffer, expected slab ", R % u_, " (rank ", R, " mod ", u_, ")");
      }
      arrivals_.push_back({R, row, id, x});
      row += shards_.len[id];
    }
    returned_ = true;
  }

  std::string arrival_name(const Arrival& a) const {
    const std::size_t id = a.shard;
    if (returned_) return concat("hp_rev[", a.rank, "][", a.source, "] (", shards_.name(id), ")");
    return concat("copy ", a.source, " of ", shards_.name(id), " (hp_fwd.dst_offset[", shards_.home[id], "][", shards_.local[id], "][", a.source, "])");
  }

  /// Ranks [lo, hi): what each one's hp_attn lists, what reaches its layout,
  /// and the cover of each document it lists.
  void check_head_parallel(std::size_t lo, std::size_t hi) {
    listed_on_.assign(plan_.documents.size(), none);
    slot_.assign(plan_.documents.size(), 0);
    arrived_on_.assign(shards_.size(), none);
    for (std::size_t d = lo; d < hi; ++d) {
      check_listing(d);
      check_arrivals(d);
      for (std::size_t i = 0; i < hp_rows_[d].documents.size(); ++i) check_head_parallel_document(d, i);
    }
  }

  /// Rank d's hp_attn lists head-parallel documents of its group, each once
  /// and at its full length, and all of them.
  void check_listing(std::size_t d) {
    const HeadParallelRow& row = hp_rows_[d];
    const std::size_t group = d / u_;
    for (std::size_t i = 0; i < row.documents.size(); ++i) {
      const I doc = row.documents[i];
      const auto at = [&] { return concat("hp_attn.documents[", d, "][", i, "] = ", doc); };
      if (doc < 0 || doc >= static_cast<I>(plan_.documents.size())) fail(who_, ": ", at(), " is outside [0, ", plan_.documents.size(), ")");
      const auto x = static_cast<std::size_t>(doc);
      if (!plan_.documents[x].head_parallel) fail(who_, ": ", at(), ", but documents[", x, "] is not head-parallel");
      if (group_of(x) != group) {
        const std::size_t first = group_of(x) * u_;
        fail(who_, ": ", at(), ", but documents[", x, "] is head-parallel on ranks [", first, ", ", first + u_, "), a group without rank ", d);
      }
      if (listed_on_[x] == d) fail(who_, ": ", at(), " lists documents[", x, "] a second time (also hp_attn.documents[", d, "][", slot_[x], "])");
      if (row.seqlens[i] != shards_.doc_length(x)) {
        fail(who_, ": hp_attn.seqlens[", d, "][", i, "] = ", row.seqlens[i], ", but documents[", x, "] has ", shards_.doc_length(x),
             " tokens (it arrives whole)");
      }
      listed_on_[x] = d;
      slot_[x] = i;
    }
    if (row.documents.size() == hp_count_[group]) return;  // each listed one is distinct and of the group
    for (std::size_t x = 0; x < plan_.documents.size(); ++x) {
      if (!plan_.documents[x].head_parallel || group_of(x) != group || listed_on_[x] == d) continue;
      fail(who_, ": hp_attn.documents[", d, "] lacks documents[", x, "], which is head-parallel on ranks [", group * u_, ", ", (group + 1) * u_, ")");
    }
  }

  /// What hp_fwd or hp_rev brings to rank d: each shard of each document
  /// listed there exactly once, at the document's start in the layout plus
  /// the shard's offset in the document; nothing else.
  void check_arrivals(std::size_t d) {
    const HeadParallelRow& row = hp_rows_[d];
    const auto first = std::partition_point(arrivals_.begin(), arrivals_.end(), [&](const Arrival& a) { return a.rank < d; });
    for (auto a = first; a != arrivals_.end() && a->rank == d; ++a) {
      const std::size_t id = a->shard, doc = shards_.doc[id];
      if (listed_on_[doc] != d) fail(who_, ": ", arrival_name(*a), " reaches rank ", d, ", whose hp_attn.documents does not list documents[", doc, "]");
      const I start = row.cu[slot_[doc]], want = start + shards_.start[id];
      if (a->row != want) {
        fail(who_, ": ", arrival_name(*a), " lands at rank ", d, " head-parallel row ", a->row, ", expected ", want, " (documents[", doc, "] starts at ", start,
             " there, the shard at ", shards_.start[id], " in it)");
      }
      if (arrived_on_[id] == d) fail(who_, ": ", arrival_name(*a), " brings ", shards_.name(id), " to rank ", d, " a second time");
      arrived_on_[id] = d;
    }
    for (std::size_t i = 0; i < row.documents.size(); ++i) {
      const auto doc = static_cast<std::size_t>(row.documents[i]);
      for (std::size_t id = shards_.doc_begin[doc]; id < shards_.doc_begin[doc + 1]; ++id) {
        if (arrived_on_[id] == d) continue;
        fail(who_, ": ", shards_.name(id), " never reaches rank ", d, " (", returned_ ? "hp_rev" : "hp_fwd", "), whose hp_attn.documents[", d, "][", i,
             "] lists its document");
      }
    }
  }

  /// Document i of rank d's hp_attn: its entries, or the whole-document
  /// entry under hp_attn.mask, attend its allowed pairs exactly once.
  void check_head_parallel_document(std::size_t d, std::size_t i) {
    const auto doc = static_cast<std::size_t>(hp_rows_[d].documents[i]);
    rows_here_.assign(1, {0, shards_.doc_length(doc)});
    collect_pieces([&](auto&& visit) { walk_head_parallel_entries(d, i, visit); });
    check_document(doc, pieces_, concat(" on rank ", d, " (hp_attn.documents[", d, "][", i, "])"));
  }

  template <class Visit>
  void walk_head_parallel_entries(std::size_t d, std::size_t i, Visit& visit) const {
    const HeadParallelRow& row = hp_rows_[d];
    if (row.entries.empty()) {  // queries and keys are the same tokens, so the mask's band applies unshifted
      const AttentionEntry whole{.q_start = 0, .q_len = row.seqlens[i], .kv_start = 0, .kv_len = row.seqlens[i], .band = hp_mask_.band()};
      split_head_parallel_entry(whole, {d, i, none, true}, visit);
      return;
    }
    for (std::size_t e = 0; e < row.entries[i].size(); ++e) split_head_parallel_entry(row.entries[i][e], {d, i, e, true}, visit);
  }

  /// Cuts an entry of a head-parallel document (rows and columns are its
  /// positions) at its shards' rows, so that pieces come by query shard as
  /// check_inside reads them; all of a query shard's columns form one cell.
  template <class Visit>
  void split_head_parallel_entry(const AttentionEntry& e, const EntrySite& site, Visit& visit) const {
    const auto doc = static_cast<std::size_t>(hp_rows_[site.rank].documents[site.shard]);
    const I length = shards_.doc_length(doc);
    check_entry_bounds(e, length, length, site);
    const I q_end = e.q_start + e.q_len;
    const Band band = shifted_within(e.band, 0, document_reach);
    const auto starts = std::span<const I>(shards_.start).subspan(shards_.doc_begin[doc], shards_.doc_begin[doc + 1] - shards_.doc_begin[doc]);
    // From the shard holding row q_start (the first starts at 0 <= q_start).
    for (auto k = std::upper_bound(starts.begin(), starts.end(), e.q_start) - 1; k != starts.end() && *k < q_end; ++k) {
      const std::size_t id = shards_.doc_begin[doc] + static_cast<std::size_t>(k - starts.begin());
      const PairRegion region{std::max(e.q_start, *k), std::min(q_end, *k + shards_.len[id]), e.kv_start, e.kv_start + e.kv_len, band};
      if (band_meets(region.p0, region.p1, region.k0, region.k1, region.band)) visit(Piece{region, id, shards_.doc_begin[doc], site});
    }
  }
};

}  // namespace detail::coverage

/// Checks that the attention layout of `metadata` attends every allowed
/// (query, key) pair of every document of `plan` exactly once and no other
/// pair (docs/plan-format.md, section 2e). Allowed: a document's slices, or
/// the plan's mask over a document without slices. Attended: each query
/// shard's entries (attn.entries, or the implicit [0, lq) x [0, lk) entry
/// with attn.mask bottom-right aligned when attn.entries is empty), read
/// through where q_fwd put the shard's queries and kv_fwd its KV copies.
/// Reads q_fwd, kv_fwd and attn only. Throws invalid_input naming the first
/// failure: a malformed plan or layout (the field and index); a shard's
/// queries not filling exactly one query shard; a KV copy crossing a KV
/// group, landing in another document's group or overlapping another copy;
/// an entry outside its query shard or attending columns no copy fills; a
/// pair attended twice (the document, one pair, both entries: rank, query
/// shard on it, entry index); a pair the mask does not allow (the entry);
/// allowed pairs never attended (the document, the count, and one pair when
/// cheap). Head-parallel documents (section 2f) must have no destination in
/// q_fwd and kv_fwd; on every rank of its group, hp_attn lists each one once
/// at its full length (and no other rank lists it), hp_fwd puts every shard
/// at the document's start there plus the shard's offset, and its entries
/// (hp_attn.entries, or the whole document under hp_attn.mask) attend its
/// allowed pairs exactly once; reads hp_fwd and hp_attn for them, and
/// messages name the rank and hp_attn.documents[rank][i]. Handles documents
/// up to max_verified_document_tokens; the KV copies, head-parallel copies
/// and pieces it tabulates are checked against `limits` before they are
/// allocated. Cost: see the top of this file; a head-parallel document
/// costs as much again on each rank of its group.
inline void verify_coverage(const QkvDocumentsPlan& plan, const QkvMetadata& metadata, const PlanLimits& limits = {}) {
  detail::coverage::CoverageCheck(plan, limits, "verify_coverage").run(metadata);
}

/// One rank's share of the same check, for plans too large to hold whole:
/// that rank `rank`'s attention layout (its share from plan_qkv_for_rank, or
/// get_slice of the global metadata) attends every allowed pair of the query
/// rows it receives exactly once and no other pair. Which shard fills which
/// rows and columns is read from where q_rev and kv_rev send them home (the
/// shard starting there on its home rank, and for kv_rev the copy's slab of
/// the replica buffer); the rank must receive exactly the shards whose dst
/// is `rank`. Each shard's queries attend on exactly one rank, its dst, so
/// when every rank's share passes, the whole plan is an exact cover. Reads
/// q_rev, kv_rev and attn of `metadata`, not q_fwd or kv_fwd: it does not
/// check that senders put their tokens where those rows expect them.
/// Head-parallel documents alike: the rank's hp_attn must list exactly
/// those of its group, and hp_rev, read row by row, must return each of
/// their shards from the rows the document's place there gives it, to slab
/// rank mod u of its home's replica buffer; their entries are checked as
/// verify_coverage does. hp_fwd is not read.
/// Throws invalid_input like verify_coverage, naming rows as q_rev[rank][x]
/// and kv_rev[rank][x]. Cost: O(N + W) to index the plan's shards, then as
/// verify_coverage for the rank's query shards, copies and entries.
inline void verify_coverage_for_rank(const QkvDocumentsPlan& plan, std::int64_t rank, const RankQkvMetadata& metadata, const PlanLimits& limits = {}) {
  detail::coverage::CoverageCheck(plan, limits, "verify_coverage_for_rank").run(rank, metadata);
}

/// The per-rank plan form: checks to_documents(plan).
inline void verify_coverage_for_rank(const QkvPlan& plan, std::int64_t rank, const RankQkvMetadata& metadata, const PlanLimits& limits = {}) {
  if (plan.world_size > 0 && plan.ranks.size() != static_cast<std::size_t>(plan.world_size)) {
    detail::fail("verify_coverage_for_rank: ranks has ", plan.ranks.size(), " entries, but world_size = ", plan.world_size);
  }
  verify_coverage_for_rank(to_documents(plan), rank, metadata, limits);
}

/// The per-rank form: verifies to_documents(plan), whose document order
/// (rank 0's documents, then rank 1's, ...) names documents in messages.
inline void verify_coverage(const QkvPlan& plan, const QkvMetadata& metadata, const PlanLimits& limits = {}) {
  if (plan.world_size > 0 && plan.ranks.size() != static_cast<std::size_t>(plan.world_size)) {
    detail::fail("verify_coverage: ranks has ", plan.ranks.size(), " entries, but world_size = ", plan.world_size);
  }
  verify_coverage(to_documents(plan), metadata, limits);
}

}  // namespace cpdispatch
