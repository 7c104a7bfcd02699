#pragma once
// Shared pieces of the host attention kernel tests: random THD inputs rounded
// to the element type, documents laid out back to back, entries with bands,
// a brute-force double reference over any entries, and the error measure
// (largest absolute difference over the largest reference magnitude).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/float16.hpp"
#include "../common/max_error.hpp"
#include "../common/reference_attention.hpp"

namespace cpdispatch::testing {

template <class E>
E to_element(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return E(x);
  }
}

template <class E>
double to_double(E x) {
  return static_cast<double>(static_cast<float>(x));
}

/// n values uniform in [-1, 1), rounded to E.
template <class E>
std::vector<E> random_elements(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<E> x(n);
  for (auto& e : x) e = to_element<E>(dist(rng));
  return x;
}

template <class E>
std::vector<double> as_doubles(std::span<const E> x) {
  std::vector<double> d(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) d[i] = to_double(x[i]);
  return d;
}

/// Rows [first, first + count) of a THD buffer with `width` values per row.
inline std::vector<double> rows_of(const std::vector<double>& x, std::int64_t first, std::int64_t count,
                                   std::int64_t width) {
  return {x.begin() + first * width, x.begin() + (first + count) * width};
}

/// Largest |got - want| over the largest |want| (1 when want is all zero);
/// infinite on a NaN, an unmatched infinity or a length mismatch (max_error.hpp).
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  return max_error(got, want).relative();
}

inline ReferenceShape reference_shape(const AttentionShape& s) {
  return {s.heads_q, s.heads_kv, s.head_dim, static_cast<double>(s.softmax_scale)};
}

inline AttentionShape make_shape(std::int64_t heads_q, std::int64_t heads_kv, std::int64_t head_dim) {
  return {heads_q, heads_kv, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim))};
}

/// The masks every test walks through.
inline std::vector<AttentionMask> all_masks() {
  return {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(1),
          AttentionMask::sliding_window(3), AttentionMask::sliding_window(6)};
}

/// Prefix sums of document lengths, leading 0.
inline std::vector<std::int64_t> prefix_sums(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

/// The entry that attends query rows [q_start, +q_len) to key rows
/// [kv_start, +kv_len) under `mask` with query row 0 at document position
/// `diagonal` counted from key row 0 (how entries were written before they
/// carried bands): the mask's band moved into buffer rows.
inline AttentionEntry part_entry(const AttentionMask& mask, std::int64_t q_start, std::int64_t q_len,
                                 std::int64_t kv_start, std::int64_t kv_len, std::int64_t diagonal) {
  return {q_start, q_len, kv_start, kv_len, mask.band().shifted(diagonal + kv_start - q_start)};
}

/// What the brute-force reference computes over a whole call.
struct EntryReference {
  std::vector<double> out, lse, dq, dk, dv;
};

/// Attention over arbitrary entries in double precision, pair by pair: query
/// row j's softmax runs over every key t of every entry with j in its rows,
/// t in its keys and e.allows(j, t) (a pair two entries allow counts twice,
/// as the concept says); backward uses the forward's own out and lse. Rows
/// no entry covers get out 0, lse -inf and zero gradients, so compare them
/// with outputs that start as 0 and -inf.
inline EntryReference reference_by_entries(const std::vector<double>& q, const std::vector<double>& k,
                                           const std::vector<double>& v, const std::vector<double>& dout,
                                           const AttentionShape& s, std::span<const AttentionEntry> entries) {
  const std::int64_t D = s.head_dim, group = s.heads_q / s.heads_kv;
  const std::int64_t tq = static_cast<std::int64_t>(q.size()) / (s.heads_q * D);
  EntryReference r{std::vector<double>(q.size(), 0.0),
                   std::vector<double>(static_cast<std::size_t>(s.heads_q * tq), -std::numeric_limits<double>::infinity()),
                   std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0), std::vector<double>(k.size(), 0.0)};
  auto qi = [&](std::int64_t j, std::int64_t h, std::int64_t d) { return static_cast<std::size_t>((j * s.heads_q + h) * D + d); };
  auto ki = [&](std::int64_t t, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>((t * s.heads_kv + h / group) * D + d);
  };
  for (std::int64_t j = 0; j < tq; ++j) {
    std::vector<std::int64_t> keys;  // with repetition
    for (const AttentionEntry& e : entries) {
      if (j < e.q_start || j >= e.q_start + e.q_len) continue;
      for (std::int64_t t = e.kv_start; t < e.kv_start + e.kv_len; ++t) {
        if (e.allows(j, t)) keys.push_back(t);
      }
    }
    if (keys.empty()) continue;
    for (std::int64_t h = 0; h < s.heads_q; ++h) {
      std::vector<double> p(keys.size());
      double m = -std::numeric_limits<double>::infinity();
      for (std::size_t n = 0; n < keys.size(); ++n) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d) dot += q[qi(j, h, d)] * k[ki(keys[n], h, d)];
        p[n] = dot * s.softmax_scale;
        m = std::max(m, p[n]);
      }
      double sum = 0;
      for (double x : p) sum += std::exp(x - m);
      const double lse = m + std::log(sum);
      r.lse[static_cast<std::size_t>(h * tq + j)] = lse;
      for (double& x : p) x = std::exp(x - lse);
      for (std::size_t n = 0; n < keys.size(); ++n) {
        for (std::int64_t d = 0; d < D; ++d) r.out[qi(j, h, d)] += p[n] * v[ki(keys[n], h, d)];
      }
      double delta = 0;  // rowsum(dout * out)
      for (std::int64_t d = 0; d < D; ++d) delta += dout[qi(j, h, d)] * r.out[qi(j, h, d)];
      for (std::size_t n = 0; n < keys.size(); ++n) {
        double dp = 0;
        for (std::int64_t d = 0; d < D; ++d) dp += dout[qi(j, h, d)] * v[ki(keys[n], h, d)];
        const double ds = p[n] * (dp - delta) * s.softmax_scale;
        for (std::int64_t d = 0; d < D; ++d) {
          r.dq[qi(j, h, d)] += ds * k[ki(keys[n], h, d)];
          r.dk[ki(keys[n], h, d)] += ds * q[qi(j, h, d)];
          r.dv[ki(keys[n], h, d)] += p[n] * dout[qi(j, h, d)];
        }
      }
    }
  }
  return r;
}

}  // namespace cpdispatch::testing
