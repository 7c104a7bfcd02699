// The worked examples of docs/plan-format.md (sections 4.1 and 4.2), number
// for number, for plan_qkv / plan_query and for the test-side reference (so
// the reference is itself pinned to the format before it judges random plans).

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "reference.hpp"

namespace {

using cpdispatch::make_tensor;
using cpdispatch::Tensor;
using I = std::int64_t;
using cptest::M2;
using cptest::M3;
using cptest::t1;
using cptest::t2;
using cptest::t3;

// {"world_size": 2, "max_cp_degree": 3, "ranks": [
//   {"docs": [{"shard_len": [4, 2], "dst": [1, 0]}, {"shard_len": [3], "dst": [0]}]},
//   {"docs": [{"shard_len": [5, 1, 2], "dst": [0, 1, 0]}]}]}
cpdispatch::QkvPlan spec_qkv_plan() {
  cpdispatch::QkvPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{4, 2}, {1, 0}}, {{3}, {0}}};
  p.ranks[1].docs = {{{5, 1, 2}, {0, 1, 0}}};
  return p;
}

void expect_spec_qkv(const cpdispatch::QkvMetadata& m) {
  // q_fwd
  EXPECT_EQ(m.q_fwd.world_size, 2);
  EXPECT_EQ(m.q_fwd.dst_rank, t2({{1, 0, 0}, {0, 1, 0}}));
  EXPECT_EQ(m.q_fwd.dst_offset, t2({{0, 0, 2}, {5, 4, 10}}));
  EXPECT_EQ(m.q_fwd.seq_len, t2({{4, 2, 3}, {5, 1, 2}}));
  EXPECT_EQ(m.q_fwd.num_recv_tokens, t2({{5, 7, 12}, {4, 1, 5}}));
  EXPECT_EQ(m.q_fwd.num_seqs, t1({3, 3}));
  EXPECT_EQ(m.q_fwd.num_total_recv_tokens, (std::vector<I>{12, 5}));
  EXPECT_FALSE(m.q_fwd.seq_recv_mask.has_value());
  EXPECT_FALSE(m.q_fwd.recv_seq_lens.has_value());
  // q_rev
  EXPECT_EQ(m.q_rev.world_size, 2);
  EXPECT_EQ(m.q_rev.dst_rank, t2({{0, 0, 1, 1}, {0, 1, -1, -1}}));
  EXPECT_EQ(m.q_rev.dst_offset, t2({{4, 6, 0, 6}, {0, 5, 0, 0}}));
  EXPECT_EQ(m.q_rev.seq_len, t2({{2, 3, 5, 2}, {4, 1, 0, 0}}));
  EXPECT_EQ(m.q_rev.num_recv_tokens, t2({{5, 4, 9}, {7, 1, 8}}));
  EXPECT_EQ(m.q_rev.num_seqs, t1({4, 2}));
  EXPECT_EQ(m.q_rev.num_total_recv_tokens, (std::vector<I>{9, 8}));
  EXPECT_FALSE(m.q_rev.seq_recv_mask.has_value());
  EXPECT_FALSE(m.q_rev.recv_seq_lens.has_value());
  // kv_fwd
  EXPECT_EQ(m.kv_fwd.world_size, 2);
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, -1}, {0, -1, -1}, {0, -1, -1}}, {{0, 1, 0}, {1, 0, -1}, {0, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 0, 0}, {4, 0, 0}, {6, 0, 0}}, {{9, 4, 14}, {9, 19, 0}, {20, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.seq_len, t2({{4, 2, 3}, {5, 1, 2}}));  // the shard lengths
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{9, 13, 22}, {4, 6, 10}}));
  EXPECT_EQ(m.kv_fwd.num_seqs, t1({3, 3}));
  EXPECT_EQ(m.kv_fwd.num_total_recv_tokens, (std::vector<I>{22, 10}));
  EXPECT_FALSE(m.kv_fwd.seq_recv_mask.has_value());
  // kv_rev
  EXPECT_EQ(m.kv_rev.world_size, 2);
  EXPECT_EQ(m.kv_rev.dst_rank, t2({{0, 0, 0, 1, 1, 1, 1}, {0, 1, 1, -1, -1, -1, -1}}));
  EXPECT_EQ(m.kv_rev.dst_offset, t2({{9, 4, 6, 0, 16, 13, 6}, {0, 8, 5, 0, 0, 0, 0}}));
  EXPECT_EQ(m.kv_rev.seq_len, t2({{4, 2, 3, 5, 5, 1, 2}, {4, 5, 1, 0, 0, 0, 0}}));
  EXPECT_EQ(m.kv_rev.num_recv_tokens, t2({{9, 4, 13}, {13, 6, 19}}));
  EXPECT_EQ(m.kv_rev.num_seqs, t1({7, 3}));
  EXPECT_EQ(m.kv_rev.num_total_recv_tokens, (std::vector<I>{13, 19}));
  ASSERT_TRUE(m.kv_rev.seq_recv_mask.has_value());
  ASSERT_TRUE(m.kv_rev.recv_seq_lens.has_value());
  EXPECT_EQ(*m.kv_rev.seq_recv_mask, t3({{{1, 1, 0}, {1, 0, 0}, {1, 0, 0}}, {{1, 1, 1}, {1, 1, 0}, {1, 0, 0}}}));
  EXPECT_EQ(*m.kv_rev.recv_seq_lens, t2({{4, 2, 3}, {5, 1, 2}}));
  // attention layout; cu_seqlens and max_seqlen derived per the spec's
  // definition (leading 0, total last; maxima)
  EXPECT_EQ(m.attn.seqlens_q, (M2{{2, 3, 5, 2}, {4, 1}}));
  EXPECT_EQ(m.attn.seqlens_kv, (M2{{6, 3, 5, 8}, {4, 6}}));
  EXPECT_EQ(m.attn.cu_seqlens_q, (M2{{0, 2, 5, 10, 12}, {0, 4, 5}}));
  EXPECT_EQ(m.attn.cu_seqlens_kv, (M2{{0, 6, 9, 14, 22}, {0, 4, 10}}));
  EXPECT_EQ(m.attn.max_seqlen_q, (std::vector<I>{5, 4}));
  EXPECT_EQ(m.attn.max_seqlen_kv, (std::vector<I>{8, 6}));
}

TEST(CoreWorkedExamples, QkvPlanMatchesSpecSection4) {
  const auto m = cpdispatch::plan_qkv(spec_qkv_plan());
  expect_spec_qkv(m);
}

TEST(CoreWorkedExamples, QkvPlanWithDefaultCpDegreeIsTheSame) {
  auto p = spec_qkv_plan();
  p.max_cp_degree.reset();  // default: the largest shard count, 3
  expect_spec_qkv(cpdispatch::plan_qkv(p));
}

TEST(CoreWorkedExamples, ReferenceAgreesWithSpecQkv) {
  const ref::Qkv r = ref::plan_qkv(cptest::from_plan(spec_qkv_plan()));
  const auto m = cpdispatch::plan_qkv(spec_qkv_plan());
  EXPECT_TRUE(cptest::same_qkv(m, r));
  // and the reference on its own against the spec's numbers
  EXPECT_EQ(r.kv_fwd.dst_offset.v, (std::vector<I>{0, 0, 0, 4, 0, 0, 6, 0, 0, 9, 4, 14, 9, 19, 0, 20, 0, 0}));
  EXPECT_EQ(r.kv_rev.dst_offset.v, (std::vector<I>{9, 4, 6, 0, 16, 13, 6, 0, 8, 5, 0, 0, 0, 0}));
  EXPECT_EQ(r.q_rev.dst_offset.v, (std::vector<I>{4, 6, 0, 6, 0, 5, 0, 0}));
  EXPECT_EQ(r.attn.cu_seqlens_kv, (M2{{0, 6, 9, 14, 22}, {0, 4, 10}}));
}

TEST(CoreWorkedExamples, QkvPlanValidates) {
  const auto m = cpdispatch::plan_qkv(spec_qkv_plan());
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
}

// Query plan, W = 3: seq_len [[5,3,4],[2,6,1],[8,2,5]], dispatch [[0,0,1],[2,2,2],[1,1,0]]
const M2 kQuerySeqLen{{5, 3, 4}, {2, 6, 1}, {8, 2, 5}};
const M2 kQueryDispatch{{0, 0, 1}, {2, 2, 2}, {1, 1, 0}};

void expect_spec_query(const cpdispatch::QueryMetadata& q) {
  EXPECT_EQ(q.fwd.world_size, 3);
  EXPECT_EQ(q.fwd.dst_rank, t2(kQueryDispatch));
  EXPECT_EQ(q.fwd.seq_len, t2(kQuerySeqLen));
  EXPECT_EQ(q.fwd.dst_offset, t2({{0, 5, 0}, {0, 2, 8}, {4, 12, 8}}));
  EXPECT_EQ(q.fwd.num_recv_tokens, t2({{8, 0, 5, 13}, {4, 0, 10, 14}, {0, 9, 0, 9}}));
  EXPECT_EQ(q.fwd.num_seqs, t1({3, 3, 3}));
  EXPECT_EQ(q.fwd.num_total_recv_tokens, (std::vector<I>{13, 14, 9}));
  EXPECT_FALSE(q.fwd.seq_recv_mask.has_value());
  EXPECT_EQ(q.rev.world_size, 3);
  EXPECT_EQ(q.rev.dst_rank, t2({{0, 0, 2}, {0, 2, 2}, {1, 1, 1}}));
  EXPECT_EQ(q.rev.dst_offset, t2({{0, 5, 10}, {8, 0, 8}, {0, 2, 8}}));
  EXPECT_EQ(q.rev.seq_len, t2({{5, 3, 5}, {4, 8, 2}, {2, 6, 1}}));
  EXPECT_EQ(q.rev.num_recv_tokens, t2({{8, 4, 0, 12}, {0, 0, 9, 9}, {5, 10, 0, 15}}));
  EXPECT_EQ(q.rev.num_seqs, t1({3, 3, 3}));  // each destination received three shards
  EXPECT_EQ(q.rev.num_total_recv_tokens, (std::vector<I>{12, 9, 15}));
  EXPECT_FALSE(q.rev.seq_recv_mask.has_value());
  EXPECT_FALSE(q.rev.recv_seq_lens.has_value());
}

TEST(CoreWorkedExamples, QueryPlanMatchesSpecSection4) {
  const auto q = cpdispatch::plan_query(t2(kQuerySeqLen), t2(kQueryDispatch));
  expect_spec_query(q);
  EXPECT_NO_THROW(q.fwd.validate("fwd"));
  EXPECT_NO_THROW(q.rev.validate("rev"));
}

TEST(CoreWorkedExamples, ReferenceAgreesWithSpecQuery) {
  ref::Cube d3(3, ref::Mat(3, ref::Vec(1)));
  for (std::size_t r = 0; r < 3; ++r)
    for (std::size_t j = 0; j < 3; ++j) d3[r][j][0] = kQueryDispatch[r][j];
  const ref::Query r = ref::plan_query(kQuerySeqLen, d3, 1, false);
  const auto q = cpdispatch::plan_query(t2(kQuerySeqLen), t2(kQueryDispatch));
  EXPECT_TRUE(cptest::same_meta(q.fwd, r.fwd, "fwd"));
  EXPECT_TRUE(cptest::same_meta(q.rev, r.rev, "rev"));
  EXPECT_EQ(r.fwd.dst_offset.v, (std::vector<I>{0, 5, 0, 0, 2, 8, 4, 12, 8}));
  EXPECT_EQ(r.rev.dst_offset.v, (std::vector<I>{0, 5, 10, 8, 0, 8, 0, 2, 8}));
}

// The same query plan as a 3-D dispatch with one copy per shard and a -1
// column: forward offsets agree, reverse offsets are k * T_r + P_r(j) (k = 0
// here), and the mask/recv_seq_lens appear.
TEST(CoreWorkedExamples, QueryPlanAs3DWithAHoleColumn) {
  M3 d3(3, M2(3, std::vector<I>(2, -1)));
  for (std::size_t r = 0; r < 3; ++r)
    for (std::size_t j = 0; j < 3; ++j) d3[r][j][0] = kQueryDispatch[r][j];
  const auto q = cpdispatch::plan_query(t2(kQuerySeqLen), t3(d3));
  EXPECT_EQ(q.fwd.dst_rank, t3(d3));
  EXPECT_EQ(q.fwd.dst_offset, t3({{{0, 0}, {5, 0}, {0, 0}}, {{0, 0}, {2, 0}, {8, 0}}, {{4, 0}, {12, 0}, {8, 0}}}));
  EXPECT_EQ(q.rev.dst_offset, t2({{0, 5, 10}, {8, 0, 8}, {0, 2, 8}}));
  ASSERT_TRUE(q.rev.seq_recv_mask.has_value());
  EXPECT_EQ(*q.rev.seq_recv_mask, t3({{{1, 0}, {1, 0}, {1, 0}}, {{1, 0}, {1, 0}, {1, 0}}, {{1, 0}, {1, 0}, {1, 0}}}));
  EXPECT_EQ(*q.rev.recv_seq_lens, t2(kQuerySeqLen));
  EXPECT_NO_THROW(q.rev.validate("rev"));
}

}  // namespace
