#pragma once
// The host fan-in of a fan list (docs/plan-format.md, section 2c): for each
// entry, the sum of its copies in the attention layout, written at its wire
// offset. Copy index ascending, fp32 accumulation for 16-bit types (vector
// code where the machine has SSE2, the same bits as the scalar code),
// integers wrap. A fan list whose wire offsets are its entries' first copies
// sums in place (the forward fan-out's reverse): an entry with one copy is
// then left as it is.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace cpdispatch::detail {

/// bfloat16::from_float without a branch (the same bits), so that the
/// fan-in's loops vectorise: round to nearest even, NaN stays a quiet NaN.
inline std::uint16_t bfloat16_bits(float f) noexcept {
  const std::uint32_t x = bits_of_float(f);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (x >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// The host fan-in's bfloat16 kernels. Each sum is 0 + copy 0 + copy 1 + ...
// in fp32, in that order, rounded once (the leading 0 turns a sum of
// negative zeros into +0, as an fp32 accumulator starting at zero does).
// SSE2 does 8 elements at a time (the compiler's own vectorisation of the
// scalar form is 2-3x slower: it cannot see that a bfloat16 is the high half
// of its fp32, nor narrow with one signed pack); the scalar loops do the
// tails, and everything where SSE2 is missing, with the same bits (NaN
// payloads aside: which NaN input's payload a sum of two NaNs keeps is not
// fixed).
#if defined(__SSE2__)
/// 8 bfloat16 -> 2 x 4 fp32 (exact: a bfloat16 is the high half of its fp32).
inline void widen_bfloat16x8(const std::uint16_t* in, __m128& lo, __m128& hi) noexcept {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  lo = _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), v));
  hi = _mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), v));
}

/// bfloat16_bits on 4 lanes, the result sign-extended in each 32-bit lane
/// (so that one signed pack narrows it without saturating).
inline __m128i round_bfloat16x4(__m128 f) noexcept {
  const __m128i x = _mm_castps_si128(f);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(1));
  const __m128i rounded = _mm_add_epi32(_mm_add_epi32(x, _mm_set1_epi32(0x7fff)), lsb);
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(x, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  const __m128i quiet = _mm_or_si128(x, _mm_set1_epi32(0x00400000));
  return _mm_srai_epi32(_mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded)), 16);
}

inline void store_bfloat16x8(std::uint16_t* out, __m128 lo, __m128 hi) noexcept {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_packs_epi32(round_bfloat16x4(lo), round_bfloat16x4(hi)));
}
#endif

/// out = round(0 + a + b): the fan-in of a shard with two copies in one pass.
inline void sum_two_bfloat16(const std::uint16_t* a, const std::uint16_t* b, std::uint16_t* out, std::size_t n) noexcept {
  std::size_t i = 0;
#if defined(__SSE2__)
  for (const std::size_t body = n & ~std::size_t{7}; i < body; i += 8) {
    __m128 alo, ahi, blo, bhi;
    widen_bfloat16x8(a + i, alo, ahi);
    widen_bfloat16x8(b + i, blo, bhi);
    const __m128 zero = _mm_setzero_ps();
    store_bfloat16x8(out + i, _mm_add_ps(_mm_add_ps(zero, alo), blo), _mm_add_ps(_mm_add_ps(zero, ahi), bhi));
  }
#endif
  for (; i < n; ++i) out[i] = bfloat16_bits(0.0f + bfloat16::to_float(a[i]) + bfloat16::to_float(b[i]));
}

/// acc = 0 + in (first copy), or acc += in (the others).
inline void accumulate_bfloat16(const std::uint16_t* in, float* acc, std::size_t n, bool first) noexcept {
  std::size_t i = 0;
#if defined(__SSE2__)
  for (const std::size_t body = n & ~std::size_t{7}; i < body; i += 8) {
    __m128 lo, hi;
    widen_bfloat16x8(in + i, lo, hi);
    const __m128 base_lo = first ? _mm_setzero_ps() : _mm_loadu_ps(acc + i);
    const __m128 base_hi = first ? _mm_setzero_ps() : _mm_loadu_ps(acc + i + 4);
    _mm_storeu_ps(acc + i, _mm_add_ps(base_lo, lo));
    _mm_storeu_ps(acc + i + 4, _mm_add_ps(base_hi, hi));
  }
#endif
  for (; i < n; ++i) acc[i] = (first ? 0.0f : acc[i]) + bfloat16::to_float(in[i]);
}

inline void round_into_bfloat16(const float* acc, std::uint16_t* out, std::size_t n) noexcept {
  std::size_t i = 0;
#if defined(__SSE2__)
  for (const std::size_t body = n & ~std::size_t{7}; i < body; i += 8) store_bfloat16x8(out + i, _mm_loadu_ps(acc + i), _mm_loadu_ps(acc + i + 4));
#endif
  for (; i < n; ++i) out[i] = bfloat16_bits(acc[i]);
}

/// The same for any 16-bit type E (fp32 accumulator), one element at a time.
template <class E>
void accumulate_narrow(const E* in, float* acc, std::size_t n, bool first) noexcept {
  if constexpr (std::is_same_v<E, bfloat16>) {
    accumulate_bfloat16(reinterpret_cast<const std::uint16_t*>(in), acc, n, first);
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = (first ? 0.0f : acc[i]) + E::to_float(in[i].bits);
  }
}

template <class E>
void round_into(const float* acc, E* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<E, bfloat16>) {
    round_into_bfloat16(acc, reinterpret_cast<std::uint16_t*>(out), n);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = E(acc[i]);
  }
}

/// Fan-in of one wire entry with its copies at token offsets `copies` (ascending), `count`
/// elements each: out = their sum, accumulated in accumulator_t<E> (fp32 for
/// 16-bit types; integers wrap). `out` may be the first copy (in place).
template <class E>
void fan_in_entry(const E* attention, std::span<const std::int64_t> copies, std::size_t count, std::size_t token_elems, E* out) {
  const auto row = [&](std::size_t c) { return attention + static_cast<std::size_t>(copies[c]) * token_elems; };
  if (copies.size() == 1) {
    if (out != row(0)) std::memcpy(out, row(0), count * sizeof(E));
    return;
  }
  if constexpr (std::is_same_v<accumulator_t<E>, E>) {
    const E* a = row(0);
    const E* b = row(1);
    for (std::size_t i = 0; i < count; ++i) out[i] = sum_of(a[i], b[i]);
    for (std::size_t c = 2; c < copies.size(); ++c) {
      const E* in = row(c);
      for (std::size_t i = 0; i < count; ++i) out[i] = sum_of(out[i], in[i]);
    }
  } else {
    if constexpr (std::is_same_v<E, bfloat16>) {
      if (copies.size() == 2) {
        sum_two_bfloat16(reinterpret_cast<const std::uint16_t*>(row(0)), reinterpret_cast<const std::uint16_t*>(row(1)),
                         reinterpret_cast<std::uint16_t*>(out), count);
        return;
      }
    }
    constexpr std::size_t block = 512;  // fp32 partial sums on the stack, in L1
    float acc[block];
    for (std::size_t b = 0; b < count; b += block) {
      const std::size_t n = std::min(block, count - b);
      for (std::size_t c = 0; c < copies.size(); ++c) accumulate_narrow<E>(row(c) + b, acc, n, c == 0);
      round_into<E>(acc, out + b, n);
    }
  }
}

/// What the fan-in reads of a fan list, as views of its arrays: they stay
/// valid when the list moves (not when it changes).
struct FanView {
  std::span<const std::int64_t> seq_len, wire_offset, attn_offset;
  std::span<const std::size_t> copy_splits;

  FanView() = default;
  FanView(const KvFanList& f) noexcept  // implicit: a view of it
      : seq_len(f.seq_len), wire_offset(f.wire_offset), attn_offset(f.attn_offset), copy_splits(f.copy_splits) {}
  std::size_t num_entries() const noexcept { return seq_len.size(); }
  std::span<const std::int64_t> copies(std::size_t e) const noexcept { return attn_offset.subspan(copy_splits[e], copy_splits[e + 1] - copy_splits[e]); }
};

/// The fan-in of a whole fan list: attention-layout gradients -> wire buffer.
template <class E>
void fan_in(const FanView& fan, const std::byte* attention, std::byte* wire, std::size_t token_elems) {
  const E* in = reinterpret_cast<const E*>(attention);
  E* out = reinterpret_cast<E*>(wire);
  for (std::size_t e = 0; e < fan.num_entries(); ++e) {
    fan_in_entry<E>(in, fan.copies(e), static_cast<std::size_t>(fan.seq_len[e]) * token_elems, token_elems,
                    out + static_cast<std::size_t>(fan.wire_offset[e]) * token_elems);
  }
}

}  // namespace cpdispatch::detail
