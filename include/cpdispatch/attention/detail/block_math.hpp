#pragma once
// The arithmetic of the host attention kernel's blocks: the three block
// products (row-major, fp32) and the softmax's row operations, written so the
// compiler vectorises them.
//
// The block products run on CBLAS (cblas_sgemm) when CPDISPATCH_ATTENTION_CBLAS
// is defined (the cpdispatch::attention target defines it and links BLAS);
// otherwise on the portable loops below, so the core needs no library.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#ifdef CPDISPATCH_ATTENTION_CBLAS
#include <cblas.h>
#endif

namespace cpdispatch::detail::attention {

#ifdef CPDISPATCH_ATTENTION_CBLAS
inline constexpr bool uses_cblas = true;
#else
inline constexpr bool uses_cblas = false;
#endif

// Chunk of independent partial results: enough lanes for AVX-512 floats and
// short enough that the compiler keeps them in registers.
inline constexpr std::int64_t lanes = 16;

/// sum_p a[p] * b[p] over n values, in `lanes` partial sums (vectorisable).
inline float dot(const float* a, const float* b, std::int64_t n) {
  float part[lanes] = {};
  std::int64_t p = 0;
  for (; p + lanes <= n; p += lanes) {
    for (std::int64_t l = 0; l < lanes; ++l) part[l] += a[p + l] * b[p + l];
  }
  for (; p < n; ++p) part[0] += a[p] * b[p];
  float sum = 0.0f;
  for (float x : part) sum += x;
  return sum;
}

/// y[p] += alpha * x[p].
inline void axpy(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t p = 0; p < n; ++p) y[p] += alpha * x[p];
}

/// c[i][:] = beta * c[i][:] for m rows of n values; beta = 0 clears (no 0 * NaN).
inline void scale_rows(std::int64_t m, std::int64_t n, float beta, float* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.0f) {
      std::fill(row, row + n, 0.0f);
    } else if (beta != 1.0f) {
      for (std::int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

/// C (m x n) = alpha * A (m x k) * B^T (B is n x k) + beta * C.
inline void gemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef CPDISPATCH_ATTENTION_CBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = alpha * dot(a + i * lda, b + j * ldb, k);
      c[i * ldc + j] = beta == 0.0f ? v : v + beta * c[i * ldc + j];
    }
  }
#endif
}

/// C (m x n) = alpha * A (m x k) * B (k x n) + beta * C.
inline void gemm_nn(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef CPDISPATCH_ATTENTION_CBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
              static_cast<int>(ldc));
#else
  scale_rows(m, n, beta, c, ldc);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t p = 0; p < k; ++p) {
      const float w = alpha * a[i * lda + p];
      if (w != 0.0f) axpy(w, b + p * ldb, c + i * ldc, n);
    }
  }
#endif
}

/// C (m x n) = alpha * A^T (A is k x m) * B (k x n) + beta * C.
inline void gemm_tn(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                    const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef CPDISPATCH_ATTENTION_CBLAS
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  scale_rows(m, n, beta, c, ldc);
  for (std::int64_t p = 0; p < k; ++p) {
    for (std::int64_t i = 0; i < m; ++i) {
      const float w = alpha * a[p * lda + i];
      if (w != 0.0f) axpy(w, b + p * ldb, c + i * ldc, n);
    }
  }
#endif
}

/// 2^x for one value, branch-free so loops over it vectorise: round x to the
/// nearest integer n, a degree-7 polynomial for 2^(x - n) on [-1/2, 1/2]
/// (relative error below 1e-7), and n added to the exponent bits. Below
/// -126 (including -infinity) the result is 0.
inline float exp2_approx(float x) {
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float clamped = std::min(std::max(x, -127.0f), 127.0f);
  const float shifted = clamped + round_magic;
  const float n = shifted - round_magic;
  const float y = (clamped - n) * 0.6931471805599453f;  // 2^f = e^(f ln 2)
  float p = 1.0f / 5040.0f;
  p = p * y + 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const auto e = static_cast<std::uint32_t>(std::bit_cast<std::int32_t>(shifted) -
                                            std::bit_cast<std::int32_t>(round_magic) + 127);
  const float scale = std::bit_cast<float>(e << 23);
  return x < -126.0f ? 0.0f : p * scale;
}

/// row[t] = 2^(row[t] - shift) for t < n (masked -infinity becomes 0); the sum.
inline float exp2_row(float* row, std::int64_t n, float shift) {
  float part[lanes] = {};
  std::int64_t t = 0;
  for (; t + lanes <= n; t += lanes) {
    for (std::int64_t l = 0; l < lanes; ++l) {
      const float v = exp2_approx(row[t + l] - shift);
      row[t + l] = v;
      part[l] += v;
    }
  }
  for (; t < n; ++t) {
    row[t] = exp2_approx(row[t] - shift);
    part[0] += row[t];
  }
  float sum = 0.0f;
  for (float x : part) sum += x;
  return sum;
}

/// The largest of row[0 .. n); -infinity when n is 0.
inline float row_max(const float* row, std::int64_t n) {
  float part[lanes];
  std::fill(part, part + lanes, -std::numeric_limits<float>::infinity());
  std::int64_t t = 0;
  for (; t + lanes <= n; t += lanes) {
    for (std::int64_t l = 0; l < lanes; ++l) part[l] = std::max(part[l], row[t + l]);
  }
  for (; t < n; ++t) part[0] = std::max(part[0], row[t]);
  return *std::max_element(part, part + lanes);
}

/// dS = P * (dP - delta), in place in dp, for n values of one row.
inline void softmax_grad_row(const float* p, float* dp, float delta, std::int64_t n) {
  for (std::int64_t t = 0; t < n; ++t) dp[t] = p[t] * (dp[t] - delta);
}

}  // namespace cpdispatch::detail::attention
