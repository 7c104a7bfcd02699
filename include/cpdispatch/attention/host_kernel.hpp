#pragma once
// HostAttentionKernel: the flash-attention algorithm on the CPU, forward and
// backward, for float, bfloat16 and float16 (fp32 accumulation), satisfying
// AttentionKernel (attention/kernel.hpp). docs/attention-kernel.md.
//
// Forward: per (entry, query head, query block), the key blocks the mask lets
// the block see are attended one after another with an online softmax (a
// running row maximum and sum), so no [q_len][kv_len] matrix is ever held.
// Backward recomputes the probabilities from the log-sum-exp in two passes:
// one per (entry, key-value head, key block) accumulates dk and dv over the
// query rows that see the block, one per (entry, query head, query block)
// accumulates dq. Every output element is summed by one thread in a fixed
// order, so results are bitwise the same for every thread count.
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
#include "cpdispatch/attention/detail/work_pool.hpp"
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

/// Keys [lo, hi) of an entry that its query row j sees (hi <= lo: none).
struct KeyRange {
  std::int64_t lo = 0, hi = 0;
};

inline KeyRange visible_keys(const AttentionMask& mask, std::int64_t j, std::int64_t diagonal, std::int64_t kv_len) {
  const std::int64_t p = j + diagonal;  // the row's document position, counted from key 0
  const std::int64_t hi = std::clamp<std::int64_t>(p + 1, 0, kv_len);
  switch (mask.type) {
    case MaskType::full: return {0, kv_len};
    case MaskType::sliding_window: {
      const std::int64_t w = std::min(mask.window, std::int64_t{1} << 62);  // wider than any entry; no overflow below
      return {std::clamp<std::int64_t>(p - w + 1, 0, hi), hi};
    }
    case MaskType::causal: break;
  }
  return {0, hi};
}

/// Query rows [begin, end) of an entry that see some key of [t0, t1). The
/// bounds of visible_keys grow with j, so those rows are contiguous.
inline std::pair<std::int64_t, std::int64_t> rows_seeing(const AttentionMask& mask, const AttentionEntry& e,
                                                         std::int64_t t0, std::int64_t t1) {
  auto first = [&](auto&& pred) {  // first row j where pred(j) holds (pred monotone false -> true)
    std::int64_t lo = 0, hi = e.q_len;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (pred(mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
  };
  const std::int64_t begin = first([&](std::int64_t j) { return visible_keys(mask, j, e.diagonal, e.kv_len).hi > t0; });
  const std::int64_t end = first([&](std::int64_t j) { return visible_keys(mask, j, e.diagonal, e.kv_len).lo >= t1; });
  return {begin, std::max(begin, end)};
}

/// One unit of parallel work: an entry, a head and the first row of a block.
struct WorkItem {
  std::int64_t entry = 0, head = 0, start = 0, cost = 0;
};

/// Scratch of one thread, grown to fit and kept across calls.
struct ThreadScratch {
  std::vector<float> s, dp, acc, acc2, m, l;
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
  void forward(const AttentionShape& shape, const AttentionMask& mask, std::span<const AttentionEntry> entries,
               std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out,
               std::span<float> lse) {
    const Sizes z = check_.forward(name_, shape, mask, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_)};
    prepare_scratch(shape);
    list_query_blocks(shape, mask, entries);
    auto body = [&](std::int64_t i, int w) {
      forward_block(shape, mask, entries, in, items_[static_cast<std::size_t>(i)], scratch_[static_cast<std::size_t>(w)],
                    out, lse, z);
    };
    pool_->run(static_cast<std::int64_t>(items_.size()), body);
  }

  template <class E>
  void backward(const AttentionShape& shape, const AttentionMask& mask, std::span<const AttentionEntry> entries,
                std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<const E> out,
                std::span<const float> lse, std::span<const E> dout, std::span<E> dq, std::span<E> dk,
                std::span<E> dv) {
    const Sizes z = check_.backward(name_, shape, mask, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                    dout.size(), dq.size(), dk.size(), dv.size());
    const Inputs in{as_f32(q, q32_), as_f32(k, k32_), as_f32(v, v32_), as_f32(dout, dout32_)};
    prepare_scratch(shape);
    row_deltas(shape, entries, out, dout, z);
    list_key_blocks(shape, mask, entries);
    auto kv_body = [&](std::int64_t i, int w) {
      key_value_grad_block(shape, mask, entries, in, lse, items_[static_cast<std::size_t>(i)],
                           scratch_[static_cast<std::size_t>(w)], dk, dv, z);
    };
    pool_->run(static_cast<std::int64_t>(items_.size()), kv_body);
    list_query_blocks(shape, mask, entries);
    auto q_body = [&](std::int64_t i, int w) {
      query_grad_block(shape, mask, entries, in, lse, items_[static_cast<std::size_t>(i)],
                       scratch_[static_cast<std::size_t>(w)], dq, z);
    };
    pool_->run(static_cast<std::int64_t>(items_.size()), q_body);
  }

 private:
  using WorkItem = detail::attention::WorkItem;
  using ThreadScratch = detail::attention::ThreadScratch;

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

  /// Keys [lo, hi) that some row of the query block [j0, j1) sees.
  static detail::attention::KeyRange block_keys(const AttentionMask& mask, const AttentionEntry& e, std::int64_t j0,
                                                std::int64_t j1) {
    const auto first = detail::attention::visible_keys(mask, j0, e.diagonal, e.kv_len);
    const auto last = detail::attention::visible_keys(mask, j1 - 1, e.diagonal, e.kv_len);
    return {first.lo, std::max(first.lo, last.hi)};
  }

  /// One item per (entry, query head, query block), the costliest first.
  void list_query_blocks(const AttentionShape& s, const AttentionMask& mask, std::span<const AttentionEntry> entries) {
    items_.clear();
    for (std::size_t e = 0; e < entries.size(); ++e) {
      for (std::int64_t j = 0; j < entries[e].q_len; j += options_.block_q) {
        const std::int64_t j1 = std::min(entries[e].q_len, j + options_.block_q);
        const auto keys = block_keys(mask, entries[e], j, j1);
        for (std::int64_t h = 0; h < s.heads_q; ++h) {
          items_.push_back({static_cast<std::int64_t>(e), h, j, (j1 - j) * (keys.hi - keys.lo + 1)});
        }
      }
    }
    sort_items();
  }

  /// One item per (entry, key-value head, key block), the costliest first.
  void list_key_blocks(const AttentionShape& s, const AttentionMask& mask, std::span<const AttentionEntry> entries) {
    items_.clear();
    for (std::size_t e = 0; e < entries.size(); ++e) {
      for (std::int64_t t = 0; t < entries[e].kv_len; t += options_.block_kv) {
        const std::int64_t t1 = std::min(entries[e].kv_len, t + options_.block_kv);
        const auto rows = detail::attention::rows_seeing(mask, entries[e], t, t1);
        for (std::int64_t g = 0; g < s.heads_kv; ++g) {
          items_.push_back({static_cast<std::int64_t>(e), g, t, (t1 - t) * (rows.second - rows.first + 1)});
        }
      }
    }
    sort_items();
  }

  void sort_items() {
    // The order only balances the threads (each item's result does not depend on it).
    std::sort(items_.begin(), items_.end(), [](const WorkItem& a, const WorkItem& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      if (a.entry != b.entry) return a.entry < b.entry;
      if (a.head != b.head) return a.head < b.head;
      return a.start < b.start;
    });
  }

  /// Scores S = scale * log2(e) * Q K^T of rows [j0, j0 + r) against keys
  /// [c0, c0 + c), with the masked ones set to -infinity; row stride ld.
  static void block_scores(const AttentionShape& s, const AttentionMask& mask, const AttentionEntry& e, HeadRows q,
                           HeadRows k, std::int64_t j0, std::int64_t r, std::int64_t c0, std::int64_t c, float* out,
                           std::int64_t ld) {
    using namespace detail::attention;
    gemm_nt(r, c, s.head_dim, s.softmax_scale * log2e, q.row(e.q_start + j0), q.stride, k.row(e.kv_start + c0),
            k.stride, 0.0f, out, ld);
    const auto first = visible_keys(mask, j0, e.diagonal, e.kv_len);
    const auto last = visible_keys(mask, j0 + r - 1, e.diagonal, e.kv_len);
    if (last.lo <= c0 && first.hi >= c0 + c) return;  // every row sees every key of the block
    for (std::int64_t i = 0; i < r; ++i) {
      const auto keys = visible_keys(mask, j0 + i, e.diagonal, e.kv_len);
      const std::int64_t lo = std::clamp<std::int64_t>(keys.lo - c0, 0, c);
      const std::int64_t hi = std::clamp<std::int64_t>(keys.hi - c0, lo, c);
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
  void forward_block(const AttentionShape& s, const AttentionMask& mask, std::span<const AttentionEntry> entries,
                     const Inputs& in, const WorkItem& item, ThreadScratch& t, std::span<E> out, std::span<float> lse,
                     const Sizes& z) const {
    using namespace detail::attention;
    const AttentionEntry& e = entries[static_cast<std::size_t>(item.entry)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, e.q_len - j0);
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv), bk = options_.block_kv;
    const HeadRows q = head_q(s, in.q, item.head), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    float* acc = t.acc.data();
    std::fill(acc, acc + r * D, 0.0f);
    std::fill(t.m.begin(), t.m.begin() + r, minus_inf);
    std::fill(t.l.begin(), t.l.begin() + r, 0.0f);
    const auto keys = block_keys(mask, e, j0, j0 + r);
    for (std::int64_t c0 = keys.lo; c0 < keys.hi; c0 += bk) {
      const std::int64_t c = std::min(bk, keys.hi - c0);
      block_scores(s, mask, e, q, k, j0, r, c0, c, t.s.data(), bk);
      for (std::int64_t i = 0; i < r; ++i) online_softmax_row(t, i, t.s.data() + i * bk, c, acc + i * D, D);
      gemm_nn(r, D, c, 1.0f, t.s.data(), bk, v.row(e.kv_start + c0), v.stride, 1.0f, acc, D);
    }
    for (std::int64_t i = 0; i < r; ++i) {
      const std::int64_t row = e.q_start + j0 + i;
      const float l = t.l[static_cast<std::size_t>(i)];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      E* o = out.data() + (row * s.heads_q + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(acc[i * D + d] * inv);
      lse[static_cast<std::size_t>(item.head * z.tokens_q + row)] =
          l > 0.0f ? (t.m[static_cast<std::size_t>(i)] + std::log2(l)) * ln2 : minus_inf;
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

  /// D = rowsum(dout * out) per (query head, row): the softmax gradient's shift.
  template <class E>
  void row_deltas(const AttentionShape& s, std::span<const AttentionEntry> entries, std::span<const E> out,
                  std::span<const E> dout, const Sizes& z) {
    const std::int64_t D = s.head_dim;
    const auto n = static_cast<std::size_t>(s.heads_q * z.tokens_q);
    if (delta_.size() < n) delta_.resize(n);
    for (const AttentionEntry& e : entries) {
      for (std::int64_t row = e.q_start; row < e.q_start + e.q_len; ++row) {
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
  /// [j0, j0 + r) of head h against keys [c0, c0 + c).
  void block_probability_grads(const AttentionShape& s, const AttentionMask& mask, const AttentionEntry& e,
                               const Inputs& in, std::span<const float> lse, std::int64_t h, std::int64_t j0,
                               std::int64_t r, std::int64_t c0, std::int64_t c, ThreadScratch& t,
                               const Sizes& z) const {
    using namespace detail::attention;
    const std::int64_t g = h / (s.heads_q / s.heads_kv), bk = options_.block_kv;
    const HeadRows q = head_q(s, in.q, h), k = head_kv(s, in.k, g), v = head_kv(s, in.v, g);
    const HeadRows dout = head_q(s, in.dout, h);
    block_scores(s, mask, e, q, k, j0, r, c0, c, t.s.data(), bk);
    gemm_nt(r, c, s.head_dim, 1.0f, dout.row(e.q_start + j0), dout.stride, v.row(e.kv_start + c0), v.stride, 0.0f,
            t.dp.data(), bk);
    for (std::int64_t i = 0; i < r; ++i) {
      const auto idx = static_cast<std::size_t>(h * z.tokens_q + e.q_start + j0 + i);
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
  void key_value_grad_block(const AttentionShape& s, const AttentionMask& mask, std::span<const AttentionEntry> entries,
                            const Inputs& in, std::span<const float> lse, const WorkItem& item, ThreadScratch& t,
                            std::span<E> dk, std::span<E> dv, const Sizes& z) const {
    using namespace detail::attention;
    const AttentionEntry& e = entries[static_cast<std::size_t>(item.entry)];
    const std::int64_t D = s.head_dim, c0 = item.start, c = std::min(options_.block_kv, e.kv_len - c0);
    const std::int64_t group = s.heads_q / s.heads_kv, bq = options_.block_q, bk = options_.block_kv;
    float* dk_acc = t.acc.data();
    float* dv_acc = t.acc2.data();
    std::fill(dk_acc, dk_acc + c * D, 0.0f);
    std::fill(dv_acc, dv_acc + c * D, 0.0f);
    const auto rows = rows_seeing(mask, e, c0, c0 + c);
    for (std::int64_t h = item.head * group; h < (item.head + 1) * group; ++h) {
      const HeadRows q = head_q(s, in.q, h), dout = head_q(s, in.dout, h);
      for (std::int64_t j0 = rows.first; j0 < rows.second; j0 += bq) {
        const std::int64_t r = std::min(bq, rows.second - j0);
        block_probability_grads(s, mask, e, in, lse, h, j0, r, c0, c, t, z);
        gemm_tn(c, D, r, 1.0f, t.s.data(), bk, dout.row(e.q_start + j0), dout.stride, 1.0f, dv_acc, D);
        gemm_tn(c, D, r, s.softmax_scale, t.dp.data(), bk, q.row(e.q_start + j0), q.stride, 1.0f, dk_acc, D);
      }
    }
    for (std::int64_t i = 0; i < c; ++i) {
      const std::int64_t base = ((e.kv_start + c0 + i) * s.heads_kv + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) {
        dk[static_cast<std::size_t>(base + d)] = from_f32<E>(dk_acc[i * D + d]);
        dv[static_cast<std::size_t>(base + d)] = from_f32<E>(dv_acc[i * D + d]);
      }
    }
  }

  template <class E>
  void query_grad_block(const AttentionShape& s, const AttentionMask& mask, std::span<const AttentionEntry> entries,
                        const Inputs& in, std::span<const float> lse, const WorkItem& item, ThreadScratch& t,
                        std::span<E> dq, const Sizes& z) const {
    using namespace detail::attention;
    const AttentionEntry& e = entries[static_cast<std::size_t>(item.entry)];
    const std::int64_t D = s.head_dim, j0 = item.start, r = std::min(options_.block_q, e.q_len - j0);
    const std::int64_t g = item.head / (s.heads_q / s.heads_kv), bk = options_.block_kv;
    const HeadRows k = head_kv(s, in.k, g);
    float* acc = t.acc.data();
    std::fill(acc, acc + r * D, 0.0f);
    const auto keys = block_keys(mask, e, j0, j0 + r);
    for (std::int64_t c0 = keys.lo; c0 < keys.hi; c0 += bk) {
      const std::int64_t c = std::min(bk, keys.hi - c0);
      block_probability_grads(s, mask, e, in, lse, item.head, j0, r, c0, c, t, z);
      gemm_nn(r, D, c, s.softmax_scale, t.dp.data(), bk, k.row(e.kv_start + c0), k.stride, 1.0f, acc, D);
    }
    for (std::int64_t i = 0; i < r; ++i) {
      E* o = dq.data() + ((e.q_start + j0 + i) * s.heads_q + item.head) * D;
      for (std::int64_t d = 0; d < D; ++d) o[d] = from_f32<E>(acc[i * D + d]);
    }
  }

  HostAttentionOptions options_;
  std::unique_ptr<detail::attention::WorkPool> pool_;
  std::vector<ThreadScratch> scratch_;
  std::vector<WorkItem> items_;
  detail::attention::CallCheck check_;
  std::vector<float> q32_, k32_, v32_, dout32_, delta_;
};

}  // inline namespace host_attention_*

static_assert(AttentionKernel<HostAttentionKernel, float>);
static_assert(AttentionKernel<HostAttentionKernel, bfloat16>);
static_assert(AttentionKernel<HostAttentionKernel, float16>);

}  // namespace cpdispatch
