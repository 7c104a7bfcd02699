#pragma once
// The load-balancing planner behind plan_balanced (balance/balance.hpp
// describes its algorithm): the pieces of the input, candidate layouts of
// shards, and the search for the target largest rank cost.

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
#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/balance/detail/balance_cuts.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

namespace detail::balance {

/// One piece of the input: positions [begin, end) of document `document`,
/// held by rank `home`.
struct Piece {
  std::size_t document = 0;
  std::size_t index = 0;  ///< its place in the document
  std::size_t home = 0;
  std::size_t slot = 0;   ///< its place on the home rank (per-rank form: the document's index there)
  std::int64_t begin = 0, end = 0;
  std::int64_t cost = 0;  ///< pairs(begin, end)
  Grid grid{};            ///< where it may be cut (BalanceOptions::grid)
};

/// The grid a Planner cuts on: its size (BalanceOptions::grid) and, per piece
/// (documents in order, each one's pieces in order), the piece's start in the
/// packed coordinate; empty: where the problem's own MLP layout puts it.
struct GridPlacement {
  std::int64_t size = 1;
  std::vector<std::int64_t> starts = {};
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
  /// `fixed`: empty, or [W] work each rank does besides the problem's
  /// documents (head-parallel documents), which the plan balances around.
  /// `grid`: where pieces may be cut (the lower bound and every
  /// construction cut only there).
  explicit Planner(const BalanceProblem& p, std::vector<std::int64_t> fixed = {}, const GridPlacement& grid = {})
      : p_(p), fixed_(std::move(fixed)) {
    check_settings();
    check_grid_size(grid.size, "plan_balanced", "BalanceOptions::grid");
    W_ = static_cast<std::size_t>(p.world_size);
    C_ = p.max_cp_degree;
    home_load_.assign(W_, 0);
    if (fixed_.empty()) fixed_.assign(W_, 0);
    if (fixed_.size() != W_) fail("plan_balanced: fixed work is given for ", fixed_.size(), " ranks, but world_size = ", W_);
    for (const std::int64_t f : fixed_) fixed_total_ += f;
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
    place_on_grid(grid);
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
    std::vector<std::int64_t> load(fixed_), kv(W_, 0);
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
    out.max_cost = highest_home_load();
    return out;
  }

  /// The largest cost of a rank whose pieces all stay home.
  std::int64_t highest_home_load() const {
    std::int64_t top = 0;
    for (std::size_t r = 0; r < W_; ++r) top = std::max(top, home_load_[r] + fixed_[r]);
    return top;
  }

  /// The documents-form plan of a layout: documents and pieces in input
  /// order, each document with its slices (in its positions, so the cuts do
  /// not change them).
  QkvDocumentsPlan to_plan(const Layout& layout) const {
    QkvDocumentsPlan out;
    out.world_size = p_.world_size;
    out.max_cp_degree = C_;
    out.documents.resize(first_piece_.size() - 1);
    for (std::size_t d = 0; d < out.documents.size(); ++d) out.documents[d].slices = slices_of(d);
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
  /// Document d's slices (section 2e); empty: the problem's mask holds for it.
  const std::vector<AttentionSlice>& slices_of(std::size_t d) const {
    static const std::vector<AttentionSlice> none_given;
    return per_rank_ ? none_given : p_.documents[d].slices;
  }
  std::size_t world() const { return W_; }
  std::int64_t cp_degree() const { return C_; }
  /// [W]: each rank's recv_capacity (`unlimited` where none is given).
  const std::vector<std::int64_t>& capacity() const { return cap_; }
  std::int64_t q_bytes() const { return p_.q_bytes; }
  std::int64_t kv_bytes() const { return p_.kv_bytes; }

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
    Piece pc{doc, pieces_.size() - first_piece_.back(), home, pieces_of_[home].size(), begin, end, 0, Grid{}};
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
      const auto& doc = p_.documents[i].pieces;
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
      check_slices(p_.documents[i].slices, end, i);
      end_document();
    }
    return tokens;
  }

  /// Refuses the slices of documents[d] (`len` tokens) that planning would:
  /// first a rectangle empty or outside the document, named here; then
  /// planning's own checks (a pair inside the band, no pair shared), so that
  /// a balanced plan always plans.
  static void check_slices(const std::vector<AttentionSlice>& slices, std::int64_t len, std::size_t d) {
    check_slices_inside(slices, len, d, "plan_balanced");
    for (std::size_t j = 0; j < slices.size(); ++j) detail::check_slice(slices[j], d, j, len);
    if (!slices.empty()) detail::check_disjoint_slices(slices, d, PlanLimits{});
  }

  /// Each piece's Grid: the phase of its packed start (given, or the MLP
  /// layout's: rank 0's pieces, then rank 1's, each rank's in order).
  void place_on_grid(const GridPlacement& grid) {
    grid_ = grid.size;
    if (grid.size == 1) return;  // every piece keeps Grid{}: cut anywhere
    std::vector<std::int64_t> starts = grid.starts;
    if (starts.empty()) {
      starts.resize(pieces_.size());
      std::int64_t at = 0;
      for (const auto& ids : pieces_of_)
        for (const std::size_t id : ids) starts[id] = at, at += pieces_[id].end - pieces_[id].begin;
    }
    if (starts.size() != pieces_.size()) fail("plan_balanced: the grid gives ", starts.size(), " piece starts for ", pieces_.size(), " pieces");
    for (std::size_t id = 0; id < pieces_.size(); ++id) {
      Grid& g = pieces_[id].grid;
      g.size = grid.size;
      g.phase = g.mod(pieces_[id].begin - starts[id] % grid.size);
    }
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
    std::vector<Grid> grids;
    for (std::size_t d : docs) {
      if (doc_cost[d] <= best) break;  // its largest shard cannot cost more than all of it
      runs.clear();
      grids.clear();
      for (std::size_t id = first_piece_[d]; id < first_piece_[d + 1]; ++id) {
        runs.push_back({pieces_[id].begin, pieces_[id].end});
        grids.push_back(pieces_[id].grid);
      }
      best = std::max(best, min_max_shard(runs, grids, C_));
    }
    best = std::max(best, *std::max_element(fixed_.begin(), fixed_.end()));
    return std::max(static_cast<double>(total_ + fixed_total_) / static_cast<double>(W_), static_cast<double>(best));
  }

  // ---- searching the target

  /// Widens geometrically from the bound `lb` (plans usually land within a
  /// few percent of it), then bisects to 0.1%; sets `target` to the one reached.
  Layout search_target(std::int64_t lb, std::int64_t& target) {
    const std::int64_t top = highest_home_load(), all = total_ + fixed_total_;
    std::optional<Layout> found;
    std::int64_t lo = lb, hi = lb;  // lo fails, hi reaches
    for (std::int64_t step = std::max<std::int64_t>(1, lb / 256); !found; step *= 4) {
      lo = hi;
      if (lo >= all) capacity_failure();  // not even with no limit on cost
      hi = std::min(all, lo + step);
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

  std::int64_t away_bytes(std::int64_t a, std::int64_t b) const { return detail::balance::away_bytes(a, b, p_.q_bytes, p_.kv_bytes); }

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
    excess_.resize(W_);  // cost above T on each rank (negative: room left), the fixed work included
    for (std::size_t r = 0; r < W_; ++r) excess_[r] = fixed_[r] - T;
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
      std::int64_t n = pieces_needed(pc.begin, pc.end, T, allowed, pc.grid);
      if (n > allowed) return false;
      if (v.extra_piece && n < allowed && n <= pc.grid.slots(pc.begin, pc.end)) ++n;
      count += n - 1;
      auto& cut = cuts_[g];
      cut = equal_cost_cuts(pc.begin, pc.end, n, pc.grid);
      if (!fits_under(cut, T)) {
        // Rounding pushed a shard over T: cut greedily at T instead (on the
        // grid), leaving every later shard a token (an allowed position).
        for (std::size_t k = 1; k < static_cast<std::size_t>(n); ++k) {
          cut[k] = std::min(max_end(cut[k - 1], pc.end, T, pc.grid), pc.grid.before(pc.end, n - static_cast<std::int64_t>(k)));
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
      // Cuts move onto the piece's grid: up to cover `need`, down to fit the room.
      const Grid& g = pieces_[id].grid;
      std::int64_t m = all >= need ? grid_up(max_end(lo, hi, need - 1) + 1, lo, hi, g) : hi;  // [lo, m) costs at least need
      m = std::min(m, grid_down(std::min(max_end(lo, hi, room), kv_room), lo, hi, g));
      if (m > lo && m < hi) consider({id, front, m, move_bytes(id, lo, m, to), std::min(pairs(lo, m), need), to});
      std::int64_t b = all >= need ? grid_down(min_begin(lo, hi, need - 1) - 1, lo, hi, g) : lo;  // [b, hi) costs at least need
      b = std::max(b, grid_up(min_begin(lo, hi, room), lo, hi, g));
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

  /// On a grid the smallest shard a piece can give (to its next allowed
  /// position) may not fit the room send_one picked: the next larger rooms
  /// are tried, then the smaller ones, largest first; the first with a move
  /// gives it.
  std::optional<Choice> move_on_grid(std::size_t r, std::int64_t need, std::set<std::pair<std::int64_t, std::size_t>>::iterator slot) const {
    for (auto it = std::next(slot); it != rooms_.end(); ++it)
      if (auto c = best_move(r, need, it->second)) return c;
    for (auto it = slot; it != rooms_.begin();)
      if (auto c = best_move(r, need, (--it)->second)) return c;
    return std::nullopt;
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
    if (!best && grid_ > 1) best = move_on_grid(r, need, slot);
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

  /// Refuses capacities no plan fits. A document with slices is left out:
  /// its KV groups hold only the shards their queries need, which depends
  /// on the cuts (the slice planner checks its plans instead).
  void check_capacity(std::int64_t tokens) const {
    const auto widest = static_cast<std::size_t>(std::max_element(cap_.begin(), cap_.end()) - cap_.begin());
    // A piece's last shard attends to all of the document up to the piece's end: some rank must hold that.
    for (const Piece& pc : pieces_) {
      if (!slices_of(pc.document).empty()) {
        tokens -= pc.end - pc.begin;
        continue;
      }
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
  std::vector<std::int64_t> fixed_;  // [W] work besides the problem's documents
  std::int64_t fixed_total_ = 0;
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
  std::int64_t grid_ = 1;  // BalanceOptions::grid
  bool dedup_ = false;  // bytes counted on the wire (section 2c); the sharing variants on
  bool share_ = false;  // this construction's Variant::share
  std::vector<std::vector<std::pair<std::size_t, std::int64_t>>> placed_;  // (sharing) per document: (rank, shard end) placed
  mutable std::vector<std::pair<std::size_t, std::int64_t>> last_;         // scratch of document_wire_bytes
};

}  // namespace detail::balance

namespace detail::balance {

/// The planner's memory, from the problem's sizes (no allocation), checked
/// before it is built. The settings' own checks come first, so that a bad
/// world_size is named as such.
inline void check_footprint(const BalanceProblem& p, const PlanLimits& limits, std::uint64_t shards_per_piece = 0) {
  if (p.world_size <= 0 || p.max_cp_degree <= 0) return;  // Planner names these
  std::uint64_t pieces = 0;
  for (const auto& doc : p.documents) pieces += doc.pieces.size();
  for (const auto& rank : p.docs) pieces += rank.size();
  const auto W = static_cast<std::uint64_t>(p.world_size), C = static_cast<std::uint64_t>(p.max_cp_degree);
  detail::check_footprint(limits, footprint::balance(W, pieces, shards_per_piece ? shards_per_piece : std::min<std::uint64_t>(C, 64)), "plan_balanced",
                          detail::concat("a problem of world_size = ", W, ", ", pieces, " pieces, max_cp_degree = ", C));
}

}  // namespace detail::balance

}  // namespace cpdispatch
