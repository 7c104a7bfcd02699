// simulate()'s streaming stores (used when outputs exceed the last-level
// cache) must write exactly the bytes the cached path writes, for any token
// width and any alignment of the destination regions.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"

namespace {

using cpdispatch::ConstBytes;
using cpdispatch::MutableBytes;
using cpdispatch::StoreMode;

std::vector<std::vector<std::byte>> run(const cpdispatch::Metadata& meta, const std::vector<std::vector<std::byte>>& in,
                                        std::size_t token_bytes, StoreMode mode) {
  const auto W = static_cast<std::size_t>(meta.world_size);
  std::vector<std::vector<std::byte>> out(W);
  std::vector<ConstBytes> ins;
  std::vector<MutableBytes> outs;
  for (std::size_t r = 0; r < W; ++r) {
    // One spare byte in front, so region starts are not 16-byte aligned either.
    out[r].assign(static_cast<std::size_t>(meta.output_tokens(static_cast<std::int64_t>(r))) * token_bytes + 1, std::byte{0xAB});
    outs.push_back(MutableBytes(out[r]).subspan(1));
    ins.push_back(ConstBytes(in[r]));
  }
  cpdispatch::simulate(meta, std::span<const ConstBytes>(ins), std::span<const MutableBytes>(outs), token_bytes, mode);
  return out;
}

TEST(SimulateStoreMode, StreamingWritesTheSameBytesAsCached) {
  for (std::size_t token_bytes : {1u, 3u, 16u, 24u, 64u, 100u, 1024u}) {
    for (std::uint64_t seed = 0; seed < 4; ++seed) {
      SCOPED_TRACE(testing::Message() << "token_bytes " << token_bytes << " seed " << seed);
      const auto plan = cpdispatch::create_qkv_dispatch(4, 64, 5, 4, seed);
      const auto meta = cpdispatch::plan_qkv(plan);
      for (const cpdispatch::Metadata* m : {&meta.q_fwd, &meta.kv_fwd}) {
        std::vector<std::vector<std::byte>> in(4);
        for (std::size_t r = 0; r < 4; ++r) {
          in[r].resize(static_cast<std::size_t>(m->send_tokens(static_cast<std::int64_t>(r))) * token_bytes);
          for (std::size_t i = 0; i < in[r].size(); ++i) in[r][i] = static_cast<std::byte>((i * 131 + r * 7 + 1) & 0xff);
        }
        const auto cached = run(*m, in, token_bytes, StoreMode::cached);
        const auto streamed = run(*m, in, token_bytes, StoreMode::streaming);
        const auto automatic = run(*m, in, token_bytes, StoreMode::automatic);
        EXPECT_EQ(cached, streamed);
        EXPECT_EQ(cached, automatic);
        for (std::size_t r = 0; r < 4; ++r) EXPECT_EQ(streamed[r][0], std::byte{0xAB}) << "wrote before rank " << r << "'s output";
      }
    }
  }
}

}  // namespace
