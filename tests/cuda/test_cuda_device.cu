// The CUDA data path on a GPU: the kernels, and the dispatcher over the
// single-GPU simulation (W virtual ranks), byte-identical to the host
// simulation; the device sim's collectives identical to the host sim's; a
// CUDA graph of a whole multi-rank forward + reverse step replays the same
// bytes. Without a CUDA device every test skips ("no CUDA device").

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

// The device data path first: the dispatcher needs it for device transports.
#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::ElementType;
using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::DeviceSimOptions;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cptest::Bytes;
using cptest::cbytes;
using cptest::mbytes;
using cptest::to_device;
using cptest::to_host;
using ::testing::HasSubstr;

using DeviceBytesBuffer = DeviceBuffer<std::byte>;

DeviceSimOptions guarded() { return DeviceSimOptions{std::chrono::milliseconds(60000), -1}; }

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// n elements of `type` with values that do not add up exactly (rounding
/// order matters), finite: the host and the device must agree bit for bit.
Bytes rough_floats(std::size_t n_bytes, std::uint64_t salt, ElementType type) {
  const std::size_t es = cpdispatch::element_size(type);
  Bytes out(n_bytes);
  for (std::size_t i = 0; i < n_bytes / es; ++i) {
    const auto h = mix(salt * 1315423911u + i);
    const float v = static_cast<float>(static_cast<std::int64_t>(h % 200001) - 100000) * 1.37e-3f + static_cast<float>((h >> 40) % 7) * 1e-7f;
    std::byte* p = out.data() + i * es;
    switch (type) {
      case ElementType::float32: std::memcpy(p, &v, 4); break;
      case ElementType::float64: { const double d = static_cast<double>(v) * 1.000000123; std::memcpy(p, &d, 8); break; }
      case ElementType::bfloat16: { const cpdispatch::bfloat16 b(v); std::memcpy(p, &b, 2); break; }
      case ElementType::float16: { const cpdispatch::float16 b(v * 0.01f); std::memcpy(p, &b, 2); break; }
      default: break;  // floats only: integer tests use cptest::pattern
    }
  }
  return out;
}

// ---- the kernels' per-warp logic, run lane by lane on the host (no GPU) ------------
// The lanes of a warp share nothing, so lanes 0..31 one after another do
// what the warp does: these check the kernels' indexing, alignment choices
// and arithmetic on any CPU.

/// Host memory with a 64-byte aligned start, so that tests choose the misalignment.
struct AlignedBytes {
  explicit AlignedBytes(std::size_t n) : storage(n + 64) {}
  std::byte* data() { return storage.data() + (64 - reinterpret_cast<std::uintptr_t>(storage.data()) % 64) % 64; }
  std::vector<std::byte> storage;
};

TEST(WarpLogicOnTheHost, CopyChunksOfEveryLengthAndRelativeAlignment) {
  const Bytes src = cptest::pattern(70000, 5);
  AlignedBytes s(src.size() + 16);
  for (std::size_t src_base = 0; src_base < 16; ++src_base) {
    for (std::size_t dst_base : {0u, 1u, 2u, 4u, 7u, 8u, 13u}) {
      std::memcpy(s.data() + src_base, src.data(), src.size());
      std::vector<cpdispatch::detail::CopyPiece> pieces;
      std::size_t at = 0;
      for (std::uint64_t i = 0; i < 60; ++i) {
        const std::uint64_t h = mix(i + 1000 * src_base + dst_base);
        const std::size_t len = i % 12 == 0 ? 16384 + h % 30000 : h % 300;  // across chunk boundaries and inside one
        pieces.push_back({(h >> 20) % (src.size() - len), at + (h >> 40) % 17, len});
        at = pieces.back().dst + len;
      }
      Bytes expect = cptest::pattern(at + 32, 6);
      AlignedBytes d(expect.size() + 16);
      std::memcpy(d.data() + dst_base, expect.data(), expect.size());
      for (const auto& p : pieces) std::memcpy(expect.data() + p.dst, src.data() + p.src, p.bytes);
      const auto* sb = reinterpret_cast<const unsigned char*>(s.data() + src_base);
      auto* db = reinterpret_cast<unsigned char*>(d.data() + dst_base);
      for (const auto& c : cpdispatch::cuda::plan_copy_chunks(pieces))
        for (unsigned lane = 0; lane < 32; ++lane) cpdispatch::cuda::kernels::copy_chunk(sb + c.src, db + c.dst, c.bytes, lane);
      ASSERT_EQ(Bytes(d.data() + dst_base, d.data() + dst_base + expect.size()), expect) << "bases " << src_base << "/" << dst_base;
    }
  }
}

template <ElementType E>
void combine_on_host(const cpdispatch::RankMetadata& rev, const std::byte* replica, std::byte* grad, std::size_t token_bytes) {
  const auto n = cpdispatch::cuda::normalize_slice(rev, "rev");
  const auto plan = cpdispatch::cuda::plan_combine_chunks(n, token_bytes);
  for (const auto& c : plan.chunks)
    for (unsigned lane = 0; lane < 32; ++lane)
      cpdispatch::cuda::kernels::combine_chunk<E>(reinterpret_cast<const unsigned char*>(replica), reinterpret_cast<unsigned char*>(grad), c,
                                                  plan.slab_bytes, n.seq_recv_mask.data(), n.mask_copies, lane);
}

TEST(WarpLogicOnTheHost, CombineMatchesTheHostCombineBitForBit) {
  for (int W : cptest::sizes({1, 3, 4}, {3})) {
    for (const auto& c : cptest::pair_cases(W, 9)) {
      if (!c.kv) continue;
      for (auto type : {ElementType::float32, ElementType::float64, ElementType::bfloat16, ElementType::float16}) {
        const std::size_t es = cpdispatch::element_size(type);
        for (std::size_t elems : cptest::sizes<std::size_t>({1, 3, 8, 24, 2100}, {3, 24, 1100})) {  // x 8 bytes crosses chunk boundaries
          for (std::size_t shift : {std::size_t{0}, es}) {     // replica at 16 bytes, or off by one element (scalar path)
            const std::size_t tb = elems * es;
            SCOPED_TRACE(c.name + " W " + std::to_string(W) + " " + cpdispatch::element_name(type) + " token_bytes " + std::to_string(tb) +
                         " shift " + std::to_string(shift));
            for (int r = 0; r < W; ++r) {
              const auto slice = c.rev.get_slice(r);
              const Bytes replica_h = rough_floats(static_cast<std::size_t>(slice.output_tokens()) * tb, 77 + static_cast<std::uint64_t>(r), type);
              Bytes expect(static_cast<std::size_t>(c.fwd.send_tokens(r)) * tb, std::byte{0x33});
              cpdispatch::combine_copies(slice, replica_h, expect, tb, type);
              AlignedBytes replica(replica_h.size() + 16), grad(expect.size() + 16);
              std::memcpy(replica.data() + shift, replica_h.data(), replica_h.size());
              std::memset(grad.data(), 0x33, expect.size() + 16);
              switch (type) {
                case ElementType::float32: combine_on_host<ElementType::float32>(slice, replica.data() + shift, grad.data(), tb); break;
                case ElementType::float64: combine_on_host<ElementType::float64>(slice, replica.data() + shift, grad.data(), tb); break;
                case ElementType::bfloat16: combine_on_host<ElementType::bfloat16>(slice, replica.data() + shift, grad.data(), tb); break;
                case ElementType::float16: combine_on_host<ElementType::float16>(slice, replica.data() + shift, grad.data(), tb); break;
                default: FAIL() << "the device combine sums floating-point types only";
              }
              ASSERT_EQ(Bytes(grad.data(), grad.data() + expect.size()), expect) << "rank " << r;
              EXPECT_EQ(grad.data()[expect.size()], std::byte{0x33}) << "wrote past grad, rank " << r;
            }
          }
        }
      }
    }
  }
}

template <ElementType D>
void sum_on_host(std::byte* out, std::byte* acc, const std::vector<const void*>& sources, std::size_t count) {
  const std::size_t per_pass = cpdispatch::cuda::kernels::sum_sources_per_pass;
  for (std::size_t at = 0; at < sources.size(); at += per_pass) {
    cpdispatch::cuda::kernels::SumSources src{};
    const std::size_t n = std::min(per_pass, sources.size() - at);
    for (std::size_t s = 0; s < n; ++s) src.at[s] = sources[at + s];
    for (std::size_t i = 0; i < count; ++i)
      cpdispatch::cuda::kernels::sum_at<D>(out, acc, src, static_cast<unsigned>(n), at == 0, at + n == sources.size(), i);
  }
}

TEST(WarpLogicOnTheHost, SumsMatchTheHostSimInRankOrder) {
  const std::size_t count = 777;
  for (int W : {1, 2, 8, 9, 20}) {
    for (ElementType type : {ElementType::int8, ElementType::uint8, ElementType::int32, ElementType::int64, ElementType::float32, ElementType::float64,
                          ElementType::bfloat16, ElementType::float16}) {
      SCOPED_TRACE(std::string(cpdispatch::element_name(type)) + " W " + std::to_string(W));
      const std::size_t es = cpdispatch::element_size(type);
      std::vector<Bytes> in;
      for (int s = 0; s < W; ++s) {
        const auto salt = static_cast<std::uint64_t>(s) * 31 + es;
        switch (type) {
          case ElementType::float32: in.push_back(rough_floats(count * es, salt, ElementType::float32)); break;
          case ElementType::float64: in.push_back(rough_floats(count * es, salt, ElementType::float64)); break;
          case ElementType::bfloat16: in.push_back(rough_floats(count * es, salt, ElementType::bfloat16)); break;
          case ElementType::float16: in.push_back(rough_floats(count * es, salt, ElementType::float16)); break;
          default: in.push_back(cptest::pattern(count * es, salt)); break;
        }
      }
      std::vector<const std::byte*> host_sources;
      std::vector<const void*> sources;
      for (const auto& b : in) {
        host_sources.push_back(b.data());
        sources.push_back(b.data());
      }
      Bytes expect(count * es), out(count * es);
      cpdispatch::detail::sim::sum(type, expect.data(), host_sources, count);
      std::vector<double> acc(count);  // 8 bytes per element, aligned for every accumulator
      auto* a = reinterpret_cast<std::byte*>(acc.data());
      switch (type) {
        case ElementType::int8: sum_on_host<ElementType::int8>(out.data(), a, sources, count); break;
        case ElementType::uint8: sum_on_host<ElementType::uint8>(out.data(), a, sources, count); break;
        case ElementType::int32: sum_on_host<ElementType::int32>(out.data(), a, sources, count); break;
        case ElementType::int64: sum_on_host<ElementType::int64>(out.data(), a, sources, count); break;
        case ElementType::float32: sum_on_host<ElementType::float32>(out.data(), a, sources, count); break;
        case ElementType::float64: sum_on_host<ElementType::float64>(out.data(), a, sources, count); break;
        case ElementType::bfloat16: sum_on_host<ElementType::bfloat16>(out.data(), a, sources, count); break;
        case ElementType::float16: sum_on_host<ElementType::float16>(out.data(), a, sources, count); break;
      }
      EXPECT_EQ(out, expect);
    }
  }
}

// ---- conversions ---------------------------------------------------------------

TEST(DeviceKernels, SixteenBitConversionsMatchTheHostBitForBit) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  std::vector<float> in;
  for (std::uint32_t bits : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x477ff000u,
                             0x477fefffu, 0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x00000001u, 0x3f808000u, 0x3f818000u}) {
    float f;
    std::memcpy(&f, &bits, 4);
    in.push_back(f);
  }
  for (std::uint64_t i = 0; i < (cptest::cpu_harness ? 1u << 16 : 1u << 20); ++i) {
    const auto bits = static_cast<std::uint32_t>(i * 4093u + (i >> 7));  // spread over every exponent and the rounding bits
    float f;
    std::memcpy(&f, &bits, 4);
    in.push_back(f);
  }
  DeviceBuffer<float> d_in(in.size());
  DeviceBuffer<std::uint16_t> d_out(in.size());
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_in.data(), in.data(), in.size() * 4, cudaMemcpyHostToDevice));
  for (bool bf16 : {true, false}) {
    cpdispatch::cuda::launch_kernel("convert_from_float_kernel",
                                    bf16 ? &cpdispatch::cuda::kernels::convert_from_float_kernel<true>
                                         : &cpdispatch::cuda::kernels::convert_from_float_kernel<false>,
                                    256, 256, nullptr, d_in.data(), d_out.data(), std::uint64_t{in.size()});
    std::vector<std::uint16_t> out(in.size());
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(out.data(), d_out.data(), out.size() * 2, cudaMemcpyDeviceToHost));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < in.size() && bad < 10; ++i) {
      const std::uint16_t expect = bf16 ? cpdispatch::bfloat16::from_float(in[i]) : cpdispatch::float16::from_float(in[i]);
      if (out[i] != expect) {
        ++bad;
        ADD_FAILURE() << (bf16 ? "bf16" : "fp16") << " of float bits 0x" << std::hex << std::bit_cast<std::uint32_t>(in[i]) << ": device 0x"
                      << out[i] << ", host 0x" << expect;
      }
    }
  }
}

// ---- the copy kernel -----------------------------------------------------------

TEST(DeviceKernels, CopyPiecesOfEveryLengthAndAlignment) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const std::size_t src_bytes = 1 << 20;
  const Bytes src = cptest::pattern(src_bytes, 3);
  for (std::size_t chunk : {cpdispatch::cuda::copy_chunk_bytes, std::size_t{40}}) {
    for (std::size_t src_base : {0u, 1u, 3u, 8u}) {
      for (std::size_t dst_base : {0u, 2u, 5u, 12u}) {
        SCOPED_TRACE("chunk " + std::to_string(chunk) + " bases " + std::to_string(src_base) + "/" + std::to_string(dst_base));
        // Pieces of 0 .. 40000 bytes at every offset modulo 16, disjoint destinations.
        std::vector<cpdispatch::detail::CopyPiece> pieces;
        std::size_t at = 0;
        for (std::uint64_t i = 0; i < (cptest::cpu_harness ? 60 : 300); ++i) {
          const std::uint64_t h = mix(i * 31 + src_base * 7 + dst_base);
          const std::size_t len = i % 10 == 0 ? 30000 + h % 10001 : h % 700;
          const std::size_t from = (h >> 20) % (src_bytes - len);
          at += (h >> 40) % 33;
          pieces.push_back({from, at, len});
          at += len;
        }
        const std::size_t dst_bytes = at + 64;
        Bytes expect = cptest::pattern(dst_bytes, 9);
        auto d_dst = to_device(expect, 16);
        for (const auto& p : pieces) std::memcpy(expect.data() + dst_base + p.dst, src.data() + p.src, p.bytes);  // ends before `at` + 12
        const auto d_src = to_device(src, 16);
        const auto chunks = cpdispatch::cuda::plan_copy_chunks(pieces, chunk);
        DeviceBuffer<cpdispatch::cuda::CopyChunk> d_chunks(chunks.size());
        CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_chunks.data(), chunks.data(), chunks.size() * sizeof(chunks[0]), cudaMemcpyHostToDevice));
        // Shift the source contents so that piece offsets stay relative to the shifted base.
        CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_src.data() + src_base, src.data(), src_bytes, cudaMemcpyHostToDevice));
        cpdispatch::cuda::launch_copy(d_src.data() + src_base, d_dst.data() + dst_base, d_chunks.data(), chunks.size(), nullptr);
        EXPECT_EQ(to_host(d_dst.data(), dst_bytes), expect);
      }
    }
  }
}

// ---- the sum kernel against the host sim's reductions ----------------------------

TEST(DeviceKernels, SumMatchesTheHostSimForEveryTypeAndRankCount) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const std::size_t count = 3001;
  for (ElementType type : {ElementType::int8, ElementType::uint8, ElementType::int32, ElementType::int64, ElementType::float32, ElementType::float64,
                        ElementType::bfloat16, ElementType::float16}) {
    const std::size_t es = cpdispatch::element_size(type);
    for (int W : {1, 2, 8, 9, 17}) {
      SCOPED_TRACE(std::string(cpdispatch::element_name(type)) + " W " + std::to_string(W));
      std::vector<Bytes> in;
      for (int s = 0; s < W; ++s) {
        const auto salt = static_cast<std::uint64_t>(s) * 77 + es;
        switch (type) {
          case ElementType::float32: in.push_back(rough_floats(count * es, salt, ElementType::float32)); break;
          case ElementType::float64: in.push_back(rough_floats(count * es, salt, ElementType::float64)); break;
          case ElementType::bfloat16: in.push_back(rough_floats(count * es, salt, ElementType::bfloat16)); break;
          case ElementType::float16: in.push_back(rough_floats(count * es, salt, ElementType::float16)); break;
          default: in.push_back(cptest::pattern(count * es, salt)); break;  // integers: any bits, wrapping sums
        }
      }
      std::vector<const std::byte*> host_sources;
      for (const auto& b : in) host_sources.push_back(b.data());
      Bytes expect(count * es);
      cpdispatch::detail::sim::sum(type, expect.data(), host_sources, count);
      std::vector<DeviceBytesBuffer> d_in;
      std::vector<const void*> sources;
      for (const auto& b : in) {
        d_in.push_back(to_device(b));
        sources.push_back(d_in.back().data());
      }
      DeviceBytesBuffer d_out(count * es), acc(count * 8);
      cpdispatch::cuda::launch_sum(type, d_out.data(), acc.data(), sources, count, nullptr);
      EXPECT_EQ(to_host(d_out.data(), count * es), expect);
    }
  }
}

// ---- the dispatcher on the single-GPU simulation ----------------------------------

class DeviceSimDispatch : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, DeviceSimDispatch, ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

TEST_P(DeviceSimDispatch, ByteIdenticalToTheHostSimulation) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  DeviceSimWorld world(W, guarded());
  for (std::uint64_t seed : cptest::sizes<std::uint64_t>({1, 2}, {1})) {
    for (const auto& c : cptest::pair_cases(W, seed)) {
      // Token widths from 2 bytes to 8 KiB, aligned to 16 and not.
      for (std::size_t tb : cptest::sizes<std::size_t>({2, 3, 12, 16, 100, 1000, 1024, 4100, 8192}, {3, 16, 1000})) {
        SCOPED_TRACE(c.name + " seed " + std::to_string(seed) + " token_bytes " + std::to_string(tb));
        const auto mlp = cptest::inputs_for(W, tb, seed, [&](int r) { return c.fwd.send_tokens(r); });
        const auto attention_in = cptest::inputs_for(W, tb, seed + 7, [&](int r) { return c.rev.send_tokens(r); });
        const auto expect_attention = cptest::simulate_bytes(c.fwd, mlp, tb);
        const auto expect_replica = cptest::simulate_bytes(c.rev, attention_in, tb);
        std::vector<DeviceBytesBuffer> d_mlp, d_attn_in, d_attn(U), d_replica(U), d_staging(U);
        for (std::size_t r = 0; r < U; ++r) {
          d_mlp.push_back(to_device(mlp[r]));
          d_attn_in.push_back(to_device(attention_in[r]));
          d_attn[r] = to_device(Bytes(expect_attention[r].size(), std::byte{0xA5}));
          d_replica[r] = to_device(Bytes(expect_replica[r].size(), std::byte{0xA5}));
        }
        world.run([&](DeviceSimTransport& t) {
          const auto r = static_cast<std::size_t>(t.rank());
          Dispatcher d(t, c.fwd, c.rev, tb);
          EXPECT_EQ(d.required_bytes().attention_bytes, expect_attention[r].size());
          d.forward(cbytes(d_mlp[r]), mbytes(d_attn[r]));
          d.reverse(cbytes(d_attn_in[r]), mbytes(d_replica[r]));
        });
        world.synchronize();
        for (std::size_t r = 0; r < U; ++r) {
          EXPECT_EQ(to_host(d_attn[r].data(), expect_attention[r].size()), expect_attention[r]) << "forward, rank " << r;
          EXPECT_EQ(to_host(d_replica[r].data(), expect_replica[r].size()), expect_replica[r]) << "reverse, rank " << r;
        }
        // Again with caller-owned staging, at an odd offset inside a larger buffer.
        world.run([&](DeviceSimTransport& t) {
          const auto r = static_cast<std::size_t>(t.rank());
          Dispatcher d(t, c.fwd, c.rev, tb);
          const std::size_t n = d.required_bytes().staging_bytes;
          d_staging[r].allocate(n + 8);
          const cpdispatch::cuda::DeviceBytes staging(d_staging[r].data() + 3, n + 5);
          CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(d_attn[r].data(), 0x5A, d_attn[r].size(), t.stream()));
          d.forward(cbytes(d_mlp[r]), mbytes(d_attn[r]), staging);
        });
        world.synchronize();
        for (std::size_t r = 0; r < U; ++r) {
          EXPECT_EQ(to_host(d_attn[r].data(), expect_attention[r].size()), expect_attention[r]) << "forward with staging, rank " << r;
        }
      }
    }
  }
}

TEST_P(DeviceSimDispatch, KvCombineMatchesTheHostCombine) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  DeviceSimWorld world(W, guarded());
  for (std::uint64_t seed : cptest::sizes<std::uint64_t>({4, 5}, {4})) {
    for (const auto& c : cptest::pair_cases(W, seed)) {
      if (!c.kv) continue;
      for (auto type : {ElementType::float32, ElementType::float64, ElementType::bfloat16, ElementType::float16}) {
        // 16-byte aligned tokens (vector path) and not (scalar path).
        for (std::size_t elems : cptest::sizes<std::size_t>({8, 3, 520}, {8})) {
          const std::size_t tb = elems * cpdispatch::element_size(type);
          for (bool exact : {true, false}) {
            SCOPED_TRACE(c.name + " seed " + std::to_string(seed) + " " + cpdispatch::element_name(type) + " token_bytes " +
                         std::to_string(tb) + (exact ? " exact" : " rounded"));
            std::vector<Bytes> grads;
            for (int r = 0; r < W; ++r) {
              const std::size_t n = static_cast<std::size_t>(c.rev.send_tokens(r)) * tb;
              const auto salt = seed * 100 + static_cast<std::uint64_t>(r);
              grads.push_back(exact ? cptest::float_pattern(n, salt, type) : rough_floats(n, salt, type));
            }
            const auto expect_replica = cptest::simulate_bytes(c.rev, grads, tb, std::byte{0});
            std::vector<Bytes> expect_grad(U);
            std::vector<DeviceBytesBuffer> d_grads, d_replica(U), d_grad(U);
            for (std::size_t r = 0; r < U; ++r) {
              expect_grad[r].assign(static_cast<std::size_t>(c.fwd.send_tokens(static_cast<std::int64_t>(r))) * tb, std::byte{0});
              cpdispatch::combine_copies(c.rev.get_slice(static_cast<std::int64_t>(r)), expect_replica[r], expect_grad[r], tb, type);
              d_grads.push_back(to_device(grads[r]));
              d_replica[r] = to_device(Bytes(expect_replica[r].size(), std::byte{0}));
              d_grad[r] = to_device(Bytes(expect_grad[r].size(), std::byte{0x77}));
            }
            world.run([&](DeviceSimTransport& t) {
              const auto r = static_cast<std::size_t>(t.rank());
              Dispatcher d(t, c.fwd, c.rev, tb);
              d.reverse_combine(cbytes(d_grads[r]), mbytes(d_replica[r]), mbytes(d_grad[r]), type);
            });
            world.synchronize();
            for (std::size_t r = 0; r < U; ++r) {
              EXPECT_EQ(to_host(d_replica[r].data(), expect_replica[r].size()), expect_replica[r]) << "replica, rank " << r;
              EXPECT_EQ(to_host(d_grad[r].data(), expect_grad[r].size()), expect_grad[r]) << "grad, rank " << r;
            }
          }
        }
      }
    }
  }
}

// ---- a whole step in one CUDA graph ------------------------------------------------

TEST(DeviceSimGraph, CapturedForwardAndReverseReplayTheSameBytes) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 4;
  const auto U = static_cast<std::size_t>(W);
  const std::size_t q_tb = 1000, kv_tb = 24;  // kv: 12 bf16 per token
  const auto qkv = cptest::random_qkv(W, 41, 96, 4);
  DeviceSimWorld world(W, guarded());
  std::vector<std::unique_ptr<Dispatcher<DeviceSimTransport>>> q(U), kv(U);
  std::vector<DeviceBytesBuffer> q_mlp(U), q_attn(U), q_back(U), kv_mlp(U), kv_attn(U), kv_replica(U), kv_grad(U);
  auto fill_inputs = [&](std::uint64_t salt, std::vector<Bytes>& q_in, std::vector<Bytes>& kv_in) {
    q_in = cptest::inputs_for(W, q_tb, salt, [&](int r) { return qkv.q_fwd.send_tokens(r); });
    kv_in.clear();
    for (int r = 0; r < W; ++r) {
      kv_in.push_back(cptest::float_pattern(static_cast<std::size_t>(qkv.kv_fwd.send_tokens(r)) * kv_tb, salt + static_cast<std::uint64_t>(r),
                                            ElementType::bfloat16));
    }
    for (std::size_t r = 0; r < U; ++r) {
      CPDISPATCH_CUDA_CHECK(cudaMemcpy(q_mlp[r].data(), q_in[r].data(), q_in[r].size(), cudaMemcpyHostToDevice));
      CPDISPATCH_CUDA_CHECK(cudaMemcpy(kv_mlp[r].data(), kv_in[r].data(), kv_in[r].size(), cudaMemcpyHostToDevice));
    }
    cptest::device_sync();
  };
  // The step: forward Q and KV, then back again (Q's attention output
  // returns; KV's attention output plays its own gradient and is combined).
  auto step = [&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    q[r]->forward(cbytes(q_mlp[r]), mbytes(q_attn[r]));
    kv[r]->forward(cbytes(kv_mlp[r]), mbytes(kv_attn[r]));
    q[r]->reverse(cbytes(q_attn[r]), mbytes(q_back[r]));
    kv[r]->reverse_combine(cbytes(kv_attn[r]), mbytes(kv_replica[r]), mbytes(kv_grad[r]), ElementType::bfloat16);
  };
  auto expected = [&](const std::vector<Bytes>& q_in, const std::vector<Bytes>& kv_in) {
    const auto q_attn_h = cptest::simulate_bytes(qkv.q_fwd, q_in, q_tb);
    const auto kv_attn_h = cptest::simulate_bytes(qkv.kv_fwd, kv_in, kv_tb);
    const auto replica = cptest::simulate_bytes(qkv.kv_rev, kv_attn_h, kv_tb, std::byte{0});
    std::vector<Bytes> out;
    for (std::size_t r = 0; r < U; ++r) {
      Bytes grad(kv_in[r].size());
      cpdispatch::combine_copies(qkv.kv_rev.get_slice(static_cast<std::int64_t>(r)), replica[r], grad, kv_tb, ElementType::bfloat16);
      out.push_back(grad);
    }
    return std::pair{cptest::simulate_bytes(qkv.q_rev, q_attn_h, q_tb), out};
  };
  auto check = [&](const std::vector<Bytes>& q_in, const std::vector<Bytes>& kv_in, const char* what) {
    const auto [q_expect, kv_expect] = expected(q_in, kv_in);
    for (std::size_t r = 0; r < U; ++r) {
      EXPECT_EQ(to_host(q_back[r].data(), q_expect[r].size()), q_expect[r]) << what << ": q, rank " << r;
      EXPECT_EQ(to_host(kv_grad[r].data(), kv_expect[r].size()), kv_expect[r]) << what << ": kv grad, rank " << r;
      EXPECT_EQ(q_expect[r], q_in[r]) << "one copy per shard: q comes back as it left";
    }
  };
  // Build the dispatchers and buffers, and run one step for real.
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    q[r] = std::make_unique<Dispatcher<DeviceSimTransport>>(t, qkv.q_fwd, qkv.q_rev, q_tb);
    kv[r] = std::make_unique<Dispatcher<DeviceSimTransport>>(t, qkv.kv_fwd, qkv.kv_rev, kv_tb);
    const auto& qs = q[r]->required_bytes();
    const auto& ks = kv[r]->required_bytes();
    q_mlp[r].allocate(qs.mlp_bytes);
    q_attn[r].allocate(qs.attention_bytes);
    q_back[r].allocate(qs.replica_bytes);
    kv_mlp[r].allocate(ks.mlp_bytes);
    kv_attn[r].allocate(ks.attention_bytes);
    kv_replica[r].allocate(ks.replica_bytes);
    kv_grad[r].allocate(ks.mlp_bytes);
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(kv_replica[r].data(), 0, kv_replica[r].size(), t.stream()));
  });
  world.synchronize();
  std::vector<Bytes> q_in, kv_in;
  fill_inputs(1, q_in, kv_in);
  world.run(step);
  world.synchronize();
  check(q_in, kv_in, "run");

  // Capture: nothing runs yet.
  for (std::size_t r = 0; r < U; ++r) {
    CPDISPATCH_CUDA_CHECK(cudaMemset(q_back[r].data(), 0xEE, q_back[r].size()));
    CPDISPATCH_CUDA_CHECK(cudaMemset(kv_grad[r].data(), 0xEE, kv_grad[r].size()));
  }
  cptest::device_sync();
  const cpdispatch::DeviceSimGraph graph = world.capture(step);
  world.synchronize();
  for (std::size_t r = 0; r < U; ++r) {
    if (q_back[r].size()) {
      EXPECT_EQ(to_host(q_back[r].data(), 1)[0], std::byte{0xEE}) << "the capture ran the step, rank " << r;
    }
  }
  // Replay: the same bytes; with new inputs, the new results (the graph reads the buffers when it runs).
  const cpdispatch::cuda::Stream stream;
  graph.launch(stream.get());
  stream.synchronize();
  check(q_in, kv_in, "replay");
  fill_inputs(2, q_in, kv_in);
  graph.launch(stream.get());
  graph.launch(stream.get());  // twice in a row: each replay overwrites what the last wrote
  stream.synchronize();
  check(q_in, kv_in, "replay with new inputs");
}

// ---- the device sim's collectives against the host sim ----------------------------

TEST(DeviceSimCollectives, MatchTheHostSimBitForBit) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (int W : {1, 2, 5, 9}) {
    const auto U = static_cast<std::size_t>(W);
    const std::size_t n = 1000;  // elements per rank
    for (ElementType type : {ElementType::int32, ElementType::float32, ElementType::bfloat16, ElementType::float16, ElementType::int8, ElementType::float64}) {
      SCOPED_TRACE(std::string(cpdispatch::element_name(type)) + " W " + std::to_string(W));
      const std::size_t es = cpdispatch::element_size(type);
      auto data = [&](std::size_t bytes, std::uint64_t salt) {
        switch (type) {
          case ElementType::float32: return rough_floats(bytes, salt, ElementType::float32);
          case ElementType::float64: return rough_floats(bytes, salt, ElementType::float64);
          case ElementType::bfloat16: return rough_floats(bytes, salt, ElementType::bfloat16);
          case ElementType::float16: return rough_floats(bytes, salt, ElementType::float16);
          default: return cptest::pattern(bytes, salt);
        }
      };
      std::vector<Bytes> reduce_in, scatter_in, gather_in, bcast_in;
      for (std::size_t r = 0; r < U; ++r) {
        reduce_in.push_back(data(n * es, r + 1));
        scatter_in.push_back(data(n * es * U, r + 50));
        gather_in.push_back(data(n * es, r + 90));
        bcast_in.push_back(data(n * es, r + 130));
      }
      // The host sim's answers.
      std::vector<Bytes> h_reduce = reduce_in, h_scatter(U, Bytes(n * es)), h_gather(U, Bytes(n * es * U)), h_bcast = bcast_in;
      cpdispatch::SimWorld host(W, cpdispatch::SimOptions{std::chrono::milliseconds(60000)});
      host.run([&](cpdispatch::SimTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        t.all_reduce(h_reduce[r].data(), n, type, cpdispatch::ReduceOp::sum);
        t.reduce_scatter(scatter_in[r].data(), h_scatter[r].data(), n, type, cpdispatch::ReduceOp::sum);
        t.all_gather(gather_in[r].data(), h_gather[r].data(), n, type);
        t.broadcast(h_bcast[r].data(), n * es, W - 1);
        t.barrier();
      });
      // The device sim's.
      std::vector<DeviceBytesBuffer> d_reduce, d_scatter_in, d_scatter(U), d_gather_in, d_gather(U), d_bcast;
      for (std::size_t r = 0; r < U; ++r) {
        d_reduce.push_back(to_device(reduce_in[r]));
        d_scatter_in.push_back(to_device(scatter_in[r]));
        d_scatter[r].allocate(n * es);
        d_gather_in.push_back(to_device(gather_in[r]));
        d_gather[r].allocate(n * es * U);
        d_bcast.push_back(to_device(bcast_in[r]));
      }
      DeviceSimWorld world(W, guarded());
      world.run([&](DeviceSimTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        t.all_reduce(d_reduce[r].data(), n, type, cpdispatch::ReduceOp::sum);
        t.reduce_scatter(d_scatter_in[r].data(), d_scatter[r].data(), n, type, cpdispatch::ReduceOp::sum);
        t.all_gather(d_gather_in[r].data(), d_gather[r].data(), n, type);
        t.broadcast(d_bcast[r].data(), n * es, W - 1);
        t.barrier();
      });
      world.synchronize();
      for (std::size_t r = 0; r < U; ++r) {
        EXPECT_EQ(to_host(d_reduce[r].data(), n * es), h_reduce[r]) << "all_reduce, rank " << r;
        EXPECT_EQ(to_host(d_scatter[r].data(), n * es), h_scatter[r]) << "reduce_scatter, rank " << r;
        EXPECT_EQ(to_host(d_gather[r].data(), n * es * U), h_gather[r]) << "all_gather, rank " << r;
        EXPECT_EQ(to_host(d_bcast[r].data(), n * es), h_bcast[r]) << "broadcast, rank " << r;
      }
    }
  }
}

TEST(DeviceSimCollectives, PointToPointRingInEitherWaitOrder) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (int W : {1, 3, 6}) {
    const auto U = static_cast<std::size_t>(W);
    const std::size_t bytes = 4099;
    std::vector<Bytes> in;
    std::vector<DeviceBytesBuffer> d_in, d_out(U);
    for (std::size_t r = 0; r < U; ++r) {
      in.push_back(cptest::pattern(bytes, r + 11));
      d_in.push_back(to_device(in.back()));
      d_out[r].allocate(bytes);
    }
    for (bool send_first : {true, false}) {
      DeviceSimWorld world(W, guarded());
      world.run([&](DeviceSimTransport& t) {
        const int r = t.rank(), right = (r + 1) % W, left = (r + W - 1) % W;
        const auto recv = t.irecv(d_out[static_cast<std::size_t>(r)].data(), bytes, left, 7);
        const auto send = t.isend(d_in[static_cast<std::size_t>(r)].data(), bytes, right, 7);
        // The sender may overwrite its buffer after wait(send), in stream order.
        if (send_first) {
          t.wait(send);
          CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(d_in[static_cast<std::size_t>(r)].data(), 0, bytes, t.stream()));
          t.wait(recv);
        } else {
          t.wait(recv);
          t.wait(send);
          CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(d_in[static_cast<std::size_t>(r)].data(), 0, bytes, t.stream()));
        }
      });
      world.synchronize();
      for (std::size_t r = 0; r < U; ++r) {
        EXPECT_EQ(to_host(d_out[r].data(), bytes), in[(r + U - 1) % U]) << "rank " << r << (send_first ? " send first" : " recv first");
        CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_in[r].data(), in[r].data(), bytes, cudaMemcpyHostToDevice));
      }
      cptest::device_sync();
    }
  }
}

// ---- failures --------------------------------------------------------------------

TEST(DeviceSimFailure, MismatchedCollectivesNameBothCalls) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  DeviceSimWorld world(3, guarded());
  DeviceBytesBuffer buf(64);
  const std::string what = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](DeviceSimTransport& t) {
      if (t.rank() == 1) t.broadcast(buf.data(), 8, 0);
      else t.barrier();
    });
  });
  EXPECT_THAT(what, HasSubstr("DeviceSimWorld rank "));
  EXPECT_THAT(what, HasSubstr("broadcast of 8 bytes from root 0"));
  EXPECT_THAT(what, HasSubstr("(collectives must match)"));
  world.run([&](DeviceSimTransport& t) { t.barrier(); });  // usable again
}

TEST(DeviceSimFailure, AShortDeviceBufferFailsTheWorldWithoutAHang) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 4;
  const auto qkv = cptest::random_qkv(W, 8);
  DeviceSimWorld world(W, guarded());
  DeviceBytesBuffer mlp(1 << 16), attn(1 << 16);
  const std::string what = cptest::message_of<cpdispatch::capacity_error>([&] {
    world.run([&](DeviceSimTransport& t) {
      Dispatcher d(t, qkv.q_fwd, qkv.q_rev, 64);
      const auto& s = d.required_bytes();
      const std::size_t short_by = t.rank() == 2 ? 1 : 0;  // every rank sends tokens: mlp_bytes > 0
      d.forward(cbytes(mlp).first(s.mlp_bytes - short_by), mbytes(attn).first(s.attention_bytes));
    });
  });
  EXPECT_THAT(what, HasSubstr("DeviceSimWorld rank 2 of 4: Dispatcher::forward (rank 2 of 4): mlp holds"));
}

TEST(DeviceDataPath, CombineRefusesMisalignedGradients) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const auto qkv = cptest::random_qkv(1, 3);
  DeviceSimWorld world(1, guarded());
  world.run([&](DeviceSimTransport& t) {
    Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, 16);
    const auto& s = d.required_bytes();
    DeviceBytesBuffer attn(s.attention_bytes), replica(s.replica_bytes), grad(s.mlp_bytes + 4);
    const cpdispatch::cuda::DeviceBytes odd(grad.data() + 1, s.mlp_bytes);
    const std::string what = cptest::message_of<cpdispatch::invalid_input>(
        [&] { d.reverse_combine(cbytes(attn), mbytes(replica), odd, ElementType::float32); });
    EXPECT_THAT(what, HasSubstr("grad is not aligned to 4 bytes for float32"));
  });
}

// A rank that never posts its side of an exchange: the ranks meet on the
// host at a post, so every other rank's post ends at the world's timeout,
// naming the call and the timeout option, instead of waiting forever.
TEST(DeviceSimStuckRank, APostARankNeverJoinsEndsAtTheTimeoutOnEveryOtherRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 3;
  const std::size_t n = 64;
  DeviceSimWorld world(W, DeviceSimOptions{std::chrono::milliseconds(200), -1});
  std::vector<std::string> errors(W);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ANY_THROW(world.run([&](DeviceSimTransport& t) {
    if (t.rank() == W - 1) {  // stalls past the timeout, alive, and never posts
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      return;
    }
    DeviceBytesBuffer send(n * W), recv(n * W);
    std::vector<std::size_t> counts(W, n), displs(W);
    for (int p = 0; p < W; ++p) displs[static_cast<std::size_t>(p)] = static_cast<std::size_t>(p) * n;
    try {
      t.wait(t.post_all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs));
    } catch (const cpdispatch::error& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
      throw;
    }
  }));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r + 1 < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("not complete after 200 ms (DeviceSimOptions::timeout)")) << "rank " << r;
  }
  EXPECT_LT(seconds, 0.6 + 1.0) << "the stalled rank's 0.6 s plus a second";
}

}  // namespace
