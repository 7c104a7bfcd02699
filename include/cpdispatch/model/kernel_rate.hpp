#pragma once
// The attention kernel's speed on one entry (a query block against its
// key-value block under a band), for the step-time model (step_model.hpp):
// a kernel is slower on short entries than on long ones, and slower per
// FLOP on small heads, so one FLOP rate misprices a dispatched rank, whose
// entries are query shards, against Ulysses' whole documents.
//
// One pass (forward or backward) over one entry takes
//
//   seconds = flops / peak
//           + heads_q x (pairs x pair_seconds + q_len x row_seconds + q_len x cut_row_seconds [band cuts the block])
//           + entry_seconds
//
// flops as flash-attention counts them (forward 4 x pairs x head_dim x
// heads_q, backward 2.5 times that), pairs the (query, key) pairs the band
// lets through. peak is the rate of the block products; pair_seconds the
// softmax's work per pair and head, which does not grow with head_dim (so
// small heads run below peak); row_seconds each query row's work per head
// (loads, rescaling, the output); cut_row_seconds the rows' share of the
// blocks a band cuts (a causal diagonal), computed whole and then masked;
// entry_seconds a fixed cost per entry. On a square causal entry of L
// tokens this is the saturating curve rate = peak' x L / (L + L_half), L_half
// set by the row terms against the pair terms. With only `peak` set
// (KernelRate::constant) it is the one-rate model: seconds = flops / peak.
//
// fit_kernel_rate finds the five from measured (entry, seconds) samples by
// least squares on the relative error (samples run from microseconds to
// seconds), none negative.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// One entry as a kernel runs it: q_len query rows against kv_len key
/// columns on heads_q query heads of head_dim, `pairs` (per head) of them
/// inside the band; `cut`: the band masks part of the block.
struct KernelEntry {
  std::int64_t q_len = 0, kv_len = 0;
  double pairs = 0;
  std::int64_t heads_q = 1, head_dim = 1;
  bool cut = false;

  /// Forward FLOPs, flash-attention's count; backward's are 2.5 times these.
  double forward_flops() const { return 4.0 * pairs * static_cast<double>(head_dim * heads_q); }
};

/// The entry of q_len x kv_len rows of which `pairs` are attended.
inline KernelEntry kernel_entry(std::int64_t q_len, std::int64_t kv_len, std::int64_t pairs, std::int64_t heads_q, std::int64_t head_dim) {
  if (q_len < 0 || kv_len < 0 || pairs < 0 || heads_q < 1 || head_dim < 1) {
    detail::fail("kernel_entry: q_len = ", q_len, ", kv_len = ", kv_len, ", pairs = ", pairs, " must not be negative and heads_q = ",
                 heads_q, ", head_dim = ", head_dim, " must be at least 1");
  }
  const double all = static_cast<double>(q_len) * static_cast<double>(kv_len);
  return {q_len, kv_len, static_cast<double>(pairs), heads_q, head_dim, static_cast<double>(pairs) < all};
}

/// An attention entry as the kernel runs it (its band in its own frame).
inline KernelEntry kernel_entry(const AttentionEntry& e, std::int64_t heads_q, std::int64_t head_dim) {
  const std::int64_t pairs = band_pairs(e.q_start, e.q_start + e.q_len, e.kv_start, e.kv_start + e.kv_len, e.band);
  return kernel_entry(e.q_len, e.kv_len, pairs, heads_q, head_dim);
}

/// A KV group's entry: lq query rows against lk key columns under `mask`, bottom-right aligned (entry_pairs).
inline KernelEntry group_entry(std::int64_t lq, std::int64_t lk, const AttentionMask& mask, std::int64_t heads_q, std::int64_t head_dim) {
  return kernel_entry(lq, lk, entry_pairs(mask, lq, lk), heads_q, head_dim);
}

/// The time of one kernel pass over an entry (see the file comment).
struct KernelRate {
  double peak = 400e12;          ///< FLOP/s of the block products
  double pair_seconds = 0;       ///< per (query, key) pair and query head
  double row_seconds = 0;        ///< per query row and query head
  double cut_row_seconds = 0;    ///< more per query row and head when the band cuts the block
  double entry_seconds = 0;      ///< per entry

  /// One rate for every entry: seconds = flops / rate (the one-rate model).
  static KernelRate constant(double flops_per_second) {
    KernelRate r;
    r.peak = flops_per_second;
    r.check();
    return r;
  }

  /// Refuses a term out of range, naming it (`who`: which rate it is).
  void check(const char* who = "KernelRate") const {
    if (!(peak > 0) || !std::isfinite(peak)) detail::fail(who, ": peak = ", peak, " FLOP/s must be positive and finite");
    const double* terms[] = {&pair_seconds, &row_seconds, &cut_row_seconds, &entry_seconds};
    const char* names[] = {"pair_seconds", "row_seconds", "cut_row_seconds", "entry_seconds"};
    for (std::size_t i = 0; i < 4; ++i) {
      if (!(*terms[i] >= 0) || !std::isfinite(*terms[i])) detail::fail(who, ": ", names[i], " = ", *terms[i], " must be finite and at least 0");
    }
  }

  /// Seconds of a pass of `flops` over `e` (its forward_flops, or 2.5 times them for backward).
  double seconds(const KernelEntry& e, double flops) const {
    const double rows = static_cast<double>(e.q_len), heads = static_cast<double>(e.heads_q);
    if (e.pairs <= 0) return 0;  // a kernel skips an entry with nothing to attend
    return flops / peak + heads * (e.pairs * pair_seconds + rows * (row_seconds + (e.cut ? cut_row_seconds : 0))) + entry_seconds;
  }
  /// FLOP/s of that pass.
  double rate(const KernelEntry& e, double flops) const {
    const double s = seconds(e, flops);
    return s > 0 ? flops / s : peak;
  }
};

/// "peak=...,pair_seconds=...,row_seconds=...,cut_row_seconds=...,entry_seconds=...": to print and to read back.
inline std::string to_string(const KernelRate& r) {
  char text[200];
  std::snprintf(text, sizeof text, "peak=%.6g,pair_seconds=%.6g,row_seconds=%.6g,cut_row_seconds=%.6g,entry_seconds=%.6g", r.peak,
                r.pair_seconds, r.row_seconds, r.cut_row_seconds, r.entry_seconds);
  return text;
}

/// The kernel's forward and backward (backward's FLOPs 2.5 times forward's).
struct KernelRates {
  KernelRate forward{}, backward{};

  static KernelRates constant(double flops_per_second) { return {KernelRate::constant(flops_per_second), KernelRate::constant(flops_per_second)}; }
  void check() const {
    forward.check("KernelRates.forward");
    backward.check("KernelRates.backward");
  }
  double forward_seconds(const KernelEntry& e) const { return forward.seconds(e, e.forward_flops()); }
  double backward_seconds(const KernelEntry& e) const { return backward.seconds(e, 2.5 * e.forward_flops()); }
};

/// A measured pass: the entry and its seconds.
struct KernelSample {
  KernelEntry entry{};
  double seconds = 0;
};

namespace detail::kernel_rate {

constexpr std::size_t terms = 5;

/// The sample's five terms, each multiplied by its parameter (1 / peak first) in seconds().
inline std::vector<double> features(const KernelEntry& e, double flops) {
  const double heads = static_cast<double>(e.heads_q), rows = static_cast<double>(e.q_len);
  return {flops, heads * e.pairs, heads * rows, e.cut ? heads * rows : 0.0, 1.0};
}

/// Solves the normal equations a x = b (n x n, row-major) by Gaussian elimination with partial pivoting;
/// false when a is singular.
inline bool solve(std::vector<double> a, std::vector<double> b, std::size_t n, std::vector<double>& x) {
  for (std::size_t c = 0; c < n; ++c) {
    std::size_t p = c;
    for (std::size_t r = c + 1; r < n; ++r)
      if (std::abs(a[r * n + c]) > std::abs(a[p * n + c])) p = r;
    if (!(std::abs(a[p * n + c]) > 1e-12)) return false;
    for (std::size_t k = 0; k < n; ++k) std::swap(a[c * n + k], a[p * n + k]);
    std::swap(b[c], b[p]);
    for (std::size_t r = c + 1; r < n; ++r) {
      const double f = a[r * n + c] / a[c * n + c];
      for (std::size_t k = c; k < n; ++k) a[r * n + k] -= f * a[c * n + k];
      b[r] -= f * b[c];
    }
  }
  x.assign(n, 0);
  for (std::size_t c = n; c-- > 0;) {
    double s = b[c];
    for (std::size_t k = c + 1; k < n; ++k) s -= a[c * n + k] * x[k];
    x[c] = s / a[c * n + c];
  }
  return true;
}

/// Least squares of sum_i (f_i . p / s_i - 1)^2 over the terms in `active`, columns scaled to unit length
/// (the terms span many orders of magnitude); p is 0 outside `active`. False when the terms cannot be told apart.
inline bool least_squares(const std::vector<std::vector<double>>& f, std::span<const double> seconds, const std::vector<bool>& active,
                          std::vector<double>& p) {
  std::vector<std::size_t> cols;
  for (std::size_t j = 0; j < terms; ++j)
    if (active[j]) cols.push_back(j);
  const std::size_t n = cols.size();
  std::vector<double> scale(n, 0), a(n * n, 0), b(n, 0), x;
  for (std::size_t c = 0; c < n; ++c) {
    for (std::size_t i = 0; i < f.size(); ++i) scale[c] += std::pow(f[i][cols[c]] / seconds[i], 2);
    scale[c] = std::sqrt(scale[c]);
    if (!(scale[c] > 0)) return false;
  }
  for (std::size_t i = 0; i < f.size(); ++i) {
    for (std::size_t r = 0; r < n; ++r) {
      const double xr = f[i][cols[r]] / seconds[i] / scale[r];
      b[r] += xr;
      for (std::size_t c = 0; c < n; ++c) a[r * n + c] += xr * f[i][cols[c]] / seconds[i] / scale[c];
    }
  }
  if (!solve(a, b, n, x)) return false;
  p.assign(terms, 0);
  for (std::size_t c = 0; c < n; ++c) p[cols[c]] = x[c] / scale[c];
  return true;
}

/// seconds() of the sample whose terms are `x`.
inline double predicted(const KernelRate& r, const std::vector<double>& x) {
  return x[0] / r.peak + x[1] * r.pair_seconds + x[2] * r.row_seconds + x[3] * r.cut_row_seconds + x[4] * r.entry_seconds;
}

/// One least-squares fit of the terms `f` to `seconds` (see fit_kernel_rate).
inline KernelRate fit(const std::vector<std::vector<double>>& f, std::span<const double> seconds) {
  std::vector<bool> active(terms, true);
  for (std::size_t j = 1; j < terms; ++j)  // a term no sample has (e.g. no band cuts a block) stays 0
    active[j] = std::any_of(f.begin(), f.end(), [j](const std::vector<double>& x) { return x[j] != 0; });
  std::vector<double> p;
  for (;;) {
    if (!least_squares(f, seconds, active, p)) {
      // One head_dim only: FLOPs and pairs move together, and the block products' rate carries both.
      if (!active[1]) detail::fail("fit_kernel_rate: the samples do not determine the kernel's peak rate");
      active[1] = false;
      continue;
    }
    const auto worst = std::min_element(p.begin() + 1, p.end());
    if (*worst < 0) {
      active[static_cast<std::size_t>(worst - p.begin())] = false;
    } else if (!(p[0] > 0)) {
      detail::fail("fit_kernel_rate: the samples do not determine the kernel's peak rate (longer entries take no longer)");
    } else {
      break;
    }
  }
  KernelRate r;
  r.peak = 1.0 / p[0];
  r.pair_seconds = p[1], r.row_seconds = p[2], r.cut_row_seconds = p[3], r.entry_seconds = p[4];
  r.check();
  return r;
}

}  // namespace detail::kernel_rate

/// The KernelRate closest to the samples, each pass counted as `flop_factor`
/// times its entry's forward FLOPs (1: forward, 2.5: backward): least squares
/// on the relative error, a term that would come out negative dropped (set
/// to 0) and the rest fitted again, then once more without the samples far
/// off the first fit (disturbed runs); with one head_dim, whose FLOPs and
/// pairs cannot be told apart, pair_seconds stays 0. Refuses fewer samples
/// than terms, a sample without pairs or time, and samples that give no
/// positive peak.
inline KernelRate fit_kernel_rate(std::span<const KernelSample> samples, double flop_factor = 1.0) {
  namespace kr = detail::kernel_rate;
  if (samples.size() < kr::terms) detail::fail("fit_kernel_rate: ", samples.size(), " samples; at least ", kr::terms, " are needed");
  if (!(flop_factor > 0)) detail::fail("fit_kernel_rate: flop_factor = ", flop_factor, " must be positive");
  std::vector<std::vector<double>> f;
  std::vector<double> seconds;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const KernelSample& s = samples[i];
    if (!(s.seconds > 0) || !(s.entry.pairs > 0) || !std::isfinite(s.seconds)) {
      detail::fail("fit_kernel_rate: samples[", i, "] has seconds = ", s.seconds, " and entry.pairs = ", s.entry.pairs, "; both must be positive");
    }
    f.push_back(kr::features(s.entry, flop_factor * s.entry.forward_flops()));
    seconds.push_back(s.seconds);
  }
  KernelRate r = kr::fit(f, seconds);
  // A run the shared machine disturbed is far off the rest: drop the samples off by more than three times the
  // median error (and more than 10 %), once, and fit again.
  std::vector<double> error;
  for (std::size_t i = 0; i < f.size(); ++i) error.push_back(std::abs(kr::predicted(r, f[i]) / seconds[i] - 1));
  std::vector<double> sorted = error;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
  const double limit = std::max(0.1, 3 * sorted[sorted.size() / 2]);
  std::vector<std::vector<double>> kept_f;
  std::vector<double> kept_seconds;
  for (std::size_t i = 0; i < f.size(); ++i)
    if (error[i] <= limit) kept_f.push_back(f[i]), kept_seconds.push_back(seconds[i]);
  return kept_f.size() < f.size() && kept_f.size() >= kr::terms ? kr::fit(kept_f, kept_seconds) : r;
}

/// One rank's compute seconds, forward and backward.
struct ComputeSeconds {
  double forward = 0, backward = 0;
  void add(const KernelRates& k, const KernelEntry& e) {
    forward += k.forward_seconds(e);
    backward += k.backward_seconds(e);
  }
};

/// Calls f(entry) for each kernel entry of head-parallel document d of rank
/// r: the document whole (its entries where it has slices) on heads_q / u
/// query heads.
template <class F>
void each_head_parallel_entry(const HeadParallelLayout& hp, std::size_t r, std::size_t d, std::int64_t heads_q, std::int64_t head_dim, F f) {
  const std::int64_t heads = std::max<std::int64_t>(1, heads_q / hp.degree), len = hp.seqlens[r][d];
  if (hp.entries.empty() || hp.entries[r][d].empty()) return f(group_entry(len, len, hp.mask, heads, head_dim));
  for (const AttentionEntry& e : hp.entries[r][d]) f(kernel_entry(e, heads, head_dim));
}

/// Each rank's compute in a plan's attention layout: an entry per KV group
/// under the plan's mask (attn.entries where the documents have slices), on
/// every query head; each head-parallel document as each_head_parallel_entry gives it.
inline std::vector<ComputeSeconds> plan_compute_seconds(const QkvMetadata& m, const KernelRates& k, std::int64_t heads_q, std::int64_t head_dim) {
  k.check();
  const AttentionLayout& a = m.attn;
  std::vector<ComputeSeconds> out(a.seqlens_q.size());
  for (std::size_t r = 0; r < out.size(); ++r) {
    for (std::size_t g = 0; g < a.seqlens_q[r].size(); ++g) {
      if (a.entries.empty()) {
        out[r].add(k, group_entry(a.seqlens_q[r][g], a.seqlens_kv[r][g], a.mask, heads_q, head_dim));
        continue;
      }
      for (const AttentionEntry& e : a.entries[r][g]) out[r].add(k, kernel_entry(e, heads_q, head_dim));
    }
  }
  const HeadParallelLayout& hp = m.hp_attn;
  if (hp.degree == 0) return out;
  for (std::size_t r = 0; r < out.size() && r < hp.seqlens.size(); ++r)
    for (std::size_t d = 0; d < hp.seqlens[r].size(); ++d) each_head_parallel_entry(hp, r, d, heads_q, head_dim, [&](const KernelEntry& e) { out[r].add(k, e); });
  return out;
}

namespace detail::kernel_rate {

/// Pairs of query chunk qa against key chunk kb (chunks of ch tokens) of a document of `len` tokens,
/// padded to `padded`: under its slices (the padding sees nothing), else under the mask over the padded document.
inline std::int64_t chunk_pairs(std::int64_t qa, std::int64_t kb, std::int64_t ch, std::int64_t len, std::int64_t padded,
                                const AttentionMask& mask, const std::vector<AttentionSlice>* slices) {
  const std::int64_t q0 = qa * ch, k0 = kb * ch;
  if (slices) return slice_pairs(*slices, std::min(q0, len), std::min(q0 + ch, len), std::min(k0, len), std::min(k0 + ch, len));
  Band band = mask.band();
  if (mask.type == MaskType::sliding_window && mask.window >= padded) band.lo = Band::unbounded_lo;
  return band_pairs(q0, q0 + ch, k0, k0 + ch, band);
}

}  // namespace detail::kernel_rate

/// A rank's compute in USP with groups of `group` ranks (model_usp's
/// layout), every rank alike: with one group (Ulysses) every document
/// whole (an entry per slice where it has slices) on heads_q / group query
/// heads; with G = W / group groups the zig-zag ring's entries, each
/// document padded to a multiple of 2G and cut into 2G chunks, every query
/// chunk against every key chunk it sees, a rank's share 1 / G of them.
/// Causal and full documents count their chunk pairs in closed form; others
/// visit all (2G)^2 chunk pairs.
inline ComputeSeconds usp_compute_seconds(const std::vector<std::int64_t>& docs, const AttentionMask& mask, std::int64_t world_size,
                                          std::int64_t group, const KernelRates& k, std::int64_t heads_q, std::int64_t head_dim,
                                          std::span<const std::vector<AttentionSlice>> slices = {}) {
  k.check();
  if (group < 1 || world_size % group != 0) detail::fail("usp_compute_seconds: group = ", group, " must divide world_size = ", world_size);
  if (!slices.empty() && slices.size() != docs.size()) detail::fail("usp_compute_seconds: slices are given for ", slices.size(), " documents, but the batch has ", docs.size());
  const std::int64_t G = world_size / group, heads = std::max<std::int64_t>(1, heads_q / group), n = 2 * G;
  ComputeSeconds total;
  for (std::size_t j = 0; j < docs.size(); ++j) {
    const std::int64_t len = docs[j];
    const std::vector<AttentionSlice>* sliced = !slices.empty() && !slices[j].empty() ? &slices[j] : nullptr;
    if (G == 1) {
      if (!sliced) total.add(k, group_entry(len, len, mask, heads, head_dim));
      for (const AttentionSlice& s : sliced ? *sliced : std::vector<AttentionSlice>{}) {
        total.add(k, kernel_entry(AttentionEntry{s.q_begin, s.q_end - s.q_begin, s.k_begin, s.k_end - s.k_begin, s.band()}, heads, head_dim));
      }
      continue;
    }
    const std::int64_t ch = (len + n - 1) / n, padded = ch * n;
    if (!sliced && mask.type != MaskType::sliding_window) {  // every chunk below the diagonal whole, the diagonal cut
      const bool full = mask.type == MaskType::full;
      const double whole = full ? static_cast<double>(n * n) : static_cast<double>(n * (n - 1) / 2), cut = full ? 0.0 : static_cast<double>(n);
      const KernelEntry block = kernel_entry(ch, ch, ch * ch, heads, head_dim), diagonal = group_entry(ch, ch, mask, heads, head_dim);
      total.forward += (whole * k.forward_seconds(block) + cut * k.forward_seconds(diagonal)) / static_cast<double>(G);
      total.backward += (whole * k.backward_seconds(block) + cut * k.backward_seconds(diagonal)) / static_cast<double>(G);
      continue;
    }
    ComputeSeconds doc;
    for (std::int64_t qa = 0; qa < n; ++qa)
      for (std::int64_t kb = 0; kb < n; ++kb) {
        const std::int64_t pairs = detail::kernel_rate::chunk_pairs(qa, kb, ch, len, padded, mask, sliced);
        if (pairs > 0) doc.add(k, kernel_entry(ch, ch, pairs, heads, head_dim));
      }
    total.forward += doc.forward / static_cast<double>(G);
    total.backward += doc.backward / static_cast<double>(G);
  }
  return total;
}

}  // namespace cpdispatch
