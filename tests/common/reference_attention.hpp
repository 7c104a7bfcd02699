#pragma once
// An independent, naive double-precision attention over one whole document:
// the yardstick for every sharded attention result (forward output,
// log-sum-exp, and the gradients of Q, K and V). It materialises the full
// score matrix on purpose: simple enough to trust, far too slow to ship.
//
// Layout (THD): q, out, dout, dq are [L][heads_q][head_dim]; k, v, dk, dv are
// [L][heads_kv][head_dim]; lse is [heads_q][L] (natural logarithm). Grouped
// query attention: query head h reads key-value head h / (heads_q / heads_kv).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch::testing {

struct ReferenceShape {
  std::int64_t heads_q = 1, heads_kv = 1, head_dim = 1;
  double scale = 1.0;
};

struct ReferenceForward {
  std::vector<double> out;  ///< [L][heads_q][head_dim]
  std::vector<double> lse;  ///< [heads_q][L]; -inf for a row that sees no key
};

struct ReferenceGradients {
  std::vector<double> dq, dk, dv;
};

namespace detail {

inline void check_reference_shape(const ReferenceShape& s) {
  if (s.heads_q < 1 || s.heads_kv < 1 || s.head_dim < 1 || s.heads_q % s.heads_kv != 0) {
    throw std::invalid_argument("reference attention: heads_q must be a positive multiple of heads_kv");
  }
}

/// probabilities[p][t] of query head h (row-major [L][L]), and each row's log-sum-exp.
inline void reference_softmax(const std::vector<double>& q, const std::vector<double>& k, std::int64_t L,
                              const ReferenceShape& s, const AttentionMask& mask, std::int64_t h,
                              std::vector<double>& prob, std::vector<double>& lse_row) {
  const std::int64_t D = s.head_dim, hk = h / (s.heads_q / s.heads_kv);
  prob.assign(static_cast<std::size_t>(L * L), 0.0);
  lse_row.assign(static_cast<std::size_t>(L), -std::numeric_limits<double>::infinity());
  for (std::int64_t p = 0; p < L; ++p) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < L; ++t) {
      if (!mask.sees(p, t)) continue;
      double dot = 0;
      for (std::int64_t d = 0; d < D; ++d) {
        dot += q[static_cast<std::size_t>((p * s.heads_q + h) * D + d)] *
               k[static_cast<std::size_t>((t * s.heads_kv + hk) * D + d)];
      }
      prob[static_cast<std::size_t>(p * L + t)] = dot * s.scale;
      m = std::max(m, dot * s.scale);
    }
    if (m == -std::numeric_limits<double>::infinity()) continue;
    double sum = 0;
    for (std::int64_t t = 0; t < L; ++t) {
      if (mask.sees(p, t)) sum += std::exp(prob[static_cast<std::size_t>(p * L + t)] - m);
    }
    lse_row[static_cast<std::size_t>(p)] = m + std::log(sum);
    for (std::int64_t t = 0; t < L; ++t) {
      double& x = prob[static_cast<std::size_t>(p * L + t)];
      x = mask.sees(p, t) ? std::exp(x - lse_row[static_cast<std::size_t>(p)]) : 0.0;
    }
  }
}

}  // namespace detail

/// softmax(scale * q k^T, masked) v over one document of L tokens.
inline ReferenceForward reference_attention_forward(const std::vector<double>& q, const std::vector<double>& k,
                                                    const std::vector<double>& v, std::int64_t L,
                                                    const ReferenceShape& s, const AttentionMask& mask) {
  detail::check_reference_shape(s);
  const std::int64_t D = s.head_dim, group = s.heads_q / s.heads_kv;
  ReferenceForward r{std::vector<double>(static_cast<std::size_t>(L * s.heads_q * D), 0.0),
                     std::vector<double>(static_cast<std::size_t>(s.heads_q * L), 0.0)};
  std::vector<double> prob, lse_row;
  for (std::int64_t h = 0; h < s.heads_q; ++h) {
    detail::reference_softmax(q, k, L, s, mask, h, prob, lse_row);
    for (std::int64_t p = 0; p < L; ++p) {
      r.lse[static_cast<std::size_t>(h * L + p)] = lse_row[static_cast<std::size_t>(p)];
      for (std::int64_t t = 0; t < L; ++t) {
        const double w = prob[static_cast<std::size_t>(p * L + t)];
        if (w == 0.0) continue;
        for (std::int64_t d = 0; d < D; ++d) {
          r.out[static_cast<std::size_t>((p * s.heads_q + h) * D + d)] +=
              w * v[static_cast<std::size_t>((t * s.heads_kv + h / group) * D + d)];
        }
      }
    }
  }
  return r;
}

/// Gradients of sum(dout * out) with respect to q, k and v (dk, dv summed over
/// the query heads of each group).
inline ReferenceGradients reference_attention_backward(const std::vector<double>& q, const std::vector<double>& k,
                                                       const std::vector<double>& v, const std::vector<double>& dout,
                                                       std::int64_t L, const ReferenceShape& s,
                                                       const AttentionMask& mask) {
  detail::check_reference_shape(s);
  const std::int64_t D = s.head_dim, group = s.heads_q / s.heads_kv;
  ReferenceGradients g{std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
                       std::vector<double>(v.size(), 0.0)};
  std::vector<double> prob, lse_row, dprob(static_cast<std::size_t>(L));
  auto qi = [&](std::int64_t p, std::int64_t h, std::int64_t d) { return static_cast<std::size_t>((p * s.heads_q + h) * D + d); };
  auto ki = [&](std::int64_t t, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>((t * s.heads_kv + h / group) * D + d);
  };
  for (std::int64_t h = 0; h < s.heads_q; ++h) {
    detail::reference_softmax(q, k, L, s, mask, h, prob, lse_row);
    for (std::int64_t p = 0; p < L; ++p) {
      // dP = dO V^T; dS = P * (dP - rowsum(P * dP)).
      double row = 0;
      for (std::int64_t t = 0; t < L; ++t) {
        double dp = 0;
        for (std::int64_t d = 0; d < D; ++d) dp += dout[qi(p, h, d)] * v[ki(t, h, d)];
        dprob[static_cast<std::size_t>(t)] = dp;
        row += prob[static_cast<std::size_t>(p * L + t)] * dp;
      }
      for (std::int64_t t = 0; t < L; ++t) {
        const double w = prob[static_cast<std::size_t>(p * L + t)];
        if (w == 0.0) continue;
        const double ds = w * (dprob[static_cast<std::size_t>(t)] - row) * s.scale;
        for (std::int64_t d = 0; d < D; ++d) {
          g.dv[ki(t, h, d)] += w * dout[qi(p, h, d)];
          g.dq[qi(p, h, d)] += ds * k[ki(t, h, d)];
          g.dk[ki(t, h, d)] += ds * q[qi(p, h, d)];
        }
      }
    }
  }
  return g;
}

}  // namespace cpdispatch::testing
