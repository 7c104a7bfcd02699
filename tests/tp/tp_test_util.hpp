#pragma once
// Shared helpers of the tensor-parallel tests.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/tp/tensor_parallel.hpp"
#include "../common/max_error.hpp"
#ifdef CPDISPATCH_TEST_HAVE_BLAS
#include "cpdispatch/gemm/gemm_cblas.hpp"
#endif

namespace tp_test {

/// The host GEMM backend the tests run: CBLAS where it is built, else the reference.
#ifdef CPDISPATCH_TEST_HAVE_BLAS
using HostGemm = cpdispatch::gemm::CblasGemm;
#else
using HostGemm = cpdispatch::gemm::ReferenceGemm;
#endif

/// What f throws as cpdispatch::error, or "(no error)" when it returns.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const cpdispatch::error& e) {
    return e.what();
  }
  return "(no error)";
}

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(dist(rng));
  return v;
}

template <class T>
cpdispatch::Tensor<T> random_tensor(std::vector<std::size_t> shape, std::uint64_t seed, double scale = 1.0) {
  cpdispatch::Tensor<T> t(shape);
  const auto v = random_vector<T>(t.numel(), seed, scale);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

/// max |a - b| / max |b| (max |a - b| when b is all 0); infinite on a NaN,
/// an unmatched infinity or, with a test failure, a size mismatch (max_error.hpp).
template <class A, class B>
double rel_error(const A* a, const B* b, std::size_t n) {
  return cpdispatch::testing::max_error(std::span(a, n), std::span(b, n)).relative();
}
template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  return cpdispatch::testing::max_error(a, b).relative();
}
template <class A, class B>
double rel_error(const cpdispatch::Tensor<A>& a, const cpdispatch::Tensor<B>& b) {
  return cpdispatch::testing::max_error(a.flat(), b.flat()).relative();
}

/// Columns [c0, c0 + n) of a row-major [rows, cols] tensor.
template <class T>
cpdispatch::Tensor<T> columns(const cpdispatch::Tensor<T>& x, std::size_t c0, std::size_t n) {
  const std::size_t cols = x.size(x.dim() - 1);
  const std::size_t rows = x.numel() / cols;
  cpdispatch::Tensor<T> out({rows, n});
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < n; ++c) out(r, c) = x.data()[r * cols + c0 + c];
  }
  return out;
}

/// Tolerance of float32 comparisons against the double-accumulating reference.
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

}  // namespace tp_test
