// Attention masks in planning (docs/plan-format.md, section 2d): the worked
// example in all three masks, number for number, the needed ranges and users,
// C's default and its error, and the mask carried into the attention layout.

#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <cstdint>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"

namespace {

using namespace cptest;
using cpdispatch::AttentionMask;
using cpdispatch::invalid_input;
using cpdispatch::QkvDocumentsPlan;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// Section 2d's example: document 0 = 3, 2, 4, 3 tokens (homes 0, 0, 1, 1;
/// destinations 1, 0, 1, 0), document 1 = 2 tokens on rank 1, attending there.
QkvDocumentsPlan example(AttentionMask mask) {
  QkvDocumentsPlan p;
  p.world_size = 2;
  p.documents = {{{{0, 3, 1}, {0, 2, 0}, {1, 4, 1}, {1, 3, 0}}}, {{{1, 2, 1}}}};
  p.mask = mask;
  return p;
}

std::vector<std::size_t> lo_of(const AttentionMask& mask, const std::vector<I>& len) {
  cpdispatch::detail::DocumentRanges r;
  r.compute(mask, len.data(), len.size());
  return r.lo;
}

TEST(Masks, NeededRangesOfTheExample) {
  const std::vector<I> len{3, 2, 4, 3};
  cpdispatch::detail::DocumentRanges r;
  r.compute(AttentionMask::sliding_window(4), len.data(), len.size());
  EXPECT_EQ(r.lo, (std::vector<std::size_t>{0, 0, 0, 2}));
  EXPECT_EQ(r.hi, (std::vector<std::size_t>{0, 1, 2, 3}));
  EXPECT_EQ(r.first, (std::vector<std::size_t>{0, 1, 2, 3}));
  EXPECT_EQ(r.end, (std::vector<std::size_t>{3, 3, 4, 4}));
  r.compute(AttentionMask::full(), len.data(), len.size());
  EXPECT_EQ(r.first, (std::vector<std::size_t>{0, 0, 0, 0}));
  EXPECT_EQ(r.end, (std::vector<std::size_t>{4, 4, 4, 4}));
  EXPECT_EQ(r.hi, (std::vector<std::size_t>{3, 3, 3, 3}));
  // A window of one token: each query shard needs only itself.
  EXPECT_EQ(lo_of(AttentionMask::sliding_window(1), len), (std::vector<std::size_t>{0, 1, 2, 3}));
  // The window reaches exactly the last key of a shard: 9 - w + 2 = 5 = b_1 for w = 6.
  EXPECT_EQ(lo_of(AttentionMask::sliding_window(6), len), (std::vector<std::size_t>{0, 0, 0, 1}));
  EXPECT_EQ(lo_of(AttentionMask::sliding_window(5), len), (std::vector<std::size_t>{0, 0, 0, 2}));
}

TEST(Masks, NeededRangesAgreeWithTheMaskPositionByPosition) {
  const std::vector<I> len{3, 1, 5, 2, 2, 7, 1};
  std::vector<I> a{0};
  for (I l : len) a.push_back(a.back() + l);
  for (I w = 1; w <= 20; ++w) {
    const AttentionMask mask = AttentionMask::sliding_window(w);
    cpdispatch::detail::DocumentRanges r;
    r.compute(mask, len.data(), len.size());
    for (std::size_t i = 0; i < len.size(); ++i) {
      for (std::size_t k = 0; k < len.size(); ++k) {
        bool seen = false;
        for (I p = a[i]; p < a[i + 1]; ++p)
          for (I t = a[k]; t < a[k + 1]; ++t) seen = seen || mask.sees(p, t);
        EXPECT_EQ(seen, r.lo[i] <= k && k <= r.hi[i]) << "w " << w << " query shard " << i << " KV shard " << k;
        EXPECT_EQ(seen, r.first[k] <= i && i < r.end[k]) << "w " << w << " query shard " << i << " KV shard " << k;
      }
    }
  }
}

TEST(Masks, WorkedExampleSlidingWindow) {
  const auto m = cpdispatch::plan_qkv(example(AttentionMask::sliding_window(4)));
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, 1}, {0, 1, -1}, {-1, -1, -1}}, {{1, 0, -1}, {0, -1, -1}, {1, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 0, 3}, {3, 6, 0}, {0, 0, 0}}, {{8, 5, 0}, {9, 0, 0}, {12, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{5, 7, 12}, {8, 6, 14}}));
  EXPECT_EQ(m.kv_fwd.num_seqs, t1({2, 3}));
  EXPECT_EQ(m.kv_rev.dst_rank, t2({{0, 0, 1, 1, -1}, {0, 0, 0, 1, 1}}));
  EXPECT_EQ(m.kv_rev.dst_offset, t2({{5, 3, 9, 4, 0}, {0, 10, 8, 0, 7}}));
  EXPECT_EQ(m.kv_rev.seq_len, t2({{3, 2, 4, 3, 0}, {3, 3, 2, 4, 2}}));
  EXPECT_EQ(m.kv_rev.num_recv_tokens, t2({{5, 8, 13}, {7, 6, 13}}));
  EXPECT_EQ(m.kv_rev.num_seqs, t1({4, 5}));
  ASSERT_TRUE(m.kv_rev.seq_recv_mask);
  EXPECT_EQ(*m.kv_rev.seq_recv_mask, t3({{{1, 1, 1}, {1, 1, 0}, {0, 0, 0}}, {{1, 1, 0}, {1, 0, 0}, {1, 0, 0}}}));
  EXPECT_EQ(m.attn.seqlens_q, (M2{{2, 3}, {3, 4, 2}}));
  EXPECT_EQ(m.attn.seqlens_kv, (M2{{5, 7}, {3, 9, 2}}));
  EXPECT_EQ(m.attn.cu_seqlens_kv, (M2{{0, 5, 12}, {0, 3, 12, 14}}));
  EXPECT_EQ(m.attn.max_seqlen_kv, (std::vector<I>{7, 9}));
  EXPECT_EQ(m.attn.mask, AttentionMask::sliding_window(4));
  const auto wire = cpdispatch::plan_kv_wire(m);
  EXPECT_EQ(wire.fwd.num_recv_tokens, t2({{5, 7, 12}, {5, 6, 11}}));
  EXPECT_EQ(wire.fwd.num_seqs, t1({2, 3}));
}

TEST(Masks, WorkedExampleFull) {
  const auto m = cpdispatch::plan_qkv(example(AttentionMask::full()));
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, 1, 0}, {1, 0, 1, 0}, {-1, -1, -1, -1}}, {{1, 0, 1, 0}, {1, 0, 1, 0}, {1, -1, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 0, 12, 12}, {3, 3, 15, 15}, {0, 0, 0, 0}}, {{5, 5, 17, 17}, {9, 9, 21, 21}, {24, 0, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{10, 14, 24}, {10, 16, 26}}));
  EXPECT_EQ(m.attn.seqlens_q, (M2{{2, 3}, {3, 4, 2}}));
  EXPECT_EQ(m.attn.seqlens_kv, (M2{{12, 12}, {12, 12, 2}}));
  EXPECT_EQ(m.attn.mask, AttentionMask::full());
  const auto wire = cpdispatch::plan_kv_wire(m);
  EXPECT_EQ(wire.fwd.dst_rank, t3({{{1, 0, -1, -1}, {1, 0, -1, -1}, {-1, -1, -1, -1}}, {{1, 0, -1, -1}, {1, 0, -1, -1}, {1, -1, -1, -1}}}));
  EXPECT_EQ(wire.fwd.dst_offset, t3({{{0, 0, 0, 0}, {3, 3, 0, 0}, {0, 0, 0, 0}}, {{5, 5, 0, 0}, {9, 9, 0, 0}, {12, 0, 0, 0}}}));
  EXPECT_EQ(wire.fwd.num_recv_tokens, t2({{5, 7, 12}, {5, 9, 14}}));
  EXPECT_EQ(wire.rev.dst_rank, t2({{0, 0, 1, 1, -1}, {0, 0, 1, 1, 1}}));
  EXPECT_EQ(wire.rev.dst_offset, t2({{5, 8, 9, 13, 0}, {0, 3, 0, 4, 7}}));
  EXPECT_EQ(wire.rev.num_recv_tokens, t2({{5, 5, 10}, {7, 9, 16}}));
  EXPECT_EQ(wire.rev.num_seqs, t1({4, 5}));
}

TEST(Masks, WorkedExampleCausal) {
  const auto m = cpdispatch::plan_qkv(example(AttentionMask::causal()));
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, 1, 0}, {0, 1, 0, -1}, {-1, -1, -1, -1}}, {{1, 0, -1, -1}, {0, -1, -1, -1}, {1, -1, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 0, 3, 5}, {3, 6, 8, 0}, {0, 0, 0, 0}}, {{8, 10, 0, 0}, {14, 0, 0, 0}, {12, 0, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{10, 7, 17}, {8, 6, 14}}));
  EXPECT_EQ(m.attn.seqlens_q, (M2{{2, 3}, {3, 4, 2}}));
  EXPECT_EQ(m.attn.seqlens_kv, (M2{{5, 12}, {3, 9, 2}}));
  EXPECT_EQ(m.attn.mask, AttentionMask::causal());
}

TEST(Masks, PerRankPlanningCarriesTheMaskAndTheWire) {
  QkvDocumentsPlan p = example(AttentionMask::sliding_window(4));
  p.dedup = true;
  const auto m = cpdispatch::plan_qkv(p);
  const auto wire = cpdispatch::plan_kv_wire(m);
  for (I r = 0; r < 2; ++r) {
    const auto share = cpdispatch::plan_qkv_for_rank(p, r);
    EXPECT_EQ(share.attn.mask, AttentionMask::sliding_window(4));
    EXPECT_EQ(share.attn.seqlens_kv, m.attn.seqlens_kv[static_cast<std::size_t>(r)]);
    ASSERT_TRUE(share.kv_wire);
    EXPECT_EQ(share.kv_wire->fan, wire.fan[static_cast<std::size_t>(r)]);
    EXPECT_EQ(share.kv_wire->fwd.num_recv_tokens, wire.get_slice(r).fwd.num_recv_tokens);
  }
  p.dedup = false;
  EXPECT_FALSE(cpdispatch::plan_qkv_for_rank(p, 0).kv_wire);
}

TEST(Masks, DefaultCopyDimensionIsTheMostUsers) {
  EXPECT_EQ(cpdispatch::plan_qkv(example(AttentionMask::sliding_window(4))).kv_fwd.num_copies(), 3u);
  EXPECT_EQ(cpdispatch::plan_qkv(example(AttentionMask::sliding_window(1))).kv_fwd.num_copies(), 1u);
  EXPECT_EQ(cpdispatch::plan_qkv(example(AttentionMask::full())).kv_fwd.num_copies(), 4u);
  EXPECT_EQ(cpdispatch::plan_qkv(example(AttentionMask::causal())).kv_fwd.num_copies(), 4u);
}

TEST(Masks, TooSmallCopyDimensionNamesDocumentAndShard) {
  QkvDocumentsPlan p = example(AttentionMask::sliding_window(4));
  p.max_cp_degree = 2;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv(p); }),
              AllOf(HasSubstr("max_cp_degree = 2"), HasSubstr("documents[0].shards[0]"), HasSubstr("3 shards")));
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(p, 1); }), HasSubstr("max_cp_degree = 2"));
  p.max_cp_degree = 3;  // exactly the most users
  EXPECT_NO_THROW((void)cpdispatch::plan_qkv(p));
  const auto per_rank = cpdispatch::QkvPlan{2, 2, {{{{{4, 1, 1}, {0, 1, 0}}}}, {{{{2, 1}, {1, 0}}}}}, AttentionMask::full(), false};
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv(per_rank); }),
              AllOf(HasSubstr("max_cp_degree = 2"), HasSubstr("ranks[0].docs[0]"), HasSubstr("shard_len[0]"), HasSubstr("full mask")));
}

TEST(Masks, WindowBelowOneIsRefused) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)AttentionMask::sliding_window(0); }), HasSubstr("window"));
  QkvDocumentsPlan p = example(AttentionMask::causal());
  p.mask.type = cpdispatch::MaskType::sliding_window;  // built by hand, bypassing the factory
  p.mask.window = -3;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv(p); }), HasSubstr("mask.window = -3"));
  const auto per_rank = cpdispatch::QkvPlan{1, std::nullopt, {{{{{4}, {0}}}}}, p.mask, false};
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(per_rank, 0); }), HasSubstr("mask.window = -3"));
}

}  // namespace
