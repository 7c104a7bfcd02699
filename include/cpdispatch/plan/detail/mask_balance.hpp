#pragma once
// Load balancing under an attention mask other than causal
// (docs/plan-format.md, section 2d), on the causal planner's pieces.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/balance_problem.hpp"
#include "cpdispatch/plan/detail/balance_cuts.hpp"
#include "cpdispatch/plan/detail/balance_planner.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

namespace detail::balance {

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

}  // namespace detail::balance

namespace detail::balance {

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

}  // namespace detail::balance

}  // namespace cpdispatch
