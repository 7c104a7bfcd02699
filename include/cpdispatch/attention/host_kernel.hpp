#pragma once
// HostAttentionKernel: the flash-attention algorithm on the CPU, forward and
// backward, for float, bfloat16 and float16 (fp32 accumulation), satisfying
// AttentionKernel (attention/kernel.hpp). docs/attention-kernel.md.
//
// The call's rows are cut into segments covered by the same entries
// (detail/row_cover.hpp; one segment per entry when no rows are shared).
// Forward: per (query segment, query head, query block), every covering
// entry in index order attends the key blocks its band lets the block see,
// one after another, with one online softmax (a running row maximum and sum)
// across all of them, so no [q_len][kv_len] matrix is ever held. Backward
// recomputes the probabilities from the log-sum-exp in two passes: one per
// (key segment, key-value head, key block) accumulates dk and dv over the
// query rows of every covering entry that see the block, one per (query
// segment, query head, query block) accumulates dq. Every output element is
// summed by one thread in a fixed order, so results are bitwise the same for
// every thread count.
//
// One call at a time per kernel object (its scratch and thread pool serve one
// call); scratch only grows, so calls of sizes seen before allocate nothing.
//
// Block products: cblas_sgemm when CPDISPATCH_ATTENTION_CBLAS is defined
// (link cpdispatch::attention), portable loops otherwise. The two builds are
// different types (an inline namespace), so they never mix in one program
// unnoticed.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/detail/block_math.hpp"
#include "cpdispatch/attention/call_check.hpp"
#include "cpdispatch/attention/detail/exact_sum.hpp"
#include "cpdispatch/attention/detail/row_cover.hpp"
#include "cpdispatch/attention/detail/work_pool.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch {

/// Threads and block sizes of HostAttentionKernel.
struct HostAttentionOptions {
  int threads = 0;              ///< threads per call, the caller included; 0: std::thread::hardware_concurrency()
  std::int64_t block_q = 128;   ///< query rows per block
  std::int64_t block_kv = 256;  ///< key-value rows per block
};

namespace detail::attention {

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr float ln2 = 0.6931471805599453f;
inline constexpr float minus_inf = -std::numeric_limits<float>::infinity();

template <class E>
inline float to_f32(E x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return static_cast<float>(x);
  }
}

template <class E>
inline E from_f32(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return E(x);
  }
}

/// Rows [begin, end) of a buffer (end <= begin: none).
struct RowRun {
  std::int64_t begin = 0, end = 0;
};

/// Whether entry e lets no pair through at all.
inline bool sees_nothing(const AttentionEntry& e) { return e.q_len <= 0 || e.kv_len <= 0 || e.band.lo > e.band.hi; }

// Bounded band ends lie within 2^62 (CallCheck) and rows below 2^56 (any
// address space), so a row plus a band end never overflows below.

/// Key rows of entry e that query row j sees: t with lo <= t - j <= hi.
inline RowRun visible_keys(const AttentionEntry& e, std::int64_t j) {
  const std::int64_t end = e.kv_start + e.kv_len;
  const std::int64_t lo = e.band.bounded_below() ? std::clamp(j + e.band.lo, e.kv_start, end) : e.kv_start;
  const std::int64_t hi = e.band.bounded_above() ? std::clamp(j + e.band.hi + 1, lo, end) : end;
  return {lo, hi};
}

/// Query rows of entry e that see some key of [t0, t1) (inside its keys):
/// t0 - hi <= j < t1 - lo. Both ends of visible_keys grow with j, so the
/// rows are contiguous.
inline RowRun rows_seeing(const AttentionEntry& e, std::int64_t t0, std::int64_t t1) {
  if (sees_nothing(e)) return {e.q_start, e.q_start};
  const std::int64_t end = e.q_start + e.q_len;
  const std::int64_t first = e.band.bounded_above() ? std::clamp(t0 - e.band.hi, e.q_start, end) : e.q_start;
  const std::int64_t last = e.band.bounded_below() ? std::clamp(t1 - e.band.lo, first, end) : end;
  return {first, last};
}

/// Key rows that some query row of [j0, j1) (inside entry e's rows) sees.
inline RowRun block_keys(const AttentionEntry& e, std::int64_t j0, std::int64_t j1) {
  if (sees_nothing(e)) return {e.kv_start, e.kv_start};
  const RowRun first = visible_keys(e, j0), last = visible_keys(e, j1 - 1);
  return {first.begin, std::max(first.begin, last.end)};
}

/// One unit of parallel work: a row segment, a head and the first row of a block.
struct WorkItem {
  std::int64_t segment = 0, head = 0, start = 0, cost = 0;
};

/// Scratch of one thread, grown to fit and kept across calls.
struct ThreadScratch {
  std::vector<float> s, dp, acc, acc2, m, l;
  // The invariant mode's: two transposed tiles, four rows of lanes, per row
  // of a block its maximum, bound, key count and exponents, its unit's fp32
  // sums and its exact sums; the forward's scores of a block (its maximum
  // pass computes them, its sum pass reads them).
  std::vector<float> ta, tb, lanes_s, lanes_p, lanes_shift, lanes_delta, row_m, row_b, row_acc, scores;
  std::vector<std::int64_t> row_n, row_exact;
  std::vector<int> row_e, row_f;
};

}  // namespace detail::attention

#ifdef CPDISPATCH_ATTENTION_CBLAS
inline namespace host_attention_cblas {
#else
inline namespace host_attention_portable {
#endif

/// The flash-attention algorithm on host threads; see the file comment.
class HostAttentionKernel {
 public:
  HostAttentionKernel() : HostAttentionKernel(HostAttentionOptions{}) {}
  explicit HostAttentionKernel(HostAttentionOptions options) : options_(checked(options)) {
    detail::attention::use_one_blas_thread();
    pool_ = std::make_unique<detail::attention::WorkPool>(options_.threads);
    scratch_.resize(static_cast<std::size_t>(options_.threads));
  }

  /// Threads a call uses, the caller included.
  int threads() const noexcept { return options_.threads; }
  const HostAttentionOptions& options() const noexcept { return options_; }

  template <class E>
  void forward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
               std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    const Sizes z = check_.forward(name_, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_)};
    prepare_scratch(shape);
    query_cover_.build(entries, detail::attention::CoverSide::query);
    list_query_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { forward_block(shape, entries, in, item, t, out, lse, z); });
  }

  template <class E>
  void backward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
                std::span<const E> k, std::span<const E> v, std::span<const E> out, std::span<const float> lse,
                std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    const Sizes z = check_.backward(name_, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                    dout.size(), dq.size(), dk.size(), dv.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_), as_f32(dout, dout32_)};
    prepare_scratch(shape);
    query_cover_.build(entries, detail::attention::CoverSide::query);
    key_cover_.build(entries, detail::attention::CoverSide::key);
    row_deltas(shape, out, dout, z);
    list_key_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { key_value_grad_block(shape, entries, in, lse, item, t, dk, dv, z); });
    list_query_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { query_grad_block(shape, entries, in, lse, item, t, dq, z); });
  }

  /// Invariant mode (attention/invariant.hpp): out and lse bitwise the same
  /// for every split of a row's keys on the grid (entries, units), every
  /// thread count and block size. Throws invalid_input on a non-finite
  /// score or sum (a NaN or infinity in the inputs).
  template <class E>
  void forward_invariant(const AttentionShape& shape, const InvariantGrid& grid, std::span<const AttentionEntry> entries,
                         std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out,
                         std::span<float> lse) {
    const Sizes z = check_.forward(name_, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    detail::check_invariant_grid(name_, grid, entries.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_)};
    prepare_invariant(shape, in, z);
    query_cover_.build(entries, detail::attention::CoverSide::query);
    list_query_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { invariant_forward_block(shape, grid, entries, in, item, t, out, lse, z); });
  }

  /// Invariant mode: dq (written, rounded once per element) bitwise the same
  /// for every split on the grid; dk and dv added as exact sums into `kv`
  /// (one term per query head and query unit), so that any caller's sum of
  /// them over calls, copies and ranks is the same integer. Needs the
  /// forward's out and lse (the invariant forward's, for the property).
  /// Throws invalid_input on a term that is not finite or outside kv's scale.
  template <class E>
  void backward_invariant(const AttentionShape& shape, const InvariantGrid& grid, std::span<const AttentionEntry> entries,
                          std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<const E> out,
                          std::span<const float> lse, std::span<const E> dout, std::span<E> dq, ExactKvGradients kv) {
    const Sizes z = check_.backward(name_, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                    dout.size(), dq.size(), kv.dk.size(), kv.dv.size());
    detail::check_invariant_grid(name_, grid, entries.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_), as_f32(dout, dout32_)};
    prepare_scratch(shape);
    prepare_invariant(shape, in, z);
    query_cover_.build(entries, detail::attention::CoverSide::query);
    key_cover_.build(entries, detail::attention::CoverSide::key);
    row_deltas(shape, out, dout, z);
    list_key_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { invariant_kv_grad_block(shape, grid, entries, in, lse, item, t, kv, z); });
    list_query_blocks(shape, entries);
    run_items([&](const WorkItem& item, ThreadScratch& t) { invariant_query_grad_block(shape, grid, entries, in, lse, item, t, dq, z); });
  }

 private:
  using WorkItem = detail::attention::WorkItem;
  using ThreadScratch = detail::attention::ThreadScratch;
  using RowRun = detail::attention::RowRun;
  using RowSegment = detail::attention::RowSegment;

  using Sizes = detail::attention::CallSizes;
  static constexpr const char* name_ = "HostAttentionKernel";
  /// fp32 views of the inputs (the caller's buffers for float, converted copies otherwise).
  struct Inputs {
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    const float* dout = nullptr;
  };
  /// Row pointers of one head: row t of a THD buffer with `heads` heads.
  struct HeadRows {
    const float* base;
    std::int64_t stride;
    const float* row(std::int64_t t) const { return base + t * stride; }
  };

  static HostAttentionOptions checked(HostAttentionOptions o) {
    if (o.threads < 0) detail::fail("HostAttentionOptions.threads is ", o.threads, "; it must be >= 0");
    if (o.block_q < 1 || o.block_q > 4096) {
      detail::fail("HostAttentionOptions.block_q is ", o.block_q, "; it must be in [1, 4096]");
    }
    if (o.block_kv < 1 || o.block_kv > 4096) {
      detail::fail("HostAttentionOptions.block_kv is ", o.block_kv, "; it must be in [1, 4096]");
    }
    if (o.threads == 0) o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    return o;
  }

  template <class E>
  static const float* as_f32(std::span<const E> x, std::vector<float>& copy) {
    if constexpr (std::is_same_v<E, float>) {
      return x.data();
    } else {
      if (copy.size() < x.size()) copy.resize(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) copy[i] = static_cast<float>(x[i]);
      return copy.data();
    }
  }

  void prepare_scratch(const AttentionShape& s) {
    const auto bq = static_cast<std::size_t>(options_.block_q), bk = static_cast<std::size_t>(options_.block_kv);
    const auto d = static_cast<std::size_t>(s.head_dim);
    for (ThreadScratch& t : scratch_) {
      auto fit = [](std::vector<float>& x, std::size_t n) {
        if (x.size() < n) x.resize(n);
      };
      fit(t.s, bq * bk);
      fit(t.dp, bq * bk);
      fit(t.acc, std::max(bq, bk) * d);
      fit(t.acc2, bk * d);
      fit(t.m, bq);
      fit(t.l, bq);
    }
  }

  const AttentionEntry& entry(std::span<const AttentionEntry> entries, std::int64_t id) const {
    return entries[static_cast<std::size_t>(id)];
  }

  /// One item per (query segment, query head, query block), the costliest
  /// first; a block's cost counts the keys of every entry covering it.
  void list_query_blocks(const AttentionShape& s, std::span<const AttentionEntry> entries) {
    list_blocks(query_cover_, options_.block_q, s.heads_q, entries, &detail::attention::block_keys);
  }

  /// One item per (key segment, key-value head, key block), the costliest
  /// first; a block's cost counts the query rows of every entry seeing it.
  void list_key_blocks(const AttentionShape& s, std::span<const AttentionEntry> entries) {
    list_blocks(key_cover_, options_.block_kv, s.heads_kv, entries, &detail::attention::rows_seeing);
  }

  /// The items of `cover`'s segments in blocks of `block` rows, each costed
  /// by the rows `across(entry, first, end)` gives on the other side.
  void list_blocks(const detail::attention::RowCover& cover, std::int64_t block, std::int64_t heads, std::span<const AttentionEntry> entries,
                   RowRun (*across)(const AttentionEntry&, std::int64_t, std::int64_t)) {
    items_.clear();
    const auto segments = cover.segments();
    for (std::size_t g = 0; g < segments.size(); ++g) {
      for (std::int64_t b = segments[g].begin; b < segments[g].end; b += block) {
        const std::int64_t b1 = std::min(segments[g].end, b + block);
        std::int64_t cost = 0;
        for (std::int64_t id : cover.entries_of(segments[g])) {
          const RowRun other = across(entry(entries, id), b, b1);
          cost += (b1 - b) * (other.end - other.begin + 1);
        }
        for (std::int64_t h = 0; h < heads; ++h) items_.push_back({static_cast<std::int64_t>(g), h, b, cost});
      }
    }
    sort_items();
  }

  /// Runs f(item, the running thread's scratch) for every listed item on the pool.
  template <class F>
  void run_items(F&& f) {
    auto body = [&](std::int64_t i, int w) { f(items_[static_cast<std::size_t>(i)], scratch_[static_cast<std::size_t>(w)]); };
    pool_->run(static_cast<std::int64_t>(items_.size()), body);
  }

  void sort_items() {
    // The order only balances the threads (each item's result does not depend on it).
    std::sort(items_.begin(), items_.end(), [](const WorkItem& a, const WorkItem& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      if (a.segment != b.segment) return a.segment < b.segment;
      if (a.head != b.head) return a.head < b.head;
      return a.start < b.start;
    });
  }

  /// Scores S = scale * log2(e) * Q K^T of query rows [j0, j0 + r) against
  /// key rows [c0, c0 + c), both inside entry e's and in buffer rows, with
  /// those outside e's band set to -infinity; row stride ld.
  static void block_scores(const AttentionShape& s, const AttentionEntry& e, HeadRows q, HeadRows k, std::int64_t j0,
                           std::int64_t r, std::int64_t c0, std::int64_t c, float* out, std::int64_t ld) {
    using namespace detail::attention;
    gemm_nt(r, c, s.head_dim, s.softmax_scale * log2e, q.row(j0), q.stride, k.row(c0), k.stride, 0.0f, out, ld);
    const RowRun first = visible_keys(e, j0), last = visible_keys(e, j0 + r - 1);
    if (last.begin <= c0 && first.end >= c0 + c) return;  // every row sees every key of the block
    for (std::int64_t i = 0; i < r; ++i) {
      const RowRun keys = visible_keys(e, j0 + i);
      const std::int64_t lo = std::clamp<std::int64_t>(keys.begin - c0, 0, c);
      const std::int64_t hi = std::clamp<std::int64_t>(keys.end - c0, lo, c);
      float* row = out + i * ld;
      std::fill(row, row + lo, minus_inf);
      std::fill(row + hi, row + c, minus_inf);
    }
  }

  HeadRows head_q(const AttentionShape& s, const float* base, std::int64_t h) const {
    return {base + h * s.head_dim, s.heads_q * s.head_dim};
  }
  HeadRows head_kv(const AttentionShape& s, const float* base, std::int64_t g) const {
    return {base + g * s.head_dim, s.heads_kv * s.head_dim};
  }

  template <class E>
  void forward_block(const AttentionShape& s, std::span<const AttentionEntry> entries, const Inputs& in,
                     const WorkItem& item, ThreadScratch& t, std::span<E> out, std::span<float> lse,
                     const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = query_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, seg.end - j0);
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv);
    const HeadRows q = head_q(s, in.q, item.head), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    float* acc = t.acc.data();
    std::fill(acc, acc + r * D, 0.0f);
    std::fill(t.m.begin(), t.m.begin() + r, minus_inf);
    std::fill(t.l.begin(), t.l.begin() + r, 0.0f);
    // One softmax per row across every entry covering it, entries in index order.
    for (std::int64_t id : query_cover_.entries_of(seg)) attend_entry(s, entry(entries, id), q, k, v, j0, r, t);
    for (std::int64_t i = 0; i < r; ++i) {
      const std::int64_t row = j0 + i;
      const float l = t.l[static_cast<std::size_t>(i)];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      E* o = out.data() + (row * s.heads_q + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(acc[i * D + d] * inv);
      lse[static_cast<std::size_t>(item.head * z.tokens_q + row)] =
          l > 0.0f ? (t.m[static_cast<std::size_t>(i)] + std::log2(l)) * ln2 : minus_inf;
    }
  }

  /// Folds entry e's keys into the running softmax of query rows [j0, j0 + r).
  void attend_entry(const AttentionShape& s, const AttentionEntry& e, HeadRows q, HeadRows k, HeadRows v,
                    std::int64_t j0, std::int64_t r, ThreadScratch& t) const {
    using namespace detail::attention;
    const std::int64_t D = s.head_dim, bk = options_.block_kv;
    float* acc = t.acc.data();
    const RowRun keys = block_keys(e, j0, j0 + r);
    for (std::int64_t c0 = keys.begin; c0 < keys.end; c0 += bk) {
      const std::int64_t c = std::min(bk, keys.end - c0);
      block_scores(s, e, q, k, j0, r, c0, c, t.s.data(), bk);
      for (std::int64_t i = 0; i < r; ++i) online_softmax_row(t, i, t.s.data() + i * bk, c, acc + i * D, D);
      gemm_nn(r, D, c, 1.0f, t.s.data(), bk, v.row(c0), v.stride, 1.0f, acc, D);
    }
  }

  /// Turns row i of the scores into probabilities against the running
  /// maximum, rescaling the row's sum and output accumulator when it grows.
  static void online_softmax_row(ThreadScratch& t, std::int64_t i, float* row, std::int64_t c, float* acc_row,
                                 std::int64_t D) {
    using namespace detail::attention;
    float& m = t.m[static_cast<std::size_t>(i)];
    float& l = t.l[static_cast<std::size_t>(i)];
    const float m_new = std::max(m, row_max(row, c));
    if (m_new == minus_inf) {  // nothing seen yet: the row adds nothing
      std::fill(row, row + c, 0.0f);
      return;
    }
    const float correction = exp2_approx(m - m_new);
    if (correction != 1.0f) {
      for (std::int64_t d = 0; d < D; ++d) acc_row[d] *= correction;
    }
    l = l * correction + exp2_row(row, c, m_new);
    m = m_new;
  }

  /// D = rowsum(dout * out) per (query head, covered row): the softmax gradient's shift.
  template <class E>
  void row_deltas(const AttentionShape& s, std::span<const E> out, std::span<const E> dout, const Sizes& z) {
    const std::int64_t D = s.head_dim;
    const auto n = static_cast<std::size_t>(s.heads_q * z.tokens_q);
    if (delta_.size() < n) delta_.resize(n);
    for (const RowSegment& seg : query_cover_.segments()) {
      for (std::int64_t row = seg.begin; row < seg.end; ++row) {
        for (std::int64_t h = 0; h < s.heads_q; ++h) {
          const std::int64_t base = (row * s.heads_q + h) * D;
          float sum = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) {
            sum += detail::attention::to_f32(out[static_cast<std::size_t>(base + d)]) *
                   detail::attention::to_f32(dout[static_cast<std::size_t>(base + d)]);
          }
          delta_[static_cast<std::size_t>(h * z.tokens_q + row)] = sum;
        }
      }
    }
  }

  /// Probabilities P (in t.s) and dS = P * (dP - D) (in t.dp) of query rows
  /// [j0, j0 + r) of head h against key rows [c0, c0 + c) under entry e.
  void block_probability_grads(const AttentionShape& s, const AttentionEntry& e, const Inputs& in,
                               std::span<const float> lse, std::int64_t h, std::int64_t j0, std::int64_t r,
                               std::int64_t c0, std::int64_t c, ThreadScratch& t, const Sizes& z) const {
    using namespace detail::attention;
    const std::int64_t g = h / (s.heads_q / s.heads_kv), bk = options_.block_kv;
    const HeadRows q = head_q(s, in.q, h), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    const HeadRows dout = head_q(s, in.dout, h);
    block_scores(s, e, q, k, j0, r, c0, c, t.s.data(), bk);
    gemm_nt(r, c, s.head_dim, 1.0f, dout.row(j0), dout.stride, v.row(c0), v.stride, 0.0f, t.dp.data(), bk);
    for (std::int64_t i = 0; i < r; ++i) {
      const auto idx = static_cast<std::size_t>(h * z.tokens_q + j0 + i);
      float* p = t.s.data() + i * bk;
      float* dp = t.dp.data() + i * bk;
      if (lse[idx] == minus_inf) {  // the row saw nothing in the whole attention
        std::fill(p, p + c, 0.0f);
        std::fill(dp, dp + c, 0.0f);
        continue;
      }
      exp2_row(p, c, lse[idx] * log2e);
      softmax_grad_row(p, dp, delta_[idx], c);
    }
  }

  template <class E>
  void key_value_grad_block(const AttentionShape& s, std::span<const AttentionEntry> entries, const Inputs& in,
                            std::span<const float> lse, const WorkItem& item, ThreadScratch& t, std::span<E> dk,
                            std::span<E> dv, const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = key_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, c0 = item.start, c = std::min(options_.block_kv, seg.end - c0);
    float* dk_acc = t.acc.data();
    float* dv_acc = t.acc2.data();
    std::fill(dk_acc, dk_acc + c * D, 0.0f);
    std::fill(dv_acc, dv_acc + c * D, 0.0f);
    // The shares of every entry covering the keys, entries in index order.
    for (std::int64_t id : key_cover_.entries_of(seg)) {
      key_value_grads_of_entry(s, entry(entries, id), in, lse, item.head, c0, c, t, z);
    }
    for (std::int64_t i = 0; i < c; ++i) {
      const std::int64_t base = ((c0 + i) * s.heads_kv + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) {
        dk[static_cast<std::size_t>(base + d)] = from_f32<E>(dk_acc[i * D + d]);
        dv[static_cast<std::size_t>(base + d)] = from_f32<E>(dv_acc[i * D + d]);
      }
    }
  }

  /// Adds entry e's dk and dv of key rows [c0, c0 + c), head g, into the
  /// thread's accumulators, over the rows of every query head of the group.
  void key_value_grads_of_entry(const AttentionShape& s, const AttentionEntry& e, const Inputs& in,
                                std::span<const float> lse, std::int64_t g, std::int64_t c0, std::int64_t c,
                                ThreadScratch& t, const Sizes& z) const {
    using namespace detail::attention;
    const std::int64_t D = s.head_dim, group = s.heads_q / s.heads_kv, bq = options_.block_q, bk = options_.block_kv;
    const RowRun rows = rows_seeing(e, c0, c0 + c);
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      const HeadRows q = head_q(s, in.q, h), dout = head_q(s, in.dout, h);
      for (std::int64_t j0 = rows.begin; j0 < rows.end; j0 += bq) {
        const std::int64_t r = std::min(bq, rows.end - j0);
        block_probability_grads(s, e, in, lse, h, j0, r, c0, c, t, z);
        gemm_tn(c, D, r, 1.0f, t.s.data(), bk, dout.row(j0), dout.stride, 1.0f, t.acc2.data(), D);
        gemm_tn(c, D, r, s.softmax_scale, t.dp.data(), bk, q.row(j0), q.stride, 1.0f, t.acc.data(), D);
      }
    }
  }

  template <class E>
  void query_grad_block(const AttentionShape& s, std::span<const AttentionEntry> entries, const Inputs& in,
                        std::span<const float> lse, const WorkItem& item, ThreadScratch& t, std::span<E> dq,
                        const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = query_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, seg.end - j0);
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv), bk = options_.block_kv;
    const HeadRows k = head_kv(s, in.k, g);
    float* acc = t.acc.data();
    std::fill(acc, acc + r * D, 0.0f);
    for (std::int64_t id : query_cover_.entries_of(seg)) {
      const AttentionEntry& e = entry(entries, id);
      const RowRun keys = block_keys(e, j0, j0 + r);
      for (std::int64_t c0 = keys.begin; c0 < keys.end; c0 += bk) {
        const std::int64_t c = std::min(bk, keys.end - c0);
        block_probability_grads(s, e, in, lse, item.head, j0, r, c0, c, t, z);
        gemm_nn(r, D, c, s.softmax_scale, t.dp.data(), bk, k.row(c0), k.stride, 1.0f, acc, D);
      }
    }
    for (std::int64_t i = 0; i < r; ++i) {
      E* o = dq.data() + ((j0 + i) * s.heads_q + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(acc[i * D + d]);
    }
  }

  // ---- The invariant mode: units in a fixed order, exact sums across them ----
  //
  // Pairs are computed in lanes (detail/block_math.hpp: dot_lanes,
  // exp2_lanes), one pair a lane with the same operations in every lane, in
  // tiles of at most `tile` rows that never cross a unit; a unit's terms are
  // summed in fp32 in increasing row order, then added exactly.

  /// The first row after t of the unit holding t, rows counted from `start` with the grid shifted by `phase`; at most `end`.
  static std::int64_t unit_end(std::int64_t t, std::int64_t start, std::int64_t phase, std::int64_t G, std::int64_t end) noexcept {
    return std::min(end, t + G - (phase + t - start) % G);
  }

  static RowRun clip(RowRun r, std::int64_t first, std::int64_t end) noexcept {
    return {std::max(r.begin, first), std::min(r.end, end)};
  }

  /// For each entry covering segment seg, each unit of the key rows that
  /// query rows [j0, j0 + r) see (the grid shifted by the entry's kv phase)
  /// and each tile of at most `tile` keys in it: begin_unit() at the unit's
  /// start, on_tile(entry, first key, keys) per tile, end_unit() at its end.
  template <class Begin, class Tile, class End>
  void for_each_key_unit(const InvariantGrid& grid, std::span<const AttentionEntry> entries, const RowSegment& seg, std::int64_t j0,
                         std::int64_t r, Begin&& begin_unit, Tile&& on_tile, End&& end_unit) const {
    using detail::attention::tile;
    for (std::int64_t id : query_cover_.entries_of(seg)) {
      const AttentionEntry& e = entry(entries, id);
      const RowRun keys = detail::attention::block_keys(e, j0, j0 + r);
      const std::int64_t phase = grid.phases.empty() ? 0 : grid.phases[static_cast<std::size_t>(id)].kv;
      for (std::int64_t u0 = keys.begin; u0 < keys.end;) {
        const std::int64_t u1 = unit_end(u0, e.kv_start, phase, grid.size, keys.end);
        begin_unit();
        for (std::int64_t t0 = u0; t0 < u1; t0 += tile) on_tile(e, t0, std::min(tile, u1 - t0));
        end_unit();
        u0 = u1;
      }
    }
  }

  template <class X>
  static void grow(std::vector<X>& x, std::size_t n) {
    if (x.size() < n) x.resize(n);
  }

  /// Scratch, and per key-value row and head its largest |k| and |v| (the rows' bounds).
  void prepare_invariant(const AttentionShape& s, const Inputs& in, const Sizes& z) {
    const auto D = static_cast<std::size_t>(s.head_dim), T = static_cast<std::size_t>(detail::attention::tile);
    const auto R = static_cast<std::size_t>(std::max(options_.block_q, options_.block_kv));
    for (ThreadScratch& t : scratch_) {
      for (auto* x : {&t.ta, &t.tb}) grow(*x, D * T);
      for (auto* x : {&t.lanes_s, &t.lanes_p, &t.lanes_shift, &t.lanes_delta}) grow(*x, T);
      for (auto* x : {&t.row_m, &t.row_b}) grow(*x, R);
      grow(t.row_acc, R * (D + 1));
      grow(t.row_n, R);
      grow(t.row_exact, R * (D + 1));
      grow(t.row_e, R);
      grow(t.row_f, R);
    }
    const auto rows = static_cast<std::size_t>(z.tokens_kv * s.heads_kv);
    grow(key_max_, rows);
    grow(value_max_, rows);
    for (std::size_t x = 0; x < rows; ++x) {
      float km = 0.0f, vm = 0.0f;
      for (std::size_t d = 0; d < D; ++d) {
        km = std::max(km, std::fabs(in.k[x * D + d]));
        vm = std::max(vm, std::fabs(in.v[x * D + d]));
      }
      key_max_[x] = km;
      value_max_[x] = vm;
    }
  }

  [[noreturn]] static void not_finite(const char* what, std::int64_t row, std::int64_t head) {
    detail::fail(name_, ": invariant ", what, " of row ", row, ", head ", head,
                 " is not finite or exceeds its exact sum's scale (a NaN or infinity in the inputs?)");
  }

  /// acc (n values) added exactly into exact at 2^e; false on a term that is not finite or too large.
  static bool fold(std::int64_t* exact, const float* acc, std::int64_t n, int e, double scale = 1.0) noexcept {
    for (std::int64_t d = 0; d < n; ++d) {
      if (!detail::attention::add_exact(exact[d], acc[d] * scale, e)) return false;
    }
    return true;
  }

  template <class E>
  void invariant_forward_block(const AttentionShape& s, const InvariantGrid& grid, std::span<const AttentionEntry> entries,
                               const Inputs& in, const WorkItem& item, ThreadScratch& t, std::span<E> out,
                               std::span<float> lse, const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = query_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, seg.end - j0), W = D + 1;
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv);
    const HeadRows q = head_q(s, in.q, item.head), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    const float cs = s.softmax_scale * log2e;
    float* ls = t.lanes_s.data();
    // The scores of the block, entry after entry (r rows of its keys each): a
    // pair's score does not depend on its lane, so pass 2 reads pass 1's.
    std::size_t cached = 0;
    for (std::int64_t id : query_cover_.entries_of(seg)) {
      const RowRun keys = block_keys(entry(entries, id), j0, j0 + r);
      cached += static_cast<std::size_t>(r * std::max<std::int64_t>(0, keys.end - keys.begin));
    }
    grow(t.scores, cached);
    // Pass 1: each row's scores, largest score (exact: a maximum), key count and largest |v|.
    std::fill_n(t.row_m.begin(), r, minus_inf);
    std::fill_n(t.row_b.begin(), r, 0.0f);
    std::fill_n(t.row_n.begin(), r, 0);
    float* slab = t.scores.data();
    for (std::int64_t id : query_cover_.entries_of(seg)) {
      const AttentionEntry& e = entry(entries, id);
      const RowRun keys = block_keys(e, j0, j0 + r);
      const std::int64_t width = keys.end - keys.begin;
      for (std::int64_t t0 = keys.begin; t0 < keys.end; t0 += tile) {
        const std::int64_t n = std::min(tile, keys.end - t0), n32 = (n + 31) / 32 * 32;
        transpose_tile(k.base, k.stride, t0, n, D, t.ta.data());
        for (std::int64_t i = 0; i < r; ++i) {
          const RowRun vis = clip(visible_keys(e, j0 + i), t0, t0 + n);
          if (vis.begin >= vis.end) continue;
          dot_lanes(q.row(j0 + i), t.ta.data(), D, n32, cs, ls);
          std::copy(ls + (vis.begin - t0), ls + (vis.end - t0), slab + i * width + (vis.begin - keys.begin));
          float m = t.row_m[i], b = t.row_b[i];  // in registers: the loop is most of the pass otherwise
          for (std::int64_t c = vis.begin; c < vis.end; ++c) {
            m = std::max(m, ls[c - t0]);
            b = std::max(b, value_max_[static_cast<std::size_t>(c * s.heads_kv + g)]);
          }
          t.row_m[i] = m;
          t.row_b[i] = b;
          t.row_n[i] += vis.end - vis.begin;
        }
      }
      if (width > 0) slab += r * width;
    }
    // Each row's exponents: its sum is at most its key count (every term <= 1), its output terms at most that times max|v|.
    for (std::int64_t i = 0; i < r; ++i) {
      if (t.row_n[i] > 0 && !std::isfinite(t.row_m[i])) not_finite("score maximum", j0 + i, item.head);
      const double n = 2.0 * static_cast<double>(t.row_n[i]);
      t.row_e[i] = exact_exponent(n, 1);
      t.row_f[i] = exact_exponent(n * t.row_b[i], 1);
    }
    std::fill_n(t.row_exact.begin(), r * W, 0);
    // Pass 2: per unit, each row's sum and output terms in fp32, keys increasing; then exactly across units.
    const auto begin_unit = [&] { std::fill_n(t.row_acc.begin(), r * W, 0.0f); };
    const AttentionEntry* current = nullptr;  // the entry whose scores start at slab (for_each_key_unit keeps pass 1's order)
    RowRun keys{};
    slab = t.scores.data();
    const auto on_tile = [&](const AttentionEntry& e, std::int64_t t0, std::int64_t n) {
      if (&e != current) {
        if (current != nullptr) slab += r * (keys.end - keys.begin);
        current = &e;
        keys = block_keys(e, j0, j0 + r);
      }
      const std::int64_t n32 = (n + 31) / 32 * 32, width = keys.end - keys.begin;
      for (std::int64_t i = 0; i < r; ++i) {
        const RowRun vis = clip(visible_keys(e, j0 + i), t0, t0 + n);
        if (vis.begin >= vis.end) continue;
        std::fill(ls, ls + (vis.begin - t0), minus_inf);
        const float* row = slab + i * width;
        std::copy(row + (vis.begin - keys.begin), row + (vis.end - keys.begin), ls + (vis.begin - t0));
        std::fill(ls + (vis.end - t0), ls + n32, minus_inf);
        std::fill_n(t.lanes_shift.begin(), n32, t.row_m[i]);
        exp2_lanes(ls, t.lanes_shift.data(), n32);
        float* acc = t.row_acc.data() + i * W;
        for (std::int64_t c = vis.begin; c < vis.end; ++c) acc[D] += ls[c - t0];
        axpy_rows(ls + (vis.begin - t0), v.row(vis.begin), v.stride, vis.end - vis.begin, acc, D);
      }
    };
    const auto end_unit = [&] {
      for (std::int64_t i = 0; i < r; ++i) {
        std::int64_t* x = t.row_exact.data() + i * W;
        const float* acc = t.row_acc.data() + i * W;
        if (!fold(x + D, acc + D, 1, t.row_e[i]) || !fold(x, acc, D, t.row_f[i])) not_finite("output", j0 + i, item.head);
      }
    };
    for_each_key_unit(grid, entries, seg, j0, r, begin_unit, on_tile, end_unit);
    for (std::int64_t i = 0; i < r; ++i) {
      E* o = out.data() + ((j0 + i) * s.heads_q + item.head) * D;
      float& row_lse = lse[static_cast<std::size_t>(item.head * z.tokens_q + j0 + i)];
      const std::int64_t* x = t.row_exact.data() + i * W;
      if (t.row_n[i] == 0) {  // the row sees no key
        std::fill(o, o + D, from_f32<E>(0.0f));
        row_lse = minus_inf;
        continue;
      }
      const double l = from_fixed(x[D], t.row_e[i]);
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(static_cast<float>(from_fixed(x[d], t.row_f[i]) / l));
      row_lse = static_cast<float>((static_cast<double>(t.row_m[i]) + std::log2(l)) * 0.6931471805599453);
    }
  }

  template <class E>
  void invariant_query_grad_block(const AttentionShape& s, const InvariantGrid& grid,
                                  std::span<const AttentionEntry> entries, const Inputs& in, std::span<const float> lse,
                                  const WorkItem& item, ThreadScratch& t, std::span<E> dq, const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = query_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, seg.end - j0);
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv);
    const HeadRows q = head_q(s, in.q, item.head), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    const HeadRows dout = head_q(s, in.dout, item.head);
    const float cs = s.softmax_scale * log2e;
    const auto row_index = [&](std::int64_t i) { return static_cast<std::size_t>(item.head * z.tokens_q + j0 + i); };
    // Each row's bound: |dq| <= (|dout|_1 max|v| + |delta|) max|k| over the keys it sees (its P sums to 1), twice to spare.
    for (std::int64_t i = 0; i < r; ++i) {
      float km = 0.0f, vm = 0.0f;
      for (std::int64_t id : query_cover_.entries_of(seg)) {
        const RowRun vis = visible_keys(entry(entries, id), j0 + i);
        for (std::int64_t c = vis.begin; c < vis.end; ++c) {
          km = std::max(km, key_max_[static_cast<std::size_t>(c * s.heads_kv + g)]);
          vm = std::max(vm, value_max_[static_cast<std::size_t>(c * s.heads_kv + g)]);
        }
      }
      double d1 = 0;
      for (std::int64_t d = 0; d < D; ++d) d1 += std::fabs(dout.row(j0 + i)[d]);
      t.row_e[i] = exact_exponent(2.0 * (d1 * vm + std::fabs(delta_[row_index(i)])) * km, 1);
    }
    std::fill_n(t.row_exact.begin(), r * D, 0);
    const auto begin_unit = [&] { std::fill_n(t.row_acc.begin(), r * D, 0.0f); };
    const auto on_tile = [&](const AttentionEntry& e, std::int64_t t0, std::int64_t n) {
      const std::int64_t n32 = (n + 31) / 32 * 32;
      transpose_tile(k.base, k.stride, t0, n, D, t.ta.data());
      transpose_tile(v.base, v.stride, t0, n, D, t.tb.data());
      for (std::int64_t i = 0; i < r; ++i) {
        const std::size_t idx = row_index(i);
        const RowRun vis = clip(visible_keys(e, j0 + i), t0, t0 + n);
        if (vis.begin >= vis.end || lse[idx] == minus_inf) continue;
        float* p = t.lanes_s.data();
        float* dp = t.lanes_p.data();
        dot_lanes(q.row(j0 + i), t.ta.data(), D, n32, cs, p);
        dot_lanes(dout.row(j0 + i), t.tb.data(), D, n32, 1.0f, dp);
        std::fill_n(t.lanes_shift.begin(), n32, lse[idx] * log2e);
        exp2_lanes(p, t.lanes_shift.data(), n32);
        const float delta = delta_[idx];
        for (std::int64_t c = vis.begin; c < vis.end; ++c) p[c - t0] *= dp[c - t0] - delta;  // dS
        axpy_rows(p + (vis.begin - t0), k.row(vis.begin), k.stride, vis.end - vis.begin, t.row_acc.data() + i * D, D);
      }
    };
    const auto end_unit = [&] {
      for (std::int64_t i = 0; i < r; ++i) {
        if (!fold(t.row_exact.data() + i * D, t.row_acc.data() + i * D, D, t.row_e[i])) not_finite("dq", j0 + i, item.head);
      }
    };
    for_each_key_unit(grid, entries, seg, j0, r, begin_unit, on_tile, end_unit);
    const double scale = s.softmax_scale;
    for (std::int64_t i = 0; i < r; ++i) {
      E* o = dq.data() + ((j0 + i) * s.heads_q + item.head) * D;
      const std::int64_t* x = t.row_exact.data() + i * D;
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(static_cast<float>(scale * from_fixed(x[d], t.row_e[i])));
    }
  }

  /// dk and dv of key rows [c0, c0 + c) of key-value head g: per query head
  /// of the group, entry and query unit, the unit's fp32 sum (rows
  /// increasing) added exactly into kv.
  void invariant_kv_grad_block(const AttentionShape& s, const InvariantGrid& grid, std::span<const AttentionEntry> entries,
                               const Inputs& in, std::span<const float> lse, const WorkItem& item, ThreadScratch& t,
                               const ExactKvGradients& kv, const Sizes& z) const {
    using namespace detail::attention;
    const RowSegment& seg = key_cover_.segments()[static_cast<std::size_t>(item.segment)];
    const std::int64_t D = s.head_dim, c0 = item.start, c = std::min(options_.block_kv, seg.end - c0);
    const std::int64_t g = item.head, group = s.heads_q / s.heads_kv;
    const HeadRows k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    const float cs = s.softmax_scale * log2e;
    const double scale = s.softmax_scale;
    float* acc_k = t.acc.data();
    float* acc_v = t.acc2.data();
    float* p = t.lanes_s.data();
    float* dp = t.lanes_p.data();
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      const HeadRows q = head_q(s, in.q, h), dout = head_q(s, in.dout, h);
      for (std::int64_t id : key_cover_.entries_of(seg)) {
        const AttentionEntry& e = entry(entries, id);
        const RowRun rows = rows_seeing(e, c0, c0 + c);
        const std::int64_t phase = grid.phases.empty() ? 0 : grid.phases[static_cast<std::size_t>(id)].q;
        for (std::int64_t w0 = rows.begin; w0 < rows.end;) {
          const std::int64_t w1 = unit_end(w0, e.q_start, phase, grid.size, rows.end);
          std::fill_n(acc_k, c * D, 0.0f);
          std::fill_n(acc_v, c * D, 0.0f);
          for (std::int64_t i0 = w0; i0 < w1; i0 += tile) {
            const std::int64_t n = std::min(tile, w1 - i0), n32 = (n + 31) / 32 * 32;
            transpose_tile(q.base, q.stride, i0, n, D, t.ta.data());
            transpose_tile(dout.base, dout.stride, i0, n, D, t.tb.data());
            for (std::int64_t l = 0; l < n32; ++l) {  // rows that saw nothing, and the padding, get p = 0
              const float x = l < n ? lse[static_cast<std::size_t>(h * z.tokens_q + i0 + l)] : minus_inf;
              t.lanes_shift[static_cast<std::size_t>(l)] = x == minus_inf ? std::numeric_limits<float>::infinity() : x * log2e;
              t.lanes_delta[static_cast<std::size_t>(l)] = l < n ? delta_[static_cast<std::size_t>(h * z.tokens_q + i0 + l)] : 0.0f;
            }
            for (std::int64_t key = c0; key < c0 + c; ++key) {
              // The rows of the tile that see `key`: key - hi <= row <= key - lo.
              const std::int64_t first = e.band.bounded_above() ? std::max(i0, key - e.band.hi) : i0;
              const std::int64_t end = e.band.bounded_below() ? std::min(i0 + n, key - e.band.lo + 1) : i0 + n;
              if (first >= end) continue;
              dot_lanes(k.row(key), t.ta.data(), D, n32, cs, p);
              dot_lanes(v.row(key), t.tb.data(), D, n32, 1.0f, dp);
              exp2_lanes(p, t.lanes_shift.data(), n32);
              axpy_rows(p + (first - i0), dout.row(first), dout.stride, end - first, acc_v + (key - c0) * D, D);
              for (std::int64_t l = first - i0; l < end - i0; ++l) dp[l] = p[l] * (dp[l] - t.lanes_delta[static_cast<std::size_t>(l)]);  // dS
              axpy_rows(dp + (first - i0), q.row(first), q.stride, end - first, acc_k + (key - c0) * D, D);
            }
          }
          for (std::int64_t key = c0; key < c0 + c; ++key) {
            const auto at = static_cast<std::size_t>((key * s.heads_kv + g) * D);
            if (!fold(kv.dk.data() + at, acc_k + (key - c0) * D, D, kv.dk_exponent, scale)) not_finite("dk", key, g);
            if (!fold(kv.dv.data() + at, acc_v + (key - c0) * D, D, kv.dv_exponent)) not_finite("dv", key, g);
          }
          w0 = w1;
        }
      }
    }
  }

  HostAttentionOptions options_;
  std::unique_ptr<detail::attention::WorkPool> pool_;
  std::vector<ThreadScratch> scratch_;
  std::vector<WorkItem> items_;
  detail::attention::CallCheck check_;
  detail::attention::RowCover query_cover_, key_cover_;
  std::vector<float> q32_, k32_, v32_, dout32_, delta_;
  std::vector<float> key_max_, value_max_;  // the invariant mode's: per key-value row and head, the largest |k|, |v|
};

}  // inline namespace host_attention_*

static_assert(AttentionKernel<HostAttentionKernel, float>);
static_assert(AttentionKernel<HostAttentionKernel, bfloat16>);
static_assert(AttentionKernel<HostAttentionKernel, float16>);
static_assert(InvariantAttentionKernel<HostAttentionKernel, float>);
static_assert(InvariantAttentionKernel<HostAttentionKernel, bfloat16>);

}  // namespace cpdispatch
