#pragma once
// The KV-gradient combine: sums the gradients of a shard's copies after the
// reverse KV exchange brought them back into the [C][T] replica buffer. Used
// by the dispatcher's host data path and by the reference simulation.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch {

namespace detail {

/// a + b; integers wrap (two's complement) instead of overflowing, so integer
/// sums are exact modulo 2^bits and never undefined.
template <class T>
constexpr T sum_of(T a, T b) noexcept {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

/// Calls f(E*) with a null pointer of the C++ type of `type`.
template <class F>
void with_element_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::int8: f(static_cast<std::int8_t*>(nullptr)); break;
    case ElementType::uint8: f(static_cast<std::uint8_t*>(nullptr)); break;
    case ElementType::int32: f(static_cast<std::int32_t*>(nullptr)); break;
    case ElementType::int64: f(static_cast<std::int64_t*>(nullptr)); break;
    case ElementType::float32: f(static_cast<float*>(nullptr)); break;
    case ElementType::float64: f(static_cast<double*>(nullptr)); break;
    case ElementType::bfloat16: f(static_cast<bfloat16*>(nullptr)); break;
    case ElementType::float16: f(static_cast<float16*>(nullptr)); break;
  }
}

/// What the combine reads of reverse KV metadata, as views of its arrays:
/// they stay valid when the metadata moves (not when it changes).
struct CombineView {
  bool reverse_kv = false;  ///< seq_recv_mask and recv_seq_lens are there
  std::span<const std::int64_t> lens, mask;
  std::size_t copies = 0;

  CombineView() = default;
  CombineView(const RankMetadata& rev) noexcept  // implicit: a view of it
      : reverse_kv(rev.seq_recv_mask && rev.recv_seq_lens), copies(rev.mask_copies) {
    if (reverse_kv) {
      lens = *rev.recv_seq_lens;
      mask = *rev.seq_recv_mask;
    }
  }
};

/// combine_copies (below) of a view.
template <class T>
void combine_copies(const CombineView& kv_rev, std::span<const T> replica, std::span<T> grad, std::size_t token_elems) {
  if (!kv_rev.reverse_kv) fail("combine_copies: the metadata has no seq_recv_mask (it is not reverse KV metadata)");
  if (token_elems == 0) fail("combine_copies: token_elems must be positive");
  const std::span<const std::int64_t> lens = kv_rev.lens, mask = kv_rev.mask;
  const std::size_t C = kv_rev.copies;
  if (mask.size() != lens.size() * C) {
    fail("combine_copies: seq_recv_mask has ", mask.size(), " entries, expected ", lens.size(), " shards x ", C, " copies");
  }
  std::int64_t total = 0;
  for (std::size_t g = 0; g < lens.size(); ++g) {
    if (lens[g] < 0) fail("combine_copies: recv_seq_lens[", g, "] = ", lens[g], " is negative");
    total = detail::add_tokens(total, lens[g], "combine_copies");
  }
  const std::size_t slab = detail::token_bytes_of(total, token_elems, "combine_copies");  // elements per copy
  std::size_t need_replica = 0;
  if (__builtin_mul_overflow(slab, C, &need_replica)) fail("combine_copies: the replica buffer does not fit in memory");
  if (replica.size() < need_replica) {
    fail<capacity_error>("combine_copies: replica holds ", replica.size(), " elements, the plan needs ", need_replica, " (", C,
                         " copies x ", total, " tokens x ", token_elems, ")");
  }
  if (grad.size() < slab) {
    fail<capacity_error>("combine_copies: grad holds ", grad.size(), " elements, the plan needs ", slab, " (", total,
                         " tokens x ", token_elems, ")");
  }
  using Acc = accumulator_t<T>;
  constexpr std::size_t block = 1024;  // fp32 scratch on the stack for 16-bit types
  std::size_t start = 0;                // first element of the shard
  for (std::size_t g = 0; g < lens.size(); ++g) {
    const std::size_t count = static_cast<std::size_t>(lens[g]) * token_elems;
    for (std::size_t b = 0; b < count; b += block) {
      const std::size_t n = std::min(block, count - b);
      T* out = grad.data() + start + b;
      if constexpr (std::is_same_v<Acc, T>) {
        bool first = true;
        for (std::size_t c = 0; c < C; ++c) {
          if (!mask[g * C + c]) continue;
          const T* in = replica.data() + c * slab + start + b;
          if (first) std::copy(in, in + n, out); else for (std::size_t i = 0; i < n; ++i) out[i] = detail::sum_of(out[i], in[i]);
          first = false;
        }
        if (first) std::fill(out, out + n, T{});
      } else {
        Acc acc[block] = {};
        for (std::size_t c = 0; c < C; ++c) {
          if (!mask[g * C + c]) continue;
          const T* in = replica.data() + c * slab + start + b;
          for (std::size_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(in[i]);
        }
        for (std::size_t i = 0; i < n; ++i) out[i] = T(acc[i]);
      }
    }
    start += count;
  }
}

/// combine_copies on raw bytes (below) of a view.
inline void combine_copies(const CombineView& kv_rev, ConstBytes replica, MutableBytes grad, std::size_t token_bytes, ElementType type) {
  const std::size_t es = element_size(type);
  if (token_bytes == 0 || token_bytes % es != 0) {
    fail("combine_copies: token_bytes = ", token_bytes, " is not a positive multiple of the ", es, "-byte ", element_name(type),
         " element");
  }
  auto aligned = [es](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % es == 0; };
  if (!aligned(replica.data()) || !aligned(grad.data())) {
    fail("combine_copies: replica and grad must be aligned to ", es, " bytes for ", element_name(type));
  }
  with_element_type(type, [&]<class T>(T*) {
    detail::combine_copies<T>(kv_rev, std::span<const T>(reinterpret_cast<const T*>(replica.data()), replica.size() / es),
                              std::span<T>(reinterpret_cast<T*>(grad.data()), grad.size() / es), token_bytes / es);
  });
}

}  // namespace detail

/// KV-gradient combine on one rank: `replica` is the [C][T] buffer the
/// reverse KV exchange filled (token = `token_elems` elements), `grad` gets
/// [T]: for each shard, the sum over its copies whose seq_recv_mask is 1, in
/// ascending copy order, accumulated in fp32 for 16-bit types (integers wrap).
template <class T>
void combine_copies(const RankMetadata& kv_rev, std::span<const T> replica, std::span<T> grad, std::size_t token_elems) {
  detail::combine_copies<T>(detail::CombineView(kv_rev), replica, grad, token_elems);
}

/// The same on raw bytes with a runtime element type (token_bytes must be a
/// multiple of the element size and the buffers aligned for it).
inline void combine_copies(const RankMetadata& kv_rev, ConstBytes replica, MutableBytes grad, std::size_t token_bytes,
                           ElementType type) {
  detail::combine_copies(detail::CombineView(kv_rev), replica, grad, token_bytes, type);
}

/// Global-view convenience: the combine for rank `rank` of reverse KV metadata.
template <class T>
void combine_copies(const Metadata& kv_rev, std::int64_t rank, std::span<const T> replica, std::span<T> grad,
                    std::size_t token_elems) {
  detail::check_shapes(kv_rev, "combine_copies: metadata");
  combine_copies<T>(kv_rev.get_slice(rank), replica, grad, token_elems);
}

}  // namespace cpdispatch
