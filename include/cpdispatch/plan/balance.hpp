#pragma once
// Load-balanced dispatch planning: the library chooses the QKV plan.
//
// Input: a packed batch -- every document as its pieces in causal order, each
// piece a contiguous run of the document on its home rank (a data loader
// packs documents end to end into the ranks' token budgets, so a long
// document starts on one rank and continues on the next ones) -- or, the
// special case, the lengths of the whole documents each rank holds. Also the
// most shards per document C, optionally a receive capacity per rank, and
// the bytes per token of queries and of key-values. Output: a documents-form
// plan (QkvDocumentsPlan) whose shards tile every piece in order (a shard
// never crosses a piece boundary and keeps its piece's home rank), at most C
// shards per document, each shard with an attention rank, that
//   1. minimises the largest attention cost of any rank, where a query shard
//      of q tokens after p tokens of its document costs q*p + q*(q+1)/2
//      (causal token pairs), and
//   2. among plans whose largest cost is within `cost_slack` of the best found,
//      moves the fewest bytes, counted exactly as the layout of
//      docs/plan-format.md sends them: q_bytes per query token attended off
//      its home rank, kv_bytes per token of every key-value copy whose home
//      is not the attention rank (query shard i attends to key-value shards
//      0..i of its document, wherever they live, each copied to it; two
//      query shards of one document on one rank get their own copies).
//
// The algorithm (balance_detail::Planner) searches the target T on the
// largest rank cost upward from the lower bound (balance_lower_bound), and
// builds a plan for one T in three steps:
//   1. a piece that costs more than T is cut into the fewest equal-cost
//      shards under T (later shards are shorter); its home keeps the shard
//      that would cost the most bytes to send, the others go to the ranks
//      with the most room left after their own pieces;
//   2. everything else stays home, except that a rank over T sends work away
//      one shard at a time, each time the choice moving the fewest bytes per
//      unit of cost: a piece's whole rest, its front (the head alone moves,
//      with its context) or its back (the tail moves, and its context with
//      it), sized to what the rank must shed or to the receiving rank's room,
//      into the tightest room that takes all it must shed, else the roomiest;
//      a document never exceeds C shards;
//   3. a rank with room left takes back its own shards that fit.
// Step 1 is also tried with one shard more, and not at all (step 2 then cuts
// those pieces too); the cheapest construction that reaches T wins. The
// smallest T reached (within 0.1%) is then relaxed by up to `cost_slack` when
// that moves fewer bytes. Deterministic: integer arithmetic and fixed
// tie-breaks throughout (a floating square root only seeds cut positions,
// which are then fixed exactly in integers).
//
// With BalanceOptions::dedup the bytes are counted as the deduplicated
// exchange (docs/plan-format.md, section 2c) sends them: a key-value token
// crosses to a rank once however many of its document's query shards attend
// there. The balanced plan above is built first; then constructions that may
// send a shard to a rank already attending its document (charged only the
// key-values that rank lacks) compete with it, each followed by a pass that
// moves single shards onto ranks attending or holding their document where
// that sends fewer bytes; one wins only by moving fewer bytes with a largest
// rank cost no higher than the first plan's. So dedup never costs balance,
// and may put several shards of one document on one rank.
//
// With BalanceProblem::mask other than causal (docs/plan-format.md, section
// 2d) a shard costs the (query, key) pairs the mask lets through, and
// balance_detail::MaskPlanner builds the plan (see there); the plan carries
// the mask and leaves max_cp_degree out, so planning derives C from it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// A contiguous run of a document's tokens on one rank (its home in the MLP
/// layout). A document packed across ranks is a list of pieces in causal order.
struct DocumentPiece {
  std::int64_t rank = 0;  ///< home rank
  std::int64_t len = 0;   ///< tokens, > 0
  friend bool operator==(const DocumentPiece&, const DocumentPiece&) = default;
};

/// What load-balanced planning starts from. Give the documents either as a
/// packed batch (`documents`) or per rank (`docs`), not both.
struct BalanceProblem {
  std::int64_t world_size = 0;
  std::int64_t max_cp_degree = 1;  ///< C: the most shards one document may be cut into
  /// Packed batch: every document's pieces in causal order. Rank r's MLP
  /// layout holds the pieces whose home is r, ordered by (document, piece).
  std::vector<std::vector<DocumentPiece>> documents;
  /// Per-rank form, [W] (or empty when `documents` is used): the lengths of
  /// the whole documents each rank holds, in MLP-layout order. The same as
  /// listing rank 0's documents, then rank 1's, ... as one-piece documents.
  std::vector<std::vector<std::int64_t>> docs;
  /// Empty, or [W]: the most tokens each rank's attention layout may hold,
  /// counted as its KV groups (context + own length of every query shard it
  /// attends), which also bounds its query tokens.
  std::vector<std::int64_t> recv_capacity;
  std::int64_t q_bytes = 1;   ///< bytes of one query token (weighs communication)
  std::int64_t kv_bytes = 1;  ///< bytes of one key-value token
  /// The attention mask (docs/plan-format.md, section 2d): it decides the
  /// attention cost of a shard and the key-values it needs. The balanced
  /// plan carries it, and leaves max_cp_degree to planning unless causal.
  AttentionMask mask;
};

struct BalanceOptions {
  /// Plans whose largest rank cost is within this fraction of the best found
  /// count as equal; among them the one moving the fewest bytes wins.
  double cost_slack = 0.01;
  /// When positive, replaces the slack: plans whose largest rank cost is at
  /// most this count as equal (e.g. to compare bytes with another plan at
  /// its level of balance).
  std::int64_t cost_limit = 0;
  /// Count key-value bytes as the deduplicated exchange sends them (once per
  /// document and destination rank), for plans run with dedup switched on.
  bool dedup = false;
};

/// What a plan costs: attention work and communication, per rank.
struct PlanCost {
  std::int64_t world_size = 0;
  std::vector<std::int64_t> attention;  ///< [W] (query, key) pairs each rank attends, under `mask`
  std::vector<std::int64_t> kv_tokens;  ///< [W] tokens of the KV groups each rank holds (what recv_capacity limits)
  std::vector<std::int64_t> bytes;      ///< [W * W] bytes rank `src` (row) sends rank `dst` (column); diagonal 0
  std::int64_t bytes_moved = 0;         ///< sum of `bytes`
  std::int64_t query_bytes = 0;         ///< of which queries
  std::int64_t kv_bytes = 0;            ///< of which key-value copies
  AttentionMask mask;                   ///< the plan's mask, whose pairs `attention` counts

  std::int64_t max_attention() const noexcept {
    return attention.empty() ? 0 : *std::max_element(attention.begin(), attention.end());
  }
  std::int64_t total_attention() const noexcept {
    return std::accumulate(attention.begin(), attention.end(), std::int64_t{0});
  }
  double mean_attention() const noexcept {
    return attention.empty() ? 0.0 : static_cast<double>(total_attention()) / static_cast<double>(attention.size());
  }
  /// max / mean (1 when perfectly even, or when there is no work at all).
  double max_over_mean() const noexcept {
    const double mean = mean_attention();
    return mean > 0 ? static_cast<double>(max_attention()) / mean : 1.0;
  }
  std::int64_t sent(std::size_t src, std::size_t dst) const { return bytes[src * static_cast<std::size_t>(world_size) + dst]; }
};

namespace balance_detail {

using detail::fail;
constexpr std::int64_t unlimited = std::numeric_limits<std::int64_t>::max() / 4;

/// Causal pairs of tokens [a, b) of a document: sum over t of (t + 1).
/// Callers keep b*(b+1) within 64 bits (checked once per document).
inline std::int64_t pairs(std::int64_t a, std::int64_t b) noexcept { return (b - a) * (a + b + 1) / 2; }

/// The largest m in [a, b] with pairs(a, m) <= budget.
inline std::int64_t max_end(std::int64_t a, std::int64_t b, std::int64_t budget) noexcept {
  if (budget <= 0) return a;
  if (pairs(a, b) <= budget) return b;
  // m^2 + m <= a^2 + a + 2*budget; the right side is below b^2 + b here.
  const double rhs = static_cast<double>(a) * static_cast<double>(a + 1) + 2.0 * static_cast<double>(budget);
  auto m = static_cast<std::int64_t>((std::sqrt(1.0 + 4.0 * rhs) - 1.0) / 2.0);
  m = std::clamp(m, a, b);
  while (m > a && pairs(a, m) > budget) --m;
  while (m < b && pairs(a, m + 1) <= budget) ++m;
  return m;
}

/// The smallest m in [a, b] with pairs(m, b) <= budget.
inline std::int64_t min_begin(std::int64_t a, std::int64_t b, std::int64_t budget) noexcept {
  if (budget <= 0) return b;
  if (pairs(a, b) <= budget) return a;
  // m^2 + m >= b^2 + b - 2*budget.
  const double rhs = static_cast<double>(b) * static_cast<double>(b + 1) - 2.0 * static_cast<double>(budget);
  auto m = static_cast<std::int64_t>(std::ceil((std::sqrt(std::max(0.0, 1.0 + 4.0 * rhs)) - 1.0) / 2.0));
  m = std::clamp(m, a, b);
  while (m < b && pairs(m, b) > budget) ++m;
  while (m > a && pairs(m - 1, b) <= budget) --m;
  return m;
}

/// The fewest contiguous shards of [a, b) that each cost at most `limit`
/// (greedy from the front is optimal for a monotone cost); `cap + 1` when
/// more than `cap` are needed.
inline std::int64_t pieces_needed(std::int64_t a, std::int64_t b, std::int64_t limit, std::int64_t cap) noexcept {
  std::int64_t n = 0;
  while (a < b) {
    if (n == cap) return cap + 1;
    const std::int64_t m = max_end(a, b, limit);
    if (m == a) return cap + 1;  // one token costs more than the limit
    a = m;
    ++n;
  }
  return n;
}

/// A run [lo, hi) of token positions of one document.
struct Range {
  std::int64_t lo, hi;
};

/// The cheapest largest shard when the runs (the pieces of one document,
/// each cut on its own) are cut into at most `c` shards in all; `c` is at
/// least the number of runs.
inline std::int64_t min_max_shard(const std::vector<Range>& runs, std::int64_t c) noexcept {
  std::int64_t total = 0, hi = 0;
  for (const Range& r : runs) {
    total += pairs(r.lo, r.hi);
    hi = std::max(hi, pairs(r.lo, r.hi));  // every run whole: always within c
  }
  std::int64_t lo = (total + c - 1) / c;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    std::int64_t used = 0;
    for (const Range& r : runs) {
      used += pieces_needed(r.lo, r.hi, mid, c);
      if (used > c) break;
    }
    if (used <= c) hi = mid; else lo = mid + 1;
  }
  return hi;
}

/// The cheapest largest shard of [0, len) cut into at most `c` contiguous shards.
inline std::int64_t min_max_piece(std::int64_t len, std::int64_t c) noexcept { return min_max_shard({Range{0, len}}, c); }

/// n + 1 boundaries cutting [a, b) into n shards of (nearly) equal cost,
/// every shard at least one token (n <= b - a).
inline std::vector<std::int64_t> equal_cost_cuts(std::int64_t a, std::int64_t b, std::int64_t n) {
  std::vector<std::int64_t> cut(static_cast<std::size_t>(n) + 1);
  cut[0] = a;
  const std::int64_t total = pairs(a, b);
  for (std::int64_t k = 1; k < n; ++k) {
    // Cumulative cost k * total / n without overflow.
    const std::int64_t want = total / n * k + (total % n) * k / n;
    std::int64_t m = max_end(a, b, want);
    if (m < b && want - pairs(a, m) > pairs(a, m + 1) - want) ++m;  // the nearer boundary
    cut[static_cast<std::size_t>(k)] = std::clamp(m, cut[static_cast<std::size_t>(k) - 1] + 1, b - (n - k));
  }
  cut[static_cast<std::size_t>(n)] = b;
  return cut;
}

/// One piece of the input: positions [begin, end) of document `document`,
/// held by rank `home`.
struct Piece {
  std::size_t document = 0;
  std::size_t index = 0;  ///< its place in the document
  std::size_t home = 0;
  std::size_t slot = 0;   ///< its place on the home rank (per-rank form: the document's index there)
  std::int64_t begin = 0, end = 0;
  std::int64_t cost = 0;  ///< pairs(begin, end)
};

/// One shard of a plan: positions [begin, end) of piece `piece`'s document,
/// attended on rank `dst`.
struct Shard {
  std::size_t piece = 0;
  std::int64_t begin = 0, end = 0;
  std::size_t dst = 0;
};

/// Bytes a shard [a, b) of a document moves at most when attended away from
/// home: its queries, and a copy of the key-values 0..b (its context and
/// itself; the part already at the destination moves nothing, which only
/// plan_cost counts exactly).
inline std::int64_t away_bytes(std::int64_t a, std::int64_t b, std::int64_t q_bytes, std::int64_t kv_bytes) noexcept {
  return q_bytes * (b - a) + kv_bytes * b;
}

/// One candidate plan: every piece's shards, pieces in order, each piece's
/// shards in order; shards[first[p] .. first[p+1]) are piece p's.
struct Layout {
  std::vector<Shard> shards;
  std::vector<std::size_t> first;
  std::int64_t max_cost = 0;
  std::int64_t bytes = 0;
};

/// Sorts shards by piece and position, merges neighbours attended on one
/// rank, and fills `first` and `bytes` (`max_cost` is the caller's).
inline Layout make_layout(std::vector<Shard>& shards, const std::vector<Piece>& pieces, std::int64_t q, std::int64_t kv) {
  std::sort(shards.begin(), shards.end(),
            [](const Shard& x, const Shard& y) { return x.piece != y.piece ? x.piece < y.piece : x.begin < y.begin; });
  Layout out;
  out.shards.reserve(shards.size());
  out.first.assign(pieces.size() + 1, 0);
  for (const Shard& s : shards) {
    Shard* last = out.shards.empty() ? nullptr : &out.shards.back();
    if (last && last->piece == s.piece && last->dst == s.dst && last->end == s.begin) last->end = s.end;
    else out.shards.push_back(s);
  }
  for (const Shard& s : out.shards) {
    ++out.first[s.piece + 1];
    if (s.dst != pieces[s.piece].home) out.bytes += away_bytes(s.begin, s.end, q, kv);
  }
  for (std::size_t p = 0; p < pieces.size(); ++p) out.first[p + 1] += out.first[p];
  return out;
}

/// How one construction treats pieces that cost more than the target.
struct Variant {
  bool precut = true;        ///< cut them first into equal-cost shards placed on the roomiest ranks
  bool extra_piece = false;  ///< ... one shard more than needed
  bool share = false;        ///< (dedup) a shard may join its document on a rank already attending it
};

class Planner {
 public:
  explicit Planner(const BalanceProblem& p) : p_(p) {
    check_settings();
    W_ = static_cast<std::size_t>(p.world_size);
    C_ = p.max_cp_degree;
    home_load_.assign(W_, 0);
    pieces_of_.resize(W_);
    const std::int64_t tokens = p.docs.empty() ? add_packed() : add_per_rank();
    // Byte counts of any plan stay below (q + C * kv) * tokens.
    if (static_cast<long double>(p.q_bytes + C_ * p.kv_bytes) * static_cast<long double>(tokens) > static_cast<long double>(unlimited)) {
      fail("plan_balanced: byte counts overflow 64 bits (q_bytes = ", p.q_bytes, ", kv_bytes = ", p.kv_bytes, ", ", tokens, " tokens)");
    }
    by_cost_.resize(pieces_.size());
    std::iota(by_cost_.begin(), by_cost_.end(), std::size_t{0});
    std::stable_sort(by_cost_.begin(), by_cost_.end(), [&](std::size_t x, std::size_t y) { return pieces_[x].cost > pieces_[y].cost; });
    read_capacity(tokens);
    bound_ = compute_bound();
  }

  /// The mean cost and, per document, its cheapest largest shard when cut
  /// into at most C shards inside its pieces: no plan's largest rank cost is
  /// below either.
  double lower_bound() const { return bound_; }

  /// The balanced layout: the smallest target a construction reaches, then
  /// the fewest bytes within the slack (or within `cost_limit`).
  Layout plan(const BalanceOptions& opt) {
    if (pieces_.empty()) return unbalanced();
    std::int64_t target = 0;
    Layout best = fewest_bytes(opt, target);
    return opt.dedup ? fewer_wire_bytes(std::move(best), target) : best;
  }

  /// The smallest target T a construction reaches (set in `target`), then
  /// the fewest bytes within the slack (or within `cost_limit`).
  Layout fewest_bytes(const BalanceOptions& opt, std::int64_t& target) {
    const auto lb = static_cast<std::int64_t>(std::ceil(lower_bound()));
    target = lb;
    std::optional<Layout> found = reach(lb);
    if (!found) found = search_target(lb, target);
    // Within the slack, the plan moving the fewest bytes.
    const std::int64_t limit =
        opt.cost_limit > 0 ? std::max(opt.cost_limit, found->max_cost)
                           : static_cast<std::int64_t>(static_cast<double>(found->max_cost) * (1.0 + std::max(0.0, opt.cost_slack)));
    Layout best = cheapest(target).value_or(std::move(*found));
    constexpr int steps = 4;
    for (int k = 1; k <= steps && limit > target; ++k) {
      const std::int64_t t = k == steps ? limit : target + (limit - target) / steps * k;
      if (auto l = cheapest(t); l && l->max_cost <= limit && l->bytes < best.bytes) best = std::move(*l);
    }
    return best;
  }

  /// Dedup: `plain` (fewest_bytes' layout, reached at `target`) against
  /// constructions that may also share ranks, all counted in wire bytes; one
  /// wins only with fewer bytes at a largest cost no higher than plain's.
  Layout fewer_wire_bytes(Layout plain, std::int64_t target) {
    dedup_ = true;
    const std::int64_t top = plain.max_cost, low = std::min(target, top);
    plain.bytes = wire_bytes(plain);
    join_documents(plain, top);
    Layout best = std::move(plain);
    std::int64_t previous = -1;
    for (const std::int64_t t : {top, low + (top - low) / 2, low}) {
      if (t == previous) continue;
      previous = t;
      auto l = cheapest(t);
      if (!l || l->max_cost > top) continue;
      join_documents(*l, top);
      if (l->bytes < best.bytes || (l->bytes == best.bytes && l->max_cost < best.max_cost)) best = std::move(*l);
    }
    return best;
  }

  /// Bytes of a layout as the deduplicated exchange sends them: the queries
  /// of every shard attended off its home, and for each document and rank t
  /// attending it, once, the key-values up to the end of its last shard on t
  /// that live on other ranks.
  std::int64_t wire_bytes(const Layout& l) const {
    std::int64_t bytes = 0;
    for (std::size_t d = 0; d + 1 < first_piece_.size(); ++d) bytes += document_wire_bytes(l, d);
    return bytes;
  }

  /// Document d's part of wire_bytes.
  std::int64_t document_wire_bytes(const Layout& l, std::size_t d) const {
    std::int64_t bytes = 0;
    std::vector<std::pair<std::size_t, std::int64_t>>& last = last_;  // (rank, end of the document's last shard there)
    last.clear();
    for (std::size_t id = first_piece_[d]; id < first_piece_[d + 1]; ++id) {
      for (std::size_t k = l.first[id]; k < l.first[id + 1]; ++k) {
        const Shard& s = l.shards[k];
        if (s.dst != pieces_[id].home) bytes += p_.q_bytes * (s.end - s.begin);
        auto it = std::find_if(last.begin(), last.end(), [&](const auto& x) { return x.first == s.dst; });
        if (it == last.end()) last.emplace_back(s.dst, s.end);
        else it->second = std::max(it->second, s.end);
      }
    }
    for (const auto& [t, e] : last)
      for (std::size_t id = first_piece_[d]; id < first_piece_[d + 1] && pieces_[id].begin < e; ++id)
        if (pieces_[id].home != t) bytes += p_.kv_bytes * (std::min(pieces_[id].end, e) - pieces_[id].begin);
    return bytes;
  }

  /// Dedup: moves single shards onto ranks that already attend or hold their
  /// document, where that sends fewer bytes and the rank stays within `top`
  /// cost and its receive capacity; neighbours that meet on a rank merge.
  void join_documents(Layout& l, std::int64_t top) const {
    std::vector<std::int64_t> load(W_, 0), kv(W_, 0);
    for (const Shard& s : l.shards) load[s.dst] += pairs(s.begin, s.end), kv[s.dst] += s.end;
    bool moved = false;
    std::vector<std::size_t> ranks;
    for (std::size_t d = 0; d + 1 < first_piece_.size(); ++d) {
      const std::size_t lo = l.first[first_piece_[d]], hi = l.first[first_piece_[d + 1]];
      if (hi - lo < 2) continue;
      ranks.clear();  // where the document is attended or held
      for (std::size_t k = lo; k < hi; ++k) ranks.push_back(l.shards[k].dst), ranks.push_back(pieces_[l.shards[k].piece].home);
      std::sort(ranks.begin(), ranks.end());
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      for (std::size_t k = lo; k < hi; ++k) moved = move_to_fewest_bytes(l, d, k, ranks, top, load, kv) || moved;
    }
    if (!moved) return;
    const std::int64_t max_cost = *std::max_element(load.begin(), load.end());
    l = make_layout(l.shards, pieces_, p_.q_bytes, p_.kv_bytes);
    l.max_cost = max_cost;
    l.bytes = wire_bytes(l);
  }

  /// Shard k of document d to whichever of `ranks` sends the document fewest bytes (within `top` and capacity).
  bool move_to_fewest_bytes(Layout& l, std::size_t d, std::size_t k, const std::vector<std::size_t>& ranks, std::int64_t top,
                            std::vector<std::int64_t>& load, std::vector<std::int64_t>& kv) const {
    Shard& s = l.shards[k];
    const std::size_t from = s.dst;
    const std::int64_t cost = pairs(s.begin, s.end);
    std::int64_t best = document_wire_bytes(l, d);
    std::size_t to = from;
    for (std::size_t t : ranks) {
      if (t == from || load[t] + cost > top || kv[t] + s.end > cap_[t]) continue;
      s.dst = t;
      const std::int64_t bytes = document_wire_bytes(l, d);
      if (bytes < best) best = bytes, to = t;
    }
    s.dst = to;
    if (to == from) return false;
    load[from] -= cost, kv[from] -= s.end;
    load[to] += cost, kv[to] += s.end;
    return true;
  }

  /// Every piece whole on its own rank.
  Layout unbalanced() const {
    std::vector<Shard> shards;
    for (std::size_t id = 0; id < pieces_.size(); ++id) shards.push_back({id, pieces_[id].begin, pieces_[id].end, pieces_[id].home});
    Layout out = make_layout(shards, pieces_, p_.q_bytes, p_.kv_bytes);
    out.max_cost = home_load_.empty() ? 0 : *std::max_element(home_load_.begin(), home_load_.end());
    return out;
  }

  /// The documents-form plan of a layout: documents and pieces in input order.
  QkvDocumentsPlan to_plan(const Layout& layout) const {
    QkvDocumentsPlan out;
    out.world_size = p_.world_size;
    out.max_cp_degree = C_;
    out.documents.resize(first_piece_.size() - 1);
    for (std::size_t id = 0; id < pieces_.size(); ++id) {
      auto& shards = out.documents[pieces_[id].document].shards;
      for (std::size_t k = layout.first[id]; k < layout.first[id + 1]; ++k) {
        const Shard& s = layout.shards[k];
        shards.push_back({static_cast<std::int64_t>(pieces_[id].home), s.end - s.begin, static_cast<std::int64_t>(s.dst)});
      }
    }
    return out;
  }

  const std::vector<Piece>& pieces() const { return pieces_; }
  std::size_t num_documents() const { return first_piece_.size() - 1; }
  std::size_t world() const { return W_; }
  std::int64_t cp_degree() const { return C_; }

 private:
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  // The first three build plans; the sharing ones join them when counting wire bytes.
  static constexpr Variant variants[] = {{true, false, false}, {false, false, false}, {true, true, false},
                                         {true, false, true},  {false, false, true},  {true, true, true}};
  std::span<const Variant> active_variants() const { return std::span<const Variant>(variants).first(dedup_ ? 6 : 3); }

  // ---- reading the problem

  void check_settings() const {
    const BalanceProblem& p = p_;
    if (p.world_size <= 0) fail("plan_balanced: world_size = ", p.world_size, " must be at least 1");
    if (!p.docs.empty() && !p.documents.empty()) {
      fail("plan_balanced: both documents (a packed batch) and docs (per rank) are given; give one");
    }
    if (!p.docs.empty() && p.docs.size() != static_cast<std::size_t>(p.world_size)) {
      fail("plan_balanced: docs has ", p.docs.size(), " ranks, but world_size = ", p.world_size);
    }
    if (p.max_cp_degree <= 0) fail("plan_balanced: max_cp_degree = ", p.max_cp_degree, " must be at least 1");
    if (p.max_cp_degree > max_supported_cp_degree) {
      fail("plan_balanced: max_cp_degree = ", p.max_cp_degree, " exceeds the supported maximum of ", max_supported_cp_degree);
    }
    if (p.q_bytes < 0 || p.kv_bytes < 0) {
      fail("plan_balanced: q_bytes = ", p.q_bytes, " and kv_bytes = ", p.kv_bytes, " must not be negative");
    }
  }

  /// Appends one piece of `len` tokens (> 0) to the current document.
  void add_piece(std::size_t home, std::int64_t len, std::int64_t& end) {
    const std::size_t doc = first_piece_.size() - 1;
    const std::int64_t begin = end;
    end = begin + len;  // within 64 bits: checked against the document's length below
    Piece pc{doc, pieces_.size() - first_piece_.back(), home, pieces_of_[home].size(), begin, end, 0};
    std::int64_t sq = 0;
    if (__builtin_mul_overflow(end, end + 1, &sq)) fail("plan_balanced: ", where(pc), ": its document's attention cost overflows 64 bits");
    pc.cost = pairs(begin, end);
    if (__builtin_add_overflow(total_, pc.cost, &total_) || total_ > unlimited) {
      fail("plan_balanced: the total attention cost overflows 64 bits (documents too long)");
    }
    home_load_[home] += pc.cost;
    pieces_of_[home].push_back(pieces_.size());
    pieces_.push_back(pc);
  }

  void end_document() { first_piece_.push_back(pieces_.size()); }

  std::int64_t add_per_rank() {
    per_rank_ = true;
    std::int64_t tokens = 0;
    for (std::size_t r = 0; r < W_; ++r) {
      for (std::size_t i = 0; i < p_.docs[r].size(); ++i) {
        const std::int64_t len = p_.docs[r][i];
        if (len <= 0) fail("plan_balanced: docs[", r, "][", i, "] = ", len, " must be positive");
        std::int64_t end = 0;
        add_piece(r, len, end);
        end_document();
        tokens = detail::add_tokens(tokens, len, "plan_balanced");
      }
    }
    return tokens;
  }

  std::int64_t add_packed() {
    std::int64_t tokens = 0;
    for (std::size_t i = 0; i < p_.documents.size(); ++i) {
      const auto& doc = p_.documents[i];
      if (doc.empty()) fail("plan_balanced: documents[", i, "] has no pieces");
      if (static_cast<std::int64_t>(doc.size()) > C_) {
        fail("plan_balanced: documents[", i, "] has ", doc.size(), " pieces, but max_cp_degree = ", C_,
             " (a shard never crosses a piece boundary, so it needs at least ", doc.size(), " shards)");
      }
      std::int64_t end = 0;
      for (std::size_t k = 0; k < doc.size(); ++k) {
        const DocumentPiece& pc = doc[k];
        if (pc.rank < 0 || pc.rank >= p_.world_size) {
          fail("plan_balanced: documents[", i, "].pieces[", k, "].rank = ", pc.rank, " is outside [0, ", W_, ")");
        }
        if (pc.len <= 0) fail("plan_balanced: documents[", i, "].pieces[", k, "].len = ", pc.len, " must be positive");
        if (pc.len > unlimited - end) fail("plan_balanced: documents[", i, "] is too long: its length overflows 64 bits");
        add_piece(static_cast<std::size_t>(pc.rank), pc.len, end);
        tokens = detail::add_tokens(tokens, pc.len, "plan_balanced");
      }
      end_document();
    }
    return tokens;
  }

  /// How messages name a piece: as the user gave it.
  std::string where(const Piece& pc) const {
    return per_rank_ ? detail::concat("docs[", pc.home, "][", pc.slot, "]")
                     : detail::concat("documents[", pc.document, "].pieces[", pc.index, "]");
  }

  void read_capacity(std::int64_t tokens) {
    cap_.assign(W_, unlimited);
    if (p_.recv_capacity.empty()) return;
    if (p_.recv_capacity.size() != W_) {
      fail("plan_balanced: recv_capacity has ", p_.recv_capacity.size(), " entries, but world_size = ", W_);
    }
    for (std::size_t r = 0; r < W_; ++r) {
      if (p_.recv_capacity[r] < 0) fail("plan_balanced: recv_capacity[", r, "] = ", p_.recv_capacity[r], " is negative");
      cap_[r] = std::min(p_.recv_capacity[r], unlimited);
    }
    check_capacity(tokens);
  }

  double compute_bound() const {
    if (pieces_.empty()) return 0;
    std::int64_t best = 0;
    std::vector<std::size_t> docs(num_documents());
    std::vector<std::int64_t> doc_cost(docs.size(), 0);
    for (const Piece& pc : pieces_) doc_cost[pc.document] += pc.cost;
    std::iota(docs.begin(), docs.end(), std::size_t{0});
    std::stable_sort(docs.begin(), docs.end(), [&](std::size_t x, std::size_t y) { return doc_cost[x] > doc_cost[y]; });
    std::vector<Range> runs;
    for (std::size_t d : docs) {
      if (doc_cost[d] <= best) break;  // its largest shard cannot cost more than all of it
      runs.clear();
      for (std::size_t id = first_piece_[d]; id < first_piece_[d + 1]; ++id) runs.push_back({pieces_[id].begin, pieces_[id].end});
      best = std::max(best, min_max_shard(runs, C_));
    }
    return std::max(static_cast<double>(total_) / static_cast<double>(W_), static_cast<double>(best));
  }

  // ---- searching the target

  /// Widens geometrically from the bound `lb` (plans usually land within a
  /// few percent of it), then bisects to 0.1%; sets `target` to the one reached.
  Layout search_target(std::int64_t lb, std::int64_t& target) {
    const std::int64_t top = *std::max_element(home_load_.begin(), home_load_.end());
    std::optional<Layout> found;
    std::int64_t lo = lb, hi = lb;  // lo fails, hi reaches
    for (std::int64_t step = std::max<std::int64_t>(1, lb / 256); !found; step *= 4) {
      lo = hi;
      if (lo >= total_) capacity_failure();  // not even with no limit on cost
      hi = std::min(total_, lo + step);
      if (lo < top && hi > top) hi = top;  // where every piece stays home
      found = reach(hi);
    }
    while (hi - lo > std::max<std::int64_t>(1, lo / 1024)) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (auto l = reach(mid)) {
        hi = mid;
        found = std::move(l);
      } else {
        lo = mid;
      }
    }
    target = hi;
    return std::move(*found);
  }

  /// The first variant that reaches target T (for the search).
  std::optional<Layout> reach(std::int64_t T) {
    for (const Variant& v : active_variants()) {
      if (v.extra_piece && C_ == 1) continue;
      if (auto l = construct(T, v)) return l;
    }
    return std::nullopt;
  }

  /// The variant reaching target T with the fewest bytes.
  std::optional<Layout> cheapest(std::int64_t T) {
    std::optional<Layout> best;
    for (const Variant& v : active_variants()) {
      if (v.extra_piece && C_ == 1) continue;
      auto l = construct(T, v);
      if (l && (!best || l->bytes < best->bytes || (l->bytes == best->bytes && l->max_cost < best->max_cost))) best = std::move(l);
    }
    return best;
  }

  // ---- one construction for target T

  /// Puts [a, b) of piece `id` on rank d.
  void place(std::size_t id, std::int64_t a, std::int64_t b, std::size_t d) {
    shards_.push_back({id, a, b, d});
    excess_[d] += pairs(a, b);
    kv_excess_[d] += b;
    if (share_) placed_[pieces_[id].document].emplace_back(d, b);
  }

  /// Every shard of the cut non-empty and costing at most T.
  static bool fits_under(const std::vector<std::int64_t>& cut, std::int64_t T) {
    for (std::size_t i = 0; i + 1 < cut.size(); ++i)
      if (cut[i + 1] <= cut[i] || pairs(cut[i], cut[i + 1]) > T) return false;
    return true;
  }

  std::int64_t away_bytes(std::int64_t a, std::int64_t b) const { return balance_detail::away_bytes(a, b, p_.q_bytes, p_.kv_bytes); }

  /// One plan whose largest rank cost is at most T, or nothing.
  std::optional<Layout> construct(std::int64_t T, Variant v) {
    share_ = v.share;
    start_construction(T);
    if (v.precut && (!cut_giants(T, v) || !place_giants())) return std::nullopt;
    keep_the_rest_home(T, v);
    if (!shed_excess()) return std::nullopt;
    for (std::size_t id = 0; id < pieces_.size(); ++id)
      if (home_[id].hi > home_[id].lo) shards_.push_back({id, home_[id].lo, home_[id].hi, pieces_[id].home});
    take_back_home();
    Layout out = make_layout(shards_, pieces_, p_.q_bytes, p_.kv_bytes);
    out.max_cost = T + *std::max_element(excess_.begin(), excess_.end());
    if (dedup_) out.bytes = wire_bytes(out);
    return out;
  }

  void start_construction(std::int64_t T) {
    shards_.clear();
    excess_.assign(W_, -T);  // cost above T on each rank (negative: room left)
    kv_excess_.resize(W_);
    for (std::size_t r = 0; r < W_; ++r) kv_excess_[r] = -cap_[r];
    pending_ = home_load_;  // cost each rank still holds of its own, not yet placed
    home_.assign(pieces_.size(), Range{0, 0});
    shards_of_.resize(num_documents());
    for (std::size_t d = 0; d < shards_of_.size(); ++d) shards_of_[d] = static_cast<std::int64_t>(first_piece_[d + 1] - first_piece_[d]);
    giants_.clear();
    if (share_) {
      placed_.resize(num_documents());
      for (auto& ranks : placed_) ranks.clear();
    }
  }

  /// Pieces above the target: cut into the fewest equal-cost shards under T
  /// (one more in the extra variant), within the document's C; the home
  /// keeps the shard costliest to send when it has room for it.
  bool cut_giants(std::int64_t T, Variant v) {
    for (std::size_t id : by_cost_) {
      if (pieces_[id].cost <= T) break;
      giants_.push_back(id);
      pending_[pieces_[id].home] -= pieces_[id].cost;
    }
    cuts_.resize(giants_.size());
    kept_.resize(giants_.size());
    for (std::size_t g = 0; g < giants_.size(); ++g) {
      const Piece& pc = pieces_[giants_[g]];
      std::int64_t& count = shards_of_[pc.document];
      const std::int64_t allowed = C_ - count + 1;  // this piece already counts one
      std::int64_t n = pieces_needed(pc.begin, pc.end, T, allowed);
      if (n > allowed) return false;
      if (v.extra_piece && n < allowed && n < pc.end - pc.begin) ++n;
      count += n - 1;
      auto& cut = cuts_[g];
      cut = equal_cost_cuts(pc.begin, pc.end, n);
      if (!fits_under(cut, T)) {
        // Rounding pushed a shard over T: cut greedily at T instead, leaving every shard a token.
        for (std::size_t k = 1; k < static_cast<std::size_t>(n); ++k) {
          cut[k] = std::min(max_end(cut[k - 1], pc.end, T), pc.end - (n - static_cast<std::int64_t>(k)));
        }
        if (!fits_under(cut, T)) return false;
      }
      std::size_t& keep = kept_[g];
      keep = none;
      for (std::size_t i = 0; i + 1 < cut.size(); ++i) {
        const std::int64_t a = cut[i], b = cut[i + 1];
        if (excess_[pc.home] + pairs(a, b) <= 0 && kv_excess_[pc.home] + b <= 0 &&
            (keep == none || away_bytes(a, b) > away_bytes(cut[keep], cut[keep + 1]))) {
          keep = i;
        }
      }
      if (keep != none) place(giants_[g], cut[keep], cut[keep + 1], pc.home);
    }
    return true;
  }

  /// The giants' other shards go where the most room is left after each
  /// rank's own pieces, one shard of a piece per rank.
  bool place_giants() {
    for (std::size_t g = 0; g < giants_.size(); ++g) {
      const std::size_t id = giants_[g], first = shards_.size();
      for (std::size_t i = 0; i + 1 < cuts_[g].size(); ++i) {
        if (i == kept_[g]) continue;
        const std::int64_t a = cuts_[g][i], b = cuts_[g][i + 1], c = pairs(a, b);
        std::size_t to = none;
        for (std::size_t r = 0; r < W_; ++r) {
          if (r == pieces_[id].home || excess_[r] + c > 0 || kv_excess_[r] + b > 0) continue;
          bool taken = false;
          for (std::size_t k = first; k < shards_.size(); ++k) taken = taken || shards_[k].dst == r;
          if (taken) continue;
          if (to == none || excess_[r] + pending_[r] < excess_[to] + pending_[to]) to = r;
        }
        if (to == none) return false;
        place(id, a, b, to);
      }
    }
    return true;
  }

  /// Every other piece starts at home; the ranks over the target queue to
  /// send, the others offer their room.
  void keep_the_rest_home(std::int64_t T, Variant v) {
    for (std::size_t id = 0; id < pieces_.size(); ++id) {
      const Piece& pc = pieces_[id];
      if (v.precut && pc.cost > T) continue;  // placed as a giant
      home_[id] = Range{pc.begin, pc.end};
      excess_[pc.home] += pc.cost;
      kv_excess_[pc.home] += pc.end;
    }
    over_.clear();
    rooms_.clear();
    for (std::size_t r = 0; r < W_; ++r) {
      if (excess_[r] > 0 || kv_excess_[r] > 0) over_.insert({excess_[r], r});
      else if (excess_[r] < 0 && kv_excess_[r] < 0) rooms_.insert({-excess_[r], r});
    }
  }

  /// The rank furthest over sends next (ranks over only for the capacity
  /// after them), so ranks over the target share the largest rooms.
  bool shed_excess() {
    while (!over_.empty()) {
      const std::size_t r = std::prev(over_.end())->second;
      over_.erase(std::prev(over_.end()));
      if (!send_one(r)) return false;
      if (excess_[r] > 0 || kv_excess_[r] > 0) over_.insert({excess_[r], r});
      else if (excess_[r] < 0 && kv_excess_[r] < 0) rooms_.insert({-excess_[r], r});
    }
    return true;
  }

  /// A rank with room left takes back its own shards that fit.
  void take_back_home() {
    for (Shard& s : shards_) {
      const std::size_t home = pieces_[s.piece].home;
      const std::int64_t c = pairs(s.begin, s.end);
      if (s.dst == home || excess_[home] + c > 0 || kv_excess_[home] + s.end > 0) continue;
      excess_[s.dst] -= c;
      kv_excess_[s.dst] -= s.end;
      excess_[home] += c;
      kv_excess_[home] += s.end;
      s.dst = home;
    }
  }

  enum Kind { whole, front, back };
  struct Choice {
    std::size_t id;
    Kind kind;
    std::int64_t cut, bytes, gain;
    std::size_t to;
  };

  /// Fewer bytes per unit of cost than `best`; on a tie, more cost.
  static bool cheaper_per_cost(const Choice& c, const Choice& best) {
    const long double lhs = static_cast<long double>(c.bytes) * static_cast<long double>(best.gain);
    const long double rhs = static_cast<long double>(best.bytes) * static_cast<long double>(c.gain);
    return lhs < rhs || (lhs == rhs && c.gain > best.gain);
  }

  /// Bytes of sending [a, b) of piece `id` to rank `to`: away_bytes, or, in a
  /// sharing construction, without the key-values `to` already holds.
  std::int64_t move_bytes(std::size_t id, std::int64_t a, std::int64_t b, std::size_t to) const {
    if (!share_) return away_bytes(a, b);
    return p_.q_bytes * (b - a) + p_.kv_bytes * (b - std::min(b, context_at(to, pieces_[id].document)));
  }

  /// How far into document `doc` rank t holds the key-values so far: to the
  /// end of its last shard placed on t, or of a rest kept home on t.
  std::int64_t context_at(std::size_t t, std::size_t doc) const {
    std::int64_t end = 0;
    for (const auto& [rank, e] : placed_[doc])
      if (rank == t) end = std::max(end, e);
    for (std::size_t id = first_piece_[doc]; id < first_piece_[doc + 1]; ++id)
      if (pieces_[id].home == t && home_[id].hi > home_[id].lo) end = std::max(end, home_[id].hi);
    return end;
  }

  /// Rank r's candidate moves to rank `to` (into its room of cost and KV
  /// tokens): of each piece's rest (or only piece `only`'s), all of it, its
  /// front (just enough cost, or what the room takes) or its back; the
  /// fewest bytes per unit of cost.
  std::optional<Choice> best_move(std::size_t r, std::int64_t need, std::size_t to, std::size_t only = none) const {
    const std::int64_t room = -excess_[to], kv_room = -kv_excess_[to];
    std::optional<Choice> best;
    auto consider = [&](const Choice& c) {
      if (c.gain > 0 && (!best || cheaper_per_cost(c, *best))) best = c;
    };
    for (std::size_t id : pieces_of_[r]) {
      if (only != none && id != only) continue;
      const std::int64_t lo = home_[id].lo, hi = home_[id].hi;
      if (hi <= lo) continue;
      const std::int64_t all = pairs(lo, hi);
      if (all <= room && hi <= kv_room) consider({id, whole, 0, move_bytes(id, lo, hi, to), need > 0 ? std::min(all, need) : hi, to});
      if (need <= 0 || shards_of_[pieces_[id].document] >= C_ || hi - lo < 2) continue;  // (capacity: only whole rests)
      // A front or back shard keeps the rest of the piece home; where all of
      // it would go anyway, only whole (no one-token shards left behind).
      std::int64_t m = all >= need ? max_end(lo, hi, need - 1) + 1 : hi;  // [lo, m) costs at least need
      m = std::min({m, max_end(lo, hi, room), kv_room});
      if (m > lo && m < hi) consider({id, front, m, move_bytes(id, lo, m, to), std::min(pairs(lo, m), need), to});
      std::int64_t b = all >= need ? min_begin(lo, hi, need - 1) - 1 : lo;  // [b, hi) costs at least need
      b = std::max(b, min_begin(lo, hi, room));
      if (b > lo && b < hi && hi <= kv_room) consider({id, back, b, move_bytes(id, b, hi, to), std::min(pairs(b, hi), need), to});
    }
    return best;
  }

  /// (sharing) Moves of r's pieces onto the ranks with room that already
  /// attend their documents, where they lack fewer key-values; better ones
  /// replace `best`.
  void join_context(std::size_t r, std::int64_t need, std::optional<Choice>& best) const {
    for (std::size_t id : pieces_of_[r]) {
      if (home_[id].hi <= home_[id].lo) continue;
      const std::size_t doc = pieces_[id].document;
      auto try_rank = [&](std::size_t t) {
        if (t == r || !rooms_.count({-excess_[t], t})) return;
        if (auto c = best_move(r, need, t, id); c && (!best || cheaper_per_cost(*c, *best))) best = c;
      };
      for (const auto& [t, end] : placed_[doc]) try_rank(t);
      for (std::size_t k = first_piece_[doc]; k < first_piece_[doc + 1]; ++k)
        if (k != id && home_[k].hi > home_[k].lo) try_rank(pieces_[k].home);
    }
  }

  /// Rank r sends one shard of one of its pieces into the room another rank
  /// has left (best_move). With no cost left to shed it sends whole rests,
  /// for the receive capacity. False when nothing can go.
  bool send_one(std::size_t r) {
    const std::int64_t need = excess_[r];
    // The receiver: the tightest room that takes all of `need`, else the roomiest.
    if (rooms_.empty()) return false;
    auto slot = need > 0 ? rooms_.lower_bound({need, 0}) : rooms_.end();
    if (slot == rooms_.end()) slot = std::prev(rooms_.end());
    std::optional<Choice> best = best_move(r, need, slot->second);
    if (share_) join_context(r, need, best);
    if (!best) return false;
    const std::size_t to = best->to;
    if (to != slot->second) slot = rooms_.find({-excess_[to], to});
    Range& h = home_[best->id];
    std::int64_t a = h.lo, b = h.hi;
    switch (best->kind) {
      case whole: h = Range{0, 0}; break;
      case front: b = h.lo = best->cut; break;
      case back: a = h.hi = best->cut; break;
    }
    if (best->kind != whole) ++shards_of_[pieces_[best->id].document];
    // What the home keeps is [h.lo, h.hi): its KV group ends at h.hi.
    excess_[r] -= pairs(a, b);
    kv_excess_[r] -= best->kind == whole ? b : best->kind == back ? b - a : 0;
    rooms_.erase(slot);
    place(best->id, a, b, to);
    if (excess_[to] < 0 && kv_excess_[to] < 0) rooms_.insert({-excess_[to], to});
    return true;
  }

  void check_capacity(std::int64_t tokens) const {
    const auto widest = static_cast<std::size_t>(std::max_element(cap_.begin(), cap_.end()) - cap_.begin());
    // A piece's last shard attends to all of the document up to the piece's end: some rank must hold that.
    for (const Piece& pc : pieces_) {
      if (pc.end > cap_[widest]) {
        fail<capacity_error>("plan_balanced: ", where(pc), per_rank_ ? " has " : " ends ", pc.end, per_rank_ ? " tokens" : " tokens into its document",
                             " and its last shard's KV group holds all of them, but the largest recv_capacity is ", cap_[widest],
                             " tokens (rank ", widest, ")");
      }
    }
    std::int64_t capacity = 0;
    for (std::int64_t c : cap_) capacity = std::min(unlimited, capacity + c);
    if (capacity < tokens) {
      fail<capacity_error>("plan_balanced: the receive capacities total ", capacity, " tokens, but the documents hold ", tokens,
                           " (the largest recv_capacity is ", cap_[widest], " tokens, rank ", widest, ")");
    }
  }

  [[noreturn]] void capacity_failure() const {
    std::size_t tight = 0, widest = 0;
    std::vector<std::int64_t> held(W_, 0);
    for (const Piece& pc : pieces_) held[pc.home] += pc.end - pc.begin;
    for (std::size_t r = 0; r < W_; ++r) {
      if (cap_[r] - held[r] < cap_[tight] - held[tight]) tight = r;
      if (cap_[r] > cap_[widest]) widest = r;
    }
    fail<capacity_error>("plan_balanced: no plan with at most ", C_, " shards per document fits the receive capacities: rank ",
                         tight, " holds ", held[tight], " tokens with recv_capacity ", cap_[tight],
                         ", and the largest recv_capacity is ", cap_[widest], " tokens (rank ", widest, ")");
  }

  const BalanceProblem& p_;
  std::size_t W_ = 0;
  std::int64_t C_ = 1;
  std::int64_t total_ = 0;
  double bound_ = 0;
  bool per_rank_ = false;
  std::vector<Piece> pieces_;
  std::vector<std::size_t> first_piece_{0};           // pieces of document d: [first_piece_[d], first_piece_[d+1])
  std::vector<std::vector<std::size_t>> pieces_of_;   // per home rank, in MLP order
  std::vector<std::size_t> by_cost_;
  std::vector<std::int64_t> home_load_, cap_;
  // scratch of one construction
  std::vector<Shard> shards_;
  std::vector<Range> home_;               // what of each piece is still home, not yet placed
  std::vector<std::int64_t> shards_of_;   // shards of each document so far
  std::vector<std::int64_t> excess_, kv_excess_, pending_;
  std::vector<std::size_t> giants_, kept_;
  std::set<std::pair<std::int64_t, std::size_t>> over_;   // (cost above the target, rank) of the ranks that must send
  std::set<std::pair<std::int64_t, std::size_t>> rooms_;  // (room left, rank) of the ranks that can take work
  std::vector<std::vector<std::int64_t>> cuts_;
  bool dedup_ = false;  // bytes counted on the wire (section 2c); the sharing variants on
  bool share_ = false;  // this construction's Variant::share
  std::vector<std::vector<std::pair<std::size_t, std::int64_t>>> placed_;  // (sharing) per document: (rank, shard end) placed
  mutable std::vector<std::pair<std::size_t, std::int64_t>> last_;         // scratch of document_wire_bytes
};

}  // namespace balance_detail

/// Causal token pairs of a query shard of `len` tokens with `context` tokens
/// of its document before it: len*context + len*(len+1)/2.
inline std::int64_t attention_cost(std::int64_t context, std::int64_t len) {
  if (context < 0 || len < 0) detail::fail("attention_cost: context = ", context, " and len = ", len, " must not be negative");
  std::int64_t end = 0, sq = 0;
  if (__builtin_add_overflow(context, len, &end) || __builtin_mul_overflow(end, end + 1, &sq)) {
    detail::fail("attention_cost: ", context, " + ", len, " tokens overflow 64 bits");
  }
  return balance_detail::pairs(context, end);
}

namespace balance_detail {

/// The planner's memory, from the problem's sizes (no allocation), checked
/// before it is built. The settings' own checks come first, so that a bad
/// world_size is named as such.
inline void check_footprint(const BalanceProblem& p, const PlanLimits& limits, std::uint64_t shards_per_piece = 0) {
  if (p.world_size <= 0 || p.max_cp_degree <= 0) return;  // Planner names these
  std::uint64_t pieces = 0;
  for (const auto& doc : p.documents) pieces += doc.size();
  for (const auto& rank : p.docs) pieces += rank.size();
  const auto W = static_cast<std::uint64_t>(p.world_size), C = static_cast<std::uint64_t>(p.max_cp_degree);
  detail::check_footprint(limits, footprint::balance(W, pieces, shards_per_piece ? shards_per_piece : std::min<std::uint64_t>(C, 64)), "plan_balanced",
                          detail::concat("a problem of world_size = ", W, ", ", pieces, " pieces, max_cp_degree = ", C));
}

}  // namespace balance_detail

namespace balance_detail {

/// Balancing under a mask other than causal (docs/plan-format.md, section
/// 2d). The cost of a shard is the (query, key) pairs the mask lets through;
/// for a full mask and past the first w tokens of a window it grows linearly
/// with the shard's length, so a simple scheme balances well: the target T
/// rises from the lower bound; for each T, a piece over T is cut into the
/// fewest equal-cost shards, then every rank above T sheds the tails of its
/// shards to the ranks with the most room (a tail keeps the front of the
/// piece at home, so under a window only the tail and its w - 1 tokens of
/// context travel), never giving a document more than C shards.
class MaskPlanner {
 public:
  MaskPlanner(const Planner& base, const AttentionMask& mask) : base_(base), mask_(mask) {
    doc_len_.assign(base.num_documents(), 0);
    for (const Piece& pc : base.pieces()) doc_len_[pc.document] = std::max(doc_len_[pc.document], pc.end);
    C_ = base.cp_degree();
    std::int64_t total = 0;
    for (const Piece& pc : base.pieces()) total = sum(total, cost(pc.document, pc.begin, pc.end));
    bound_ = static_cast<double>(total) / static_cast<double>(base.world());
    std::vector<std::vector<Range>> runs(base.num_documents());
    for (const Piece& pc : base.pieces()) runs[pc.document].push_back({pc.begin, pc.end});
    for (std::size_t d = 0; d < runs.size(); ++d) bound_ = std::max(bound_, static_cast<double>(min_max_shard(d, runs[d])));
  }

  double lower_bound() const { return bound_; }

  /// The most balanced layout found: targets from the bound upward in steps
  /// of 0.1%, then 1%; every piece at home when nothing better is reached.
  Layout plan() const {
    const auto start = static_cast<std::int64_t>(std::ceil(bound_));
    for (int k = 0; k < 400; ++k) {
      const double step = k < 100 ? 0.001 * k : 0.1 + 0.01 * (k - 100);
      const auto T = static_cast<std::int64_t>(static_cast<double>(start) * (1.0 + step)) + (k == 0 ? 0 : 1);
      for (const Cut cut : {Cut::equal, Cut::greedy, Cut::extra}) {
        std::vector<Shard> shards;
        if (build(T, cut, shards)) return finish(shards);
      }
    }
    return base_.unbalanced();
  }

 private:
  static std::int64_t sum(std::int64_t a, std::int64_t b) {
    std::int64_t out = 0;
    if (__builtin_add_overflow(a, b, &out) || out > unlimited) fail("plan_balanced: the total attention cost overflows 64 bits");
    return out;
  }

  /// Pairs of positions [a, b) of document d under the mask.
  std::int64_t cost(std::size_t d, std::int64_t a, std::int64_t b) const { return attention_pairs(mask_, a, b - a, doc_len_[d]); }

  /// The largest m in [a, b] with cost [a, m) <= budget (binary search: the cost grows with m).
  std::int64_t max_end(std::size_t d, std::int64_t a, std::int64_t b, std::int64_t budget) const {
    std::int64_t lo = a, hi = b;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo + 1) / 2;
      if (cost(d, a, mid) <= budget) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  /// The smallest m in [a, b] with cost [m, b) <= budget.
  std::int64_t min_begin(std::size_t d, std::int64_t a, std::int64_t b, std::int64_t budget) const {
    std::int64_t lo = a, hi = b;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (cost(d, mid, b) <= budget) hi = mid; else lo = mid + 1;
    }
    return lo;
  }

  /// The fewest shards of [a, b) each within `limit`; cap + 1 beyond `cap`.
  std::int64_t needed(std::size_t d, std::int64_t a, std::int64_t b, std::int64_t limit, std::int64_t cap) const {
    std::int64_t n = 0;
    while (a < b) {
      const std::int64_t m = max_end(d, a, b, limit);
      if (n == cap || m == a) return cap + 1;
      a = m;
      ++n;
    }
    return n;
  }

  /// The cheapest largest shard of document d's runs cut into at most C shards in all.
  std::int64_t min_max_shard(std::size_t d, const std::vector<Range>& runs) const {
    std::int64_t lo = 1, hi = 0;
    for (const Range& r : runs) hi = std::max(hi, cost(d, r.lo, r.hi));
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      std::int64_t used = 0;
      for (const Range& r : runs) {
        used += needed(d, r.lo, r.hi, mid, C_);
        if (used > C_) break;
      }
      if (used <= C_) hi = mid; else lo = mid + 1;
    }
    return hi;
  }

  /// How a piece over the target is cut: into the fewest shards of equal
  /// cost, the fewest with the first ones as large as the target allows (the
  /// home keeps a full one), or one shard more than needed, of equal cost.
  enum class Cut { equal, greedy, extra };

  /// One layout whose largest rank cost is at most T, if this scheme finds
  /// one. A piece over T is cut as `how` says; its home keeps the first shard, and the others go,
  /// costliest first, to the ranks with the most room after their own
  /// pieces; every other piece starts at home.
  bool build(std::int64_t T, Cut how, std::vector<Shard>& shards) const {
    const auto& pieces = base_.pieces();
    std::vector<std::int64_t> load(base_.world(), 0), count(base_.num_documents(), 0);
    std::vector<std::size_t> order(pieces.size()), away;
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::vector<std::int64_t> piece_cost(pieces.size());
    for (std::size_t id = 0; id < pieces.size(); ++id) piece_cost[id] = cost(pieces[id].document, pieces[id].begin, pieces[id].end);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return piece_cost[x] > piece_cost[y]; });
    for (std::size_t id : order) {
      const Piece& pc = pieces[id];
      std::int64_t n = needed(pc.document, pc.begin, pc.end, T, C_);
      if (how == Cut::extra && n > 1 && count[pc.document] + n < C_ && n < pc.end - pc.begin) ++n;
      count[pc.document] += n;
      if (count[pc.document] > C_) return false;
      std::int64_t a = pc.begin;
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t rest = cost(pc.document, a, pc.end);
        const std::int64_t share = how == Cut::greedy ? T : (rest + (n - k) - 1) / (n - k);
        const std::int64_t b = k + 1 == n ? pc.end : std::max(a + 1, max_end(pc.document, a, pc.end, share));
        shards.push_back({id, a, b, pc.home});
        if (k == 0) load[pc.home] += cost(pc.document, a, b);
        else away.push_back(shards.size() - 1);
        a = b;
      }
    }
    // The cut-off shards, costliest first, to the ranks with the most room after their own pieces.
    const auto shard_cost = [&](std::size_t s) { return cost(pieces[shards[s].piece].document, shards[s].begin, shards[s].end); };
    std::stable_sort(away.begin(), away.end(), [&](std::size_t x, std::size_t y) { return shard_cost(x) > shard_cost(y); });
    for (std::size_t s : away) {
      const auto to = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      shards[s].dst = to;
      load[to] += shard_cost(s);
    }
    return shed(T, shards, load, count);
  }

  /// Moves work of shard `pick` (on a rank `excess` over T) to rank `to`
  /// with `room` left: the whole shard, or its shortest tail that covers the
  /// excess (else the longest that fits) while its document may gain a shard.
  bool move_work(std::vector<Shard>& shards, std::size_t pick, std::size_t to, std::int64_t room, std::int64_t excess,
                 std::vector<std::int64_t>& load, std::vector<std::int64_t>& count) const {
    Shard& s = shards[pick];
    const std::size_t d = base_.pieces()[s.piece].document, from = s.dst;
    const std::int64_t whole = cost(d, s.begin, s.end);
    if (whole <= room && (whole <= excess || count[d] >= C_)) {
      s.dst = to;
      load[from] -= whole;
      load[to] += whole;
      return true;
    }
    if (count[d] >= C_) return false;
    std::int64_t m = min_begin(d, s.begin, s.end, room);
    if (cost(d, m, s.end) >= excess) m = std::max(m, min_begin(d, s.begin, s.end, excess - 1) - 1);
    if (m <= s.begin || m >= s.end) return false;
    const std::int64_t tail = cost(d, m, s.end);
    const Shard moved{s.piece, m, s.end, to};
    s.end = m;
    load[from] += cost(d, s.begin, m) - whole;
    load[to] += tail;
    ++count[d];
    shards.push_back(moved);
    return true;
  }

  /// Every rank above T sends work to the rank with the most room, trying
  /// its shards from the last placed to the first.
  bool shed(std::int64_t T, std::vector<Shard>& shards, std::vector<std::int64_t>& load, std::vector<std::int64_t>& count) const {
    for (std::size_t r = 0; r < load.size(); ++r) {
      std::size_t guard = 0;
      while (load[r] > T) {
        if (++guard > 4 * shards.size() + 16) return false;
        const std::size_t to = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
        const std::int64_t room = T - load[to], excess = load[r] - T;
        if (room <= 0) return false;
        bool moved = false;
        for (std::size_t s = shards.size(); s-- > 0 && !moved;) {
          if (shards[s].dst == r) moved = move_work(shards, s, to, room, excess, load, count);
        }
        if (!moved) return false;
      }
    }
    return true;
  }

  Layout finish(std::vector<Shard>& shards) const {
    Layout out = make_layout(shards, base_.pieces(), 0, 0);
    return out;
  }

  const Planner& base_;
  AttentionMask mask_;
  std::vector<std::int64_t> doc_len_;
  std::int64_t C_ = 1;
  double bound_ = 0;
};

}  // namespace balance_detail

namespace balance_detail {

/// A plan of `layout` under the problem's mask: the mask travels with it and,
/// unless causal, planning derives C from the mask (section 2d).
inline QkvDocumentsPlan masked_plan(const Planner& planner, const Layout& layout, const AttentionMask& mask) {
  QkvDocumentsPlan out = planner.to_plan(layout);
  out.mask = mask;
  if (mask != AttentionMask::causal()) out.max_cp_degree.reset();
  return out;
}

/// Refuses what the masked planner does not model.
inline void check_masked_problem(const BalanceProblem& p) {
  detail::check_mask(p.mask);
  if (p.mask != AttentionMask::causal() && !p.recv_capacity.empty()) {
    fail("plan_balanced: recv_capacity is supported with the causal mask only (the ", to_string(p.mask), " mask is given)");
  }
}

}  // namespace balance_detail

/// No plan's largest rank cost is below this: the larger of the mean rank
/// cost and, for each document, the cheapest possible largest shard when it
/// is cut into at most C shards inside its pieces.
inline double balance_lower_bound(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  balance_detail::check_footprint(problem, limits);
  balance_detail::check_masked_problem(problem);
  const balance_detail::Planner planner(problem);
  if (problem.mask == AttentionMask::causal()) return planner.lower_bound();
  return balance_detail::MaskPlanner(planner, problem.mask).lower_bound();
}

/// The load-balanced plan (see the top of this header), in documents form:
/// documents in input order (for the per-rank form: rank 0's documents,
/// then rank 1's, ...), each piece tiled by its shards in order. Throws
/// invalid_input for a malformed problem (naming `documents[i].pieces[k]`
/// or `docs[r][i]`) and capacity_error (naming ranks and token counts) when
/// the receive capacities cannot hold the documents.
inline QkvDocumentsPlan plan_balanced(const BalanceProblem& problem, const BalanceOptions& options = {}, const PlanLimits& limits = {}) {
  balance_detail::check_footprint(problem, limits);
  balance_detail::check_masked_problem(problem);
  balance_detail::Planner planner(problem);
  if (problem.mask == AttentionMask::causal()) return balance_detail::masked_plan(planner, planner.plan(options), problem.mask);
  return balance_detail::masked_plan(planner, balance_detail::MaskPlanner(planner, problem.mask).plan(), problem.mask);
}

/// Baseline: every piece whole, attended on its own home rank (moves nothing).
inline QkvDocumentsPlan plan_unbalanced(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  balance_detail::check_footprint(problem, limits);
  balance_detail::check_masked_problem(problem);
  balance_detail::Planner planner(problem);
  return balance_detail::masked_plan(planner, planner.unbalanced(), problem.mask);
}

/// The per-rank form of a documents-form plan whose documents each live on
/// one rank (every plan of a per-rank problem): document order kept within
/// each rank. Throws invalid_input naming the first document that spans ranks.
inline QkvPlan to_rank_plan(const QkvDocumentsPlan& plan) {
  using detail::fail;
  if (plan.world_size <= 0) fail("to_rank_plan: world_size = ", plan.world_size, " must be at least 1");
  QkvPlan out;
  out.world_size = plan.world_size;
  out.max_cp_degree = plan.max_cp_degree;
  out.ranks.resize(static_cast<std::size_t>(plan.world_size));
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty()) fail("to_rank_plan: documents[", i, "] has no shards");
    const std::int64_t home = shards.front().rank;
    if (home < 0 || home >= plan.world_size) fail("to_rank_plan: documents[", i, "].shards[0].rank = ", home, " is outside [0, ", plan.world_size, ")");
    Document doc;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      if (shards[k].rank != home) {
        fail("to_rank_plan: documents[", i, "] spans ranks ", home, " and ", shards[k].rank, " (shards[", k, "]); only the documents form holds it");
      }
      doc.shard_len.push_back(shards[k].len);
      doc.dst.push_back(shards[k].dst);
    }
    out.ranks[static_cast<std::size_t>(home)].docs.push_back(std::move(doc));
  }
  return out;
}

/// The documents of a documents-form plan as a packed batch: consecutive
/// shards with one home rank form a piece; C from the plan (its largest
/// shard count when unset).
inline BalanceProblem balance_problem_of(const QkvDocumentsPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  BalanceProblem p;
  p.world_size = plan.world_size;
  p.q_bytes = q_bytes;
  p.kv_bytes = kv_bytes;
  p.max_cp_degree = plan.max_cp_degree.value_or(1);
  for (const PackedDocument& doc : plan.documents) {
    auto& pieces = p.documents.emplace_back();
    for (const DocumentShard& s : doc.shards) {
      if (!pieces.empty() && pieces.back().rank == s.rank) pieces.back().len = detail::add_tokens(pieces.back().len, s.len, "balance_problem_of");
      else pieces.push_back({s.rank, s.len});
    }
    if (!plan.max_cp_degree) p.max_cp_degree = std::max(p.max_cp_degree, static_cast<std::int64_t>(doc.shards.size()));
  }
  return p;
}

/// The documents of a per-rank plan as a balancing problem: each rank's
/// document lengths in order, C from the plan (its largest shard count when unset).
inline BalanceProblem balance_problem_of(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  BalanceProblem p = balance_problem_of(to_documents(plan), q_bytes, kv_bytes);
  // to_documents lists rank 0's documents, then rank 1's, ...; each is one piece on its rank.
  auto piece = p.documents.begin();
  for (const RankDocuments& rank : plan.ranks) {
    auto& lengths = p.docs.emplace_back();
    for (std::size_t i = 0; i < rank.docs.size(); ++i, ++piece) lengths.push_back(piece->empty() ? 0 : piece->front().len);
  }
  p.documents.clear();
  return p;
}

/// How many documents of a packed batch span more than one rank.
inline std::size_t spanning_documents(const std::vector<std::vector<DocumentPiece>>& documents) {
  std::size_t n = 0;
  for (const auto& doc : documents)
    n += std::any_of(doc.begin(), doc.end(), [&](const DocumentPiece& pc) { return pc.rank != doc.front().rank; }) ? 1u : 0u;
  return n;
}

/// The most ranks any document of a packed batch spans.
inline std::size_t widest_span(const std::vector<std::vector<DocumentPiece>>& documents) {
  std::size_t widest = 0;
  for (const auto& doc : documents) {
    std::vector<std::int64_t> ranks;
    for (const DocumentPiece& pc : doc) ranks.push_back(pc.rank);
    std::sort(ranks.begin(), ranks.end());
    widest = std::max(widest, static_cast<std::size_t>(std::unique(ranks.begin(), ranks.end()) - ranks.begin()));
  }
  return widest;
}

namespace balance_detail {

/// One greedy move: the costliest whole shard on rank `hi` within `amount`,
/// else a cut off the end of its costliest shard that can still be cut
/// (within the document's C), moved to rank `lo`. The cost moved, 0 for none.
inline std::int64_t greedy_move(std::vector<std::vector<Shard>>& shards, std::vector<std::int64_t>& count, const std::vector<Piece>& pieces,
                                std::size_t hi, std::size_t lo, std::int64_t amount, std::int64_t C) {
  Shard* whole = nullptr;
  std::vector<Shard>* cut_piece = nullptr;
  std::size_t cut_i = 0;
  std::int64_t whole_cost = 0, cut_cost = 0;
  for (auto& ps : shards) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].dst != hi) continue;
      const std::int64_t c = pairs(ps[i].begin, ps[i].end);
      if (c <= amount && c > whole_cost) whole = &ps[i], whole_cost = c;
      if (c > amount && c > cut_cost && count[pieces[ps[i].piece].document] < C && ps[i].end - ps[i].begin > 1) {
        cut_piece = &ps, cut_i = i, cut_cost = c;
      }
    }
  }
  if (whole) {
    whole->dst = lo;
    return whole_cost;
  }
  if (!cut_piece) return 0;
  const Shard s = (*cut_piece)[cut_i];
  const std::int64_t m = std::clamp(min_begin(s.begin, s.end, amount), s.begin + 1, s.end - 1);
  (*cut_piece)[cut_i].end = m;
  cut_piece->insert(cut_piece->begin() + static_cast<std::ptrdiff_t>(cut_i) + 1, Shard{s.piece, m, s.end, lo});
  ++count[pieces[s.piece].document];
  return pairs(m, s.end);
}

}  // namespace balance_detail

/// Baseline: repeatedly move work from the most loaded rank to the least
/// loaded one, either the costliest whole shard that fits the least loaded
/// rank's deficit or, when none does, a shard cut off the end of the
/// costliest shard sized to that deficit (inside its piece, at most C shards
/// per document), until the largest cost is within `within` of the level any
/// plan could reach (balance_lower_bound) or no move is left. Ignores
/// receive capacities.
inline QkvDocumentsPlan plan_greedy(const BalanceProblem& problem, double within = 0.10, const PlanLimits& limits = {}) {
  using namespace balance_detail;
  check_footprint(problem, limits);
  Planner planner(problem);
  const auto& pieces = planner.pieces();
  const std::size_t W = planner.world();
  std::vector<std::vector<Shard>> shards(pieces.size());  // per piece, in order
  std::vector<std::int64_t> load(W, 0), count(planner.num_documents(), 0);
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    shards[id].push_back({id, pieces[id].begin, pieces[id].end, pieces[id].home});
    load[pieces[id].home] += pieces[id].cost;
    ++count[pieces[id].document];
  }
  const auto level = static_cast<std::int64_t>(std::ceil(planner.lower_bound()));
  const auto stop = static_cast<std::int64_t>(static_cast<double>(level) * (1.0 + within));
  const std::size_t max_moves = 64 * W + 4 * pieces.size();
  for (std::size_t move = 0; move < max_moves && !pieces.empty(); ++move) {
    const auto hi = static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto lo = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (load[hi] <= stop) break;
    const std::int64_t amount = std::min(load[hi] - level, level - load[lo]);
    if (amount <= 0) break;
    const std::int64_t moved = greedy_move(shards, count, pieces, hi, lo, amount, planner.cp_degree());
    if (moved == 0) break;
    load[hi] -= moved;
    load[lo] += moved;
  }
  std::vector<Shard> all;
  for (const auto& ps : shards) all.insert(all.end(), ps.begin(), ps.end());
  return planner.to_plan(make_layout(all, pieces, problem.q_bytes, problem.kv_bytes));
}

/// Baseline: per-document zig-zag, the causal load balancing of Megatron-LM
/// and Transformer Engine. Every document is cut into 2W chunks of (nearly)
/// equal length, chunk i attended on rank min(i, 2W-1-i), so each rank gets
/// one early and one late chunk of every document; chunks are further cut at
/// piece boundaries (a shard keeps its piece's home). Ignores C and receive
/// capacities: the plan's max_cp_degree is the most shards it gives a
/// document (up to 2W - 1 plus the piece boundaries).
inline QkvDocumentsPlan plan_zigzag(const BalanceProblem& problem, const PlanLimits& limits = {}) {
  using namespace balance_detail;
  check_footprint(problem, limits, 2 * static_cast<std::uint64_t>(std::max<std::int64_t>(problem.world_size, 0)));  // 2W chunks a document
  BalanceProblem wide = problem;  // C does not limit zig-zag: only every piece's own shard
  for (const auto& doc : problem.documents) wide.max_cp_degree = std::max(wide.max_cp_degree, static_cast<std::int64_t>(doc.size()));
  Planner planner(wide);  // validates, and lists the pieces
  const auto& pieces = planner.pieces();
  const auto W = static_cast<std::int64_t>(planner.world());
  std::vector<std::int64_t> doc_len(planner.num_documents(), 0);
  for (const Piece& pc : pieces) doc_len[pc.document] = pc.end;
  std::vector<Shard> shards;
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    const Piece& pc = pieces[id];
    const std::int64_t L = doc_len[pc.document];
    auto chunk_start = [&](std::int64_t i) { return L / (2 * W) * i + L % (2 * W) * i / (2 * W); };
    // The chunk holding position pc.begin, then every chunk up to pc.end.
    std::int64_t i = std::min(2 * W - 1, pc.begin / std::max<std::int64_t>(1, L / (2 * W)));
    while (i > 0 && chunk_start(i) > pc.begin) --i;
    while (i + 1 < 2 * W && chunk_start(i + 1) <= pc.begin) ++i;
    for (std::int64_t a = pc.begin; a < pc.end; ++i) {
      const std::int64_t b = i + 1 < 2 * W ? std::min(pc.end, chunk_start(i + 1)) : pc.end;
      if (b > a) shards.push_back({id, a, b, static_cast<std::size_t>(std::min(i, 2 * W - 1 - i))});
      a = b;
    }
  }
  QkvDocumentsPlan out = planner.to_plan(make_layout(shards, pieces, problem.q_bytes, problem.kv_bytes));
  out.mask = problem.mask;
  std::int64_t most = 1;
  for (const PackedDocument& d : out.documents) most = std::max(most, static_cast<std::int64_t>(d.shards.size()));
  out.max_cp_degree = most;
  return out;
}

namespace balance_detail {

/// Checked arithmetic for plan_cost.
inline void add_to(std::int64_t& acc, std::int64_t v) {
  if (__builtin_add_overflow(acc, v, &acc)) fail("plan_cost: a total overflows 64 bits");
}
inline std::int64_t times(std::int64_t a, std::int64_t b) {
  std::int64_t v = 0;
  if (__builtin_mul_overflow(a, b, &v)) fail("plan_cost: a byte count overflows 64 bits");
  return v;
}

inline PlanCost empty_cost(std::int64_t world_size, const PlanLimits& limits) {
  if (world_size <= 0) fail("plan_cost: world_size = ", world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(world_size);
  detail::check_footprint(limits, footprint::plan_cost(W), "plan_cost", detail::concat("the [W][W] byte matrix of world_size = ", W));
  PlanCost out;
  out.world_size = world_size;
  out.attention.assign(W, 0);
  out.kv_tokens.assign(W, 0);
  out.bytes.assign(W * W, 0);
  return out;
}

/// Adds one document's shards (validated) to `out`: attention and KV group
/// at each shard's destination; its queries when attended off home, and a
/// copy of every key-value shard 0..i whose home is not the destination.
/// `held` is scratch: the tokens so far per home rank of this document.
inline void add_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                         std::vector<std::pair<std::size_t, std::int64_t>>& held) {
  const auto W = static_cast<std::size_t>(out.world_size);
  held.clear();
  std::int64_t context = 0;
  for (const DocumentShard& s : shards) {
    const auto home = static_cast<std::size_t>(s.rank), d = static_cast<std::size_t>(s.dst);
    add_to(out.attention[d], attention_cost(context, s.len));
    const std::int64_t end = detail::add_tokens(context, s.len, "plan_cost");
    add_to(out.kv_tokens[d], end);
    auto it = std::find_if(held.begin(), held.end(), [&](const auto& h) { return h.first == home; });
    if (it == held.end()) it = held.insert(held.end(), {home, 0});
    it->second += s.len;
    if (d != home) {
      const std::int64_t qb = times(q_bytes, s.len);
      add_to(out.bytes[home * W + d], qb);
      add_to(out.query_bytes, qb);
    }
    for (const auto& [from, tokens] : held) {
      if (from == d) continue;
      const std::int64_t kvb = times(kv_bytes, tokens);
      add_to(out.bytes[from * W + d], kvb);
      add_to(out.kv_bytes, kvb);
    }
    context = end;
  }
}

/// The same under a mask other than causal (section 2d): query shard i costs
/// the pairs the mask lets through, holds KV shards lo(i)..hi(i), and gets
/// a copy of each of them whose home is not its destination.
inline void add_masked_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                                detail::DocumentRanges& need) {
  const auto W = static_cast<std::size_t>(out.world_size);
  std::vector<std::int64_t> len, start;
  std::int64_t total = 0;
  for (const DocumentShard& s : shards) {
    len.push_back(s.len);
    start.push_back(total);
    total = detail::add_tokens(total, s.len, "plan_cost");
  }
  need.compute(out.mask, len.data(), len.size());
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto home = static_cast<std::size_t>(shards[i].rank), d = static_cast<std::size_t>(shards[i].dst);
    add_to(out.attention[d], attention_pairs(out.mask, start[i], len[i], total));
    add_to(out.kv_tokens[d], start[need.hi[i]] + len[need.hi[i]] - start[need.lo[i]]);
    if (d != home) {
      const std::int64_t qb = times(q_bytes, len[i]);
      add_to(out.bytes[home * W + d], qb);
      add_to(out.query_bytes, qb);
    }
    for (std::size_t k = need.lo[i]; k <= need.hi[i]; ++k) {
      const auto from = static_cast<std::size_t>(shards[k].rank);
      if (from == d) continue;
      const std::int64_t kvb = times(kv_bytes, len[k]);
      add_to(out.bytes[from * W + d], kvb);
      add_to(out.kv_bytes, kvb);
    }
  }
}

/// One document into `out`, as its mask sends it.
inline void add_any_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                             std::vector<std::pair<std::size_t, std::int64_t>>& held, detail::DocumentRanges& need) {
  if (out.mask == AttentionMask::causal()) {
    add_document(out, shards, q_bytes, kv_bytes, held);
  } else {
    add_masked_document(out, shards, q_bytes, kv_bytes, need);
  }
}

}  // namespace balance_detail

/// Attention cost and bytes moved of a documents-form plan, counted as the
/// layout of docs/plan-format.md sends them (see the top of this header).
/// Throws invalid_input naming `documents[i].shards[k].<field>` for a home
/// or destination outside [0, W), a non-positive length or an empty document.
inline PlanCost plan_cost(const QkvDocumentsPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1, const PlanLimits& limits = {}) {
  using detail::fail;
  PlanCost out = balance_detail::empty_cost(plan.world_size, limits);
  out.mask = plan.mask;
  detail::check_mask(plan.mask);
  detail::DocumentRanges need;
  std::vector<std::pair<std::size_t, std::int64_t>> held;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty()) fail("plan_cost: documents[", i, "] has no shards");
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const DocumentShard& s = shards[k];
      if (s.rank < 0 || s.rank >= plan.world_size) fail("plan_cost: documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", plan.world_size, ")");
      if (s.dst < 0 || s.dst >= plan.world_size) fail("plan_cost: documents[", i, "].shards[", k, "].dst = ", s.dst, " is outside [0, ", plan.world_size, ")");
      if (s.len <= 0) fail("plan_cost: documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
    }
    balance_detail::add_any_document(out, shards, q_bytes, kv_bytes, held, need);
  }
  balance_detail::add_to(out.bytes_moved, out.query_bytes);
  balance_detail::add_to(out.bytes_moved, out.kv_bytes);
  return out;
}

/// Attention cost and bytes moved of a per-rank plan (every document on
/// one rank), counted as for the documents form.
inline PlanCost plan_cost(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1, const PlanLimits& limits = {}) {
  using detail::fail;
  PlanCost out = balance_detail::empty_cost(plan.world_size, limits);
  out.mask = plan.mask;
  detail::check_mask(plan.mask);
  detail::DocumentRanges need;
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (plan.ranks.size() != W) fail("plan_cost: ranks has ", plan.ranks.size(), " entries, but world_size = ", W);
  std::vector<std::pair<std::size_t, std::int64_t>> held;
  std::vector<DocumentShard> shards;
  for (std::size_t r = 0; r < W; ++r) {
    const auto& docs = plan.ranks[r].docs;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      const Document& doc = docs[i];
      if (doc.dst.size() != doc.shard_len.size()) {
        fail("plan_cost: ranks[", r, "].docs[", i, "].dst has ", doc.dst.size(), " entries but shard_len has ", doc.shard_len.size());
      }
      shards.clear();
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
        const std::int64_t len = doc.shard_len[s], d = doc.dst[s];
        if (len <= 0) fail("plan_cost: ranks[", r, "].docs[", i, "].shard_len[", s, "] = ", len, " must be positive");
        if (d < 0 || d >= plan.world_size) fail("plan_cost: ranks[", r, "].docs[", i, "].dst[", s, "] = ", d, " is outside [0, ", W, ")");
        shards.push_back({static_cast<std::int64_t>(r), len, d});
      }
      balance_detail::add_any_document(out, shards, q_bytes, kv_bytes, held, need);
    }
  }
  balance_detail::add_to(out.bytes_moved, out.query_bytes);
  balance_detail::add_to(out.bytes_moved, out.kv_bytes);
  return out;
}

}  // namespace cpdispatch
