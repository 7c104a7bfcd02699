// Per-rank planning at W = 16384 builds nothing of W x W size: every
// allocation made while planning one rank is counted (the program's counting
// allocator), and the largest one and the peak of live bytes must stay far
// below one dense [W][W+1] count matrix (2 GiB).

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "../common/counting_allocator.hpp"

namespace {

TEST(RankPlanningMemory, NoWorldSquaredStructureAt16384Ranks) {
  const std::int64_t W = 16384;
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 16 * W / 4;  // about 16 shards per rank
  o.max_shards = 8;
  o.max_len = 512;
  const cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 7);
  cpdispatch::RankQkvMetadata mine;
  const counting_allocator::Counted used = counting_allocator::count([&] { mine = cpdispatch::plan_qkv_for_rank(plan, W / 2); });
  const std::size_t dense = static_cast<std::size_t>(W) * static_cast<std::size_t>(W + 1) * sizeof(std::int64_t);
  EXPECT_LT(used.largest, dense / 64) << "largest allocation " << used.largest << " bytes";
  EXPECT_LT(used.peak, dense / 16) << "peak " << used.peak << " bytes";
  EXPECT_EQ(mine.q_fwd.num_recv_tokens.size(), static_cast<std::size_t>(W + 1));
  EXPECT_GT(mine.kv_fwd.num_total_recv_tokens, 0);
}

}  // namespace
