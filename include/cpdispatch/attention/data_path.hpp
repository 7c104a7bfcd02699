#pragma once
// What ContextParallelAttention does with memory, by memory space: its
// owned buffers, the piece lists its exchanges and fan-outs run, the fan-in
// and the home combine of key-value gradients, and the arithmetic of staged
// passes (the log-sum-exp merge of partial outputs, the fp32 sum of dq). The
// op's logic (what moves where, when) is written once over this interface;
// the host path is below, the device path in cpdispatch/cuda/attention_data_path.hpp
// (the op picks the one of its transport's memory space).
//
//   template <> class AttentionDataPath<Space> {
//    public:
//     template <class Transport> explicit AttentionDataPath(Transport&);
//     template <class U> using span = ...;       // the op's public buffer type
//     template <class U> class buffer;           // owned; grows, never shrinks
//     // Per plan: clear(), then add_* (ids count from 0 in order), then commit().
//     std::size_t add_copies(std::span<const detail::CopyPiece>);   // bytes, src -> dst
//     std::size_t add_fan_in(const KvFanList&, std::size_t token_bytes);  // sums at wire offsets
//     std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes);
//     void commit();                             // (the device path uploads here)
//     // Per call, ordered after everything before it:
//     void copy(id, const std::byte* src, std::byte* dst);
//     void copy(detail::PieceList, const std::byte* src, std::byte* dst);  // the exchange engine's: an id with its pieces
//     void fan_in(id, ElementType, std::byte* attention);   // in place where wire offsets are first copies
//     void combine(id, ElementType, const std::byte* replica, std::size_t, std::byte* grad, std::size_t);
//     void fill(float*, std::size_t n, float value);  void zero(std::byte*, std::size_t bytes);
//     // The invariant mode's: the largest |x| (NaN if x holds one; the device
//     // path waits for its stream), and exact sums rounded once (round_exact).
//     template <class E> double max_abs(const E*, std::size_t n);
//     template <class E> void round_exact(const std::int64_t*, int exponent, E* out, std::size_t n);
//     template <class E> void merge(...);  accumulate(...);  store(...);
//   };
//
// The host path runs everything at once on the calling thread and keeps
// references to what is added (unchanged until the next clear()), so a plan
// allocates nothing in it once its number of lists has been seen.

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
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/dedup.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/memory_space.hpp"
#include "cpdispatch/plan/dedup.hpp"
#include "cpdispatch/plan/metadata.hpp"

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
class AttentionDataPath<MemorySpace::host> {
 public:
  static constexpr bool available = true;

  template <class Transport>
  explicit AttentionDataPath(Transport&) noexcept {}

  template <class U>
  using span = std::span<U>;

  /// Owned memory of U: resize keeps the storage once it is large enough.
  template <class U>
  class buffer {
   public:
    void resize(std::size_t n) { v_.resize(n); }
    void reserve(std::size_t n) { v_.reserve(n); }
    U* data() noexcept { return v_.data(); }
    const U* data() const noexcept { return v_.data(); }
    std::size_t size() const noexcept { return v_.size(); }

   private:
    std::vector<U> v_;
  };

  /// Forgets the last plan's lists (keeping their storage).
  void clear() noexcept { copies_used_ = fans_used_ = combines_used_ = 0; }

  // The host path keeps references: what is added must stay unchanged until the next clear().
  std::size_t add_copies(std::span<const detail::CopyPiece> pieces) {
    next(copies_, copies_used_) = pieces;
    return copies_used_ - 1;
  }

  std::size_t add_fan_in(const KvFanList& fan, std::size_t token_bytes) {
    next(fans_, fans_used_) = {&fan, token_bytes};
    return fans_used_ - 1;
  }

  std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes) {
    next(combines_, combines_used_) = {&rev, token_bytes};
    return combines_used_ - 1;
  }

  void commit() noexcept {}

  void copy(std::size_t id, const std::byte* src, std::byte* dst) const noexcept { detail::copy_pieces(copies_[id], src, dst); }
  /// The exchange engine's form: a list added here, with its pieces.
  void copy(detail::PieceList list, const std::byte* src, std::byte* dst) const noexcept { detail::copy_pieces(list.pieces, src, dst); }

  /// Sums each entry's copies at its wire offset, in the fixed order of the fan-in.
  void fan_in(std::size_t id, ElementType type, std::byte* attention) const {
    const Fan& f = fans_[id];
    detail::with_element_type(type, [&](auto* tag) {
      using E = std::remove_pointer_t<decltype(tag)>;
      detail::fan_in<E>(*f.list, attention, attention, f.token_bytes / sizeof(E));
    });
  }

  void combine(std::size_t id, ElementType type, const std::byte* replica, std::size_t replica_bytes, std::byte* grad, std::size_t grad_bytes) const {
    const Combine& c = combines_[id];
    combine_copies(*c.rev, ConstBytes(replica, replica_bytes), MutableBytes(grad, grad_bytes), c.token_bytes, type);
  }

  void fill(float* p, std::size_t n, float value) const noexcept { std::fill(p, p + n, value); }
  void zero(std::byte* p, std::size_t bytes) const noexcept {
    if (bytes > 0) std::memset(p, 0, bytes);
  }

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

 private:
  struct Fan {
    const KvFanList* list = nullptr;
    std::size_t token_bytes = 0;
  };
  struct Combine {
    const RankMetadata* rev = nullptr;
    std::size_t token_bytes = 0;
  };

  template <class X>
  static X& next(std::vector<X>& v, std::size_t& used) {
    if (v.size() <= used) v.emplace_back();
    return v[used++];
  }

  std::vector<std::span<const detail::CopyPiece>> copies_;
  std::vector<Fan> fans_;
  std::vector<Combine> combines_;
  std::size_t copies_used_ = 0, fans_used_ = 0, combines_used_ = 0;
};

}  // namespace cpdispatch
