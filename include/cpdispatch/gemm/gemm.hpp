#pragma once
// The GEMM backend concept of the tensor-parallel layers, and the reference
// host backend (plain loops, no dependency).
//
// A backend owns the arithmetic of a linear layer on one memory space: a
// row-major GEMM plus the few element-wise kernels a linear layer and its
// activations need (bias add, bias gradient, activations, SGD update), and
// the buffer type parameters and activations live in. Keeping the element-
// wise kernels here, rather than in the layers, is what lets a device backend
// (cuBLAS plus small kernels, memory_space == device) keep every tensor on the
// device: the layers only ever touch data through the backend.
//
// Backends in this library:
//   ReferenceGemm  (this header)        host, naive loops, accumulates float in double
//   CblasGemm      (gemm/gemm_cblas.hpp)  host, CBLAS (OpenBLAS), target cpdispatch::blas
// A cuBLAS backend is meant to slot in with memory_space == device and a
// device buffer type; nothing in the layers assumes host memory except the
// convenience overloads taking cpdispatch::Tensor, which require a host backend.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/memory_space.hpp"

namespace cpdispatch::gemm {

/// op(A) of a GEMM operand: A itself or its transpose.
enum class Transpose : bool { no = false, yes = true };

/// Element-wise activations of a model stack.
enum class Activation { identity, relu, gelu, tanh };

constexpr const char* activation_name(Activation a) noexcept {
  switch (a) {
    case Activation::identity: return "Identity";
    case Activation::relu: return "ReLU";
    case Activation::gelu: return "GELU";
    case Activation::tanh: return "Tanh";
  }
  return "?";
}

namespace detail {

template <class G>
concept gemm_has_memory_space = requires {
  { G::memory_space } -> std::convertible_to<MemorySpace>;
};
template <class G, class T>
concept gemm_has_buffer = requires(typename G::template buffer<T> b) {
  { b.data() } -> std::convertible_to<T*>;
  { b.size() } -> std::convertible_to<std::size_t>;
} && std::constructible_from<typename G::template buffer<T>, std::size_t> &&
                          std::movable<typename G::template buffer<T>>;
template <class G, class T>
concept gemm_has_gemm = requires(G& g, Transpose t, std::size_t n, T s, const T* a, T* c) {
  g.gemm(t, t, n, n, n, s, a, n, a, n, s, c, n);
};
template <class G, class T>
concept gemm_has_kernels = requires(G& g, std::size_t n, T s, const T* a, T* c, Activation act, bool flag) {
  g.add_bias(c, a, n, n);
  g.sum_rows(a, n, n, c, flag);
  g.activation_forward(act, a, c, n);
  g.activation_backward(act, a, a, c, n);
  g.axpy(s, a, c, n);
  g.fill(c, s, n);
  g.copy(a, c, n);
  g.upload(a, c, n);
  g.download(a, c, n);
};

}  // namespace detail

/// A GEMM backend for element type T (see the top of this header):
///   static constexpr MemorySpace memory_space;
///   template <class T> using buffer = ...;   // buffer(n), data(), size(), movable
///   // row-major C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C
///   void gemm(Transpose ta, Transpose tb, size_t m, size_t n, size_t k, T alpha,
///             const T* a, size_t lda, const T* b, size_t ldb, T beta, T* c, size_t ldc);
///   void add_bias(T* y, const T* bias, size_t rows, size_t cols);           // y[r,c] += bias[c]
///   void sum_rows(const T* x, size_t rows, size_t cols, T* out, bool accumulate); // out[c] (+)= sum_r x[r,c]
///   void activation_forward(Activation, const T* x, T* y, size_t n);        // y = f(x), may alias
///   void activation_backward(Activation, const T* x, const T* dy, T* dx, size_t n);  // dx = f'(x) dy
///   void axpy(T alpha, const T* x, T* y, size_t n);                         // y += alpha x
///   void fill(T* y, T value, size_t n);
///   void copy(const T* src, T* dst, size_t n);                              // same memory space
///   void upload(const T* host, T* dst, size_t n);  void download(const T* src, T* host, size_t n);
template <class G, class T>
concept GemmBackend = detail::gemm_has_memory_space<G> && detail::gemm_has_buffer<G, T> &&
                      detail::gemm_has_gemm<G, T> && detail::gemm_has_kernels<G, T>;

/// Checks a GEMM backend at its point of use, one readable line per missing part.
#define CPDISPATCH_CHECK_GEMM_BACKEND(G, T)                                                                            \
  static_assert(::cpdispatch::gemm::detail::gemm_has_memory_space<G>,                                                    \
                "cpdispatch: the GEMM backend lacks `static constexpr MemorySpace memory_space`");                     \
  static_assert(::cpdispatch::gemm::detail::gemm_has_buffer<G, T>,                                                       \
                "cpdispatch: the GEMM backend lacks `template <class T> using buffer` (buffer(n), data(), size())");   \
  static_assert(::cpdispatch::gemm::detail::gemm_has_gemm<G, T>,                                                         \
                "cpdispatch: the GEMM backend lacks `gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)` "     \
                "for this element type");                                                                              \
  static_assert(::cpdispatch::gemm::detail::gemm_has_kernels<G, T>,                                                      \
                "cpdispatch: the GEMM backend lacks an element-wise kernel (add_bias, sum_rows, activation_forward, "  \
                "activation_backward, axpy, fill, copy, upload, download)")

/// The element-wise kernels every host backend shares.
struct HostKernels {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  template <class T>
  using buffer = std::vector<T>;

  template <class T>
  void add_bias(T* y, const T* bias, std::size_t rows, std::size_t cols) const noexcept {
    for (std::size_t r = 0; r < rows; ++r) {
      T* row = y + r * cols;
      for (std::size_t c = 0; c < cols; ++c) row[c] += bias[c];
    }
  }

  template <class T>
  void sum_rows(const T* x, std::size_t rows, std::size_t cols, T* out, bool accumulate) const noexcept {
    if (!accumulate) std::fill(out, out + cols, T{0});
    for (std::size_t r = 0; r < rows; ++r) {
      const T* row = x + r * cols;
      for (std::size_t c = 0; c < cols; ++c) out[c] += row[c];
    }
  }

  template <class T>
  void activation_forward(Activation act, const T* x, T* y, std::size_t n) const noexcept {
    switch (act) {
      case Activation::identity:
        if (x != y) std::copy(x, x + n, y);
        return;
      case Activation::relu:
        for (std::size_t i = 0; i < n; ++i) y[i] = x[i] > T{0} ? x[i] : T{0};
        return;
      case Activation::gelu:  // exact (erf) GELU, as torch.nn.GELU()
        for (std::size_t i = 0; i < n; ++i) {
          const T v = x[i];
          y[i] = T(0.5) * v * (T(1) + std::erf(v * T(0.70710678118654752440)));
        }
        return;
      case Activation::tanh:
        for (std::size_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
        return;
    }
  }

  template <class T>
  void activation_backward(Activation act, const T* x, const T* dy, T* dx, std::size_t n) const noexcept {
    switch (act) {
      case Activation::identity:
        if (dy != dx) std::copy(dy, dy + n, dx);
        return;
      case Activation::relu:
        for (std::size_t i = 0; i < n; ++i) dx[i] = x[i] > T{0} ? dy[i] : T{0};
        return;
      case Activation::gelu:
        for (std::size_t i = 0; i < n; ++i) {
          const T v = x[i];
          const T cdf = T(0.5) * (T(1) + std::erf(v * T(0.70710678118654752440)));
          const T pdf = std::exp(T(-0.5) * v * v) * T(0.39894228040143267794);
          dx[i] = dy[i] * (cdf + v * pdf);
        }
        return;
      case Activation::tanh:
        for (std::size_t i = 0; i < n; ++i) {
          const T t = std::tanh(x[i]);
          dx[i] = dy[i] * (T(1) - t * t);
        }
        return;
    }
  }

  template <class T>
  void axpy(T alpha, const T* x, T* y, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
  template <class T>
  void fill(T* y, T value, std::size_t n) const noexcept {
    std::fill(y, y + n, value);
  }
  template <class T>
  void copy(const T* src, T* dst, std::size_t n) const noexcept {
    if (n != 0 && src != dst) std::memmove(dst, src, n * sizeof(T));
  }
  template <class T>
  void upload(const T* host, T* dst, std::size_t n) const noexcept {
    copy(host, dst, n);
  }
  template <class T>
  void download(const T* src, T* host, std::size_t n) const noexcept {
    copy(src, host, n);
  }
};

/// Host GEMM with plain loops: the dependency-free backend and the test
/// oracle. float products are accumulated in double.
struct ReferenceGemm : HostKernels {
  template <class T>
  void gemm(Transpose ta, Transpose tb, std::size_t m, std::size_t n, std::size_t k, T alpha, const T* a,
            std::size_t lda, const T* b, std::size_t ldb, T beta, T* c, std::size_t ldc) const noexcept {
    using Acc = std::conditional_t<std::is_same_v<T, float>, double, T>;
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < n; ++j) {
        Acc sum = 0;
        for (std::size_t p = 0; p < k; ++p) {
          const T av = ta == Transpose::no ? a[i * lda + p] : a[p * lda + i];
          const T bv = tb == Transpose::no ? b[p * ldb + j] : b[j * ldb + p];
          sum += static_cast<Acc>(av) * static_cast<Acc>(bv);
        }
        T& out = c[i * ldc + j];
        out = static_cast<T>(static_cast<Acc>(alpha) * sum + (beta == T{0} ? Acc{0} : static_cast<Acc>(beta) * out));
      }
    }
  }
};

}  // namespace cpdispatch::gemm
