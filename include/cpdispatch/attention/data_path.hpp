#pragma once
// ContextParallelAttention's data path: the data path of its transport's
// memory space (execute/data_path.hpp: owned buffers, piece lists, fan-ins,
// combines, fill, zero) and the op's arithmetic on top of it:
//
//   template <> class AttentionDataPath<Space> : public <Space's data path> {
//    public:
//     // The log-sum-exp merge of staged passes and the fp32 sum of dq:
//     template <class E> void merge(float* acc, float* lse, const E* part, const float* lse_part, tokens, heads, head_dim);
//     template <class E> void accumulate(float* acc, const E* part, std::size_t n);   // acc += part
//     template <class E> void store(const float* acc, E* out, std::size_t n);        // out = acc, rounded
//     // The invariant mode's: the largest |x| (NaN if x holds one; the device
//     // path waits for its stream), and exact sums rounded once (round_exact).
//     template <class E> double max_abs(const E*, std::size_t n);
//     template <class E> void round_exact(const std::int64_t*, int exponent, E* out, std::size_t n);
//   };
//
// The host one is below, the device one in cpdispatch/cuda/attention_data_path.hpp
// (the op picks the one of its transport's memory space).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "cpdispatch/attention/detail/lse_merge.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/memory_space.hpp"

namespace cpdispatch {

/// The op's data path of a memory space (host below; device in
/// cpdispatch/cuda/attention_data_path.hpp). `available` is false where none
/// is defined in the translation unit, so the op can refuse it readably.
template <MemorySpace Space>
class AttentionDataPath {
 public:
  static constexpr bool available = false;
};

template <>
class AttentionDataPath<MemorySpace::host> : public HostDataPath {
 public:
  using HostDataPath::HostDataPath;

  template <class E>
  double max_abs(const E* x, std::size_t n) const {
    return detail::max_abs_of<E>(std::span<const E>(x, n));
  }
  template <class E>
  void round_exact(const std::int64_t* exact, int exponent, E* out, std::size_t n) const {
    cpdispatch::round_exact<E>(std::span<const std::int64_t>(exact, n), exponent, std::span<E>(out, n));
  }

  /// Folds a pass's output into the running fp32 one over the whole layout;
  /// rows the pass did not attend carry lse_part = -inf and are left alone.
  template <class E>
  void merge(float* acc, float* lse, const E* part, const float* lse_part, std::int64_t tokens, std::int64_t heads, std::int64_t head_dim) const {
    const auto n = static_cast<std::size_t>(tokens * heads * head_dim), l = static_cast<std::size_t>(tokens * heads);
    detail::merge_partial<E>(std::span<float>(acc, n), std::span<float>(lse, l), std::span<const E>(part, n), std::span<const float>(lse_part, l), tokens,
                             heads, head_dim, 0, tokens);
  }

  /// acc += part, element by element.
  template <class E>
  void accumulate(float* acc, const E* part, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) acc[i] += detail::to_f32(part[i]);
  }

  /// out = acc, rounded to E.
  template <class E>
  void store(const float* acc, E* out, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) out[i] = detail::from_f32<E>(acc[i]);
  }
};

}  // namespace cpdispatch
