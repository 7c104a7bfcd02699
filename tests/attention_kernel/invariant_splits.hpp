#pragma once
// The invariant mode's split runs, shared by the host kernel's tests
// (test_invariant_kernel.cpp) and the device kernel's (tests/cuda): a
// document attended whole or split on the grid (query shards in calls of
// their own, key groups cut into entries, rows at other buffer offsets,
// other grid phases), its results gathered in document order, the key-value
// gradients as exact sums added over calls as integers.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"

namespace cpdispatch::testing {

/// One document's tensors, [L][heads][head_dim].
template <class E>
struct Document {
  AttentionShape shape;
  std::int64_t length;
  std::vector<E> q, k, v, dout;

  Document(AttentionShape s, std::int64_t L, unsigned seed) : shape(s), length(L) {
    std::mt19937 rng(seed);
    const auto t = static_cast<std::size_t>(L);
    q = random_elements<E>(t * static_cast<std::size_t>(s.heads_q * s.head_dim), rng);
    k = random_elements<E>(t * static_cast<std::size_t>(s.heads_kv * s.head_dim), rng);
    v = random_elements<E>(t * static_cast<std::size_t>(s.heads_kv * s.head_dim), rng);
    dout = random_elements<E>(q.size(), rng);
  }
  std::size_t qw() const { return static_cast<std::size_t>(shape.heads_q * shape.head_dim); }
  std::size_t kw() const { return static_cast<std::size_t>(shape.heads_kv * shape.head_dim); }
};

/// How a run splits the document: query shards [cuts[i], cuts[i + 1]), each
/// attended in a call of its own against its key group; the group's keys cut
/// into entries wherever the packed position is a multiple of key_cut (0:
/// one entry), the shard's rows likewise by row_cut; `pad` unused rows
/// before the shard's in the call's query buffer.
struct Split {
  std::vector<std::int64_t> cuts;
  std::int64_t key_cut = 0, row_cut = 0, pad = 0;
};

/// A run's results in document order; dk and dv as exact sums.
template <class E>
struct SplitRun {
  std::vector<E> out, dq;
  std::vector<float> lse;  // [heads_q][L]
  std::vector<std::int64_t> dk, dv;
};

/// [first, end) cut wherever first-based packed position (packed + x) is a multiple of `every` (0: not cut).
inline std::vector<std::int64_t> grid_cuts(std::int64_t first, std::int64_t end, std::int64_t packed, std::int64_t every) {
  std::vector<std::int64_t> cuts{first};
  if (every > 0) {
    for (std::int64_t x = first + 1; x < end; ++x) {
      if ((packed + x) % every == 0) cuts.push_back(x);
    }
  }
  cuts.push_back(end);
  return cuts;
}

/// Runs `split` of `doc` through `calls` (forward_invariant then
/// backward_invariant of one call, on host vectors: calls(shape, grid,
/// entries, q, k, v, dout, out, lse, dq, dk, dv, exponents)).
template <class E, class Calls>
SplitRun<E> run_split_with(Calls&& calls, const Document<E>& doc, const AttentionMask& mask, std::int64_t grid,
                           std::int64_t packed, const Split& split, KvGradientExponents ex) {
  const AttentionShape& s = doc.shape;
  const std::int64_t L = doc.length;
  const std::size_t qw = doc.qw(), kw = doc.kw();
  SplitRun<E> r{std::vector<E>(doc.q.size()), std::vector<E>(doc.q.size()), std::vector<float>(static_cast<std::size_t>(s.heads_q * L)),
           std::vector<std::int64_t>(doc.k.size(), 0), std::vector<std::int64_t>(doc.k.size(), 0)};
  const Band band = mask.band();
  for (std::size_t c = 0; c + 1 < split.cuts.size(); ++c) {
    const std::int64_t a = split.cuts[c], b = split.cuts[c + 1], lq = b - a, rows = split.pad + lq;
    const std::int64_t k0 = band.bounded_below() ? std::max<std::int64_t>(0, a + band.lo) : 0;
    const std::int64_t k1 = band.bounded_above() ? std::min<std::int64_t>(L, b - 1 + band.hi + 1) : L;
    std::vector<AttentionEntry> entries;
    std::vector<UnitPhase> phases;
    const auto row_cuts = grid_cuts(a, b, packed, split.row_cut), key_cuts = grid_cuts(k0, k1, packed, split.key_cut);
    for (std::size_t i = 0; i + 1 < row_cuts.size(); ++i) {
      for (std::size_t j = 0; j + 1 < key_cuts.size(); ++j) {
        const std::int64_t r0 = row_cuts[i], t0 = key_cuts[j];
        entries.push_back(part_entry(mask, split.pad + r0 - a, row_cuts[i + 1] - r0, t0 - k0, key_cuts[j + 1] - t0, r0 - t0));
        phases.push_back({(packed + r0) % grid, (packed + t0) % grid});
      }
    }
    // The call's buffers: `pad` rows of other data, then the shard's rows; the group's keys.
    std::vector<E> q(static_cast<std::size_t>(rows) * qw, to_element<E>(0.5f)), dout(q.size(), to_element<E>(-0.25f));
    std::copy(doc.q.begin() + a * qw, doc.q.begin() + b * qw, q.begin() + split.pad * qw);
    std::copy(doc.dout.begin() + a * qw, doc.dout.begin() + b * qw, dout.begin() + split.pad * qw);
    const std::vector<E> k(doc.k.begin() + k0 * kw, doc.k.begin() + k1 * kw), v(doc.v.begin() + k0 * kw, doc.v.begin() + k1 * kw);
    std::vector<E> out(q.size()), dq(q.size());
    std::vector<float> lse(static_cast<std::size_t>(s.heads_q * rows));
    std::vector<std::int64_t> dk(k.size(), 0), dv(k.size(), 0);
    calls.template operator()<E>(s, InvariantGrid{grid, phases}, entries, q, k, v, dout, out, lse, dq, dk, dv, ex);
    std::copy(out.begin() + split.pad * qw, out.end(), r.out.begin() + a * qw);
    std::copy(dq.begin() + split.pad * qw, dq.end(), r.dq.begin() + a * qw);
    for (std::int64_t h = 0; h < s.heads_q; ++h) {
      for (std::int64_t p = 0; p < lq; ++p) {
        r.lse[static_cast<std::size_t>(h * L + a + p)] = lse[static_cast<std::size_t>(h * rows + split.pad + p)];
      }
    }
    // The copies' exact sums add at home as integers.
    for (std::size_t i = 0; i < dk.size(); ++i) {
      r.dk[static_cast<std::size_t>(k0) * kw + i] += dk[i];
      r.dv[static_cast<std::size_t>(k0) * kw + i] += dv[i];
    }
  }
  return r;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class E>
void expect_same_bits(const SplitRun<E>& got, const SplitRun<E>& want, const std::string& what) {
  EXPECT_TRUE(same_bits(got.out, want.out)) << what << ": out";
  EXPECT_TRUE(same_bits(got.lse, want.lse)) << what << ": lse";
  EXPECT_TRUE(same_bits(got.dq, want.dq)) << what << ": dq";
  EXPECT_TRUE(same_bits(got.dk, want.dk)) << what << ": dk";
  EXPECT_TRUE(same_bits(got.dv, want.dv)) << what << ": dv";
}

template <class E>
double max_abs(const std::vector<E>& x) {
  double m = 0;
  for (const E& e : x) m = std::max(m, std::fabs(to_double(e)));
  return m;
}

template <class E>
KvGradientExponents exponents_of(const Document<E>& d) {
  return kv_gradient_exponents(d.shape, {max_abs(d.q), max_abs(d.v), max_abs(d.dout), d.length});
}

/// A split run `r` (its exact dk and dv rounded at `ex`) and the default
/// mode's run `d` of the same document (out, lse, dq, dk, dv) against the
/// double reference `fwd`, `grad`: each within `tol`, and never worse than
/// twice the default's error (plus tol / 10).
template <class E, class Default, class Forward, class Backward>
void expect_as_accurate_as_the_default(const SplitRun<E>& r, KvGradientExponents ex, const Default& d, const Forward& fwd, const Backward& grad,
                                       double tol) {
  std::vector<E> dk(r.dk.size()), dv(r.dv.size());
  round_exact<E>(r.dk, ex.dk, dk);
  round_exact<E>(r.dv, ex.dv, dv);
  const std::vector<double> lse(r.lse.begin(), r.lse.end()), lse0(d.lse.begin(), d.lse.end());
  const std::pair<double, double> errors[] = {{relative_error(as_doubles<E>(r.out), fwd.out), relative_error(as_doubles<E>(d.out), fwd.out)},
                                              {relative_error(lse, fwd.lse), relative_error(lse0, fwd.lse)},
                                              {relative_error(as_doubles<E>(r.dq), grad.dq), relative_error(as_doubles<E>(d.dq), grad.dq)},
                                              {relative_error(as_doubles<E>(dk), grad.dk), relative_error(as_doubles<E>(d.dk), grad.dk)},
                                              {relative_error(as_doubles<E>(dv), grad.dv), relative_error(as_doubles<E>(d.dv), grad.dv)}};
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i) {
    EXPECT_LE(errors[i].first, tol) << names[i];
    EXPECT_TRUE(within_twice(errors[i].first, errors[i].second, tol / 10)) << names[i];
  }
}

/// Every split below must give the bits of the whole document in one call
/// (run(doc, mask, grid, packed, split, exponents) runs one split).
template <class E, class Run>
void check_splits_with(Run&& run, const AttentionShape& s, std::int64_t L, std::int64_t grid, std::int64_t packed) {
  const Document<E> doc(s, L, 5);
  const auto ex = exponents_of(doc);
  const auto shards = grid_cuts(0, L, packed, grid);      // every block its own call
  const auto larger = grid_cuts(0, L, packed, 3 * grid);  // a few larger shards
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask) + ", packed start " + std::to_string(packed));
    const SplitRun<E> whole = run(doc, mask, grid, packed, Split{{0, L}}, ex);
    expect_same_bits(run(doc, mask, grid, packed, Split{shards}, ex), whole, "a call per block");
    expect_same_bits(run(doc, mask, grid, packed, Split{larger, 0, 0, 3}, ex), whole, "larger shards, padded rows");
    expect_same_bits(run(doc, mask, grid, packed, Split{{0, L}, grid, 0, 0}, ex), whole, "keys cut into entries");
    expect_same_bits(run(doc, mask, grid, packed, Split{larger, 2 * grid, grid, 1}, ex), whole, "rows and keys cut");
  }
}

}  // namespace cpdispatch::testing
