#pragma once
// The checks every attention kernel call makes before touching a buffer
// (shared by the host, CUDA and cuDNN kernels): the shape, buffer sizes that
// match the shape, entries inside the buffers, and band ends a kernel can
// add a row to without overflow. Entries may share rows and may have an
// empty band (lo > hi: the entry sees nothing). A kernel that cannot fold
// shared rows (cuDNN's) checks separate_rows as well. A broken rule is an
// invalid_input naming the kernel, the call and the field.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch::detail::attention {

/// Rows of the query and key-value buffers of one call.
struct CallSizes {
  std::int64_t tokens_q = 0, tokens_kv = 0;
};

class CallCheck {
 public:
  // Limits that keep every product and stride within a 32-bit BLAS int.
  static constexpr std::int64_t max_heads = 4096, max_dim = 4096;
  /// A bounded band end within +-2^62, plus or minus a row (below 2^56 in
  /// any address space), stays inside 64 bits.
  static constexpr std::int64_t max_band_end = std::int64_t{1} << 62;

  CallSizes forward(const char* kernel, const AttentionShape& s, std::span<const AttentionEntry> entries,
                    std::size_t q, std::size_t k, std::size_t v, std::size_t out, std::size_t lse) {
    const Where w{kernel, "forward"};
    const CallSizes z = common(w, s, entries, q, k, v);
    size(w, "out", out, q);
    size(w, "lse", lse, static_cast<std::size_t>(s.heads_q * z.tokens_q));
    return z;
  }

  CallSizes backward(const char* kernel, const AttentionShape& s, std::span<const AttentionEntry> entries,
                     std::size_t q, std::size_t k, std::size_t v, std::size_t out, std::size_t lse, std::size_t dout,
                     std::size_t dq, std::size_t dk, std::size_t dv) {
    const Where w{kernel, "backward"};
    const CallSizes z = common(w, s, entries, q, k, v);
    size(w, "out", out, q);
    size(w, "dout", dout, q);
    size(w, "dq", dq, q);
    size(w, "dk", dk, k);
    size(w, "dv", dv, k);
    size(w, "lse", lse, static_cast<std::size_t>(s.heads_q * z.tokens_q));
    return z;
  }

  /// For a kernel that cannot fold shared rows: refuses two entries of the
  /// call sharing a query row or a key-value row ("forward" or "backward" as `call`).
  void separate_rows(const char* kernel, const char* call, std::span<const AttentionEntry> entries) {
    const Where w{kernel, call};
    disjoint(w, entries, "query", &AttentionEntry::q_start, &AttentionEntry::q_len);
    disjoint(w, entries, "key-value", &AttentionEntry::kv_start, &AttentionEntry::kv_len);
  }

 private:
  struct Where {
    const char* kernel;
    const char* call;
  };

  static void size(const Where& w, const char* field, std::size_t got, std::size_t want) {
    if (got != want) fail(w.kernel, "::", w.call, ": ", field, " has ", got, " elements; expected ", want);
  }

  CallSizes common(const Where& w, const AttentionShape& s, std::span<const AttentionEntry> entries, std::size_t q,
                   std::size_t k, std::size_t v) {
    shape(w, s);
    const auto row_q = static_cast<std::size_t>(s.heads_q * s.head_dim);
    const auto row_kv = static_cast<std::size_t>(s.heads_kv * s.head_dim);
    if (q % row_q != 0) {
      fail(w.kernel, "::", w.call, ": q has ", q, " elements, not a multiple of heads_q * head_dim = ", row_q);
    }
    if (k % row_kv != 0) {
      fail(w.kernel, "::", w.call, ": k has ", k, " elements, not a multiple of heads_kv * head_dim = ", row_kv);
    }
    size(w, "v", v, k);
    const CallSizes z{static_cast<std::int64_t>(q / row_q), static_cast<std::int64_t>(k / row_kv)};
    ranges(w, entries, z);
    return z;
  }

  static void shape(const Where& w, const AttentionShape& s) {
    if (s.heads_q < 1 || s.heads_q > max_heads || s.heads_kv < 1 || s.heads_kv > max_heads ||
        s.heads_q % s.heads_kv != 0) {
      fail(w.kernel, "::", w.call, ": shape.heads_q = ", s.heads_q, " and shape.heads_kv = ", s.heads_kv,
           "; heads_q must be a positive multiple of heads_kv (at most ", max_heads, ")");
    }
    if (s.head_dim < 1 || s.head_dim > max_dim) {
      fail(w.kernel, "::", w.call, ": shape.head_dim is ", s.head_dim, "; it must be in [1, ", max_dim, "]");
    }
    if (!std::isfinite(s.softmax_scale)) {
      fail(w.kernel, "::", w.call, ": shape.softmax_scale is ", s.softmax_scale, "; it must be finite");
    }
  }

  static void ranges(const Where& w, std::span<const AttentionEntry> entries, const CallSizes& z) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const AttentionEntry& e = entries[i];
      if (e.q_start < 0 || e.q_len < 0 || e.q_start > z.tokens_q || e.q_len > z.tokens_q - e.q_start) {
        fail(w.kernel, "::", w.call, ": entries[", i, "] has query rows [", e.q_start, ", +", e.q_len,
             ") outside the ", z.tokens_q, " rows of q");
      }
      if (e.kv_start < 0 || e.kv_len < 0 || e.kv_start > z.tokens_kv || e.kv_len > z.tokens_kv - e.kv_start) {
        fail(w.kernel, "::", w.call, ": entries[", i, "] has key-value rows [", e.kv_start, ", +", e.kv_len,
             ") outside the ", z.tokens_kv, " rows of k and v");
      }
      band_end(w, i, "lo", e.band.lo, e.band.bounded_below());
      band_end(w, i, "hi", e.band.hi, e.band.bounded_above());
    }
  }

  static void band_end(const Where& w, std::size_t i, const char* end, std::int64_t x, bool bounded) {
    if (bounded && (x < -max_band_end || x > max_band_end)) {
      fail(w.kernel, "::", w.call, ": entries[", i, "].band.", end, " is ", x,
           "; a bounded band end must be within +-2^62 (an open end is Band::unbounded_lo / unbounded_hi)");
    }
  }

  /// Sorts the non-empty ranges by start and compares neighbours.
  void disjoint(const Where& w, std::span<const AttentionEntry> entries, const char* what,
                std::int64_t AttentionEntry::*start, std::int64_t AttentionEntry::*len) {
    order_.clear();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].*len > 0) order_.emplace_back(entries[i].*start, i);
    }
    std::sort(order_.begin(), order_.end());
    for (std::size_t n = 1; n < order_.size(); ++n) {
      const AttentionEntry& prev = entries[order_[n - 1].second];
      if (prev.*start + prev.*len > order_[n].first) {
        const auto a = std::min(order_[n - 1].second, order_[n].second);
        const auto b = std::max(order_[n - 1].second, order_[n].second);
        fail(w.kernel, "::", w.call, ": entries[", a, "] and entries[", b, "] share ", what,
             " rows; this kernel attends only entries that share no row (it cannot fold them into one softmax)");
      }
    }
  }

  std::vector<std::pair<std::int64_t, std::size_t>> order_;  // non-empty ranges by first row; kept across calls
};

}  // namespace cpdispatch::detail::attention
