#pragma once
// A small owning, row-major, up-to-3-D array: the storage of Metadata fields.
// Deliberately minimal: shapes, element access, rows; no arithmetic.

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
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

#if defined(__linux__)
#include <sys/mman.h>  // madvise: huge pages for large outputs
#endif

namespace cpdispatch {
namespace detail {

/// Zero-filled arithmetic storage of a fixed size: calloc hands out memory
/// the kernel has already zeroed, so large mostly-zero metadata (the
/// W x (W+1) counts) costs no memset and no page touched until written.
/// The size is set once, at construction: there is no resize that could hand
/// back reused memory believed to be zero.
template <class T>
class ZeroedBuffer {
  static_assert(std::is_arithmetic_v<T>, "ZeroedBuffer holds arithmetic types only");

 public:
  ZeroedBuffer() = default;
  explicit ZeroedBuffer(std::size_t n) : data_(allocate(n)), size_(n) {}
  ZeroedBuffer(const ZeroedBuffer& other) : data_(allocate(other.size_)), size_(other.size_) {
    if (size_ != 0) std::memcpy(data_, other.data_, size_ * sizeof(T));
  }
  ZeroedBuffer(ZeroedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  ZeroedBuffer& operator=(ZeroedBuffer other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  ~ZeroedBuffer() { std::free(data_); }

  std::size_t size() const noexcept { return size_; }
  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + size_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

  friend bool operator==(const ZeroedBuffer& a, const ZeroedBuffer& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  static T* allocate(std::size_t n) {
    if (n == 0) return nullptr;
    void* p = std::calloc(n, sizeof(T));
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
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
    data_ = detail::ZeroedBuffer<T>(n);  // zero, without touching the pages
    if (fill != T{}) std::fill(data_.begin(), data_.end(), fill);
  }

  std::size_t dim() const noexcept { return dim_; }
  std::size_t size(std::size_t axis) const noexcept { return axis < dim_ ? shape_[axis] : 1; }
  std::vector<std::size_t> shape() const { return {shape_.begin(), shape_.begin() + dim_}; }
  std::size_t numel() const noexcept { return data_.size(); }
  bool empty() const noexcept { return dim_ == 0; }

  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }
  std::span<T> flat() noexcept { return {data_.data(), data_.size()}; }
  std::span<const T> flat() const noexcept { return {data_.data(), data_.size()}; }
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
  /// Throws invalid_input when `i` is not below size(0) (a tensor with a
  /// leading extent of 0 has no rows).
  std::span<T> row(std::size_t i) { return flat().subspan(row_start(i), row_size()); }
  std::span<const T> row(std::size_t i) const { return flat().subspan(row_start(i), row_size()); }

  /// Elements per row of the leading axis (the product of the other extents).
  std::size_t row_size() const noexcept {
    std::size_t n = 1;
    for (std::size_t axis = 1; axis < dim_; ++axis) n *= shape_[axis];  // no overflow: the constructor checked the product
    return n;
  }

  friend bool operator==(const Tensor& a, const Tensor& b) {
    return a.dim_ == b.dim_ && a.shape() == b.shape() && a.data_ == b.data_;
  }

 private:
  std::size_t row_start(std::size_t i) const {
    if (dim_ == 0 || i >= shape_[0]) detail::fail("Tensor::row: row ", i, " is outside [0, ", size(0), ")");
    return i * row_size();
  }

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
  detail::ZeroedBuffer<T> data_;
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

namespace detail {

/// Storage platform code. Planner outputs are large (a W = 4096 count matrix is 128 MiB) and first
/// written scattered, so on 4 KiB pages nearly every write is a page fault.
/// Asking for huge pages on the buffer's 2 MiB-aligned interior cuts the
/// faults 512-fold. Advice only: contents are unchanged, and where the kernel
/// (or the platform) does not follow it nothing changes.
template <class T>
void advise_huge_pages(Tensor<T>& t) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t huge = std::uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data());
  const std::uintptr_t end = begin + t.numel() * sizeof(T);
  const std::uintptr_t first = (begin + huge - 1) & ~(huge - 1), last = end & ~(huge - 1);
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

}  // namespace detail

}  // namespace cpdispatch
