// Per-rank planning under every attention mask (section 2d): for random
// plans of both forms, with and without dedup, each rank's share equals the
// global plan's slices, attention row (mask included) and dedup wire, and
// the global layout covers every allowed pair once (verify_coverage).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "helpers.hpp"
#include "../common/same_slice.hpp"

namespace {

using cpdispatch::AttentionMask;
using cptest::I;
using cptest::same_slice;

/// Causal, full, and windows from one token to past most documents.
AttentionMask mask_of(std::uint64_t seed) {
  switch (seed % 4) {
    case 0: return AttentionMask::causal();
    case 1: return AttentionMask::full();
    default: return AttentionMask::sliding_window(1 + static_cast<I>(seed * 7 % 60));
  }
}

::testing::AssertionResult same_attention(const cpdispatch::RankAttentionLayout& mine, const cpdispatch::AttentionLayout& a, std::size_t u) {
  if (mine.seqlens_q != a.seqlens_q[u] || mine.seqlens_kv != a.seqlens_kv[u] || mine.cu_seqlens_q != a.cu_seqlens_q[u] ||
      mine.cu_seqlens_kv != a.cu_seqlens_kv[u] || mine.max_seqlen_q != a.max_seqlen_q[u] || mine.max_seqlen_kv != a.max_seqlen_kv[u] ||
      mine.mask != a.mask) {
    return ::testing::AssertionFailure() << "attention layout differs";
  }
  return ::testing::AssertionSuccess();
}

template <class Plan>
::testing::AssertionResult every_rank_matches(const Plan& plan) {
  const cpdispatch::QkvMetadata global = cpdispatch::plan_qkv(plan);
  if (global.attn.mask != plan.mask) return ::testing::AssertionFailure() << "the global layout lost the mask";
  try {
    cpdispatch::verify_coverage(plan, global);
  } catch (const cpdispatch::invalid_input& e) {
    return ::testing::AssertionFailure() << e.what();
  }
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(global);
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankPlanWorkspace workspace;  // reused across ranks, as a job reuses it across steps
  for (I r = 0; r < plan.world_size; ++r) {
    cpdispatch::plan_qkv_for_rank(plan, r, mine, workspace);
    const std::string at = "rank " + std::to_string(r) + ": ";
    for (auto [got, want, name] : {std::tuple{&mine.q_fwd, &global.q_fwd, "q_fwd"}, std::tuple{&mine.q_rev, &global.q_rev, "q_rev"},
                                   std::tuple{&mine.kv_fwd, &global.kv_fwd, "kv_fwd"}, std::tuple{&mine.kv_rev, &global.kv_rev, "kv_rev"}}) {
      auto same = same_slice(*got, want->get_slice(r), at + name);
      if (!same) return same;
    }
    auto attn = same_attention(mine.attn, global.attn, static_cast<std::size_t>(r));
    if (!attn) return attn << " at " << at;
    if (mine.kv_wire.has_value() != plan.dedup) return ::testing::AssertionFailure() << at << "kv_wire present = " << mine.kv_wire.has_value();
    if (!plan.dedup) continue;
    const cpdispatch::RankKvWire want = wire.get_slice(r);
    for (auto [got, w, name] : {std::tuple{&mine.kv_wire->fwd, &want.fwd, "kv_wire_fwd"}, std::tuple{&mine.kv_wire->rev, &want.rev, "kv_wire_rev"}}) {
      auto same = same_slice(*got, *w, at + name);
      if (!same) return same;
    }
    if (!(mine.kv_wire->fan == want.fan)) return ::testing::AssertionFailure() << at << "fan list differs";
  }
  return ::testing::AssertionSuccess();
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
