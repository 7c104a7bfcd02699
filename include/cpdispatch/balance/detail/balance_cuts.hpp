#pragma once
// Cut arithmetic of load-balanced planning: the causal cost of a run of a
// document's tokens, and where to cut a run so that its shards stay under a
// cost (balance/balance.hpp describes the planner that uses it); and what a run
// of a document with slices (docs/plan-format.md, section 2e) costs and needs.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch {

namespace detail::balance {

using detail::fail;
constexpr std::int64_t unlimited = std::numeric_limits<std::int64_t>::max() / 4;

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

/// A run [lo, hi) of token positions of one document.
struct Range {
  std::int64_t lo, hi;
};

/// Where a grid (BalanceOptions::grid) lets the balancer cut one piece: at
/// the positions x of its document with x = phase (mod size), which are the
/// multiples of `size` in the packed coordinate (the piece's packed start s
/// and document start b give phase = (b - s) mod size). Size 1 allows every
/// position, and then every function below is the identity.
struct Grid {
  std::int64_t size = 1;
  std::int64_t phase = 0;  ///< in [0, size)

  /// v mod size, in [0, size).
  std::int64_t mod(std::int64_t v) const noexcept {
    const std::int64_t m = v % size;
    return m < 0 ? m + size : m;
  }
  /// The largest allowed position <= x, and the smallest >= x.
  std::int64_t floor(std::int64_t x) const noexcept { return x - mod(x - phase); }
  std::int64_t ceil(std::int64_t x) const noexcept { return x + mod(phase - x); }
  /// Allowed positions strictly inside (a, b): the most cuts [a, b) can take.
  std::int64_t slots(std::int64_t a, std::int64_t b) const noexcept {
    if (b - a < 2) return 0;
    const std::int64_t first = ceil(a + 1);
    return first >= b ? 0 : (b - 1 - first) / size + 1;
  }
  /// The j-th allowed position below b (j >= 1): the last cut that leaves
  /// room for j shards [cut, b) ending at b.
  std::int64_t before(std::int64_t b, std::int64_t j) const noexcept { return floor(b - 1) - (j - 1) * size; }
};

/// A cut position m that a search found inside (a, b), moved down onto the
/// grid: a when no allowed position lies in (a, m]. An m at a or b (nothing,
/// or all of [a, b)) is not a cut and stays.
inline std::int64_t grid_down(std::int64_t m, std::int64_t a, std::int64_t b, const Grid& g) noexcept {
  if (m <= a || m >= b) return m;
  return std::max(a, g.floor(m));
}

/// The same moved up: b when no allowed position lies in [m, b).
inline std::int64_t grid_up(std::int64_t m, std::int64_t a, std::int64_t b, const Grid& g) noexcept {
  if (m <= a || m >= b) return m;
  return std::min(b, g.ceil(m));
}

/// The largest m in [a, b] with pairs(a, m) <= budget that is b or allowed by the grid (a when none).
inline std::int64_t max_end(std::int64_t a, std::int64_t b, std::int64_t budget, const Grid& g) noexcept {
  return grid_down(max_end(a, b, budget), a, b, g);
}

/// The fewest contiguous shards of [a, b), cut on the grid, that each cost
/// at most `limit` (greedy from the front is optimal: the cost of a shard
/// grows with its end and falls with its start); `cap + 1` when more than
/// `cap` are needed.
inline std::int64_t pieces_needed(std::int64_t a, std::int64_t b, std::int64_t limit, std::int64_t cap, const Grid& g) noexcept {
  std::int64_t n = 0;
  while (a < b) {
    if (n == cap) return cap + 1;
    const std::int64_t m = max_end(a, b, limit, g);
    if (m == a) return cap + 1;  // no allowed shard from a costs at most the limit
    a = m;
    ++n;
  }
  return n;
}

/// The cheapest largest shard when the runs (the pieces of one document,
/// each cut on its own, only on its grid: grids[i] for runs[i]) are cut into
/// at most `c` shards in all; `c` is at least the number of runs. A binary
/// search between every run whole and an even split.
inline std::int64_t min_max_shard(const std::vector<Range>& runs, const std::vector<Grid>& grids, std::int64_t c) noexcept {
  std::int64_t total = 0, hi = 0;
  for (const Range& r : runs) {
    total += pairs(r.lo, r.hi);
    hi = std::max(hi, pairs(r.lo, r.hi));  // every run whole: always within c
  }
  return first_where((total + c - 1) / c, hi, [&](std::int64_t limit) {
    std::int64_t used = 0;
    for (std::size_t i = 0; i < runs.size() && used <= c; ++i) used += pieces_needed(runs[i].lo, runs[i].hi, limit, c, grids[i]);
    return used <= c;
  });
}

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

/// equal_cost_cuts with every inner boundary on the grid: each moved to the
/// allowed position nearer in cost (the lower one on a tie), after the one
/// before it and leaving an allowed position for each later one (n - 1 <=
/// g.slots(a, b)).
inline std::vector<std::int64_t> equal_cost_cuts(std::int64_t a, std::int64_t b, std::int64_t n, const Grid& g) {
  std::vector<std::int64_t> cut = equal_cost_cuts(a, b, n);
  if (g.size == 1) return cut;
  for (std::size_t k = 1; k < static_cast<std::size_t>(n); ++k) {
    const std::int64_t x = cut[k], lo = g.ceil(cut[k - 1] + 1), hi = g.before(b, n - static_cast<std::int64_t>(k));
    const std::int64_t down = std::clamp(g.floor(x), lo, hi), up = std::clamp(g.ceil(x), lo, hi);
    cut[k] = pairs(a, x) - pairs(a, down) <= pairs(a, up) - pairs(a, x) ? down : up;
  }
  return cut;
}

}  // namespace detail::balance

}  // namespace cpdispatch
