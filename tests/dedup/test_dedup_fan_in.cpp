// The host fan-in of the deduplicated KV exchange against a one-element-at-a-
// time model of section 2c's rule: each wire entry's sum is 0 + copy 0 +
// copy 1 + ... in the accumulator type (fp32 for 16-bit types, integers
// wrap), in copy order, rounded to the element type once. Bit for bit, for
// every element type, 1 to 5 copies (one copy travels as it is), lengths that do and do not fill the
// vector width, the wire and the in-place forms, and bfloat16 values that
// stress the rounding (ties, carries into the exponent, overflow to
// infinity, subnormals, signed zeros, infinities).

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace {

using cpdispatch::bfloat16;
using cpdispatch::float16;
using cpdispatch::KvFanList;
using I = std::int64_t;

/// A fan list over an attention layout of `entries` shards of `len` tokens
/// each with `copies[e]` copies, interleaved (copy c of entry e at token
/// (c * entries + e) * len), the wire back to back.
KvFanList fan_list(const std::vector<int>& copies, I len) {
  KvFanList f;
  const auto n = static_cast<I>(copies.size());
  int most = 0;
  for (int c : copies) most = std::max(most, c);
  f.copy_splits.push_back(0);
  for (I e = 0; e < n; ++e) {
    f.wire_offset.push_back(e * len);
    f.seq_len.push_back(len);
    f.src_rank.push_back(0);
    f.src_shard.push_back(e);
    for (int c = 0; c < copies[static_cast<std::size_t>(e)]; ++c) f.attn_offset.push_back((c * n + e) * len);
    f.copy_splits.push_back(f.attn_offset.size());
  }
  f.wire_tokens = n * len;
  f.attention_tokens = most * n * len;
  return f;
}

/// The model: element by element, in copy order; a single copy travels as it is.
template <class E>
E model_sum(const std::vector<E>& attention, const KvFanList& f, std::size_t e, std::size_t x, std::size_t te) {
  using Acc = cpdispatch::accumulator_t<E>;
  if (f.copy_splits[e + 1] - f.copy_splits[e] == 1) return attention[static_cast<std::size_t>(f.attn_offset[f.copy_splits[e]]) * te + x];
  Acc acc{};
  bool first = true;
  for (std::size_t i = f.copy_splits[e]; i < f.copy_splits[e + 1]; ++i) {
    const E v = attention[static_cast<std::size_t>(f.attn_offset[i]) * te + x];
    if constexpr (std::is_same_v<Acc, E>) {
      acc = first ? v : cpdispatch::detail::sum_of(acc, v);
    } else {
      acc = acc + static_cast<float>(v);  // acc starts at +0, as the rule says
    }
    first = false;
  }
  if constexpr (std::is_same_v<Acc, E>) {
    return acc;
  } else {
    return E(acc);
  }
}

/// bfloat16 patterns at the edges: zeros of both signs, +-1 and neighbours
/// (ties when summed), the largest finite (overflow), infinities, subnormals,
/// the smallest normal, exponent carries.
const std::vector<std::uint16_t> special_bfloat16 = {0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x0001,
                                                     0x8001, 0x007f, 0x0080, 0x3f81, 0x3b80, 0x4000, 0xc000, 0x3c01, 0x7f00};

/// Edge patterns and random ones (no NaN).
std::uint16_t bfloat16_pattern(cpdispatch::Rng& rng) {
  const auto& special = special_bfloat16;
  if (rng.between(0, 3) == 0) return special[static_cast<std::size_t>(rng.between(0, static_cast<I>(special.size()) - 1))];
  std::uint16_t v = 0;
  do v = static_cast<std::uint16_t>(rng.next());
  while ((v & 0x7f80u) == 0x7f80u && (v & 0x7fu) != 0);  // no NaN: a sum of NaNs keeps no fixed payload
  return v;
}

template <class E>
std::vector<E> random_attention(std::size_t n, cpdispatch::Rng& rng) {
  std::vector<E> v(n);
  for (E& x : v) {
    if constexpr (std::is_same_v<E, bfloat16>) {
      x.bits = bfloat16_pattern(rng);
    } else if constexpr (std::is_integral_v<E>) {
      x = static_cast<E>(rng.next());
    } else {
      x = E(static_cast<float>(rng.between(-1000000, 1000000)) / 1e3f);
    }
  }
  return v;
}

template <class E>
bool same_bits(E a, E b) {
  return std::memcmp(&a, &b, sizeof(E)) == 0;
}

/// Wire and in-place fan-in of random lists against the model.
template <class E>
void check_type() {
  cpdispatch::Rng rng(sizeof(E) * 97 + std::is_integral_v<E>);
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t te = static_cast<std::size_t>(rng.between(1, 13));  // elements per token: tails of every size
    const I len = rng.between(1, 9);
    std::vector<int> copies(static_cast<std::size_t>(rng.between(1, 6)));
    for (int& c : copies) c = static_cast<int>(rng.between(1, 5));
    const KvFanList f = fan_list(copies, len);
    const std::vector<E> attention = random_attention<E>(static_cast<std::size_t>(f.attention_tokens) * te, rng);
    std::vector<E> wire(static_cast<std::size_t>(f.wire_tokens) * te);
    cpdispatch::detail::fan_in<E>(f, reinterpret_cast<const std::byte*>(attention.data()), reinterpret_cast<std::byte*>(wire.data()), te);
    std::vector<E> in_place = attention;
    KvFanList in_place_list;
    cpdispatch::detail::fan_in_place_of(f, in_place_list);
    cpdispatch::detail::fan_in<E>(in_place_list, reinterpret_cast<const std::byte*>(in_place.data()), reinterpret_cast<std::byte*>(in_place.data()), te);
    for (std::size_t e = 0; e < copies.size(); ++e) {
      const std::size_t first = static_cast<std::size_t>(f.attn_offset[f.copy_splits[e]]) * te;
      for (std::size_t x = 0; x < static_cast<std::size_t>(len) * te; ++x) {
        const E want = model_sum(attention, f, e, x, te);
        ASSERT_TRUE(same_bits(wire[static_cast<std::size_t>(f.wire_offset[e]) * te + x], want))
            << "trial " << trial << ", wire entry " << e << ", element " << x << " of " << copies[e] << " copies";
        ASSERT_TRUE(same_bits(in_place[first + x], want)) << "trial " << trial << ", in place, entry " << e << ", element " << x;
      }
    }
  }
}

TEST(DedupFanIn, BfloatSixteenMatchesTheModelBitForBit) { check_type<bfloat16>(); }
TEST(DedupFanIn, FloatSixteenMatchesTheModelBitForBit) { check_type<float16>(); }
TEST(DedupFanIn, FloatAndDoubleMatchTheModelBitForBit) {
  check_type<float>();
  check_type<double>();
}
TEST(DedupFanIn, IntegersWrapLikeTheModel) {
  check_type<std::int8_t>();
  check_type<std::uint8_t>();
  check_type<std::int32_t>();
  check_type<std::int64_t>();
}

// Every pair (and triple) of edge patterns, in every position of the vector width.
TEST(DedupFanIn, BfloatSixteenEdgePairs) {
  const auto& v = special_bfloat16;
  const std::size_t n = v.size(), te = n * n * n;
  for (int copies : {2, 3}) {
    std::vector<bfloat16> attention(te * static_cast<std::size_t>(copies));
    for (std::size_t x = 0; x < te; ++x) {
      for (int c = 0; c < copies; ++c) attention[static_cast<std::size_t>(c) * te + x].bits = v[(c == 0 ? x : c == 1 ? x / n : x / (n * n)) % n];
    }
    const KvFanList f = fan_list({copies}, 1);
    std::vector<bfloat16> wire(te);
    cpdispatch::detail::fan_in<bfloat16>(f, reinterpret_cast<const std::byte*>(attention.data()), reinterpret_cast<std::byte*>(wire.data()), te);
    for (std::size_t x = 0; x < te; ++x) {
      ASSERT_TRUE(same_bits(wire[x], model_sum(attention, f, 0, x, te))) << copies << " copies, element " << x << ": " << std::hex
                                                                          << attention[x].bits << " + " << attention[te + x].bits;
    }
  }
}

// Long rows (several of the 512-element fp32 blocks, and the two-copy pass)
// with every bfloat16 pattern but NaNs against the model.
TEST(DedupFanIn, BfloatSixteenLongRowsEveryPattern) {
  for (int copies : {2, 3}) {
    const std::size_t te = 65536 + 5;
    std::vector<bfloat16> attention(te * static_cast<std::size_t>(copies));
    for (std::size_t i = 0; i < attention.size(); ++i) {
      std::uint16_t v = static_cast<std::uint16_t>(i * 40503u + static_cast<std::size_t>(copies) * (i / te));
      if ((v & 0x7f80u) == 0x7f80u && (v & 0x7fu) != 0) v = 0x8000;  // NaN -> -0
      attention[i].bits = v;
    }
    const KvFanList f = fan_list({copies}, 1);
    std::vector<bfloat16> wire(te);
    cpdispatch::detail::fan_in<bfloat16>(f, reinterpret_cast<const std::byte*>(attention.data()), reinterpret_cast<std::byte*>(wire.data()), te);
    for (std::size_t x = 0; x < te; ++x) {
      ASSERT_TRUE(same_bits(wire[x], model_sum(attention, f, 0, x, te))) << copies << " copies, element " << x;
    }
  }
}

// A NaN in a copy makes the sum a quiet NaN (its payload is not fixed).
TEST(DedupFanIn, BfloatSixteenNaNStaysAQuietNaN) {
  for (std::uint16_t nan : {std::uint16_t{0x7fc1}, std::uint16_t{0xff81}, std::uint16_t{0x7f81}}) {
    for (int copies : {2, 3}) {
      const std::size_t te = 19;
      std::vector<bfloat16> attention(te * static_cast<std::size_t>(copies));
      for (std::size_t i = 0; i < attention.size(); ++i) attention[i].bits = i % 3 == 0 ? nan : std::uint16_t{0x3f80};
      std::vector<bfloat16> wire(te);
      cpdispatch::detail::fan_in<bfloat16>(fan_list({copies}, 1), reinterpret_cast<const std::byte*>(attention.data()),
                                           reinterpret_cast<std::byte*>(wire.data()), te);
      for (std::size_t x = 0; x < te; ++x) {
        bool any_nan = false;
        for (int c = 0; c < copies; ++c) any_nan = any_nan || attention[static_cast<std::size_t>(c) * te + x].bits == nan;
        const std::uint16_t got = wire[x].bits;
        if (any_nan) {
          EXPECT_EQ(got & 0x7fc0u, 0x7fc0u) << "element " << x << ": " << std::hex << got;
        } else {
          EXPECT_EQ(got, bfloat16(static_cast<float>(copies)).bits) << "element " << x;
        }
      }
    }
  }
}

}  // namespace
