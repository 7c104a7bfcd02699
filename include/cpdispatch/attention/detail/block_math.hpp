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
#include <cstring>
#include <cstdint>
#include <limits>

#ifdef CPDISPATCH_ATTENTION_CBLAS
#include "cpdispatch/gemm/gemm_cblas.hpp"
#endif

namespace cpdispatch::detail::attention {

// The two builds' definitions differ, so they live in differently named
// namespaces: a program mixing both gets two sets of functions, not one
// definition silently standing in for the other.
#ifdef CPDISPATCH_ATTENTION_CBLAS
inline namespace cblas_blocks {
inline constexpr bool uses_cblas = true;
#else
inline namespace portable_blocks {
inline constexpr bool uses_cblas = false;
#endif

/// The kernel's own threads are the parallelism: each block product runs
/// on one BLAS thread (OpenBLAS's setting is process-wide, as CblasGemm's).
inline void use_one_blas_thread() {
#ifdef CPDISPATCH_ATTENTION_CBLAS
  gemm::CblasGemm::set_blas_threads(1);
#endif
}

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

// Four floats as one value (GCC and Clang vector extensions): the softmax's
// row loops are written on these, because a float comparison in a scalar
// loop keeps GCC from vectorising it (-ftrapping-math, the default).
typedef float f32x4 __attribute__((vector_size(16)));
typedef std::int32_t i32x4 __attribute__((vector_size(16)));

inline f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, f32x4 v) { std::memcpy(p, &v, sizeof v); }
inline f32x4 splat4(float x) { return f32x4{x, x, x, x}; }
/// mask ? a : b per lane (mask lanes all ones or all zeros).
inline f32x4 select4(i32x4 mask, f32x4 a, f32x4 b) {
  return std::bit_cast<f32x4>((std::bit_cast<i32x4>(a) & mask) | (std::bit_cast<i32x4>(b) & ~mask));
}

/// 2^x per lane: x rounded to the nearest integer n, a degree-7 polynomial
/// for 2^(x - n) on [-1/2, 1/2] (relative error below 1e-7), n added to the
/// exponent bits. Below -126 (-infinity included) the result is 0; NaN stays NaN.
inline f32x4 exp2_approx(f32x4 x) {
  const f32x4 round_magic = splat4(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x4 lo = splat4(-127.0f), hi = splat4(127.0f);
  f32x4 c = select4(x > lo, x, lo);
  c = select4(c < hi, c, hi);
  const f32x4 shifted = c + round_magic;
  const f32x4 y = (c - (shifted - round_magic)) * splat4(0.6931471805599453f);  // 2^f = e^(f ln 2)
  f32x4 p = splat4(1.0f / 5040.0f);
  p = p * y + splat4(1.0f / 720.0f);
  p = p * y + splat4(1.0f / 120.0f);
  p = p * y + splat4(1.0f / 24.0f);
  p = p * y + splat4(1.0f / 6.0f);
  p = p * y + splat4(0.5f);
  p = p * y + splat4(1.0f);
  p = p * y + splat4(1.0f);
  const i32x4 bias = std::bit_cast<i32x4>(round_magic) - 127;
  const f32x4 scale = std::bit_cast<f32x4>((std::bit_cast<i32x4>(shifted) - bias) << 23);
  const f32x4 r = std::bit_cast<f32x4>(std::bit_cast<i32x4>(p * scale) & (x >= splat4(-126.0f)));
  return select4(x != x, x, r);
}

/// 2^x for one value (the same arithmetic as the lanes above).
inline float exp2_approx(float x) { return exp2_approx(splat4(x))[0]; }

/// row[t] = 2^(row[t] - shift) for t < n (masked -infinity becomes 0); the sum.
inline float exp2_row(float* row, std::int64_t n, float shift) {
  const f32x4 s = splat4(shift);
  f32x4 sum[4] = {};
  std::int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int l = 0; l < 4; ++l) {
      const f32x4 v = exp2_approx(load4(row + t + 4 * l) - s);
      store4(row + t + 4 * l, v);
      sum[l] += v;
    }
  }
  for (; t + 4 <= n; t += 4) {
    const f32x4 v = exp2_approx(load4(row + t) - s);
    store4(row + t, v);
    sum[0] += v;
  }
  const f32x4 total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
  float result = (total[0] + total[1]) + (total[2] + total[3]);
  for (; t < n; ++t) {
    row[t] = exp2_approx(row[t] - shift);
    result += row[t];
  }
  return result;
}

/// The largest of row[0 .. n); -infinity when n is 0.
inline float row_max(const float* row, std::int64_t n) {
  f32x4 m[4];
  for (auto& x : m) x = splat4(-std::numeric_limits<float>::infinity());
  std::int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int l = 0; l < 4; ++l) {
      const f32x4 v = load4(row + t + 4 * l);
      m[l] = select4(v > m[l], v, m[l]);
    }
  }
  float result = -std::numeric_limits<float>::infinity();
  for (const auto& x : m) {
    for (int l = 0; l < 4; ++l) result = std::max(result, x[l]);
  }
  for (; t < n; ++t) result = std::max(result, row[t]);
  return result;
}

// ---- The invariant mode's lanes: one pair per lane, the same arithmetic in every lane ----

/// Columns of a transposed tile (a multiple of 32).
inline constexpr std::int64_t tile = 64;

/// t[d * tile + c] = row (first + c) of a buffer (rows `stride` apart), value d, for c < n; 0 for n <= c < n
/// rounded up to 32 (the lanes dot_lanes reads).
inline void transpose_tile(const float* base, std::int64_t stride, std::int64_t first, std::int64_t n, std::int64_t D, float* t) {
  const std::int64_t n32 = (n + 31) / 32 * 32;
  for (std::int64_t d = 0; d < D; ++d) {
    float* row = t + d * tile;
    for (std::int64_t c = 0; c < n; ++c) row[c] = base[(first + c) * stride + d];
    std::fill(row + n, row + n32, 0.0f);
  }
}

// 256-bit lanes where the CPU has AVX2 (x86-64, GCC and Clang): every value
// gets the operations of the 128-bit lanes, a multiplication then an
// addition in the same order (AVX2 brings no fused multiply-add; -mfma or
// -march builds fuse both versions alike), so the bits are those of the
// 128-bit code on every CPU, only computed faster.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CPDISPATCH_WIDE_LANES 1
typedef float f32x8 __attribute__((vector_size(32)));
#endif

/// Whether dot_lanes and axpy_rows run their 256-bit versions here.
inline bool wide_lanes() noexcept {
#ifdef CPDISPATCH_WIDE_LANES
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

/// out[c] = scale * (sum over d, increasing, of a[d] * t[d * tile + c]) for c < n32 (a multiple of 32):
/// every lane the same operations, so a pair's value does not depend on its lane or tile (one machine
/// code for every caller: not inlined).
[[gnu::noinline]] inline void dot_lanes_narrow(const float* a, const float* t, std::int64_t D, std::int64_t n32, float scale,
                                               float* out) {
  for (std::int64_t c = 0; c < n32; c += 32) {
    f32x4 x[8] = {};
    for (std::int64_t d = 0; d < D; ++d) {
      const f32x4 ad = splat4(a[d]);
      const float* row = t + d * tile + c;
      for (int l = 0; l < 8; ++l) x[l] += ad * load4(row + 4 * l);
    }
    const f32x4 sc = splat4(scale);
    for (int l = 0; l < 8; ++l) store4(out + c + 4 * l, x[l] * sc);
  }
}

/// acc[d] += sum over c < n, increasing, of w[c] * rows[c * stride + d], for d < D: each element's
/// terms in row order (as n calls of axpy), the accumulators kept in registers across the rows.
inline void axpy_rows_narrow(const float* w, const float* rows, std::int64_t stride, std::int64_t n, float* acc, std::int64_t D) {
  std::int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    f32x4 a[4];
    for (int l = 0; l < 4; ++l) a[l] = load4(acc + d0 + 4 * l);
    for (std::int64_t c = 0; c < n; ++c) {
      const f32x4 wc = splat4(w[c]);
      const float* row = rows + c * stride + d0;
      for (int l = 0; l < 4; ++l) a[l] += wc * load4(row + 4 * l);
    }
    for (int l = 0; l < 4; ++l) store4(acc + d0 + 4 * l, a[l]);
  }
  for (; d0 < D; ++d0) {
    float a = acc[d0];
    for (std::int64_t c = 0; c < n; ++c) a += w[c] * rows[c * stride + d0];
    acc[d0] = a;
  }
}

#ifdef CPDISPATCH_WIDE_LANES
/// dot_lanes_narrow in 256-bit lanes (f32x8 values only inside: no AVX type crosses a call).
[[gnu::noinline, gnu::target("avx2")]] inline void dot_lanes_wide(const float* a, const float* t, std::int64_t D, std::int64_t n32,
                                                                  float scale, float* out) {
  for (std::int64_t c = 0; c < n32; c += 32) {
    f32x8 x[4] = {};
    for (std::int64_t d = 0; d < D; ++d) {
      const float ad = a[d];
      const float* row = t + d * tile + c;
      for (int l = 0; l < 4; ++l) {
        f32x8 v;
        std::memcpy(&v, row + 8 * l, sizeof v);
        x[l] += ad * v;
      }
    }
    for (int l = 0; l < 4; ++l) {
      const f32x8 v = x[l] * scale;
      std::memcpy(out + c + 8 * l, &v, sizeof v);
    }
  }
}

/// axpy_rows_narrow in 256-bit lanes, 32 values of a row at a time, then as the narrow one.
[[gnu::noinline, gnu::target("avx2")]] inline void axpy_rows_wide(const float* w, const float* rows, std::int64_t stride,
                                                                  std::int64_t n, float* acc, std::int64_t D) {
  std::int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    f32x8 a[4];
    std::memcpy(a, acc + d0, sizeof a);
    for (std::int64_t c = 0; c < n; ++c) {
      const float wc = w[c];
      const float* row = rows + c * stride + d0;
      for (int l = 0; l < 4; ++l) {
        f32x8 v;
        std::memcpy(&v, row + 8 * l, sizeof v);
        a[l] += wc * v;
      }
    }
    std::memcpy(acc + d0, a, sizeof a);
  }
  for (; d0 < D; ++d0) {
    float x = acc[d0];
    for (std::int64_t c = 0; c < n; ++c) x += w[c] * rows[c * stride + d0];
    acc[d0] = x;
  }
}
#endif

/// dot_lanes_narrow, in 256-bit lanes where wide_lanes(): the same bits.
inline void dot_lanes(const float* a, const float* t, std::int64_t D, std::int64_t n32, float scale, float* out) {
#ifdef CPDISPATCH_WIDE_LANES
  if (wide_lanes()) return dot_lanes_wide(a, t, D, n32, scale, out);
#endif
  dot_lanes_narrow(a, t, D, n32, scale, out);
}

/// axpy_rows_narrow, in 256-bit lanes where wide_lanes(): the same bits.
inline void axpy_rows(const float* w, const float* rows, std::int64_t stride, std::int64_t n, float* acc, std::int64_t D) {
#ifdef CPDISPATCH_WIDE_LANES
  if (wide_lanes()) return axpy_rows_wide(w, rows, stride, n, acc, D);
#endif
  axpy_rows_narrow(w, rows, stride, n, acc, D);
}

/// x[c] = 2^(x[c] - shift[c]) for c < n32 (a multiple of 4); -infinity gives 0 (not inlined either).
[[gnu::noinline]] inline void exp2_lanes(float* x, const float* shift, std::int64_t n32) {
  for (std::int64_t c = 0; c < n32; c += 4) store4(x + c, exp2_approx(load4(x + c) - load4(shift + c)));
}

/// dS = P * (dP - delta), in place in dp, for n values of one row.
inline void softmax_grad_row(const float* p, float* dp, float delta, std::int64_t n) {
  for (std::int64_t t = 0; t < n; ++t) dp[t] = p[t] * (dp[t] - delta);
}

}  // inline namespace cblas_blocks / portable_blocks
}  // namespace cpdispatch::detail::attention
