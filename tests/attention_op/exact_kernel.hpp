#pragma once
// A small exact attention kernel for the op's tests: double accumulation, one
// query row at a time, no tiling. It models AttentionKernel (entries with
// bands, rows shared between entries folded), so the op's tests do not
// depend on the speed or rounding of the shipped kernel.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cpdispatch/attention/detail/lse_merge.hpp"
#include "cpdispatch/attention/kernel.hpp"

namespace attention_test {

struct ExactKernel {
  int forward_calls = 0;
  int backward_calls = 0;

  template <class E>
  void forward(const cpdispatch::AttentionShape& s, std::span<const cpdispatch::AttentionEntry> entries, std::span<const E> q,
               std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    ++forward_calls;
    const std::int64_t tq = static_cast<std::int64_t>(lse.size()) / s.heads_q;
    std::vector<std::int64_t> keys;
    std::vector<double> p;
    for (std::int64_t j = 0; j < tq; ++j) {
      if (!keys_of_row(entries, j, keys)) continue;  // no entry covers the row: untouched
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        const double l = probabilities(s, keys, q, k, h, j, p);
        lse[static_cast<std::size_t>(h * tq + j)] = static_cast<float>(l);
        for (std::int64_t d = 0; d < s.head_dim; ++d) {
          double acc = 0;
          for (std::size_t n = 0; n < keys.size(); ++n) acc += p[n] * val(v, kv_at(s, keys[n], h, d));
          out[q_at(s, j, h, d)] = cpdispatch::detail::from_f32<E>(static_cast<float>(acc));
        }
      }
    }
  }

  template <class E>
  void backward(const cpdispatch::AttentionShape& s, std::span<const cpdispatch::AttentionEntry> entries, std::span<const E> q,
                std::span<const E> k, std::span<const E> v, std::span<const E> out, std::span<const float> lse, std::span<const E> dout,
                std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    ++backward_calls;
    const std::int64_t tq = static_cast<std::int64_t>(lse.size()) / s.heads_q, D = s.head_dim;
    std::vector<double> gq(dq.size()), gk(dk.size()), gv(dv.size());
    std::vector<std::int64_t> keys;
    for (std::int64_t j = 0; j < tq; ++j) {
      if (!keys_of_row(entries, j, keys)) continue;
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        const double l = lse[static_cast<std::size_t>(h * tq + j)];
        if (l == -std::numeric_limits<double>::infinity()) continue;
        double delta = 0;  // rowsum(dout * out) of the whole attention
        for (std::int64_t d = 0; d < D; ++d) delta += val(dout, q_at(s, j, h, d)) * val(out, q_at(s, j, h, d));
        for (const std::int64_t t : keys) {
          double score = 0, dp = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            score += val(q, q_at(s, j, h, d)) * val(k, kv_at(s, t, h, d));
            dp += val(dout, q_at(s, j, h, d)) * val(v, kv_at(s, t, h, d));
          }
          const double pr = std::exp(score * s.softmax_scale - l), ds = pr * (dp - delta) * s.softmax_scale;
          for (std::int64_t d = 0; d < D; ++d) {
            gq[q_at(s, j, h, d)] += ds * val(k, kv_at(s, t, h, d));
            gk[kv_at(s, t, h, d)] += ds * val(q, q_at(s, j, h, d));
            gv[kv_at(s, t, h, d)] += pr * val(dout, q_at(s, j, h, d));
          }
        }
      }
    }
    // Every row of an entry is written (zero where nothing was seen), no other.
    for (const cpdispatch::AttentionEntry& e : entries) {
      store(dq, gq, static_cast<std::size_t>(e.q_start * s.heads_q * D), static_cast<std::size_t>(e.q_len * s.heads_q * D));
      store(dk, gk, static_cast<std::size_t>(e.kv_start * s.heads_kv * D), static_cast<std::size_t>(e.kv_len * s.heads_kv * D));
      store(dv, gv, static_cast<std::size_t>(e.kv_start * s.heads_kv * D), static_cast<std::size_t>(e.kv_len * s.heads_kv * D));
    }
  }

 private:
  template <class E>
  static double val(std::span<const E> x, std::size_t i) { return cpdispatch::detail::to_f32(x[i]); }
  static std::size_t q_at(const cpdispatch::AttentionShape& s, std::int64_t row, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>((row * s.heads_q + h) * s.head_dim + d);
  }
  static std::size_t kv_at(const cpdispatch::AttentionShape& s, std::int64_t row, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>((row * s.heads_kv + h / (s.heads_q / s.heads_kv)) * s.head_dim + d);
  }
  template <class E>
  static void store(std::span<E> to, const std::vector<double>& from, std::size_t at, std::size_t count) {
    for (std::size_t i = at; i < at + count; ++i) to[i] = cpdispatch::detail::from_f32<E>(static_cast<float>(from[i]));
  }

  /// The keys query row j sees in every entry covering it (a key two entries
  /// allow, twice); false when no entry covers the row.
  static bool keys_of_row(std::span<const cpdispatch::AttentionEntry> entries, std::int64_t j, std::vector<std::int64_t>& keys) {
    keys.clear();
    bool covered = false;
    for (const cpdispatch::AttentionEntry& e : entries) {
      if (j < e.q_start || j >= e.q_start + e.q_len) continue;
      covered = true;
      for (std::int64_t t = e.kv_start; t < e.kv_start + e.kv_len; ++t) {
        if (e.allows(j, t)) keys.push_back(t);
      }
    }
    return covered;
  }

  /// Softmax weights of query row j (head h) over `keys`; returns the log-sum-exp (-inf without keys).
  template <class E>
  static double probabilities(const cpdispatch::AttentionShape& s, const std::vector<std::int64_t>& keys, std::span<const E> q,
                              std::span<const E> k, std::int64_t h, std::int64_t j, std::vector<double>& p) {
    p.assign(keys.size(), 0.0);
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t n = 0; n < keys.size(); ++n) {
      double dot = 0;
      for (std::int64_t d = 0; d < s.head_dim; ++d) dot += val(q, q_at(s, j, h, d)) * val(k, kv_at(s, keys[n], h, d));
      p[n] = dot * s.softmax_scale;
      m = std::max(m, p[n]);
    }
    if (m == -std::numeric_limits<double>::infinity()) return m;
    double sum = 0;
    for (const double x : p) sum += std::exp(x - m);
    const double l = m + std::log(sum);
    for (double& x : p) x = std::exp(x - l);
    return l;
  }
};

}  // namespace attention_test
