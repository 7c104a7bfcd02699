// Per-rank planning under every attention mask (section 2d): for random
// plans of both forms, with and without dedup, each rank's share equals the
// global plan's slices, attention row (mask included) and dedup wire, and
// the global layout covers every allowed pair once (verify_coverage).

#include <gtest/gtest.h>

#include <cstdint>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "helpers.hpp"
#include "rank_share.hpp"

namespace {

using cpdispatch::AttentionMask;
using cptest::I;
using cptest::every_rank_matches;

/// Causal, full, and windows from one token to past most documents.
AttentionMask mask_of(std::uint64_t seed) {
  switch (seed % 4) {
    case 0: return AttentionMask::causal();
    case 1: return AttentionMask::full();
    default: return AttentionMask::sliding_window(1 + static_cast<I>(seed * 7 % 60));
  }
}

TEST(MaskRankPlanning, PerRankFormEqualsTheGlobalSlices) {
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    cpdispatch::QkvPlan plan = cptest::to_plan(cptest::random_qkv_plan(seed, {seed % 5 == 0 ? 24 : 6, 3, 8, 20}));
    plan.mask = mask_of(seed);
    plan.dedup = seed % 3 == 0;
    ASSERT_TRUE(every_rank_matches(plan)) << "seed " << seed << " mask " << to_string(plan.mask) << " dedup " << plan.dedup;
  }
}

TEST(MaskRankPlanning, DocumentsFormEqualsTheGlobalSlices) {
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 1 + static_cast<I>(seed % 5 == 0 ? seed * 7 % 24 : seed % 8);
    o.num_documents = static_cast<I>(seed % 12);
    o.max_shards = 1 + static_cast<I>(seed % 9);
    o.max_len = 1 + static_cast<I>(seed % 20);
    if (seed % 7 == 0) o.max_cp_degree = o.max_shards + 1;
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
    plan.mask = mask_of(seed / 2);
    plan.dedup = seed % 2 == 0;
    ASSERT_TRUE(every_rank_matches(plan)) << "seed " << seed << " mask " << to_string(plan.mask) << " dedup " << plan.dedup;
  }
}

TEST(MaskRankPlanning, BothFormsGiveTheSameMetadata) {
  for (std::uint64_t seed = 1; seed <= 100; ++seed) {
    cpdispatch::QkvPlan plan = cptest::to_plan(cptest::random_qkv_plan(seed, {6, 3, 8, 20}));
    plan.mask = mask_of(seed);
    const cpdispatch::QkvMetadata a = cpdispatch::plan_qkv(plan), b = cpdispatch::plan_qkv(cpdispatch::to_documents(plan));
    ASSERT_NO_THROW(cpdispatch::verify_coverage(cpdispatch::to_documents(plan), b)) << "seed " << seed;
    ASSERT_EQ(a.kv_fwd.dst_rank, b.kv_fwd.dst_rank) << "seed " << seed;
    ASSERT_EQ(a.kv_fwd.dst_offset, b.kv_fwd.dst_offset) << "seed " << seed;
    ASSERT_EQ(a.kv_rev.dst_offset, b.kv_rev.dst_offset) << "seed " << seed;
    ASSERT_EQ(a.attn.seqlens_kv, b.attn.seqlens_kv) << "seed " << seed;
    ASSERT_EQ(a.attn.mask, b.attn.mask) << "seed " << seed;
  }
}

}  // namespace
