#pragma once
// A small owning, row-major, up-to-3-D array: the storage of Metadata fields.
// Deliberately minimal: shapes, element access, rows; no arithmetic.

#include <algorithm>
#include <array>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"

namespace cpdispatch {
namespace detail {

/// Allocator for zero-filled arithmetic storage: calloc hands out memory the
/// kernel has already zeroed, and value-initialising construct() is a no-op,
/// so large mostly-zero metadata (the W x (W+1) counts) costs no memset and
/// no page touched until written. Only used by Tensor, which never shrinks
/// and regrows its storage.
template <class T>
struct ZeroedAllocator {
  static_assert(std::is_arithmetic_v<T>, "ZeroedAllocator holds arithmetic types only");
  using value_type = T;
  ZeroedAllocator() = default;
  template <class U>
  ZeroedAllocator(const ZeroedAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n == 0) return nullptr;
    void* p = std::calloc(n, sizeof(T));
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <class U>
  void construct(U*) noexcept {}  // calloc'd memory already holds zero
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  friend bool operator==(const ZeroedAllocator&, const ZeroedAllocator<U>&) noexcept { return true; }
};

}  // namespace detail

template <class T>
class Tensor {
 public:
  using value_type = T;

  Tensor() = default;

  /// A tensor of the given shape (1 to 3 dimensions) filled with `fill`.
  explicit Tensor(std::initializer_list<std::size_t> shape, T fill = T{})
      : Tensor(std::vector<std::size_t>(shape), fill) {}

  explicit Tensor(const std::vector<std::size_t>& shape, T fill = T{}) {
    if (shape.empty() || shape.size() > 3) {
      detail::fail("Tensor: ", shape.size(), " dimensions requested, 1 to 3 are supported");
    }
    dim_ = shape.size();
    std::size_t n = 1;
    for (std::size_t i = 0; i < dim_; ++i) {
      shape_[i] = shape[i];
      if (__builtin_mul_overflow(n, shape[i], &n)) {  // a wrapped count would allocate too little
        std::string dims;
        for (std::size_t extent : shape) {
          if (!dims.empty()) dims += ", ";
          dims += std::to_string(extent);
        }
        detail::fail("Tensor: shape [", dims, "] has more elements than memory can address");
      }
    }
    data_.resize(n);  // zero, without touching the pages
    if (fill != T{}) std::fill(data_.begin(), data_.end(), fill);
  }

  std::size_t dim() const noexcept { return dim_; }
  std::size_t size(std::size_t axis) const noexcept { return axis < dim_ ? shape_[axis] : 1; }
  std::vector<std::size_t> shape() const { return {shape_.begin(), shape_.begin() + dim_}; }
  std::size_t numel() const noexcept { return data_.size(); }
  bool empty() const noexcept { return dim_ == 0; }

  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }
  std::span<T> flat() noexcept { return data_; }
  std::span<const T> flat() const noexcept { return data_; }
  /// A copy of the elements in row-major order.
  std::vector<T> values() const { return {data_.begin(), data_.end()}; }

  // Unchecked access; indices must be in range (the library validates first).
  T& operator()(std::size_t i) noexcept { return data_[i]; }
  const T& operator()(std::size_t i) const noexcept { return data_[i]; }
  T& operator()(std::size_t i, std::size_t j) noexcept { return data_[i * shape_[1] + j]; }
  const T& operator()(std::size_t i, std::size_t j) const noexcept { return data_[i * shape_[1] + j]; }
  T& operator()(std::size_t i, std::size_t j, std::size_t k) noexcept {
    return data_[(i * shape_[1] + j) * shape_[2] + k];
  }
  const T& operator()(std::size_t i, std::size_t j, std::size_t k) const noexcept {
    return data_[(i * shape_[1] + j) * shape_[2] + k];
  }

  /// Checked access for callers handling untrusted indices.
  template <class... Ix>
  const T& at(Ix... ix) const {
    check_index({static_cast<std::size_t>(ix)...});
    return (*this)(static_cast<std::size_t>(ix)...);
  }

  /// Row `i` of the leading axis: every element whose first index is `i`.
  std::span<T> row(std::size_t i) noexcept {
    const std::size_t n = dim_ ? data_.size() / shape_[0] : 0;
    return std::span<T>(data_).subspan(i * n, n);
  }
  std::span<const T> row(std::size_t i) const noexcept {
    const std::size_t n = dim_ ? data_.size() / shape_[0] : 0;
    return std::span<const T>(data_).subspan(i * n, n);
  }

  friend bool operator==(const Tensor& a, const Tensor& b) {
    return a.dim_ == b.dim_ && a.shape() == b.shape() && a.data_ == b.data_;
  }

 private:
  void check_index(std::initializer_list<std::size_t> ix) const {
    if (ix.size() != dim_) {
      detail::fail("Tensor::at: ", ix.size(), " indices given for a ", dim_, "-D tensor");
    }
    std::size_t axis = 0;
    for (std::size_t i : ix) {
      if (i >= shape_[axis]) {
        detail::fail("Tensor::at: index ", i, " on axis ", axis, " is outside [0, ", shape_[axis], ")");
      }
      ++axis;
    }
  }

  std::size_t dim_ = 0;
  std::array<std::size_t, 3> shape_{};
  std::vector<T, detail::ZeroedAllocator<T>> data_;
};

/// A 2-D tensor from nested rows (rows must have equal length); handy in tests.
template <class T>
Tensor<T> make_tensor(const std::vector<std::vector<T>>& rows) {
  const std::size_t cols = rows.empty() ? 0 : rows[0].size();
  Tensor<T> t({rows.size(), cols});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].size() != cols) {
      detail::fail("make_tensor: row ", i, " has ", rows[i].size(), " entries, row 0 has ", cols);
    }
    for (std::size_t j = 0; j < cols; ++j) t(i, j) = rows[i][j];
  }
  return t;
}

/// A 3-D tensor from nested rows (all inner lists of equal length).
template <class T>
Tensor<T> make_tensor(const std::vector<std::vector<std::vector<T>>>& rows) {
  const std::size_t s = rows.empty() ? 0 : rows[0].size();
  const std::size_t c = (rows.empty() || rows[0].empty()) ? 0 : rows[0][0].size();
  Tensor<T> t({rows.size(), s, c});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].size() != s) {
      detail::fail("make_tensor: row ", i, " has ", rows[i].size(), " entries, row 0 has ", s);
    }
    for (std::size_t j = 0; j < s; ++j) {
      if (rows[i][j].size() != c) {
        detail::fail("make_tensor: [", i, "][", j, "] has ", rows[i][j].size(), " entries, [0][0] has ", c);
      }
      for (std::size_t k = 0; k < c; ++k) t(i, j, k) = rows[i][j][k];
    }
  }
  return t;
}

}  // namespace cpdispatch
