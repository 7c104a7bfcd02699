#pragma once
// Load balancing under an attention mask other than causal
// (docs/plan-format.md, section 2d), or with documents that carry their own
// mask as slices (section 2e), on the causal planner's pieces.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/balance/detail/balance_cuts.hpp"
#include "cpdispatch/balance/detail/balance_planner.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

namespace detail::balance {

/// Balancing under a mask other than causal (docs/plan-format.md, section
/// 2d), or with slices (section 2e). The cost of a shard is the (query, key)
/// pairs the mask, or its document's slices, let through; for a full mask
/// and past the first w tokens of a window it grows linearly with the
/// shard's length, and under slices it is a sum over the shard's queries
/// too, so a simple scheme balances well: the target T rises from the lower
/// bound; for each T, a piece over T is cut into the fewest equal-cost
/// shards, then every rank above T sheds the tails of its shards to the
/// ranks with the most room (a tail keeps the front of the piece at home, so
/// under a window only the tail and its w - 1 tokens of context travel),
/// never giving a document more than C shards.
///
/// With slices, a plan counts only when every rank's KV groups (the shards
/// its queries need) fit its recv_capacity, and then single shards move to
/// ranks attending or holding their document where that sends fewer bytes
/// (wire bytes with dedup), no rank's cost passing the plan's largest by
/// more than the options' cost slack.
class MaskPlanner {
 public:
  MaskPlanner(const Planner& base, const AttentionMask& mask) : base_(base), mask_(mask) {
    doc_len_.assign(base.num_documents(), 0);
    first_piece_.assign(base.num_documents() + 1, 0);
    for (const Piece& pc : base.pieces()) {
      doc_len_[pc.document] = std::max(doc_len_[pc.document], pc.end);
      ++first_piece_[pc.document + 1];
    }
    for (std::size_t d = 0; d < base.num_documents(); ++d) {
      first_piece_[d + 1] += first_piece_[d];
      sliced_ = sliced_ || !base.slices_of(d).empty();
    }
    capped_ = std::any_of(base.capacity().begin(), base.capacity().end(), [](std::int64_t c) { return c < unlimited; });
    C_ = base.cp_degree();
    std::int64_t total = 0;
    for (const Piece& pc : base.pieces()) total = sum(total, cost(pc.document, pc.begin, pc.end));
    bound_ = static_cast<double>(total) / static_cast<double>(base.world());
    std::vector<std::vector<std::size_t>> runs(base.num_documents());  // each document's pieces
    for (std::size_t id = 0; id < base.pieces().size(); ++id) runs[base.pieces()[id].document].push_back(id);
    for (std::size_t d = 0; d < runs.size(); ++d) bound_ = std::max(bound_, static_cast<double>(min_max_shard(d, runs[d])));
  }

  double lower_bound() const { return bound_; }

  /// The most balanced layout found (that fits the receive capacities):
  /// targets from the bound upward in steps of 0.1%, then 1%; every piece at
  /// home when nothing better is reached. With slices, then fewer bytes
  /// (`options.dedup`: as the deduplicated exchange sends them).
  Layout plan(const BalanceOptions& options = {}) const {
    const auto start = static_cast<std::int64_t>(std::ceil(bound_));
    for (int k = 0; k < 400; ++k) {
      const double step = k < 100 ? 0.001 * k : 0.1 + 0.01 * (k - 100);
      const auto T = static_cast<std::int64_t>(static_cast<double>(start) * (1.0 + step)) + (k == 0 ? 0 : 1);
      for (const Cut cut : {Cut::equal, Cut::greedy, Cut::extra}) {
        std::vector<Shard> shards;
        if (!build(T, cut, shards)) continue;
        Layout out = finish(shards);
        if (fits_capacity(out)) return sliced_ ? fewer_bytes(std::move(out), options) : out;
      }
    }
    Layout home = base_.unbalanced();
    if (!fits_capacity(home)) capacity_failure(home);
    return sliced_ ? fewer_bytes(std::move(home), options) : home;
  }

 private:
  static std::int64_t sum(std::int64_t a, std::int64_t b) {
    std::int64_t out = 0;
    if (__builtin_add_overflow(a, b, &out) || out > unlimited) fail("plan_balanced: the total attention cost overflows 64 bits");
    return out;
  }

  /// Pairs of query positions [a, b) of document d under its slices, else the mask.
  std::int64_t cost(std::size_t d, std::int64_t a, std::int64_t b) const {
    return query_pairs(base_.slices_of(d), mask_, a, b, doc_len_[d]);
  }
  std::int64_t shard_cost(const Shard& s) const { return cost(base_.pieces()[s.piece].document, s.begin, s.end); }

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
    return first_where(a, b, [&](std::int64_t m) { return cost(d, m, b) <= budget; });
  }

  /// The fewest shards of [a, b) each within `limit`, cut on the grid g;
  /// cap + 1 beyond `cap`.
  std::int64_t needed(std::size_t d, std::int64_t a, std::int64_t b, std::int64_t limit, std::int64_t cap, const Grid& g) const {
    std::int64_t n = 0;
    while (a < b) {
      const std::int64_t m = grid_down(max_end(d, a, b, limit), a, b, g);
      if (n == cap || m == a) return cap + 1;
      a = m;
      ++n;
    }
    return n;
  }

  /// The cheapest largest shard of document d's pieces (`ids`) cut into at
  /// most C shards in all, each piece on its grid.
  std::int64_t min_max_shard(std::size_t d, const std::vector<std::size_t>& ids) const {
    const auto& pieces = base_.pieces();
    std::int64_t hi = 0;
    for (const std::size_t id : ids) hi = std::max(hi, cost(d, pieces[id].begin, pieces[id].end));
    return first_where(std::int64_t{1}, hi, [&](std::int64_t limit) {
      std::int64_t used = 0;
      for (const std::size_t id : ids) {
        used += needed(d, pieces[id].begin, pieces[id].end, limit, C_, pieces[id].grid);
        if (used > C_) break;
      }
      return used <= C_;
    });
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
      const Grid& g = pc.grid;
      std::int64_t n = needed(pc.document, pc.begin, pc.end, T, C_, g);
      if (how == Cut::extra && n > 1 && count[pc.document] + n < C_ && n <= g.slots(pc.begin, pc.end)) ++n;
      count[pc.document] += n;
      if (count[pc.document] > C_) return false;
      std::int64_t a = pc.begin;
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t rest = cost(pc.document, a, pc.end);
        const std::int64_t share = how == Cut::greedy ? T : (rest + (n - k) - 1) / (n - k);
        std::int64_t b = k + 1 == n ? pc.end : std::max(a + 1, max_end(pc.document, a, pc.end, share));
        // On a grid: the allowed position at or below, after a and leaving one for each later shard.
        if (g.size > 1 && k + 1 < n) b = std::clamp(g.floor(b), g.ceil(a + 1), g.before(pc.end, n - k - 1));
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
    // The cut on the piece's grid: up to fit the room, down to cover the excess.
    const Grid& g = base_.pieces()[s.piece].grid;
    std::int64_t m = grid_up(min_begin(d, s.begin, s.end, room), s.begin, s.end, g);
    if (cost(d, m, s.end) >= excess) m = std::max(m, grid_down(min_begin(d, s.begin, s.end, excess - 1) - 1, s.begin, s.end, g));
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

  // ---- key-value groups and bytes (needed sets: section 2e)

  /// Document d's shards in a layout, in causal order.
  std::span<const Shard> shards_of(const Layout& l, std::size_t d) const {
    const std::size_t lo = l.first[first_piece_[d]], hi = l.first[first_piece_[d + 1]];
    return {l.shards.data() + lo, hi - lo};
  }

  /// Whether query shard q of document d needs key-value shard k.
  bool needs(std::size_t d, const Shard& q, const Shard& k) const {
    return detail::needs(base_.slices_of(d), mask_, q.begin, q.end, k.begin, k.end);
  }

  std::size_t home(const Shard& s) const { return base_.pieces()[s.piece].home; }

  /// [W]: the tokens of the KV groups each rank holds (what recv_capacity limits).
  std::vector<std::int64_t> kv_tokens(const Layout& l) const {
    std::vector<std::int64_t> kv(base_.world(), 0);
    for (std::size_t d = 0; d < doc_len_.size(); ++d) {
      const std::span<const Shard> doc = shards_of(l, d);
      for (const Shard& q : doc)
        for (const Shard& k : doc)
          if (needs(d, q, k)) kv[q.dst] += k.end - k.begin;
    }
    return kv;
  }

  bool fits_capacity(const Layout& l) const {
    if (!capped_) return true;
    const std::vector<std::int64_t> kv = kv_tokens(l);
    for (std::size_t r = 0; r < kv.size(); ++r)
      if (kv[r] > base_.capacity()[r]) return false;
    return true;
  }

  /// No target gave a plan that fits: name the rank furthest over its
  /// capacity with every piece at home.
  [[noreturn]] void capacity_failure(const Layout& home) const {
    const std::vector<std::int64_t> kv = kv_tokens(home);
    std::size_t worst = 0;
    for (std::size_t r = 0; r < kv.size(); ++r)
      if (kv[r] - base_.capacity()[r] > kv[worst] - base_.capacity()[worst]) worst = r;
    fail<capacity_error>("plan_balanced: no plan found whose KV groups (the shards their queries need) fit the receive capacities: "
                         "with every piece at home rank ", worst, " holds ", kv[worst], " KV tokens with recv_capacity ",
                         base_.capacity()[worst]);
  }

  /// Bytes document d's shards move: the queries of every shard attended
  /// off its home, and every key-value shard a query shard needs from
  /// another rank, once per query shard (section 2e), or with `dedup` once
  /// per destination rank (section 2c).
  std::int64_t document_bytes(std::span<const Shard> doc, std::size_t d, bool dedup) const {
    std::int64_t bytes = 0;
    std::vector<std::pair<std::size_t, std::size_t>> sent;  // (rank, KV shard) already on the wire
    for (const Shard& q : doc) {
      if (q.dst != home(q)) bytes += base_.q_bytes() * (q.end - q.begin);
      for (std::size_t k = 0; k < doc.size(); ++k) {
        if (home(doc[k]) == q.dst || !needs(d, q, doc[k])) continue;
        if (dedup && std::find(sent.begin(), sent.end(), std::pair{q.dst, k}) != sent.end()) continue;
        if (dedup) sent.emplace_back(q.dst, k);
        bytes += base_.kv_bytes() * (doc[k].end - doc[k].begin);
      }
    }
    return bytes;
  }

  /// Neighbours of one piece attended on one rank as one shard (make_layout's rule).
  static std::vector<Shard> merged(const std::vector<Shard>& doc) {
    std::vector<Shard> out;
    for (const Shard& s : doc) {
      if (!out.empty() && out.back().piece == s.piece && out.back().dst == s.dst && out.back().end == s.begin) out.back().end = s.end;
      else out.push_back(s);
    }
    return out;
  }

  /// Moves each shard of document d (`doc`) to whichever rank attending or
  /// holding the document sends it the fewest bytes, every rank's load
  /// staying within `top`; kept only when the document, its neighbours on
  /// one rank merged, sends fewer bytes than before.
  void move_shards(std::vector<Shard>& doc, std::size_t d, std::int64_t top, std::vector<std::int64_t>& load, bool dedup) const {
    std::vector<std::size_t> ranks;
    for (const Shard& s : doc) ranks.push_back(s.dst), ranks.push_back(home(s));
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    std::vector<Shard> trial = doc;
    for (Shard& s : trial) {
      const std::size_t from = s.dst;
      const std::int64_t c = shard_cost(s);
      std::int64_t best = document_bytes(trial, d, dedup);
      std::size_t to = from;
      for (const std::size_t t : ranks) {
        if (t == from || load[t] + c > top) continue;
        s.dst = t;
        if (const std::int64_t b = document_bytes(trial, d, dedup); b < best) best = b, to = t;
      }
      s.dst = to;
      load[from] -= c, load[to] += c;
    }
    std::vector<Shard> better = merged(trial);
    if (document_bytes(better, d, dedup) < document_bytes(doc, d, dedup)) {
      doc = std::move(better);
      return;
    }
    for (std::size_t k = 0; k < doc.size(); ++k) {  // undo
      const std::int64_t c = shard_cost(doc[k]);
      load[trial[k].dst] -= c, load[doc[k].dst] += c;
    }
  }

  /// The layout with shards moved where they send fewer bytes (move_shards),
  /// no rank's cost passing the largest by more than the options' slack (or
  /// `cost_limit`), as the causal planner trades balance for bytes; `l`
  /// itself when the result would not fit the receive capacities.
  Layout fewer_bytes(Layout l, const BalanceOptions& options) const {
    if (base_.q_bytes() == 0 && base_.kv_bytes() == 0) return l;
    std::vector<std::int64_t> load(base_.world(), 0);
    for (const Shard& s : l.shards) load[s.dst] += shard_cost(s);
    const std::int64_t most = *std::max_element(load.begin(), load.end());
    const double slack = 1.0 + std::max(0.0, options.cost_slack);
    const std::int64_t top = options.cost_limit > 0 ? std::max(options.cost_limit, most) : static_cast<std::int64_t>(static_cast<double>(most) * slack);
    const bool dedup = options.dedup;
    std::vector<Shard> shards;
    for (std::size_t d = 0; d < doc_len_.size(); ++d) {
      const std::span<const Shard> now = shards_of(l, d);
      std::vector<Shard> doc(now.begin(), now.end());
      if (document_bytes(doc, d, dedup) > 0) move_shards(doc, d, top, load, dedup);
      shards.insert(shards.end(), doc.begin(), doc.end());
    }
    Layout out = finish(shards);
    return fits_capacity(out) ? out : l;
  }

  const Planner& base_;
  AttentionMask mask_;
  std::vector<std::int64_t> doc_len_;
  std::vector<std::size_t> first_piece_;  // pieces of document d: [first_piece_[d], first_piece_[d+1])
  bool sliced_ = false;                   // some document has slices
  bool capped_ = false;                   // some rank has a recv_capacity
  std::int64_t C_ = 1;
  double bound_ = 0;
};

}  // namespace detail::balance

namespace detail::balance {

/// A plan of `layout` under the problem's mask: the mask (and every
/// document's slices) travel with it and, unless causal without slices,
/// planning derives C from the needed key-values (sections 2d, 2e).
inline QkvDocumentsPlan masked_plan(const Planner& planner, const Layout& layout, const AttentionMask& mask) {
  QkvDocumentsPlan out = planner.to_plan(layout);
  out.mask = mask;
  if (mask != AttentionMask::causal() || detail::has_slices(out)) out.max_cp_degree.reset();
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
