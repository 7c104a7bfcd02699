#pragma once
// Load-balanced dispatch planning: the library chooses the QKV plan.
//
// Input: the lengths of the documents each rank holds in the MLP layout, the
// most shards per document C, optionally a receive capacity per rank, and the
// bytes per token of queries and of key-values. Output: a QkvPlan (documents
// cut into contiguous shards, each with an attention destination) that
//   1. minimises the largest attention cost of any rank, where a query shard
//      of q tokens after p tokens of its document costs q*p + q*(q+1)/2
//      (causal token pairs), and
//   2. among plans whose largest cost is within `cost_slack` of the best found,
//      moves the fewest bytes, counted exactly as the spec's layout sends them:
//      q_bytes per query token sent off its home rank, kv_bytes per token of
//      every key-value copy sent off its home rank (query shard i attends to
//      key-value shards 0..i, each copied to it; two query shards of one
//      document on one rank get their own copies).
//
// The algorithm (balance_detail::Planner) searches the target T on the
// largest rank cost upward from the lower bound (balance_lower_bound), and
// builds a plan for one T in three steps:
//   1. a document that costs more than T is cut into the fewest equal-cost
//      shards under T (later shards are shorter; C at most); its home keeps
//      the shard that would cost the most bytes to send, the others go to
//      the ranks with the most room left after their own documents;
//   2. everything else stays home, except that a rank over T sends pieces
//      away one at a time, each time the choice moving the fewest bytes per
//      unit of cost: a document's whole rest, its front (the head alone
//      moves, with only its own key-values) or its back (the tail moves, and
//      its whole context with it), sized to what the rank must shed or to the
//      receiving rank's room, into the tightest room that takes all it must
//      shed, else the roomiest; a document never exceeds C shards;
//   3. a rank with room left takes back its own pieces that fit.
// Step 1 is also tried with one shard more, and not at all (step 2 then cuts
// those documents too); the cheapest construction that reaches T wins. The
// smallest T reached (within 0.1%) is then relaxed by up to `cost_slack` when
// that moves fewer bytes. Deterministic: integer arithmetic and fixed
// tie-breaks throughout (a floating square root only seeds cut positions,
// which are then fixed exactly in integers).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// What load-balanced planning starts from.
struct BalanceProblem {
  std::int64_t world_size = 0;
  std::int64_t max_cp_degree = 1;  ///< C: the most shards one document may be cut into
  /// [W]: the lengths of the documents each rank holds, in MLP-layout order.
  std::vector<std::vector<std::int64_t>> docs;
  /// Empty, or [W]: the most tokens each rank's attention layout may hold,
  /// counted as its KV groups (context + own length of every query shard it
  /// attends), which also bounds its query tokens.
  std::vector<std::int64_t> recv_capacity;
  std::int64_t q_bytes = 1;   ///< bytes of one query token (weighs communication)
  std::int64_t kv_bytes = 1;  ///< bytes of one key-value token
};

struct BalanceOptions {
  /// Plans whose largest rank cost is within this fraction of the best found
  /// count as equal; among them the one moving the fewest bytes wins.
  double cost_slack = 0.01;
  /// When positive, replaces the slack: plans whose largest rank cost is at
  /// most this count as equal (e.g. to compare bytes with another plan at
  /// its level of balance).
  std::int64_t cost_limit = 0;
};

/// What a plan costs: attention work and communication, per rank.
struct PlanCost {
  std::int64_t world_size = 0;
  std::vector<std::int64_t> attention;  ///< [W] causal token pairs each rank attends
  std::vector<std::int64_t> kv_tokens;  ///< [W] tokens of the KV groups each rank holds (what recv_capacity limits)
  std::vector<std::int64_t> bytes;      ///< [W * W] bytes rank `src` (row) sends rank `dst` (column); diagonal 0
  std::int64_t bytes_moved = 0;         ///< sum of `bytes`
  std::int64_t query_bytes = 0;         ///< of which queries
  std::int64_t kv_bytes = 0;            ///< of which key-value copies

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

/// The fewest contiguous pieces of [a, b) that each cost at most `limit`
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

/// The cheapest largest piece of [0, len) cut into at most `c` contiguous pieces.
inline std::int64_t min_max_piece(std::int64_t len, std::int64_t c) noexcept {
  const std::int64_t total = pairs(0, len);
  std::int64_t lo = (total + c - 1) / c, hi = total;  // hi always works
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (pieces_needed(0, len, mid, c) <= c) hi = mid; else lo = mid + 1;
  }
  return hi;
}

/// n + 1 boundaries cutting [a, b) into n pieces of (nearly) equal cost,
/// every piece at least one token (n <= b - a).
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

/// One contiguous piece [begin, end) of document `doc` and the rank attending it.
struct Piece {
  std::size_t doc = 0;
  std::int64_t begin = 0, end = 0;
  std::size_t dst = 0;
};

/// Bytes a piece [a, b) of a document moves when attended away from home:
/// its queries, and a copy of key-value shards 0..b (its context and itself).
inline std::int64_t away_bytes(std::int64_t a, std::int64_t b, std::int64_t q_bytes, std::int64_t kv_bytes) noexcept {
  return q_bytes * (b - a) + kv_bytes * b;
}

struct Doc {
  std::size_t home = 0;   ///< rank holding it in the MLP layout
  std::size_t index = 0;  ///< its place on that rank
  std::int64_t len = 0;
  std::int64_t cost = 0;  ///< pairs(0, len)
};

/// One candidate plan: every document's pieces, documents in order, each
/// document's pieces in order; pieces[first[d] .. first[d+1]) are document d's.
struct Layout {
  std::vector<Piece> pieces;
  std::vector<std::size_t> first;
  std::int64_t max_cost = 0;
  std::int64_t bytes = 0;
};

/// Sorts pieces by document and position, merges neighbours attended on one
/// rank, and fills `first` and `bytes` (`max_cost` is the caller's).
inline Layout make_layout(std::vector<Piece>& pieces, const std::vector<Doc>& docs, std::int64_t q, std::int64_t kv) {
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& x, const Piece& y) { return x.doc != y.doc ? x.doc < y.doc : x.begin < y.begin; });
  Layout out;
  out.pieces.reserve(pieces.size());
  out.first.assign(docs.size() + 1, 0);
  for (const Piece& pc : pieces) {
    Piece* last = out.pieces.empty() ? nullptr : &out.pieces.back();
    if (last && last->doc == pc.doc && last->dst == pc.dst && last->end == pc.begin) last->end = pc.end;
    else out.pieces.push_back(pc);
  }
  for (const Piece& pc : out.pieces) {
    ++out.first[pc.doc + 1];
    if (pc.dst != docs[pc.doc].home) out.bytes += away_bytes(pc.begin, pc.end, q, kv);
  }
  for (std::size_t d = 0; d < docs.size(); ++d) out.first[d + 1] += out.first[d];
  return out;
}

/// How one construction treats documents that cost more than the target.
struct Variant {
  bool precut = true;        ///< cut them first into equal-cost shards placed on the roomiest ranks
  bool extra_piece = false;  ///< ... one shard more than needed
};

class Planner {
 public:
  explicit Planner(const BalanceProblem& p) : p_(p) {
    if (p.world_size <= 0) fail("plan_balanced: world_size = ", p.world_size, " must be at least 1");
    W_ = static_cast<std::size_t>(p.world_size);
    if (p.docs.size() != W_) fail("plan_balanced: docs has ", p.docs.size(), " ranks, but world_size = ", W_);
    if (p.max_cp_degree <= 0) fail("plan_balanced: max_cp_degree = ", p.max_cp_degree, " must be at least 1");
    if (p.max_cp_degree > max_supported_cp_degree) {
      fail("plan_balanced: max_cp_degree = ", p.max_cp_degree, " exceeds the supported maximum of ", max_supported_cp_degree);
    }
    if (p.q_bytes < 0 || p.kv_bytes < 0) {
      fail("plan_balanced: q_bytes = ", p.q_bytes, " and kv_bytes = ", p.kv_bytes, " must not be negative");
    }
    C_ = p.max_cp_degree;
    home_load_.assign(W_, 0);
    docs_of_.resize(W_);
    std::int64_t tokens = 0;
    for (std::size_t r = 0; r < W_; ++r) {
      for (std::size_t i = 0; i < p.docs[r].size(); ++i) {
        const std::int64_t len = p.docs[r][i];
        if (len <= 0) fail("plan_balanced: docs[", r, "][", i, "] = ", len, " must be positive");
        std::int64_t sq = 0;
        if (__builtin_mul_overflow(len, len + 1, &sq)) {
          fail("plan_balanced: docs[", r, "][", i, "] = ", len, " tokens: its attention cost overflows 64 bits");
        }
        const std::int64_t cost = sq / 2;
        if (__builtin_add_overflow(total_, cost, &total_) || total_ > unlimited) {
          fail("plan_balanced: the total attention cost overflows 64 bits (documents too long)");
        }
        tokens = detail::add_tokens(tokens, len, "plan_balanced");
        home_load_[r] += cost;
        docs_of_[r].push_back(docs_.size());
        docs_.push_back({r, i, len, cost});
      }
    }
    // Byte counts of any plan stay below (q + C * kv) * tokens.
    if (static_cast<long double>(p.q_bytes + C_ * p.kv_bytes) * static_cast<long double>(tokens) > static_cast<long double>(unlimited)) {
      fail("plan_balanced: byte counts overflow 64 bits (q_bytes = ", p.q_bytes, ", kv_bytes = ", p.kv_bytes, ", ", tokens, " tokens)");
    }
    by_cost_.resize(docs_.size());
    std::iota(by_cost_.begin(), by_cost_.end(), std::size_t{0});
    std::stable_sort(by_cost_.begin(), by_cost_.end(), [&](std::size_t x, std::size_t y) { return docs_[x].cost > docs_[y].cost; });
    cap_.assign(W_, unlimited);
    if (!p.recv_capacity.empty()) {
      if (p.recv_capacity.size() != W_) {
        fail("plan_balanced: recv_capacity has ", p.recv_capacity.size(), " entries, but world_size = ", W_);
      }
      for (std::size_t r = 0; r < W_; ++r) {
        if (p.recv_capacity[r] < 0) fail("plan_balanced: recv_capacity[", r, "] = ", p.recv_capacity[r], " is negative");
        cap_[r] = std::min(p.recv_capacity[r], unlimited);
      }
      check_capacity(tokens);
    }
  }

  /// The mean cost and the cheapest largest shard of the costliest document:
  /// no plan's largest rank cost is below either.
  double lower_bound() const {
    if (docs_.empty()) return 0;
    const double mean = static_cast<double>(total_) / static_cast<double>(W_);
    const Doc& top = docs_[by_cost_.front()];
    return std::max(mean, static_cast<double>(min_max_piece(top.len, std::min(C_, top.len))));
  }

  /// The balanced layout: the smallest target a construction reaches, then
  /// the fewest bytes within the slack (or within `cost_limit`).
  Layout plan(const BalanceOptions& opt) {
    if (docs_.empty()) return unbalanced();
    const auto lb = static_cast<std::int64_t>(std::ceil(lower_bound()));
    const std::int64_t top = *std::max_element(home_load_.begin(), home_load_.end());
    std::optional<Layout> found = reach(lb);
    std::int64_t target = lb;
    if (!found) {
      // Widen geometrically from the bound (plans usually land within a few
      // percent of it), then bisect to 0.1%.
      std::int64_t lo = lb, hi = lb;  // lo fails, hi reaches
      for (std::int64_t step = std::max<std::int64_t>(1, lb / 256); !found; step *= 4) {
        lo = hi;
        if (lo >= total_) capacity_failure();  // not even with no limit on cost
        hi = std::min(total_, lo + step);
        if (lo < top && hi > top) hi = top;  // where every document stays home
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
    }
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

  /// Every document whole on its own rank.
  Layout unbalanced() const {
    std::vector<Piece> pieces;
    for (std::size_t id = 0; id < docs_.size(); ++id) pieces.push_back({id, 0, docs_[id].len, docs_[id].home});
    Layout out = make_layout(pieces, docs_, p_.q_bytes, p_.kv_bytes);
    out.max_cost = *std::max_element(home_load_.begin(), home_load_.end());
    return out;
  }

  /// A QkvPlan from a layout: every rank's documents in their MLP order.
  QkvPlan to_plan(const Layout& layout) const {
    QkvPlan out;
    out.world_size = p_.world_size;
    out.max_cp_degree = C_;
    out.ranks.resize(W_);
    for (std::size_t r = 0; r < W_; ++r) {
      for (std::size_t id : docs_of_[r]) {
        Document d;
        for (std::size_t k = layout.first[id]; k < layout.first[id + 1]; ++k) {
          d.shard_len.push_back(layout.pieces[k].end - layout.pieces[k].begin);
          d.dst.push_back(static_cast<std::int64_t>(layout.pieces[k].dst));
        }
        out.ranks[r].docs.push_back(std::move(d));
      }
    }
    return out;
  }

  const std::vector<Doc>& docs() const { return docs_; }
  std::size_t world() const { return W_; }
  std::int64_t cp_degree() const { return C_; }

 private:
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  static constexpr Variant variants[] = {{true, false}, {false, false}, {true, true}};

  /// The first variant that reaches target T (for the search).
  std::optional<Layout> reach(std::int64_t T) {
    for (const Variant& v : variants) {
      if (v.extra_piece && C_ == 1) continue;
      if (auto l = construct(T, v)) return l;
    }
    return std::nullopt;
  }

  /// The variant reaching target T with the fewest bytes.
  std::optional<Layout> cheapest(std::int64_t T) {
    std::optional<Layout> best;
    for (const Variant& v : variants) {
      if (v.extra_piece && C_ == 1) continue;
      auto l = construct(T, v);
      if (l && (!best || l->bytes < best->bytes || (l->bytes == best->bytes && l->max_cost < best->max_cost))) best = std::move(l);
    }
    return best;
  }

  struct Range {
    std::int64_t lo, hi;
  };

  /// Puts [a, b) of document `doc` on rank d.
  void place(std::size_t doc, std::int64_t a, std::int64_t b, std::size_t d) {
    pieces_.push_back({doc, a, b, d});
    excess_[d] += pairs(a, b);
    kv_excess_[d] += b;
  }

  /// Every piece of the cut non-empty and costing at most T.
  static bool fits_under(const std::vector<std::int64_t>& cut, std::int64_t T) {
    for (std::size_t i = 0; i + 1 < cut.size(); ++i)
      if (cut[i + 1] <= cut[i] || pairs(cut[i], cut[i + 1]) > T) return false;
    return true;
  }

  std::int64_t away_bytes(std::int64_t a, std::int64_t b) const { return balance_detail::away_bytes(a, b, p_.q_bytes, p_.kv_bytes); }

  /// One plan whose largest rank cost is at most T, or nothing.
  std::optional<Layout> construct(std::int64_t T, Variant v) {
    pieces_.clear();
    excess_.assign(W_, -T);  // cost above T on each rank (negative: room left)
    kv_excess_.resize(W_);
    for (std::size_t r = 0; r < W_; ++r) kv_excess_[r] = -cap_[r];
    // ---- documents above the target: equal-cost shards, the home keeps the
    // one costliest to send, the others go where the most room is left
    // after each rank's own documents
    pending_ = home_load_;  // cost each rank still holds of its own, not yet placed
    home_.assign(docs_.size(), Range{0, 0});
    shards_.assign(docs_.size(), 1);
    giants_.clear();
    for (std::size_t id : by_cost_) {
      if (!v.precut || docs_[id].cost <= T) break;
      giants_.push_back(id);
      pending_[docs_[id].home] -= docs_[id].cost;
    }
    cuts_.resize(giants_.size());
    kept_.resize(giants_.size());
    for (std::size_t g = 0; g < giants_.size(); ++g) {
      const Doc& d = docs_[giants_[g]];
      std::int64_t n = pieces_needed(0, d.len, T, C_);
      if (n > C_) return std::nullopt;
      if (v.extra_piece && n < C_ && n < d.len) ++n;
      cuts_[g] = equal_cost_cuts(0, d.len, n);
      if (!fits_under(cuts_[g], T)) {
        // Rounding pushed a piece over T: cut greedily at T instead, leaving every piece a token.
        for (std::size_t k = 1; k < static_cast<std::size_t>(n); ++k) {
          cuts_[g][k] = std::min(max_end(cuts_[g][k - 1], d.len, T), d.len - (n - static_cast<std::int64_t>(k)));
        }
        if (!fits_under(cuts_[g], T)) return std::nullopt;
      }
      shards_[giants_[g]] = n;
      std::size_t& keep = kept_[g];
      keep = none;
      for (std::size_t i = 0; i + 1 < cuts_[g].size(); ++i) {
        const std::int64_t a = cuts_[g][i], b = cuts_[g][i + 1];
        if (excess_[d.home] + pairs(a, b) <= 0 && kv_excess_[d.home] + b <= 0 &&
            (keep == none || away_bytes(a, b) > away_bytes(cuts_[g][keep], cuts_[g][keep + 1]))) {
          keep = i;
        }
      }
      if (keep != none) place(giants_[g], cuts_[g][keep], cuts_[g][keep + 1], d.home);
    }
    for (std::size_t g = 0; g < giants_.size(); ++g) {
      const std::size_t id = giants_[g], first = pieces_.size();
      for (std::size_t i = 0; i + 1 < cuts_[g].size(); ++i) {
        if (i == kept_[g]) continue;
        const std::int64_t a = cuts_[g][i], b = cuts_[g][i + 1], c = pairs(a, b);
        std::size_t to = none;
        for (std::size_t r = 0; r < W_; ++r) {
          if (r == docs_[id].home || excess_[r] + c > 0 || kv_excess_[r] + b > 0) continue;
          bool taken = false;  // one shard of a document per rank
          for (std::size_t k = first; k < pieces_.size(); ++k) taken = taken || pieces_[k].dst == r;
          if (taken) continue;
          if (to == none || excess_[r] + pending_[r] < excess_[to] + pending_[to]) to = r;
        }
        if (to == none) return std::nullopt;
        place(id, a, b, to);
      }
    }
    // ---- the rest stays home, except what a rank over the target sends
    // away: piece by piece, the fewest bytes per unit of cost, into the room
    // other ranks have left
    for (std::size_t id = 0; id < docs_.size(); ++id) {
      if (v.precut && docs_[id].cost > T) continue;  // placed above
      home_[id] = Range{0, docs_[id].len};
      excess_[docs_[id].home] += docs_[id].cost;
      kv_excess_[docs_[id].home] += docs_[id].len;
    }
    // The rank furthest over sends next (ranks over only for the capacity
    // after them), so ranks over the target share the largest rooms.
    over_.clear();
    rooms_.clear();  // the ranks that can take work, by room
    for (std::size_t r = 0; r < W_; ++r) {
      if (excess_[r] > 0 || kv_excess_[r] > 0) over_.insert({excess_[r], r});
      else if (excess_[r] < 0 && kv_excess_[r] < 0) rooms_.insert({-excess_[r], r});
    }
    while (!over_.empty()) {
      const std::size_t r = std::prev(over_.end())->second;
      over_.erase(std::prev(over_.end()));
      if (!send_one(r)) return std::nullopt;
      if (excess_[r] > 0 || kv_excess_[r] > 0) over_.insert({excess_[r], r});
      else if (excess_[r] < 0 && kv_excess_[r] < 0) rooms_.insert({-excess_[r], r});
    }
    for (std::size_t id = 0; id < docs_.size(); ++id)
      if (home_[id].hi > home_[id].lo) pieces_.push_back({id, home_[id].lo, home_[id].hi, docs_[id].home});
    // ---- a rank with room left takes back its own pieces that fit
    for (Piece& pc : pieces_) {
      const std::size_t home = docs_[pc.doc].home;
      const std::int64_t c = pairs(pc.begin, pc.end);
      if (pc.dst == home || excess_[home] + c > 0 || kv_excess_[home] + pc.end > 0) continue;
      excess_[pc.dst] -= c;
      kv_excess_[pc.dst] -= pc.end;
      excess_[home] += c;
      kv_excess_[home] += pc.end;
      pc.dst = home;
    }
    Layout out = make_layout(pieces_, docs_, p_.q_bytes, p_.kv_bytes);
    out.max_cost = T + *std::max_element(excess_.begin(), excess_.end());
    return out;
  }

  /// Rank r sends one piece of one of its documents into the room another
  /// rank has left: of its documents' whole rest, front piece (just enough
  /// cost, or what the room takes) and back piece, the one moving the fewest
  /// bytes per unit of cost shed. With no cost left to shed it sends whole
  /// rests, for the receive capacity. False when nothing can go.
  bool send_one(std::size_t r) {
    const std::int64_t need = excess_[r];
    // The receiver: the tightest room that takes all of `need`, else the roomiest.
    if (rooms_.empty()) return false;
    auto slot = need > 0 ? rooms_.lower_bound({need, 0}) : rooms_.end();
    if (slot == rooms_.end()) slot = std::prev(rooms_.end());
    const std::size_t to = slot->second;
    const std::int64_t room = -excess_[to], kv_room = -kv_excess_[to];
    enum Kind { whole, front, back };
    struct Choice {
      std::size_t id;
      Kind kind;
      std::int64_t cut, bytes, gain;
    };
    std::optional<Choice> best;
    auto consider = [&](const Choice& c) {
      if (c.gain <= 0) return;
      if (best) {
        const long double lhs = static_cast<long double>(c.bytes) * static_cast<long double>(best->gain);
        const long double rhs = static_cast<long double>(best->bytes) * static_cast<long double>(c.gain);
        if (lhs > rhs || (lhs == rhs && c.gain <= best->gain)) return;
      }
      best = c;
    };
    for (std::size_t id : docs_of_[r]) {
      const std::int64_t lo = home_[id].lo, hi = home_[id].hi;
      if (hi <= lo) continue;
      const std::int64_t all = pairs(lo, hi);
      if (all <= room && hi <= kv_room) consider({id, whole, 0, away_bytes(lo, hi), need > 0 ? std::min(all, need) : hi});
      if (need <= 0 || shards_[id] >= C_ || hi - lo < 2) continue;  // (tokens for the capacity: only whole rests)
      // A front or back piece keeps the rest of the document home; where all
      // of it would go anyway, only whole (no one-token shards left behind).
      std::int64_t m = all >= need ? max_end(lo, hi, need - 1) + 1 : hi;  // [lo, m) costs at least need
      m = std::min({m, max_end(lo, hi, room), kv_room});
      if (m > lo && m < hi) consider({id, front, m, away_bytes(lo, m), std::min(pairs(lo, m), need)});
      std::int64_t b = all >= need ? min_begin(lo, hi, need - 1) - 1 : lo;  // [b, hi) costs at least need
      b = std::max(b, min_begin(lo, hi, room));
      if (b > lo && b < hi && hi <= kv_room) consider({id, back, b, away_bytes(b, hi), std::min(pairs(b, hi), need)});
    }
    if (!best) return false;
    Range& h = home_[best->id];
    std::int64_t a = h.lo, b = h.hi;
    switch (best->kind) {
      case whole: h = Range{0, 0}; break;
      case front: b = h.lo = best->cut; break;
      case back: a = h.hi = best->cut; break;
    }
    if (best->kind != whole) ++shards_[best->id];
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
    // A document's last shard attends to all of it: some rank must hold it whole.
    for (const Doc& d : docs_) {
      if (d.len > cap_[widest]) {
        fail<capacity_error>("plan_balanced: docs[", d.home, "][", d.index, "] has ", d.len,
                             " tokens and its last shard's KV group holds all of them, but the largest recv_capacity is ",
                             cap_[widest], " tokens (rank ", widest, ")");
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
    for (const Doc& d : docs_) held[d.home] += d.len;
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
  std::vector<Doc> docs_;
  std::vector<std::vector<std::size_t>> docs_of_;
  std::vector<std::size_t> by_cost_;
  std::vector<std::int64_t> home_load_, cap_;
  // scratch of one construction
  std::vector<Piece> pieces_;
  std::vector<Range> home_;           // what of each document is still home, not yet placed
  std::vector<std::int64_t> shards_;  // shards of each document so far
  std::vector<std::int64_t> excess_, kv_excess_, pending_;
  std::vector<std::size_t> giants_, kept_;
  std::set<std::pair<std::int64_t, std::size_t>> over_;   // (cost above the target, rank) of the ranks that must send
  std::set<std::pair<std::int64_t, std::size_t>> rooms_;  // (room left, rank) of the ranks that can take work
  std::vector<std::vector<std::int64_t>> cuts_;
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

/// No plan's largest rank cost is below this: the larger of the mean rank
/// cost and the largest shard of the costliest document cut into C shards of
/// (as nearly as integer positions allow) equal cost.
inline double balance_lower_bound(const BalanceProblem& problem) { return balance_detail::Planner(problem).lower_bound(); }

/// The load-balanced plan (see the top of this header). Throws invalid_input
/// for a malformed problem and capacity_error (naming ranks and token counts)
/// when the receive capacities cannot hold the documents.
inline QkvPlan plan_balanced(const BalanceProblem& problem, const BalanceOptions& options = {}) {
  balance_detail::Planner planner(problem);
  return planner.to_plan(planner.plan(options));
}

/// The documents of a plan as a balancing problem: each rank's document
/// lengths in order, C from the plan (its largest shard count when unset).
inline BalanceProblem balance_problem_of(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  BalanceProblem p;
  p.world_size = plan.world_size;
  p.q_bytes = q_bytes;
  p.kv_bytes = kv_bytes;
  p.max_cp_degree = plan.max_cp_degree.value_or(1);
  for (const RankDocuments& rank : plan.ranks) {
    auto& lengths = p.docs.emplace_back();
    for (const Document& doc : rank.docs) {
      std::int64_t len = 0;
      for (std::int64_t s : doc.shard_len) len = detail::add_tokens(len, s, "balance_problem_of");
      lengths.push_back(len);
      if (!plan.max_cp_degree) p.max_cp_degree = std::max(p.max_cp_degree, static_cast<std::int64_t>(doc.shard_len.size()));
    }
  }
  return p;
}

/// Baseline: every document whole, attended on its own rank (moves nothing).
inline QkvPlan plan_unbalanced(const BalanceProblem& problem) {
  balance_detail::Planner planner(problem);
  return planner.to_plan(planner.unbalanced());
}

/// Baseline: repeatedly move work from the most loaded rank to the least
/// loaded one, either the costliest whole shard that fits the least loaded
/// rank's deficit or, when none does, a piece cut off the end of the
/// costliest shard sized to that deficit, until the largest cost is within
/// `within` of the level any plan could reach (balance_lower_bound: the mean,
/// or more when the costliest document cannot be cut finely enough) or no
/// move is left. Ignores receive capacities.
inline QkvPlan plan_greedy(const BalanceProblem& problem, double within = 0.10) {
  using namespace balance_detail;
  Planner planner(problem);
  const auto& docs = planner.docs();
  const std::size_t W = planner.world();
  const std::int64_t C = planner.cp_degree();
  std::vector<std::vector<Piece>> shards(docs.size());  // per document, in order
  std::vector<std::int64_t> load(W, 0);
  for (std::size_t id = 0; id < docs.size(); ++id) {
    shards[id].push_back({id, 0, docs[id].len, docs[id].home});
    load[docs[id].home] += docs[id].cost;
  }
  const auto level = static_cast<std::int64_t>(std::ceil(planner.lower_bound()));
  const auto stop = static_cast<std::int64_t>(static_cast<double>(level) * (1.0 + within));
  const std::size_t max_moves = 64 * W + 4 * docs.size();
  for (std::size_t move = 0; move < max_moves && !docs.empty(); ++move) {
    const auto hi = static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto lo = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (load[hi] <= stop) break;
    const std::int64_t amount = std::min(load[hi] - level, level - load[lo]);
    if (amount <= 0) break;
    // The costliest whole shard within the deficit, else the costliest shard that can still be cut.
    Piece* whole = nullptr;
    std::vector<Piece>* cut_doc = nullptr;
    std::size_t cut_i = 0;
    std::int64_t whole_cost = 0, cut_cost = 0;
    for (auto& ps : shards) {
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].dst != hi) continue;
        const std::int64_t c = pairs(ps[i].begin, ps[i].end);
        if (c <= amount && c > whole_cost) whole = &ps[i], whole_cost = c;
        if (c > amount && c > cut_cost && static_cast<std::int64_t>(ps.size()) < C && ps[i].end - ps[i].begin > 1) {
          cut_doc = &ps, cut_i = i, cut_cost = c;
        }
      }
    }
    std::int64_t moved = 0;
    if (whole) {
      whole->dst = lo;
      moved = whole_cost;
    } else if (cut_doc) {
      const Piece pc = (*cut_doc)[cut_i];
      const std::int64_t m = std::clamp(min_begin(pc.begin, pc.end, amount), pc.begin + 1, pc.end - 1);
      (*cut_doc)[cut_i].end = m;
      cut_doc->insert(cut_doc->begin() + static_cast<std::ptrdiff_t>(cut_i) + 1, Piece{pc.doc, m, pc.end, lo});
      moved = pairs(m, pc.end);
    } else {
      break;
    }
    load[hi] -= moved;
    load[lo] += moved;
  }
  std::vector<Piece> pieces;
  for (const auto& ps : shards) pieces.insert(pieces.end(), ps.begin(), ps.end());
  return planner.to_plan(make_layout(pieces, docs, problem.q_bytes, problem.kv_bytes));
}

/// Attention cost and bytes moved of any QKV plan, counted as the spec's
/// layout sends them (see the top of this header).
inline PlanCost plan_cost(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1) {
  using detail::fail;
  if (plan.world_size <= 0) fail("plan_cost: world_size = ", plan.world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (plan.ranks.size() != W) fail("plan_cost: ranks has ", plan.ranks.size(), " entries, but world_size = ", W);
  PlanCost out;
  out.world_size = plan.world_size;
  out.attention.assign(W, 0);
  out.kv_tokens.assign(W, 0);
  out.bytes.assign(W * W, 0);
  auto add = [](std::int64_t& acc, std::int64_t v) {
    if (__builtin_add_overflow(acc, v, &acc)) fail("plan_cost: a total overflows 64 bits");
  };
  auto mul = [](std::int64_t a, std::int64_t b) {
    std::int64_t v = 0;
    if (__builtin_mul_overflow(a, b, &v)) fail("plan_cost: a byte count overflows 64 bits");
    return v;
  };
  for (std::size_t r = 0; r < W; ++r) {
    const auto& docs = plan.ranks[r].docs;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      const Document& doc = docs[i];
      if (doc.dst.size() != doc.shard_len.size()) {
        fail("plan_cost: ranks[", r, "].docs[", i, "].dst has ", doc.dst.size(), " entries but shard_len has ", doc.shard_len.size());
      }
      std::int64_t context = 0;
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
        const std::int64_t len = doc.shard_len[s], d = doc.dst[s];
        if (len <= 0) fail("plan_cost: ranks[", r, "].docs[", i, "].shard_len[", s, "] = ", len, " must be positive");
        if (d < 0 || d >= plan.world_size) fail("plan_cost: ranks[", r, "].docs[", i, "].dst[", s, "] = ", d, " is outside [0, ", W, ")");
        const auto du = static_cast<std::size_t>(d);
        add(out.attention[du], attention_cost(context, len));
        const std::int64_t end = detail::add_tokens(context, len, "plan_cost");
        add(out.kv_tokens[du], end);
        if (du != r) {
          // The query shard, and a copy of every key-value shard 0..s of its document.
          const std::int64_t qb = mul(q_bytes, len), kvb = mul(kv_bytes, end);
          add(out.bytes[r * W + du], qb);
          add(out.bytes[r * W + du], kvb);
          add(out.query_bytes, qb);
          add(out.kv_bytes, kvb);
        }
        context = end;
      }
    }
  }
  add(out.bytes_moved, out.query_bytes);
  add(out.bytes_moved, out.kv_bytes);
  return out;
}

}  // namespace cpdispatch
