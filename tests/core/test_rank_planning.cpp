// Per-rank planning (plan_qkv_for_rank, plan_query_for_rank) equals the
// global plan's get_slice() for every rank, metadata and attention row, on
// random plans of both QKV forms and on random query plans.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "helpers.hpp"
#include "../common/same_slice.hpp"

namespace {

using cpdispatch::RankMetadata;
using cptest::I;

using cptest::same_slice;

template <class Plan>
::testing::AssertionResult every_rank_matches(const Plan& plan) {
  const cpdispatch::QkvMetadata global = cpdispatch::plan_qkv(plan);
  for (I r = 0; r < plan.world_size; ++r) {
    const cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, r);
    const std::string at = "rank " + std::to_string(r) + ": ";
    for (auto [got, want, name] : {std::tuple{&mine.q_fwd, &global.q_fwd, "q_fwd"}, std::tuple{&mine.q_rev, &global.q_rev, "q_rev"},
                                   std::tuple{&mine.kv_fwd, &global.kv_fwd, "kv_fwd"}, std::tuple{&mine.kv_rev, &global.kv_rev, "kv_rev"}}) {
      auto same = same_slice(*got, want->get_slice(r), at + name);
      if (!same) return same;
    }
    const auto u = static_cast<std::size_t>(r);
    const auto& a = global.attn;
    if (mine.attn.seqlens_q != a.seqlens_q[u] || mine.attn.seqlens_kv != a.seqlens_kv[u] || mine.attn.cu_seqlens_q != a.cu_seqlens_q[u] ||
        mine.attn.cu_seqlens_kv != a.cu_seqlens_kv[u] || mine.attn.max_seqlen_q != a.max_seqlen_q[u] ||
        mine.attn.max_seqlen_kv != a.max_seqlen_kv[u]) {
      return ::testing::AssertionFailure() << at << "attention layout differs";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(RankPlanning, PerRankFormEqualsTheGlobalSlices) {
  for (std::uint64_t seed = 1; seed <= 150; ++seed) {
    const cpdispatch::QkvPlan plan = cptest::to_plan(cptest::random_qkv_plan(seed, {64, 3, 8, 30}));
    ASSERT_TRUE(every_rank_matches(plan)) << "seed " << seed;
  }
}

TEST(RankPlanning, DocumentsFormEqualsTheGlobalSlices) {
  for (std::uint64_t seed = 1; seed <= 150; ++seed) {
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 1 + static_cast<I>(seed % 5 == 0 ? seed * 7 % 64 : seed % 12);  // mostly small, up to 64
    o.num_documents = static_cast<I>(seed % 40);  // few documents over many ranks: empty ranks
    o.max_shards = 1 + static_cast<I>(seed % 16);
    o.max_len = 20;
    if (seed % 3 == 0) o.max_cp_degree = o.max_shards + 2;
    ASSERT_TRUE(every_rank_matches(cpdispatch::random_documents_plan(o, seed))) << "seed " << seed;
  }
}

TEST(RankPlanning, QueryPlansEqualTheGlobalSlices) {
  for (std::uint64_t seed = 1; seed <= 100; ++seed) {
    const cptest::QueryCase c = cptest::random_query_plan(seed);
    const auto seq_len = c.seq_len_tensor(), dispatch = c.dispatch_tensor();
    const cpdispatch::QueryMetadata global = cpdispatch::plan_query(seq_len, dispatch);
    for (I r = 0; r < global.fwd.world_size; ++r) {
      const cpdispatch::RankQueryMetadata mine = cpdispatch::plan_query_for_rank(seq_len, dispatch, r);
      ASSERT_TRUE(same_slice(mine.fwd, global.fwd.get_slice(r), "fwd")) << "seed " << seed << " rank " << r;
      ASSERT_TRUE(same_slice(mine.rev, global.rev.get_slice(r), "rev")) << "seed " << seed << " rank " << r;
    }
  }
}

TEST(RankPlanning, RankOutsideTheWorldIsAnError) {
  const auto plan = cpdispatch::create_qkv_dispatch(4, 64, 2, 2, 1);
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(plan, 4); }),
              ::testing::HasSubstr("plan_qkv_for_rank: rank 4 is outside [0, 4)"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(cpdispatch::to_documents(plan), -1); }),
              ::testing::HasSubstr("rank -1 is outside [0, 4)"));
  const auto seq_len = cpdispatch::gen_seq_lens(2, 2, 8, 1);
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_query_for_rank(seq_len, cpdispatch::make_tensor<I>({{0, 1}, {1, 0}}), 2); }),
              ::testing::HasSubstr("plan_query_for_rank: rank 2 is outside [0, 2)"));
}

TEST(RankPlanning, InvalidPlansFailLikeTheGlobalPlanner) {
  cpdispatch::QkvDocumentsPlan p;
  p.world_size = 2;
  p.documents = {{{{0, 3, 1}, {1, 2, 7}}}};
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(p, 0); }),
              ::testing::HasSubstr("documents[0].shards[1].dst = 7"));
}

// One output and workspace kept over many planning steps (plans growing and
// shrinking, other ranks): every step equals a fresh plan_qkv_for_rank.
TEST(RankPlanning, ReusedStorageGivesTheSameShares) {
  cpdispatch::RankQkvMetadata kept, kept_documents;
  cpdispatch::RankPlanWorkspace workspace;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const cpdispatch::QkvPlan plan = cptest::to_plan(cptest::random_qkv_plan(seed, {seed % 2 ? 64 : 3, 3, 8, 30}));
    const I r = static_cast<I>(seed * 7 % static_cast<std::uint64_t>(plan.world_size));
    cpdispatch::plan_qkv_for_rank(plan, r, kept, workspace);
    const cpdispatch::RankQkvMetadata fresh = cpdispatch::plan_qkv_for_rank(plan, r);
    for (auto [got, want, name] : {std::tuple{&kept.q_fwd, &fresh.q_fwd, "q_fwd"}, std::tuple{&kept.q_rev, &fresh.q_rev, "q_rev"},
                                   std::tuple{&kept.kv_fwd, &fresh.kv_fwd, "kv_fwd"}, std::tuple{&kept.kv_rev, &fresh.kv_rev, "kv_rev"}}) {
      ASSERT_TRUE(same_slice(*got, *want, name)) << "seed " << seed;
    }
    ASSERT_EQ(kept.attn.cu_seqlens_kv, fresh.attn.cu_seqlens_kv) << "seed " << seed;
    ASSERT_EQ(kept.attn.seqlens_q, fresh.attn.seqlens_q) << "seed " << seed;
    ASSERT_EQ(kept.attn.max_seqlen_kv, fresh.attn.max_seqlen_kv) << "seed " << seed;
    // The documents form through the same workspace (its shard table rebuilt in place).
    cpdispatch::plan_qkv_for_rank(cpdispatch::to_documents(plan), r, kept_documents, workspace);
    for (auto [got, want, name] : {std::tuple{&kept_documents.q_fwd, &fresh.q_fwd, "q_fwd"}, std::tuple{&kept_documents.q_rev, &fresh.q_rev, "q_rev"},
                                   std::tuple{&kept_documents.kv_fwd, &fresh.kv_fwd, "kv_fwd"},
                                   std::tuple{&kept_documents.kv_rev, &fresh.kv_rev, "kv_rev"}}) {
      ASSERT_TRUE(same_slice(*got, *want, name)) << "documents form, seed " << seed;
    }
    ASSERT_EQ(kept_documents.attn.cu_seqlens_kv, fresh.attn.cu_seqlens_kv) << "documents form, seed " << seed;
  }
}

// A replica buffer 64 bits cannot address is refused per rank as globally,
// whichever rank plans.
TEST(RankPlanning, ReplicaBufferOverflowIsRefusedOnEveryRank) {
  cpdispatch::QkvPlan plan;
  plan.world_size = 2;
  plan.ranks.resize(2);
  const I big = I{1} << 61;
  plan.ranks[1].docs.push_back({{big, big}, {0, 1}});
  for (I r = 0; r < 2; ++r) {
    EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv_for_rank(plan, r); }),
                ::testing::HasSubstr("rank 1 holds 4611686018427387904 tokens; its replica buffer of 2 copies overflows 64 bits"));
  }
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv(plan); }),
              ::testing::HasSubstr("its replica buffer of 2 copies overflows 64 bits"));
}

}  // namespace
