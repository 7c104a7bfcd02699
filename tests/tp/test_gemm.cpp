// The GEMM backends: CblasGemm against the loop reference, the host kernels,
// and the concept's diagnostics.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <limits>
#include <vector>

#include "cpdispatch/gemm/gemm.hpp"
#include "tp_test_util.hpp"
#ifdef CPDISPATCH_TEST_HAVE_BLAS
#include "cpdispatch/gemm/gemm_cblas.hpp"
#endif

namespace tp = cpdispatch::tp;
using cpdispatch::gemm::Transpose;

namespace {

struct NotABackend {
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
};
static_assert(cpdispatch::gemm::GemmBackend<cpdispatch::gemm::ReferenceGemm, float>);
static_assert(cpdispatch::gemm::GemmBackend<cpdispatch::gemm::ReferenceGemm, double>);
static_assert(!cpdispatch::gemm::GemmBackend<NotABackend, float>);
static_assert(!cpdispatch::gemm::detail::gemm_has_gemm<NotABackend, float>);
#ifdef CPDISPATCH_TEST_HAVE_BLAS
static_assert(cpdispatch::gemm::GemmBackend<cpdispatch::gemm::CblasGemm, float>);
static_assert(cpdispatch::gemm::GemmBackend<cpdispatch::gemm::CblasGemm, double>);
// CblasGemm has gemm overloads for float and double only.
static_assert(!cpdispatch::gemm::detail::gemm_has_gemm<cpdispatch::gemm::CblasGemm, long double>);
#endif

/// C = alpha op(A) op(B) + beta C in plain double loops.
template <class T>
std::vector<double> naive(Transpose ta, Transpose tb, std::size_t m, std::size_t n, std::size_t k, double alpha,
                          const std::vector<T>& a, const std::vector<T>& b, double beta, const std::vector<T>& c) {
  std::vector<double> out(m * n);
  const std::size_t lda = ta == Transpose::no ? k : m;
  const std::size_t ldb = tb == Transpose::no ? n : k;
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p) {
        const double av = ta == Transpose::no ? a[i * lda + p] : a[p * lda + i];
        const double bv = tb == Transpose::no ? b[p * ldb + j] : b[j * ldb + p];
        s += av * bv;
      }
      out[i * n + j] = alpha * s + beta * c[i * n + j];
    }
  }
  return out;
}

template <class G, class T>
void check_gemm(G& g) {
  const std::size_t m = 7, n = 5, k = 9;
  std::uint64_t seed = 1;
  for (Transpose ta : {Transpose::no, Transpose::yes}) {
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      for (double beta : {0.0, 0.25}) {
        const auto a = tp_test::random_vector<T>(m * k, seed++);
        const auto b = tp_test::random_vector<T>(k * n, seed++);
        auto c = tp_test::random_vector<T>(m * n, seed++);
        const auto expected = naive(ta, tb, m, n, k, 0.5, a, b, beta, c);
        g.gemm(ta, tb, m, n, k, T(0.5), a.data(), ta == Transpose::no ? k : m, b.data(), tb == Transpose::no ? n : k,
               T(beta), c.data(), n);
        EXPECT_LT(tp_test::rel_error(c, expected), tp_test::tolerance<T>())
            << "ta=" << static_cast<int>(ta) << " tb=" << static_cast<int>(tb) << " beta=" << beta;
      }
    }
  }
  // k = 0: C = beta C; m = 0 or n = 0: nothing is touched.
  std::vector<T> c{1, 2, 3, 4};
  g.gemm(Transpose::no, Transpose::no, 2, 2, 0, T(1), static_cast<const T*>(nullptr), 1, static_cast<const T*>(nullptr),
         2, T(0.5), c.data(), 2);
  EXPECT_EQ(c, (std::vector<T>{0.5, 1, 1.5, 2}));
  g.gemm(Transpose::no, Transpose::no, 0, 2, 3, T(1), static_cast<const T*>(nullptr), 3, static_cast<const T*>(nullptr),
         2, T(0), c.data(), 2);
  EXPECT_EQ(c, (std::vector<T>{0.5, 1, 1.5, 2}));
}

}  // namespace

TEST(TpGemm, ReferenceMatchesNaiveLoops) {
  cpdispatch::gemm::ReferenceGemm g;
  check_gemm<cpdispatch::gemm::ReferenceGemm, float>(g);
  check_gemm<cpdispatch::gemm::ReferenceGemm, double>(g);
}

#ifdef CPDISPATCH_TEST_HAVE_BLAS
TEST(TpGemm, CblasMatchesNaiveLoops) {
  cpdispatch::gemm::CblasGemm g;
  check_gemm<cpdispatch::gemm::CblasGemm, float>(g);
  check_gemm<cpdispatch::gemm::CblasGemm, double>(g);
}

TEST(TpGemm, CblasRefusesSizesBeyondItsIntegers) {
  cpdispatch::gemm::CblasGemm g;
  const std::size_t huge = static_cast<std::size_t>(INT_MAX) + 1;
  float c = 0;
  try {
    g.gemm(Transpose::no, Transpose::no, huge, 1, 1, 1.0f, &c, 1, &c, 1, 0.0f, &c, 1);
    FAIL() << "expected an error";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("CblasGemm: m = 2147483648 exceeds the CBLAS integer range"),
              std::string::npos)
        << e.what();
  }
}
#else
TEST(TpGemm, CblasMatchesNaiveLoops) { GTEST_SKIP() << "cpdispatch::blas is not built (Debian: libopenblas-dev)"; }
#endif

TEST(TpGemm, BiasAndRowSums) {
  cpdispatch::gemm::ReferenceGemm g;
  std::vector<double> y{1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<double> bias{10, 20, 30};
  g.add_bias(y.data(), bias.data(), 2, 3);
  EXPECT_EQ(y, (std::vector<double>{11, 22, 33, 14, 25, 36}));
  std::vector<double> sums{1, 1, 1};
  g.sum_rows(y.data(), 2, 3, sums.data(), true);
  EXPECT_EQ(sums, (std::vector<double>{26, 48, 70}));
  g.sum_rows(y.data(), 2, 3, sums.data(), false);
  EXPECT_EQ(sums, (std::vector<double>{25, 47, 69}));
}

TEST(TpGemm, ActivationsAndTheirDerivatives) {
  cpdispatch::gemm::ReferenceGemm g;
  const std::vector<double> x{-2.5, -1.0, -0.1, 0.3, 1.0, 2.0};
  std::vector<double> y(x.size());
  g.activation_forward(cpdispatch::gemm::Activation::relu, x.data(), y.data(), x.size());
  EXPECT_EQ(y, (std::vector<double>{0, 0, 0, 0.3, 1.0, 2.0}));
  g.activation_forward(cpdispatch::gemm::Activation::gelu, x.data(), y.data(), x.size());
  EXPECT_NEAR(y[4], 0.8413447460685429, 1e-12);  // GELU(1) = Phi(1)
  EXPECT_NEAR(y[1], -0.15865525393145707, 1e-12);
  for (cpdispatch::gemm::Activation act : {cpdispatch::gemm::Activation::identity, cpdispatch::gemm::Activation::relu, cpdispatch::gemm::Activation::gelu,
                             cpdispatch::gemm::Activation::tanh}) {
    std::vector<double> dy(x.size(), 1.0), dx(x.size());
    g.activation_backward(act, x.data(), dy.data(), dx.data(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double h = 1e-6;
      double lo = x[i] - h, hi = x[i] + h, flo = 0, fhi = 0;
      g.activation_forward(act, &lo, &flo, 1);
      g.activation_forward(act, &hi, &fhi, 1);
      EXPECT_NEAR(dx[i], (fhi - flo) / (2 * h), 1e-6) << cpdispatch::gemm::activation_name(act) << " at " << x[i];
    }
  }
  // In place is allowed.
  std::vector<double> z = x;
  g.activation_forward(cpdispatch::gemm::Activation::relu, z.data(), z.data(), z.size());
  EXPECT_EQ(z[0], 0.0);
}

TEST(TpGemm, UpdateKernels) {
  cpdispatch::gemm::ReferenceGemm g;
  std::vector<float> p{1, 2, 3}, grad{1, 1, 2};
  g.axpy(-0.5f, grad.data(), p.data(), p.size());
  EXPECT_EQ(p, (std::vector<float>{0.5f, 1.5f, 2.0f}));
  g.fill(p.data(), 7.0f, p.size());
  EXPECT_EQ(p, (std::vector<float>{7, 7, 7}));
  g.copy(grad.data(), p.data(), 3);
  EXPECT_EQ(p, grad);
}
