#pragma once
// CblasGemm: the host GEMM backend on CBLAS (OpenBLAS on Debian:
// libopenblas-dev). Link cpdispatch::blas, which exists when CMake found a
// BLAS with cblas.h.
//
// Threads: simulated ranks are threads of one process, so by default the
// backend asks OpenBLAS for ONE thread per call (openblas_set_num_threads(1),
// once per process); each rank's GEMM then runs on its own thread instead of
// every rank fighting over one OpenBLAS pool. Pass blas_threads = 0 to leave
// OpenBLAS's setting (OPENBLAS_NUM_THREADS) alone, e.g. one rank per process
// under mpiexec with cores to spare. Other CBLAS implementations ignore it.

#include <cblas.h>

#include <climits>
#include <cstddef>
#include <mutex>

#include "cpdispatch/error.hpp"
#include "cpdispatch/gemm/gemm.hpp"

namespace cpdispatch::gemm {

struct CblasGemm : HostKernels {
  /// blas_threads > 0: set OpenBLAS's thread count (process-wide) to it;
  /// 0: leave it as it is.
  explicit CblasGemm(int blas_threads = 1) {
    if (blas_threads > 0) set_blas_threads(blas_threads);
  }

  /// Sets OpenBLAS's (process-wide) thread count; serialised, since OpenBLAS
  /// does not expect concurrent calls. No effect with another CBLAS.
  static void set_blas_threads([[maybe_unused]] int threads) {
#ifdef OPENBLAS_VERSION
    static std::mutex mutex;
    static int current = -1;
    const std::lock_guard<std::mutex> lock(mutex);
    if (current != threads) {
      openblas_set_num_threads(threads);
      current = threads;
    }
#endif
  }

  void gemm(Transpose ta, Transpose tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) const {
    if (m == 0 || n == 0) return;
    if (k == 0) return scale(m, n, beta, c, ldc);
    cblas_sgemm(CblasRowMajor, op(ta), op(tb), to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), alpha, a,
                to_int(lda, "lda"), b, to_int(ldb, "ldb"), beta, c, to_int(ldc, "ldc"));
  }

  void gemm(Transpose ta, Transpose tb, std::size_t m, std::size_t n, std::size_t k, double alpha, const double* a,
            std::size_t lda, const double* b, std::size_t ldb, double beta, double* c, std::size_t ldc) const {
    if (m == 0 || n == 0) return;
    if (k == 0) return scale(m, n, beta, c, ldc);
    cblas_dgemm(CblasRowMajor, op(ta), op(tb), to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), alpha, a,
                to_int(lda, "lda"), b, to_int(ldb, "ldb"), beta, c, to_int(ldc, "ldc"));
  }

 private:
  static CBLAS_TRANSPOSE op(Transpose t) noexcept { return t == Transpose::yes ? CblasTrans : CblasNoTrans; }

  static int to_int(std::size_t v, const char* what) {
    if (v > static_cast<std::size_t>(INT_MAX)) {
      cpdispatch::detail::fail("CblasGemm: ", what, " = ", v, " exceeds the CBLAS integer range (", INT_MAX, ")");
    }
    return static_cast<int>(v);
  }

  template <class T>
  static void scale(std::size_t m, std::size_t n, T beta, T* c, std::size_t ldc) noexcept {
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T{0} ? T{0} : beta * c[i * ldc + j];
    }
  }
};

}  // namespace cpdispatch::gemm
