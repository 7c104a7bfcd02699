#pragma once
// A small exact attention kernel for the op's tests: double accumulation, one
// query row at a time, no tiling. It models AttentionKernel, so the op's tests
// do not depend on the speed or rounding of the shipped kernel.

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
  void forward(const cpdispatch::AttentionShape& s, const cpdispatch::AttentionMask& mask, std::span<const cpdispatch::AttentionEntry> entries,
               std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    ++forward_calls;
    const std::int64_t tq = static_cast<std::int64_t>(lse.size()) / s.heads_q;
    std::vector<double> p;
    for (const cpdispatch::AttentionEntry& e : entries) {
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        for (std::int64_t j = 0; j < e.q_len; ++j) {
          const double l = probabilities(s, mask, e, q, k, h, j, p);
          lse[static_cast<std::size_t>(h * tq + e.q_start + j)] = static_cast<float>(l);
          for (std::int64_t d = 0; d < s.head_dim; ++d) {
            double acc = 0;
            for (std::int64_t t = 0; t < e.kv_len; ++t) acc += p[static_cast<std::size_t>(t)] * val(v, kv_at(s, e.kv_start + t, h, d));
            out[q_at(s, e.q_start + j, h, d)] = cpdispatch::detail::from_f32<E>(static_cast<float>(acc));
          }
        }
      }
    }
  }

  template <class E>
  void backward(const cpdispatch::AttentionShape& s, const cpdispatch::AttentionMask& mask, std::span<const cpdispatch::AttentionEntry> entries,
                std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<const E> out, std::span<const float> lse,
                std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    ++backward_calls;
    const std::int64_t tq = static_cast<std::int64_t>(lse.size()) / s.heads_q, D = s.head_dim;
    for (const cpdispatch::AttentionEntry& e : entries) {
      std::vector<double> gq(static_cast<std::size_t>(e.q_len * s.heads_q * D)), gk(static_cast<std::size_t>(e.kv_len * s.heads_kv * D)), gv(gk.size());
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        const std::int64_t hk = h / (s.heads_q / s.heads_kv);
        for (std::int64_t j = 0; j < e.q_len; ++j) {
          const double l = lse[static_cast<std::size_t>(h * tq + e.q_start + j)];
          if (l == -std::numeric_limits<double>::infinity()) continue;
          double delta = 0;  // rowsum(dout * out) of the whole attention
          for (std::int64_t d = 0; d < D; ++d) delta += val(dout, q_at(s, e.q_start + j, h, d)) * val(out, q_at(s, e.q_start + j, h, d));
          for (std::int64_t t = 0; t < e.kv_len; ++t) {
            if (!mask.allows(j, t, e.diagonal)) continue;
            double score = 0, dp = 0;
            for (std::int64_t d = 0; d < D; ++d) {
              score += val(q, q_at(s, e.q_start + j, h, d)) * val(k, kv_at(s, e.kv_start + t, h, d));
              dp += val(dout, q_at(s, e.q_start + j, h, d)) * val(v, kv_at(s, e.kv_start + t, h, d));
            }
            const double pr = std::exp(score * s.softmax_scale - l), ds = pr * (dp - delta) * s.softmax_scale;
            for (std::int64_t d = 0; d < D; ++d) {
              const auto qi = static_cast<std::size_t>((j * s.heads_q + h) * D + d), ki = static_cast<std::size_t>((t * s.heads_kv + hk) * D + d);
              gq[qi] += ds * val(k, kv_at(s, e.kv_start + t, h, d));
              gk[ki] += ds * val(q, q_at(s, e.q_start + j, h, d));
              gv[ki] += pr * val(dout, q_at(s, e.q_start + j, h, d));
            }
          }
        }
      }
      store(dq, gq, static_cast<std::size_t>(e.q_start * s.heads_q * D));
      store(dk, gk, static_cast<std::size_t>(e.kv_start * s.heads_kv * D));
      store(dv, gv, static_cast<std::size_t>(e.kv_start * s.heads_kv * D));
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
  static void store(std::span<E> to, const std::vector<double>& from, std::size_t at) {
    for (std::size_t i = 0; i < from.size(); ++i) to[at + i] = cpdispatch::detail::from_f32<E>(static_cast<float>(from[i]));
  }

  /// Softmax weights of query row j (head h) over the entry's keys; returns the log-sum-exp.
  template <class E>
  static double probabilities(const cpdispatch::AttentionShape& s, const cpdispatch::AttentionMask& mask, const cpdispatch::AttentionEntry& e,
                              std::span<const E> q, std::span<const E> k, std::int64_t h, std::int64_t j, std::vector<double>& p) {
    p.assign(static_cast<std::size_t>(e.kv_len), 0.0);
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < e.kv_len; ++t) {
      if (!mask.allows(j, t, e.diagonal)) continue;
      double dot = 0;
      for (std::int64_t d = 0; d < s.head_dim; ++d) dot += val(q, q_at(s, e.q_start + j, h, d)) * val(k, kv_at(s, e.kv_start + t, h, d));
      p[static_cast<std::size_t>(t)] = dot * s.softmax_scale;
      m = std::max(m, dot * s.softmax_scale);
    }
    if (m == -std::numeric_limits<double>::infinity()) return m;
    double sum = 0;
    for (std::int64_t t = 0; t < e.kv_len; ++t) {
      if (mask.allows(j, t, e.diagonal)) sum += std::exp(p[static_cast<std::size_t>(t)] - m);
    }
    const double l = m + std::log(sum);
    for (std::int64_t t = 0; t < e.kv_len; ++t) {
      double& x = p[static_cast<std::size_t>(t)];
      x = mask.allows(j, t, e.diagonal) ? std::exp(x - l) : 0.0;
    }
    return l;
  }
};

}  // namespace attention_test
