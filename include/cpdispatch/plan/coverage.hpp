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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// The longest document verify_coverage handles: 2^31 tokens, so that any
/// count of its pairs fits 64 bits.
inline constexpr std::int64_t max_verified_document_tokens = std::int64_t{1} << 31;

/// The most tokens one rank's query or KV layout may hold for verify_coverage
/// (2^62), so that column - row differences and their shifts stay exact.
inline constexpr std::int64_t max_verified_layout_tokens = std::int64_t{1} << 62;

namespace detail::coverage {

using I = std::int64_t;

inline constexpr const char* who = "verify_coverage";
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

/// Where an entry sits: destination rank, query shard on that rank, entry
/// index (none for the implicit entry of a layout without attn.entries).
struct EntrySite {
  std::size_t rank = 0, shard = 0, entry = 0;
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

/// One verification: reads the layout, the plan and the metadata into
/// tables, cuts entries into pieces, then checks each document's cover.
class CoverageCheck {
 public:
  CoverageCheck(const QkvDocumentsPlan& plan, const QkvMetadata& metadata, const PlanLimits& limits)
      : plan_(plan), m_(metadata), limits_(limits) {}

  void run() {
    read_layout();
    read_plan();
    place_queries();
    place_key_values();
    collect_pieces();
    for (std::size_t doc = 0; doc < plan_.documents.size(); ++doc) check_document(doc);
  }

 private:
  const QkvDocumentsPlan& plan_;
  const QkvMetadata& m_;
  const PlanLimits& limits_;
  std::size_t W_ = 0;
  std::vector<std::size_t> group_begin_;  // [W + 1]: query shards of rank d are group ids group_begin_[d]..
  ShardPlaces shards_;
  std::vector<std::size_t> owner_;        // [G]: the shard whose queries fill each query shard
  std::vector<KeyRun> runs_;              // sorted by (group, c0)
  std::vector<std::size_t> run_begin_;    // [G + 1]
  std::vector<Piece> pieces_;             // sorted by (cell, p0, k0)
  std::vector<std::size_t> active_;       // sweep storage

  // ------------------------------------------------------------ the layout

  void read_layout() {
    const AttentionLayout& a = m_.attn;
    if (plan_.world_size <= 0) fail(who, ": world_size = ", plan_.world_size, " must be at least 1");
    W_ = static_cast<std::size_t>(plan_.world_size);
    // Compared with the layout before anything of size W is allocated.
    for (const auto& [rows, name] : {std::pair{a.seqlens_q.size(), "seqlens_q"}, std::pair{a.seqlens_kv.size(), "seqlens_kv"},
                                     std::pair{a.cu_seqlens_q.size(), "cu_seqlens_q"}, std::pair{a.cu_seqlens_kv.size(), "cu_seqlens_kv"}}) {
      if (rows != W_) fail(who, ": attn.", name, " has ", rows, " ranks, but world_size = ", W_);
    }
    group_begin_.assign(1, 0);
    for (std::size_t d = 0; d < W_; ++d) {
      const std::size_t n = a.seqlens_q[d].size();
      if (a.seqlens_kv[d].size() != n) fail(who, ": attn.seqlens_kv[", d, "] has ", a.seqlens_kv[d].size(), " query shards, attn.seqlens_q[", d, "] has ", n);
      check_prefix_sums(a.seqlens_q[d], a.cu_seqlens_q[d], "q", d);
      check_prefix_sums(a.seqlens_kv[d], a.cu_seqlens_kv[d], "kv", d);
      group_begin_.push_back(group_begin_.back() + n);
    }
    check_entry_lists();
    check_window(a.mask, "attn.mask");
  }

  /// cu = exclusive prefix sums of len with the total last; every value stays
  /// within [0, max_verified_layout_tokens].
  static void check_prefix_sums(const std::vector<I>& len, const std::vector<I>& cu, const char* side, std::size_t d) {
    if (cu.size() != len.size() + 1) {
      fail(who, ": attn.cu_seqlens_", side, "[", d, "] has ", cu.size(), " entries, expected ", len.size() + 1, " (a leading 0, then one per query shard)");
    }
    if (cu[0] != 0) fail(who, ": attn.cu_seqlens_", side, "[", d, "][0] = ", cu[0], ", expected 0");
    for (std::size_t g = 0; g < len.size(); ++g) {
      if (len[g] < 0 || len[g] > max_verified_layout_tokens - cu[g]) {
        fail(who, ": attn.seqlens_", side, "[", d, "][", g, "] = ", len[g], " is negative or takes rank ", d, "'s layout past ",
             max_verified_layout_tokens, " tokens");
      }
      if (cu[g + 1] != cu[g] + len[g]) {
        fail(who, ": attn.cu_seqlens_", side, "[", d, "][", g + 1, "] = ", cu[g + 1], ", expected ", cu[g] + len[g], " (the prefix sum of seqlens_",
             side, ")");
      }
    }
  }

  /// attn.entries: empty (every query shard has its implicit entry) or one
  /// list per query shard of every rank.
  void check_entry_lists() const {
    const auto& entries = m_.attn.entries;
    if (entries.empty()) return;
    if (entries.size() != W_) fail(who, ": attn.entries has ", entries.size(), " ranks, but world_size = ", W_);
    for (std::size_t d = 0; d < W_; ++d) {
      if (entries[d].size() != m_.attn.seqlens_q[d].size()) {
        fail(who, ": attn.entries[", d, "] has ", entries[d].size(), " query shards, attn.seqlens_q[", d, "] has ", m_.attn.seqlens_q[d].size());
      }
    }
  }

  /// A window below 1 has no band (AttentionMask::band would overflow).
  static void check_window(const AttentionMask& mask, const char* name) {
    if (mask.type == MaskType::sliding_window && mask.window < 1) fail(who, ": ", name, ".window = ", mask.window, " must be at least 1");
  }

  // -------------------------------------------------------------- the plan

  void read_plan() {
    check_window(plan_.mask, "mask");
    shards_.held.assign(W_, 0);
    for (std::size_t i = 0; i < plan_.documents.size(); ++i) {
      const PackedDocument& doc = plan_.documents[i];
      if (doc.shards.empty()) fail(who, ": documents[", i, "] has no shards");
      I at = 0;
      for (std::size_t k = 0; k < doc.shards.size(); ++k) at = add_shard(i, k, at);
      shards_.doc_begin.push_back(shards_.size());
      check_slice_bounds(i, at);
    }
  }

  /// Records shard k of document i starting at position `at`; returns its end.
  I add_shard(std::size_t i, std::size_t k, I at) {
    const DocumentShard& s = plan_.documents[i].shards[k];
    if (s.rank < 0 || s.rank >= plan_.world_size) fail(who, ": documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", W_, ")");
    if (s.len <= 0) fail(who, ": documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
    if (s.len > max_verified_document_tokens - at) {
      fail(who, ": documents[", i, "] is longer than ", max_verified_document_tokens, " tokens (its pair counts would leave 64 bits)");
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
      fail(who, ": documents[", i, "].slices[", s, "] (q [", x.q_begin, ", ", x.q_end, "), k [", x.k_begin, ", ", x.k_end,
           ")) is empty or leaves the document's ", length, " positions");
    }
  }

  // ----------------------------------------------------- where things went

  /// The (non-empty) group of `cu` whose columns hold `column`, or none.
  static std::size_t group_at(const std::vector<I>& cu, I column) {
    if (column < 0 || column >= cu.back()) return none;
    return static_cast<std::size_t>(std::upper_bound(cu.begin(), cu.end(), column) - cu.begin()) - 1;
  }

  /// Rank-major metadata: [W][S] (or [W][S][C] where copies are allowed),
  /// room for every rank's shards, seq_len [W][S].
  void check_rank_major(const Metadata& m, const char* name, bool copies) const {
    const bool dims = m.dst_rank.dim() == 2 || (copies && m.dst_rank.dim() == 3);
    if (!dims || m.dst_rank.size(0) != W_) {
      fail(who, ": ", name, ".dst_rank has shape ", shape_str(m.dst_rank.shape()), ", expected [", W_, ", S]", copies ? " or [W, S, C]" : "");
    }
    const std::size_t S = m.dst_rank.size(1);
    if (m.dst_offset.shape() != m.dst_rank.shape()) {
      fail(who, ": ", name, ".dst_offset has shape ", shape_str(m.dst_offset.shape()), ", but dst_rank has ", shape_str(m.dst_rank.shape()));
    }
    if (m.seq_len.dim() != 2 || m.seq_len.size(0) != W_ || m.seq_len.size(1) != S) {
      fail(who, ": ", name, ".seq_len has shape ", shape_str(m.seq_len.shape()), ", expected [", W_, ", ", S, "]");
    }
    for (std::size_t r = 0; r < W_; ++r) {
      if (shards_.held[r] > S) fail(who, ": ", name, " has room for ", S, " shards a rank, but rank ", r, " holds ", shards_.held[r]);
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
        fail(who, ": ", name, ".dst_rank[", r, "][", x / C, "]", C > 1 ? index_str(x % C) : "", " = ", row[x], " sends a padding entry (rank ", r,
             " holds ", shards_.held[r], " shards)");
      }
    }
  }

  void place_queries() {
    check_rank_major(m_.q_fwd, "q_fwd", false);
    check_padding(m_.q_fwd, "q_fwd");
    owner_.assign(group_begin_.back(), none);
    for (std::size_t id = 0; id < shards_.size(); ++id) claim_query_shard(id);
    for (std::size_t d = 0; d < W_; ++d) {
      for (std::size_t g = 0; g < m_.attn.seqlens_q[d].size(); ++g) {
        if (owner_[group_begin_[d] + g] == none) fail(who, ": rank ", d, " query shard ", g, " receives no document shard's queries (q_fwd sends none there)");
      }
    }
  }

  /// The query shard of the layout that shard `id`'s queries fill, exactly.
  void claim_query_shard(std::size_t id) {
    const Metadata& q = m_.q_fwd;
    const std::size_t r = shards_.home[id], j = shards_.local[id];
    const I d = q.dst_rank(r, j), row = q.dst_offset(r, j), len = q.seq_len(r, j);
    const auto at = [&] { return concat("q_fwd[", r, "][", j, "] (", shards_.name(id), ")"); };
    if (len != shards_.len[id]) fail(who, ": ", at(), " has seq_len ", len, ", but the shard has ", shards_.len[id], " tokens");
    if (d < 0 || d >= plan_.world_size) fail(who, ": ", at(), " has dst_rank ", d, ", outside [0, ", W_, ")");
    const auto du = static_cast<std::size_t>(d);
    const std::size_t g = group_at(m_.attn.cu_seqlens_q[du], row);
    if (g == none || m_.attn.cu_seqlens_q[du][g] != row || m_.attn.seqlens_q[du][g] != len) {
      fail(who, ": ", at(), " lands at rank ", d, " row ", row, ", which does not start a query shard of ", len, " rows there (attn.cu_seqlens_q)");
    }
    std::size_t& claimed = owner_[group_begin_[du] + g];
    if (claimed != none) fail(who, ": rank ", d, " query shard ", g, " receives the queries of both ", shards_.name(claimed), " and ", shards_.name(id));
    claimed = id;
  }

  void place_key_values() {
    check_rank_major(m_.kv_fwd, "kv_fwd", true);
    check_padding(m_.kv_fwd, "kv_fwd");
    const auto destinations = m_.kv_fwd.dst_rank.flat();  // padding sends nothing (checked), so these are the copies
    const auto copies = static_cast<std::size_t>(std::count_if(destinations.begin(), destinations.end(), [](I d) { return d >= 0; }));
    check_footprint(limits_, {0, sat_mul(copies, sizeof(KeyRun))}, who, concat(copies, " KV copies"));
    runs_.reserve(copies);
    for (std::size_t id = 0; id < shards_.size(); ++id) place_copies(id);
    std::sort(runs_.begin(), runs_.end(), [](const KeyRun& a, const KeyRun& b) { return std::tie(a.group, a.c0) < std::tie(b.group, b.c0); });
    run_begin_.assign(group_begin_.back() + 1, 0);
    for (const KeyRun& run : runs_) ++run_begin_[run.group + 1];
    for (std::size_t g = 0; g + 1 < run_begin_.size(); ++g) run_begin_[g + 1] += run_begin_[g];
    check_copies_apart();
  }

  void place_copies(std::size_t id) {
    const Metadata& kv = m_.kv_fwd;
    const std::size_t r = shards_.home[id], j = shards_.local[id], C = kv.num_copies();
    if (kv.seq_len(r, j) != shards_.len[id]) {
      fail(who, ": kv_fwd.seq_len[", r, "][", j, "] (", shards_.name(id), ") = ", kv.seq_len(r, j), ", but the shard has ", shards_.len[id], " tokens");
    }
    const auto dst = kv.dst_rank.row(r).subspan(j * C, C), column = kv.dst_offset.row(r).subspan(j * C, C);
    for (std::size_t c = 0; c < C; ++c) {
      if (dst[c] == -1) continue;
      if (dst[c] < -1 || dst[c] >= plan_.world_size) {
        fail(who, ": kv_fwd.dst_rank[", r, "][", j, "][", c, "] (", shards_.name(id), ") = ", dst[c], " is outside [0, ", W_, ") (-1: no copy)");
      }
      place_copy(id, c, static_cast<std::size_t>(dst[c]), column[c]);
    }
  }

  /// Copy c of KV shard id fills columns [column, column + len) of rank d's
  /// KV layout: inside one KV group, of a query shard of its own document.
  void place_copy(std::size_t id, std::size_t c, std::size_t d, I column) {
    const auto& cu = m_.attn.cu_seqlens_kv[d];
    const I len = shards_.len[id];
    const std::size_t g = group_at(cu, column);
    const auto copy = [&] {
      return concat("copy ", c, " of ", shards_.name(id), " (kv_fwd.dst_offset[", shards_.home[id], "][", shards_.local[id], "][", c, "])");
    };
    if (g == none) fail(who, ": ", copy(), " lands at rank ", d, " column ", column, ", outside its KV layout of ", cu.back(), " columns");
    if (column + len > cu[g + 1]) {
      fail(who, ": ", copy(), " fills rank ", d, " columns [", column, ", ", column + len, "), which cross the end of KV group ", g, " at ", cu[g + 1]);
    }
    const std::size_t gid = group_begin_[d] + g, q = owner_[gid];
    if (shards_.doc[q] != shards_.doc[id]) {
      fail(who, ": ", copy(), " lands in the KV group of rank ", d, " query shard ", g, ", which holds ", shards_.name(q), " (another document)");
    }
    runs_.push_back({gid, column - cu[g], column - cu[g] + len, id, c});
  }

  void check_copies_apart() const {
    for (std::size_t x = 1; x < runs_.size(); ++x) {
      const KeyRun &a = runs_[x - 1], &b = runs_[x];
      if (a.group != b.group || a.c1 <= b.c0) continue;
      const auto [d, g] = group_site(a.group);
      fail(who, ": rank ", d, " KV group ", g, ": copy ", a.copy, " of ", shards_.name(a.shard), " fills columns [", a.c0, ", ", a.c1, ") and copy ", b.copy,
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
    const std::size_t q = owner_[group_begin_[s.rank] + s.shard];
    const std::string entry = s.entry == none ? std::string("implicit entry") : concat("entries[", s.entry, "]");
    return concat("rank ", s.rank, " query shard ", s.shard, " (", shards_.name(q), ") ", entry);
  }

  /// Counts the pieces, checks the budget, then keeps them sorted by cell.
  void collect_pieces() {
    std::size_t count = 0;
    walk_entries([&](const Piece&) { ++count; });
    check_footprint(limits_, {0, sat_mul(count, sizeof(Piece))}, who, concat(count, " pieces of attention entries"));
    pieces_.reserve(count);
    walk_entries([&](const Piece& p) { pieces_.push_back(p); });
    const auto order = [](const Piece& x) { return std::tie(x.query_shard, x.kv_shard, x.region.p0, x.region.k0, x.site.entry); };
    // By cell, then rows; the entry last, so the first failure reported does not depend on the sort.
    std::sort(pieces_.begin(), pieces_.end(), [&](const Piece& a, const Piece& b) { return order(a) < order(b); });
  }

  template <class Visit>
  void walk_entries(Visit&& visit) const {
    for (std::size_t d = 0; d < W_; ++d) {
      for (std::size_t g = 0; g < m_.attn.seqlens_q[d].size(); ++g) {
        const I lq = m_.attn.seqlens_q[d][g], lk = m_.attn.seqlens_kv[d][g];
        if (m_.attn.entries.empty()) {  // spec 2e: the 2d mask, bottom-right aligned in the group
          const Band band = shifted_within(m_.attn.mask.band(), lk - lq, layout_reach);
          const AttentionEntry whole{.q_start = 0, .q_len = lq, .kv_start = 0, .kv_len = lk, .band = band};
          split_entry(whole, {d, g, none}, visit);
          continue;
        }
        const auto& list = m_.attn.entries[d][g];
        for (std::size_t e = 0; e < list.size(); ++e) split_entry(list[e], {d, g, e}, visit);
      }
    }
  }

  /// Cuts one entry along its group's KV copies; a column it attends that no
  /// copy fills is an error.
  template <class Visit>
  void split_entry(const AttentionEntry& e, const EntrySite& site, Visit& visit) const {
    check_entry_bounds(e, site);
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

  void check_entry_bounds(const AttentionEntry& e, const EntrySite& site) const {
    const I lq = m_.attn.seqlens_q[site.rank][site.shard], lk = m_.attn.seqlens_kv[site.rank][site.shard];
    if (e.q_start < 0 || e.q_len < 0 || e.q_len > lq - e.q_start) {
      fail(who, ": ", describe(site), " has q_start = ", e.q_start, ", q_len = ", e.q_len, ", rows outside the query shard's ", lq);
    }
    if (e.kv_start < 0 || e.kv_len < 0 || e.kv_len > lk - e.kv_start) {
      fail(who, ": ", describe(site), " has kv_start = ", e.kv_start, ", kv_len = ", e.kv_len, ", columns outside the KV group's ", lk);
    }
  }

  void check_unfilled(const AttentionEntry& e, I c0, I c1, const EntrySite& site) const {
    if (!band_meets(e.q_start, e.q_start + e.q_len, c0, c1, e.band)) return;  // it attends nothing there
    fail(who, ": ", describe(site), " attends columns [", c0, ", ", c1, ") of its KV group, which no KV copy fills");
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

  /// The slices, or the plan's mask over the whole document; sorted by p0.
  std::vector<AllowedRegion> allowed_regions(std::size_t doc) const {
    const auto& slices = plan_.documents[doc].slices;
    const I length = shards_.doc_length(doc);
    std::vector<AllowedRegion> out;
    if (slices.empty()) out.push_back({{0, length, 0, length, plan_.mask.band()}, none});
    for (std::size_t s = 0; s < slices.size(); ++s) {
      const AttentionSlice& x = slices[s];
      out.push_back({{x.q_begin, x.q_end, x.k_begin, x.k_end, x.band()}, s});
    }
    std::stable_sort(out.begin(), out.end(), [](const AllowedRegion& a, const AllowedRegion& b) { return a.region.p0 < b.region.p0; });
    return out;
  }

  void check_document(std::size_t doc) {
    const std::span<const Piece> pieces = pieces_of(doc);
    const std::vector<AllowedRegion> allowed = allowed_regions(doc);
    check_slices_apart(doc, allowed);
    std::vector<wide_int> covered(allowed.size(), 0);  // pairs of each allowed region the pieces attend
    check_inside(doc, pieces, allowed, covered);
    check_apart(doc, pieces);
    check_complete(doc, pieces, allowed, covered);
  }

  /// Slices share no pair (section 2e's validation; the counting in
  /// check_inside relies on it).
  void check_slices_apart(std::size_t doc, const std::vector<AllowedRegion>& allowed) {
    const auto region = [&](std::size_t x) -> const PairRegion& { return allowed[x].region; };
    for_each_meeting_pair(allowed.size(), region, [&](std::size_t x, std::size_t y) {
      const PairRegion shared = common_part(allowed[x].region, allowed[y].region);
      const I n = pairs_in(shared);
      if (n == 0) return;
      fail(who, ": documents[", doc, "].slices[", std::min(allowed[x].slice, allowed[y].slice), "] and slices[", std::max(allowed[x].slice, allowed[y].slice),
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
    fail(who, ": documents[", doc, "]: ", describe(piece.site), " attends ", count_of(own - inside, "pair"), " the mask does not allow",
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
    fail(who, ": documents[", doc, "]: query ", p, " key ", t, n > 1 ? concat(" and ", count_of(n - 1, "more pair")) : std::string{}, " attended twice, by ",
         describe(a.site), " and by ", describe(b.site));
  }

  /// (c): with (a) and (b), covered[x] counts the distinct pairs of region x
  /// attended, so any shortfall is a pair no entry attends.
  void check_complete(std::size_t doc, std::span<const Piece> pieces, const std::vector<AllowedRegion>& allowed, const std::vector<wide_int>& covered) const {
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
    fail(who, ": documents[", doc, "]: no entry attends ", count_of(missing, "allowed pair"),
         r.slice == none ? std::string{} : concat(" (", static_cast<I>(pairs_in(r.region) - covered[first]), " in slices[", r.slice, "])"),
         example_pair(r.region, pieces.size(), unattended));
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
/// cheap). Handles documents up to max_verified_document_tokens; the KV
/// copies and pieces it tabulates are checked against `limits` before they
/// are allocated. Cost: see the top of this file.
inline void verify_coverage(const QkvDocumentsPlan& plan, const QkvMetadata& metadata, const PlanLimits& limits = {}) {
  detail::coverage::CoverageCheck(plan, metadata, limits).run();
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
