#pragma once
// The invariant mode of the attention kernels (docs/invariant-attention.md):
// out, lse, dq, dk and dv bitwise the same however the keys and queries of a
// batch are split over entries, calls, ranks and threads, as long as every
// split falls on the grid.
//
// The grid: blocks of G tokens in the packed coordinate (a token's position
// in the batch's packed sequence: rank 0's tokens, then rank 1's, ...). A
// *unit* is one document's tokens inside one block. The kernel sums each
// unit's terms in fp32 in a fixed order and adds the units exactly (integer
// fixed point, attention/detail/exact_sum.hpp), so only the units, never the
// split, decide the bits. An entry tells the kernel where its rows sit on the
// grid through its UnitPhase: the packed position, modulo G, of its first
// query row and of its first key row. Entries must start or end their rows
// on the grid or at a document's own bounds (or a slice's key bounds, which
// belong to the batch), so that no split cuts a unit.
//
// Forward and dq: every key of a query row is in one call, so the row's
// exact sums are scaled by the row's own terms (no agreement needed).
// dk and dv: a key's terms come from queries on many ranks, so their exact
// sums use one scale for the whole batch (kv_gradient_exponents, from the
// batch's largest |q|, |v|, |dout| and query count, which the op agrees on);
// calls add into ExactKvGradients, callers add those (copies, ranks) as
// integers and round once (round_exact).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "cpdispatch/attention/detail/exact_sum.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// Where an entry's rows sit on the grid: the packed position, modulo the
/// grid, of its first query row (q) and of its first key row (kv).
struct UnitPhase {
  std::int64_t q = 0;
  std::int64_t kv = 0;
  friend constexpr bool operator==(const UnitPhase&, const UnitPhase&) = default;
};

/// The grid of an invariant call: its block size and one phase per entry
/// (empty: every entry's first rows start a block).
struct InvariantGrid {
  std::int64_t size = 64;
  std::span<const UnitPhase> phases = {};
};

/// Key-value gradients as exact sums, [tokens_kv][heads_kv][head_dim] each:
/// the value of element x is dk[x] * 2^dk_exponent. Invariant backward calls
/// add into them; callers add them as integers (every copy of a key, every
/// rank) and round once (round_exact).
struct ExactKvGradients {
  std::span<std::int64_t> dk, dv;
  int dk_exponent = 0;
  int dv_exponent = 0;
};

/// What bounds the batch's key-value gradients: the largest |q|, |v| and
/// |dout| of any element of the batch, and the most query rows any key is
/// attended by (the batch's token count will do). Every rank must use the
/// same values: the op agrees on them.
struct InvariantBounds {
  double max_abs_q = 0;
  double max_abs_v = 0;
  double max_abs_dout = 0;
  std::int64_t queries = 0;
};

/// The exponents of ExactKvGradients for a batch with these bounds: |dv| <=
/// group * queries * max|dout| and |dk| <= |scale| * group * queries * 2 *
/// head_dim * max|dout| * max|v| * max|q| (|dS| <= P (|dout . v| + |dout .
/// out|)), with a factor 2 to spare. Throws invalid_input on a bound that is
/// not finite or negative.
struct KvGradientExponents {
  int dk = 0;
  int dv = 0;
};

inline KvGradientExponents kv_gradient_exponents(const AttentionShape& s, const InvariantBounds& b) {
  const double values[] = {b.max_abs_q, b.max_abs_v, b.max_abs_dout};
  const char* names[] = {"max_abs_q", "max_abs_v", "max_abs_dout"};
  for (int i = 0; i < 3; ++i) {
    if (!(values[i] >= 0) || !std::isfinite(values[i])) {
      detail::fail("invariant attention: bounds.", names[i], " is ", values[i], "; it must be finite and >= 0 (a NaN or infinity in the inputs?)");
    }
  }
  if (b.queries < 0) detail::fail("invariant attention: bounds.queries is ", b.queries, "; it must be >= 0");
  const double n = static_cast<double>(b.queries) * static_cast<double>(s.heads_q / s.heads_kv);
  const double dv = 2 * n * b.max_abs_dout;
  const double dk = 2 * std::fabs(static_cast<double>(s.softmax_scale)) * n * 2 * static_cast<double>(s.head_dim) * b.max_abs_dout *
                    b.max_abs_v * b.max_abs_q;
  if (!std::isfinite(dk) || !std::isfinite(dv)) {
    detail::fail("invariant attention: the key-value gradients' bound overflows a double (bounds ", b.max_abs_q, ", ", b.max_abs_v, ", ",
                 b.max_abs_dout, ", ", b.queries, " queries)");
  }
  return {detail::attention::exact_exponent(dk, 1), detail::attention::exact_exponent(dv, 1)};
}

/// out[x] = exact[x] * 2^exponent, rounded once to E.
template <class E>
void round_exact(std::span<const std::int64_t> exact, int exponent, std::span<E> out) {
  if (exact.size() != out.size()) detail::fail("round_exact: ", exact.size(), " exact sums but ", out.size(), " outputs");
  for (std::size_t i = 0; i < exact.size(); ++i) {
    const auto x = static_cast<float>(detail::attention::from_fixed(exact[i], exponent));
    if constexpr (std::is_same_v<E, float>) {
      out[i] = x;
    } else {
      out[i] = E(x);
    }
  }
}

/// A kernel with the invariant mode: forward_invariant and backward_invariant
/// beside forward and backward (HostAttentionKernel).
template <class K, class E>
concept InvariantAttentionKernel =
    requires(K& kernel, const AttentionShape& shape, const InvariantGrid& grid, std::span<const AttentionEntry> entries,
             std::span<const E> in, std::span<E> out, std::span<float> lse, std::span<const float> lse_in, ExactKvGradients kv) {
      kernel.forward_invariant(shape, grid, entries, in, in, in, out, lse);
      kernel.backward_invariant(shape, grid, entries, in, in, in, in, lse_in, in, out, kv);
    };

namespace detail {

/// The largest |x| of a host buffer; NaN when it holds a NaN (the op's
/// bounds, InvariantBounds, then refuse the batch on every rank).
template <class E>
double max_abs_of(std::span<const E> x) {
  double m = 0;
  for (const E& e : x) m = attention::max_keeping_nan(m, std::fabs(static_cast<double>(static_cast<float>(e))));
  return m;
}

/// Refuses a grid that does not fit a call of `entries` entries.
inline void check_invariant_grid(const char* who, const InvariantGrid& g, std::size_t entries) {
  if (g.size < 1 || g.size > (std::int64_t{1} << 40)) fail(who, ": grid.size is ", g.size, "; it must be in [1, 2^40]");
  if (!g.phases.empty() && g.phases.size() != entries) {
    fail(who, ": grid.phases has ", g.phases.size(), " phases for ", entries, " entries (one per entry, or none)");
  }
  for (std::size_t e = 0; e < g.phases.size(); ++e) {
    const UnitPhase& p = g.phases[e];
    if (p.q < 0 || p.q >= g.size || p.kv < 0 || p.kv >= g.size) {
      fail(who, ": grid.phases[", e, "] is (q ", p.q, ", kv ", p.kv, "); each must be in [0, grid.size = ", g.size, ")");
    }
  }
}

}  // namespace detail
}  // namespace cpdispatch
