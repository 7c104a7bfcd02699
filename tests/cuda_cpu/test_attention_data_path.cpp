// AttentionDataPath<MemorySpace::device> (cuda/attention_data_path.hpp)
// against the host path of attention/data_path.hpp on random inputs:
// copies, the fan-in in place and into a wire buffer, the home combine, fill and zero, accumulate
// and store, the invariant mode's max_abs and round_exact bit for bit; the log-sum-exp merge within 1e-6 (the device's
// expf/logf), with rows the part did not see left alone; and plans
// replaced by larger ones. Each data set depends on the harness's seed.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/data_path.hpp"
#include "cpdispatch/cuda/attention_data_path.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cuda_runtime.h"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::bfloat16;
using cpdispatch::ElementType;
using cpdispatch::float16;
using cpdispatch::KvFanList;
using cpdispatch::MemorySpace;
using cpdispatch::cuda::DeviceBuffer;
using Bytes = std::vector<std::byte>;
using HostPath = cpdispatch::AttentionDataPath<MemorySpace::host>;
using DevicePath = cpdispatch::AttentionDataPath<MemorySpace::device>;

/// A device transport as far as the data path needs one.
struct StreamTransport {
  cudaStream_t s;
  cudaStream_t stream() const { return s; }
};

std::mt19937_64 rng_for(std::uint64_t salt) { return std::mt19937_64(cuda_harness::seed() * 1000003u + salt); }

/// A random float: mostly in [-4, 4), some far larger or smaller, some zeros of either sign.
float rough(std::mt19937_64& rng) {
  const std::uint64_t r = rng();
  const float v = static_cast<float>(static_cast<std::int64_t>(r >> 40) - (std::int64_t{1} << 23)) / static_cast<float>(1 << 21);
  switch (r % 16) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return v * 1e-30f;  // subnormal once rounded to a 16-bit type (or fp32 products)
    case 3: return v * 3e4f;    // near the top of float16
    default: return v;
  }
}

template <class E>
E to_e(float x) {
  if constexpr (std::is_same_v<E, float>) return x;
  else if constexpr (std::is_integral_v<E>) return static_cast<E>(x * 1e6f);  // wraps in the sums: integers must too
  else return E(x);
}

template <class E>
std::vector<E> random_values(std::size_t n, std::uint64_t salt) {
  std::mt19937_64 rng = rng_for(salt);
  std::vector<E> v(n);
  for (E& x : v) x = to_e<E>(rough(rng));
  return v;
}

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& host, std::size_t extra = 0) {
  DeviceBuffer<T> d(std::max<std::size_t>(host.size() + extra, 1));
  if (!host.empty()) CPDISPATCH_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  cptest::device_sync();
  return d;
}

template <class T>
std::vector<T> download(const T* device, std::size_t n) {
  cptest::device_sync();
  std::vector<T> host(n);
  if (n) CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template <class T>
Bytes bytes_of(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class E>
constexpr ElementType type_of() {
  if constexpr (std::is_same_v<E, float>) return ElementType::float32;
  else if constexpr (std::is_same_v<E, bfloat16>) return ElementType::bfloat16;
  else if constexpr (std::is_same_v<E, std::int64_t>) return ElementType::int64;
  else return ElementType::float16;
}

class AttentionDataPathTest : public ::testing::Test {
 protected:
  cpdispatch::cuda::Stream stream;
  StreamTransport transport{stream.get()};
};

// ---- copies -----------------------------------------------------------------------

/// Random pieces of a src_bytes source into disjoint places of a destination; returns its size.
std::size_t random_pieces(std::vector<cpdispatch::detail::CopyPiece>& pieces, std::size_t count, std::size_t src_bytes, std::uint64_t salt) {
  std::mt19937_64 rng = rng_for(salt);
  std::size_t at = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t len = i % 7 == 0 ? 16384 + rng() % 20000 : rng() % 300;  // across copy chunks, and within one
    pieces.push_back({rng() % (src_bytes - len), at + rng() % 17, len});
    at = pieces.back().dst + len;
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  return at + 32;
}

TEST_F(AttentionDataPathTest, CopiesMatchTheHostPath) {
  HostPath host(transport);
  DevicePath device(transport);
  const Bytes src = cptest::pattern(60000, cuda_harness::seed());
  std::vector<std::vector<cpdispatch::detail::CopyPiece>> lists(3);
  std::vector<std::size_t> dst_bytes;
  for (std::size_t i = 0; i < lists.size(); ++i) dst_bytes.push_back(random_pieces(lists[i], i == 1 ? 0 : 20 + 10 * i, src.size(), 10 + i));
  for (const auto& l : lists) {
    const std::size_t h = host.add_copies(l), d = device.add_copies(l);
    EXPECT_EQ(h, d);
  }
  host.commit();
  device.commit();
  const auto d_src = upload(src);
  for (std::size_t i = 0; i < lists.size(); ++i) {
    Bytes expect = cptest::pattern(dst_bytes[i], 99 + i);
    const auto d_dst = upload(expect);
    host.copy(i, src.data(), expect.data());
    device.copy(i, d_src.data(), d_dst.data());
    EXPECT_EQ(download(d_dst.data(), expect.size()), expect) << "list " << i;
  }
  EXPECT_THROW(device.copy(lists.size(), d_src.data(), d_src.data()), cpdispatch::invalid_input);
}

// ---- the fan-in, in place -----------------------------------------------------------

/// A fan list for the in-place fan-in: `entries` shards of 1..max_len tokens
/// with 2..4 copies each, at disjoint places of an attention layout (with
/// gaps), each entry's wire offset at its first copy. With `no_ops`, also
/// shards with one copy (at its wire offset: nothing to do) and empty ones.
KvFanList in_place_fan_list(std::size_t entries, std::int64_t max_len, bool no_ops, std::uint64_t salt) {
  std::mt19937_64 rng = rng_for(salt);
  struct Shard {
    std::int64_t len;
    std::size_t copies;
  };
  std::vector<Shard> shards;
  for (std::size_t e = 0; e < entries; ++e) {
    const bool single = no_ops && e % 4 == 3;
    shards.push_back({no_ops && e % 5 == 4 ? 0 : 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_len)),
                      single ? 1 : 2 + static_cast<std::size_t>(rng() % 3)});
  }
  // Every copy of every shard is a slot; slots are laid out in random order.
  std::vector<std::pair<std::size_t, std::size_t>> slots;  // (entry, copy)
  for (std::size_t e = 0; e < shards.size(); ++e)
    for (std::size_t c = 0; c < shards[e].copies; ++c) slots.emplace_back(e, c);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<std::vector<std::int64_t>> at(shards.size());
  std::int64_t tokens = 0;
  for (const auto& [e, c] : slots) {
    tokens += static_cast<std::int64_t>(rng() % 3);  // a gap the fan-in must not touch
    at[e].push_back(tokens);
    tokens += shards[e].len;
  }
  KvFanList fan;
  fan.copy_splits.push_back(0);
  for (std::size_t e = 0; e < shards.size(); ++e) {
    std::sort(at[e].begin(), at[e].end());
    fan.wire_offset.push_back(at[e][0]);
    fan.seq_len.push_back(shards[e].len);
    fan.src_rank.push_back(0);
    fan.src_shard.push_back(static_cast<std::int64_t>(e));
    fan.attn_offset.insert(fan.attn_offset.end(), at[e].begin(), at[e].end());
    fan.copy_splits.push_back(fan.attn_offset.size());
    fan.wire_tokens += shards[e].len;
  }
  fan.attention_tokens = tokens + 2;
  return fan;
}

template <class E>
void check_fan_in(DevicePath& device, HostPath& host, std::size_t id, const KvFanList& fan, std::size_t token_elems, std::size_t shift,
                  std::uint64_t salt) {
  const std::size_t elems = static_cast<std::size_t>(fan.attention_tokens) * token_elems;
  std::vector<E> expect = random_values<E>(elems, salt);
  std::vector<E> shifted(shift, to_e<E>(7.0f));
  shifted.insert(shifted.end(), expect.begin(), expect.end());
  const auto d = upload(shifted);
  host.fan_in(id, type_of<E>(), reinterpret_cast<std::byte*>(expect.data()));
  device.fan_in(id, type_of<E>(), reinterpret_cast<std::byte*>(d.data() + shift));
  const std::vector<E> got = download(d.data(), shifted.size());
  EXPECT_EQ(bytes_of(std::vector<E>(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(shift))), bytes_of(std::vector<E>(shift, to_e<E>(7.0f))));
  EXPECT_EQ(bytes_of(std::vector<E>(got.begin() + static_cast<std::ptrdiff_t>(shift), got.end())), bytes_of(expect));
}

template <class E>
void fan_in_case(StreamTransport& transport, bool no_ops) {
  for (std::size_t token_elems : {std::size_t{3}, std::size_t{64}, std::size_t{1100}}) {  // odd rows; 8 KiB chunks crossed
    for (std::size_t shift : {std::size_t{0}, std::size_t{1}}) {                         // 16-byte accesses, or scalar ones
      SCOPED_TRACE(std::string(cpdispatch::element_name(type_of<E>())) + " token_elems " + std::to_string(token_elems) + " shift " +
                   std::to_string(shift) + (no_ops ? " with no-op entries" : ""));
      HostPath host(transport);
      DevicePath device(transport);
      const std::size_t token_bytes = token_elems * sizeof(E);
      const KvFanList a = in_place_fan_list(9, token_elems > 100 ? 4 : 6, no_ops, 20 + token_elems);
      const KvFanList b = in_place_fan_list(3, 2, no_ops, 30 + token_elems);
      ASSERT_EQ(device.add_fan_in_place(a, token_bytes), host.add_fan_in_place(a, token_bytes));
      ASSERT_EQ(device.add_fan_in_place(b, token_bytes), host.add_fan_in_place(b, token_bytes));
      host.commit();
      device.commit();
      check_fan_in<E>(device, host, 0, a, token_elems, shift, 40 + token_elems);
      check_fan_in<E>(device, host, 1, b, token_elems, shift, 50 + token_elems);
    }
  }
}

TEST_F(AttentionDataPathTest, FanInInPlaceMatchesTheHostPathBitForBit) {
  fan_in_case<float>(transport, false);
  fan_in_case<bfloat16>(transport, false);
  fan_in_case<float16>(transport, false);
}

TEST_F(AttentionDataPathTest, FanInLeavesNoOpEntriesAsTheHostDoes) {
  fan_in_case<float>(transport, true);
  fan_in_case<bfloat16>(transport, true);
}

TEST_F(AttentionDataPathTest, FanInRefusesMisalignedBuffers) {
  DevicePath device(transport);
  const KvFanList fan = in_place_fan_list(2, 2, false, 5);
  device.add_fan_in_place(fan, 3 * sizeof(float));
  device.commit();
  DeviceBuffer<float> d(static_cast<std::size_t>(fan.attention_tokens) * 3 + 1);
  EXPECT_THROW(device.fan_in(0, ElementType::float32, reinterpret_cast<std::byte*>(d.data()) + 2), cpdispatch::invalid_input);
  EXPECT_THROW(device.fan_in(1, ElementType::float32, reinterpret_cast<std::byte*>(d.data())), cpdispatch::invalid_input);
}

// ---- the fan-in into a wire buffer ---------------------------------------------------

/// `fan`'s entries summed into a wire buffer of their own, back to back. An
/// entry with one copy reads it from its own wire offset in the attention
/// layout (the sources may overlap: they are only read), so that a fan-in
/// that took it for an in-place no-op would leave its wire tokens unwritten.
KvFanList into_wire(KvFanList fan) {
  std::int64_t at = 0;
  for (std::size_t e = 0; e < fan.num_entries(); ++e) {
    fan.wire_offset[e] = at;
    if (fan.copies(e).size() == 1) fan.attn_offset[fan.copy_splits[e]] = at;
    at += fan.seq_len[e];
  }
  fan.wire_tokens = at;
  return fan;
}

template <class E>
void fan_in_into_wire_case(StreamTransport& transport) {
  for (std::size_t token_elems : {std::size_t{3}, std::size_t{64}}) {
    SCOPED_TRACE(std::string(cpdispatch::element_name(type_of<E>())) + " token_elems " + std::to_string(token_elems));
    HostPath host(transport);
    DevicePath device(transport);
    const std::size_t token_bytes = token_elems * sizeof(E);
    const KvFanList fan = into_wire(in_place_fan_list(11, 5, true, 60 + token_elems));  // with single copies: copied, not summed
    ASSERT_EQ(device.add_fan_in(fan, token_bytes), host.add_fan_in(fan, token_bytes));
    host.commit();
    device.commit();
    const std::vector<E> attention = random_values<E>(static_cast<std::size_t>(fan.attention_tokens) * token_elems, 70 + token_elems);
    std::vector<E> expect(static_cast<std::size_t>(fan.wire_tokens) * token_elems, to_e<E>(7.0f));
    const auto d_attention = upload(attention), d_wire = upload(expect);
    host.fan_in(0, type_of<E>(), reinterpret_cast<const std::byte*>(attention.data()), reinterpret_cast<std::byte*>(expect.data()));
    device.fan_in(0, type_of<E>(), reinterpret_cast<const std::byte*>(d_attention.data()), reinterpret_cast<std::byte*>(d_wire.data()));
    EXPECT_EQ(bytes_of(download(d_wire.data(), expect.size())), bytes_of(expect));
    EXPECT_EQ(bytes_of(download(d_attention.data(), attention.size())), bytes_of(attention)) << "the source is only read";
  }
}

TEST_F(AttentionDataPathTest, FanInIntoAWireBufferMatchesTheHostPathBitForBit) {
  fan_in_into_wire_case<float>(transport);
  fan_in_into_wire_case<bfloat16>(transport);
  fan_in_into_wire_case<std::int64_t>(transport);
}

TEST_F(AttentionDataPathTest, AnInPlaceFanInRefusesTwoBuffers) {
  DevicePath device(transport);
  const KvFanList fan = in_place_fan_list(2, 2, false, 5);
  device.add_fan_in_place(fan, 3 * sizeof(float));
  device.commit();
  const std::size_t n = static_cast<std::size_t>(fan.attention_tokens) * 3;
  DeviceBuffer<float> a(n), b(n);
  const auto* from = reinterpret_cast<const std::byte*>(a.data());
  EXPECT_THROW(device.fan_in(0, ElementType::float32, from, reinterpret_cast<std::byte*>(b.data())), cpdispatch::invalid_input);
}

// ---- the home combine -----------------------------------------------------------------

template <class E>
void check_combine(DevicePath& device, HostPath& host, std::size_t id, const cpdispatch::RankMetadata& rev, std::size_t sends,
                   std::size_t token_elems, std::uint64_t salt) {
  const std::size_t token_bytes = token_elems * sizeof(E);
  const std::vector<E> replica = random_values<E>(static_cast<std::size_t>(rev.output_tokens()) * token_elems, salt);
  std::vector<E> expect(sends * token_elems, to_e<E>(5.0f));
  const auto d_replica = upload(replica);
  const auto d_grad = upload(expect);
  host.combine(id, type_of<E>(), reinterpret_cast<const std::byte*>(replica.data()), replica.size() * sizeof(E),
               reinterpret_cast<std::byte*>(expect.data()), expect.size() * sizeof(E));
  device.combine(id, type_of<E>(), reinterpret_cast<const std::byte*>(d_replica.data()), replica.size() * sizeof(E),
                 reinterpret_cast<std::byte*>(d_grad.data()), expect.size() * sizeof(E));
  EXPECT_EQ(bytes_of(download(d_grad.data(), expect.size())), bytes_of(expect)) << "token_bytes " << token_bytes;
}

template <class E>
void combine_case(StreamTransport& transport) {
  const int W = 3;
  for (const auto& c : cptest::pair_cases(W, 9 + cuda_harness::seed())) {
    if (!c.kv) continue;
    SCOPED_TRACE(c.name + " " + cpdispatch::element_name(type_of<E>()));
    for (int r = 0; r < W; ++r) {
      const cpdispatch::RankMetadata rev = c.rev.get_slice(r);
      const auto sends = static_cast<std::size_t>(c.fwd.send_tokens(r));
      HostPath host(transport);
      DevicePath device(transport);
      for (std::size_t token_elems : {std::size_t{5}, std::size_t{2100}}) {
        ASSERT_EQ(device.add_combine(rev, token_elems * sizeof(E)), host.add_combine(rev, token_elems * sizeof(E)));
      }
      host.commit();
      device.commit();
      check_combine<E>(device, host, 0, rev, sends, 5, 60 + static_cast<std::uint64_t>(r));
      check_combine<E>(device, host, 1, rev, sends, 2100, 70 + static_cast<std::uint64_t>(r));
    }
  }
}

TEST_F(AttentionDataPathTest, CombineMatchesTheHostPathBitForBit) {
  combine_case<float>(transport);
  combine_case<bfloat16>(transport);
  combine_case<float16>(transport);
}

// ---- fill, zero -------------------------------------------------------------------------

TEST_F(AttentionDataPathTest, FillAndZeroMatchTheHostPath) {
  HostPath host(transport);
  DevicePath device(transport);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{257}, std::size_t{70000}}) {
    std::vector<float> expect = random_values<float>(n + 3, 80 + n);
    const auto d = upload(expect);
    host.fill(expect.data() + 1, n, -1.5f);
    device.fill(d.data() + 1, n, -1.5f);
    EXPECT_EQ(bytes_of(download(d.data(), expect.size())), bytes_of(expect)) << "fill " << n;

    Bytes zeroed = cptest::pattern(n + 5, 90 + n);
    const auto z = upload(zeroed);
    host.zero(zeroed.data() + 3, n);
    device.zero(z.data() + 3, n);
    EXPECT_EQ(download(z.data(), zeroed.size()), zeroed) << "zero " << n;
  }
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> lse(5, 0.0f);
  const auto d = upload(lse);
  device.fill(d.data(), lse.size(), -inf);
  for (float x : download(d.data(), lse.size())) EXPECT_EQ(x, -inf);
}

// ---- the merge ---------------------------------------------------------------------------

template <class E>
void merge_case(StreamTransport& transport) {
  const float inf = std::numeric_limits<float>::infinity();
  struct Shape {
    std::int64_t tokens, heads, dim;
  };
  for (const Shape s : {Shape{37, 3, 40}, Shape{5, 2, 1}, Shape{9, 4, 128}, Shape{4, 2, 0}, Shape{0, 3, 8}}) {
    SCOPED_TRACE(std::string(cpdispatch::element_name(type_of<E>())) + " " + std::to_string(s.tokens) + " x " + std::to_string(s.heads) + " x " +
                 std::to_string(s.dim));
    HostPath host(transport);
    DevicePath device(transport);
    const auto rows = static_cast<std::size_t>(s.tokens * s.heads), n = rows * static_cast<std::size_t>(s.dim);
    const std::uint64_t salt = 100 + static_cast<std::uint64_t>(s.tokens * 1000 + s.dim);
    std::vector<float> acc = random_values<float>(n, salt), lse(rows), lse_part(rows);
    const std::vector<E> part = random_values<E>(n, salt + 1);
    std::mt19937_64 rng = rng_for(salt + 2);
    // Rows of each kind: the part unseen (-inf), the running lse -inf (takes the part), both finite.
    std::vector<int> kind(rows);
    for (std::size_t l = 0; l < rows; ++l) {
      kind[l] = static_cast<int>(rng() % 4);
      lse[l] = kind[l] == 1 ? -inf : std::ldexp(static_cast<float>(rng() % 20000) - 10000.0f, -10);
      lse_part[l] = kind[l] == 0 ? -inf : std::ldexp(static_cast<float>(rng() % 20000) - 10000.0f, -10);
    }
    const auto d_acc = upload(acc), d_lse = upload(lse), d_lse_part = upload(lse_part);
    const auto d_part = upload(part);
    const std::vector<float> acc0 = acc, lse0 = lse;
    host.merge<E>(acc.data(), lse.data(), part.data(), lse_part.data(), s.tokens, s.heads, s.dim);
    device.merge<E>(d_acc.data(), d_lse.data(), d_part.data(), d_lse_part.data(), s.tokens, s.heads, s.dim);
    const std::vector<float> got = download(d_acc.data(), n), got_lse = download(d_lse.data(), rows);
    auto close = [](float a, float b) {
      return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || std::fabs(a - b) <= 1e-6f * std::max(std::fabs(a), std::fabs(b));
    };
    const auto D = static_cast<std::size_t>(s.dim);
    for (std::int64_t j = 0; j < s.tokens; ++j) {
      for (std::int64_t h = 0; h < s.heads; ++h) {
        const auto l = static_cast<std::size_t>(h * s.tokens + j), at = static_cast<std::size_t>(j * s.heads + h) * D;
        EXPECT_TRUE(close(got_lse[l], lse[l])) << "lse " << l << ": " << got_lse[l] << " vs " << lse[l];
        if (kind[l] == 0) {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(got_lse[l]), std::bit_cast<std::uint32_t>(lse0[l])) << "row " << l << " changed";
        }
        if (kind[l] == 1) {
          EXPECT_EQ(got_lse[l], lse_part[l]);
        }
        for (std::size_t d = 0; d < D; ++d) {
          EXPECT_TRUE(close(got[at + d], acc[at + d])) << "row " << l << " d " << d << ": " << got[at + d] << " vs " << acc[at + d];
          if (kind[l] == 0) {
            EXPECT_EQ(std::bit_cast<std::uint32_t>(got[at + d]), std::bit_cast<std::uint32_t>(acc0[at + d])) << "row " << l << " changed";
          }
          if (kind[l] == 1) {
            EXPECT_EQ(got[at + d], cpdispatch::detail::to_f32(part[at + d])) << "row " << l << " did not take the part";
          }
        }
      }
    }
  }
}

TEST_F(AttentionDataPathTest, MergeMatchesTheHostPath) {
  merge_case<float>(transport);
  merge_case<bfloat16>(transport);
  merge_case<float16>(transport);
}

// ---- accumulate, store --------------------------------------------------------------------

/// Values that round every way to a 16-bit type: ties, overflow, subnormals, infinities, NaN.
std::vector<float> rounding_values(std::size_t n, std::uint64_t salt) {
  std::mt19937_64 rng = rng_for(salt);
  std::vector<float> v(n);
  for (float& x : v) {
    const std::uint64_t r = rng();
    switch (r % 8) {
      case 0: x = std::bit_cast<float>((static_cast<std::uint32_t>(rng()) & 0xffff8000u) | 0x00008000u); break;  // a bf16 tie
      case 1: x = std::bit_cast<float>((static_cast<std::uint32_t>(rng()) & 0xffffe000u) | 0x00001000u); break;  // an fp16 tie (if in range)
      case 2: x = std::ldexp(rough(rng), -static_cast<int>(r % 30)); break;                                     // fp16 subnormals
      case 3: x = 65520.0f * (r & 8 ? 1.0f : -1.0f); break;                                                      // rounds to infinity in fp16
      case 4: x = r & 8 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN(); break;
      default: x = std::bit_cast<float>(static_cast<std::uint32_t>(rng())); break;  // any bits
    }
  }
  return v;
}

template <class E>
void accumulate_and_store_case(StreamTransport& transport) {
  HostPath host(transport);
  DevicePath device(transport);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{300}, std::size_t{40000}}) {
    SCOPED_TRACE(std::string(cpdispatch::element_name(type_of<E>())) + " n " + std::to_string(n));
    std::vector<float> acc = random_values<float>(n, 200 + n);
    const std::vector<E> part = random_values<E>(n, 210 + n);
    const auto d_acc = upload(acc);
    const auto d_part = upload(part);
    host.accumulate<E>(acc.data(), part.data(), n);
    device.accumulate<E>(d_acc.data(), d_part.data(), n);
    EXPECT_EQ(bytes_of(download(d_acc.data(), n)), bytes_of(acc));

    const std::vector<float> values = rounding_values(n, 220 + n);
    std::vector<E> out(n + 1, to_e<E>(3.0f));
    const auto d_values = upload(values);
    const auto d_out = upload(out);
    host.store<E>(values.data(), out.data(), n);
    device.store<E>(d_values.data(), d_out.data(), n);
    EXPECT_EQ(bytes_of(download(d_out.data(), n + 1)), bytes_of(out));
  }
}

TEST_F(AttentionDataPathTest, AccumulateAndStoreMatchTheHostPathBitForBit) {
  accumulate_and_store_case<float>(transport);
  accumulate_and_store_case<bfloat16>(transport);
  accumulate_and_store_case<float16>(transport);
}

// ---- the invariant mode's: max_abs, round_exact ------------------------------------------

template <class E>
void max_abs_and_round_exact_case(StreamTransport& transport) {
  HostPath host(transport);
  DevicePath device(transport);
  // Past one block's partial maxima, and (float) past the first pass's 1024 blocks of threads.
  std::vector<std::size_t> sizes = {0, 1, 300, 70000};
  if (std::is_same_v<E, float>) sizes.push_back(270000);
  for (std::size_t n : sizes) {
    SCOPED_TRACE(std::string(cpdispatch::element_name(type_of<E>())) + " n " + std::to_string(n));
    std::mt19937_64 rng = rng_for(300 + n);
    std::vector<E> x(n);
    for (E& e : x) e = to_e<E>(std::ldexp(static_cast<float>(static_cast<std::int64_t>(rng() >> 41)) - 0x1p22f, -22));  // [-1, 1)
    for (std::size_t at : {std::size_t{0}, n / 2, n - 1}) {  // the largest value first, inside, last
      if (n == 0) break;
      std::vector<E> spiked = x;
      spiked[at] = to_e<E>(-1000.0f);  // exact in every type
      const auto d = upload(spiked);
      EXPECT_EQ(device.max_abs<E>(d.data(), n), 1000.0) << "at " << at;
      EXPECT_EQ(host.max_abs<E>(spiked.data(), n), 1000.0) << "at " << at;
      spiked[at] = to_e<E>(std::numeric_limits<float>::quiet_NaN());  // then larger values after it, on any thread
      const auto d_nan = upload(spiked);
      EXPECT_TRUE(std::isnan(device.max_abs<E>(d_nan.data(), n))) << "NaN at " << at;
    }
    const auto d = upload(x);
    EXPECT_EQ(device.max_abs<E>(d.data(), n), host.max_abs<E>(x.data(), n));

    std::vector<std::int64_t> exact(n);
    for (std::int64_t& v : exact) v = static_cast<std::int64_t>(rng()) >> (2 + rng() % 60);
    const auto d_exact = upload(exact);
    for (int exponent : {-90, -40, 0}) {
      std::vector<E> out(n + 1, to_e<E>(3.0f));
      const auto d_out = upload(out);
      host.round_exact<E>(exact.data(), exponent, out.data(), n);
      device.round_exact<E>(d_exact.data(), exponent, d_out.data(), n);
      EXPECT_EQ(bytes_of(download(d_out.data(), n + 1)), bytes_of(out)) << "exponent " << exponent;
    }
  }
}

TEST_F(AttentionDataPathTest, MaxAbsAndRoundExactMatchTheHostPath) {
  max_abs_and_round_exact_case<float>(transport);
  max_abs_and_round_exact_case<bfloat16>(transport);
  max_abs_and_round_exact_case<float16>(transport);
}

// ---- buffers, plans ------------------------------------------------------------------------

TEST_F(AttentionDataPathTest, BuffersGrowAndKeepALiveAllocation) {
  DevicePath::buffer<float> b;
  EXPECT_EQ(b.data(), nullptr);
  b.resize(0);
  EXPECT_NE(b.data(), nullptr);  // never a zero-byte allocation
  EXPECT_EQ(b.size(), 0u);
  b.resize(100);
  const float* at = b.data();
  EXPECT_EQ(b.size(), 100u);
  b.resize(10);
  EXPECT_EQ(b.size(), 10u);
  b.resize(100);
  EXPECT_EQ(b.data(), at);  // fits: no new allocation
  b.reserve(1000);
  EXPECT_EQ(b.size(), 100u);
  at = b.data();
  b.resize(1000);
  EXPECT_EQ(b.data(), at);
  DevicePath device(transport);
  device.fill(b.data(), b.size(), 2.0f);
  for (float x : download(b.data(), b.size())) ASSERT_EQ(x, 2.0f);
}

/// One plan of every kind of list, run on both paths: copies, a fan-in, a combine.
template <class E>
void run_plan(DevicePath& device, HostPath& host, std::size_t scale, std::uint64_t salt) {
  device.clear();
  host.clear();
  const Bytes src = cptest::pattern(50000, salt);
  std::vector<cpdispatch::detail::CopyPiece> pieces;
  const std::size_t dst_bytes = random_pieces(pieces, 8 * scale, src.size(), salt);
  const KvFanList fan = in_place_fan_list(4 * scale, 3, false, salt + 1);
  const auto c = cptest::pair_cases(3, salt)[1];  // "kv"
  const cpdispatch::RankMetadata rev = c.rev.get_slice(1);
  const std::size_t token_elems = 16 * scale;
  ASSERT_EQ(device.add_copies(pieces), 0u);
  ASSERT_EQ(device.add_fan_in_place(fan, token_elems * sizeof(E)), 0u);
  ASSERT_EQ(device.add_combine(rev, token_elems * sizeof(E)), 0u);
  host.add_copies(pieces);
  host.add_fan_in_place(fan, token_elems * sizeof(E));
  host.add_combine(rev, token_elems * sizeof(E));
  device.commit();
  host.commit();

  Bytes expect = cptest::pattern(dst_bytes, salt + 2);
  const auto d_src = upload(src), d_dst = upload(expect);
  host.copy(0, src.data(), expect.data());
  device.copy(0, d_src.data(), d_dst.data());
  EXPECT_EQ(download(d_dst.data(), expect.size()), expect);
  check_fan_in<E>(device, host, 0, fan, token_elems, 0, salt + 3);
  check_combine<E>(device, host, 0, rev, static_cast<std::size_t>(c.fwd.send_tokens(1)), token_elems, salt + 4);
}

TEST_F(AttentionDataPathTest, APlanReplacedByALargerOneWorks) {
  HostPath host(transport);
  DevicePath device(transport);
  {
    SCOPED_TRACE("first plan");
    run_plan<bfloat16>(device, host, 1, 300);
  }
  {
    SCOPED_TRACE("second, larger plan");
    run_plan<bfloat16>(device, host, 3, 400);
  }
  {
    SCOPED_TRACE("third plan, float");
    run_plan<float>(device, host, 2, 500);
  }
  device.clear();
  EXPECT_THROW(device.copy(0, nullptr, nullptr), cpdispatch::invalid_input);
}

}  // namespace
