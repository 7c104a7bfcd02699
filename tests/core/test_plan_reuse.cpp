// plan_qkv into a kept QkvMetadata (the storage-reusing overload) equals the
// independent reference on every step of a sequence of plans whose shapes
// grow, shrink and repeat: nothing of an earlier plan survives into a later
// one. Both plan forms.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "reference.hpp"

namespace {

TEST(PlanReuse, EveryStepEqualsTheReference) {
  cpdispatch::QkvMetadata kept, kept_documents;
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    // Seeds in pairs plan the same shape twice (reuse of every tensor), then
    // a different one (fresh storage for some).
    const ref::Plan p = cptest::random_qkv_plan(seed / 2 * 2 + 7, {seed % 4 < 2 ? 64 : 6, 3, 8, 40});
    const ref::Qkv want = ref::plan_qkv(p);
    const cpdispatch::QkvPlan plan = cptest::to_plan(p);
    cpdispatch::plan_qkv(plan, kept);
    ASSERT_TRUE(cptest::same_qkv(kept, want)) << "seed " << seed;
    cpdispatch::plan_qkv(cpdispatch::to_documents(plan), kept_documents);
    ASSERT_TRUE(cptest::same_qkv(kept_documents, want)) << "documents form, seed " << seed;
  }
}

// The storage really is reused: planning the same plan again keeps the
// count matrices where they were.
TEST(PlanReuse, TheSameShapeKeepsItsStorage) {
  const ref::Plan p = cptest::random_qkv_plan(5, {16, 3, 8, 40});
  const cpdispatch::QkvPlan plan = cptest::to_plan(p);
  cpdispatch::QkvMetadata kept;
  cpdispatch::plan_qkv(plan, kept);
  const std::int64_t* counts = kept.kv_fwd.num_recv_tokens.data();
  const std::int64_t* offsets = kept.kv_fwd.dst_offset.data();
  cpdispatch::plan_qkv(plan, kept);
  EXPECT_EQ(kept.kv_fwd.num_recv_tokens.data(), counts);
  EXPECT_EQ(kept.kv_fwd.dst_offset.data(), offsets);
  EXPECT_TRUE(cptest::same_qkv(kept, ref::plan_qkv(p)));
}

}  // namespace
