// gather_plan and gather_documents_plan carry the attention mask: every rank
// gets the plan with the mask it gave, and ranks that disagree on it all
// throw the same invalid_input instead of planning different exchanges.

#include <gtest/gtest.h>

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "../common/sim_world_fixture.hpp"
#include "cpdispatch/execute/gather_plan.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using namespace cpdispatch;

class MaskGather : public sim_test::WorldSizeTest {};

TEST_P(MaskGather, EveryRankGetsThePlanWithItsMask) {
  const int W = GetParam();
  for (const AttentionMask& mask : {AttentionMask::full(), AttentionMask::sliding_window(5), AttentionMask::causal()}) {
    std::mutex mu;
    std::vector<QkvPlan> plans(static_cast<std::size_t>(W));
    std::vector<QkvDocumentsPlan> documents(static_cast<std::size_t>(W));
    run([&](SimTransport& t) {
      const std::vector<Document> mine{{{3, 2}, {0, static_cast<std::int64_t>(W - 1)}}};
      const std::vector<LocalShard> shards{{0, t.rank(), 4, 0}};
      QkvPlan plan = gather_plan(t, std::span<const Document>(mine), std::nullopt, mask);
      QkvDocumentsPlan docs = gather_documents_plan(t, std::span<const LocalShard>(shards), std::nullopt, mask);
      std::lock_guard lock(mu);
      plans[static_cast<std::size_t>(t.rank())] = std::move(plan);
      documents[static_cast<std::size_t>(t.rank())] = std::move(docs);
    });
    for (int r = 0; r < W; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(plans[u].mask, mask) << "rank " << r;
      EXPECT_EQ(documents[u].mask, mask) << "rank " << r;
      ASSERT_EQ(plans[u].ranks.size(), static_cast<std::size_t>(W));
      EXPECT_EQ(plans[u].ranks[u].docs.front().shard_len, (std::vector<std::int64_t>{3, 2}));
      ASSERT_EQ(documents[u].documents.size(), 1u);
      EXPECT_EQ(documents[u].documents.front().shards.size(), static_cast<std::size_t>(W));
    }
  }
}

TEST_P(MaskGather, RanksThatDisagreeOnTheMaskAllThrow) {
  const int W = GetParam();
  if (W < 2) GTEST_SKIP() << "one rank cannot disagree with itself";
  std::mutex mu;
  std::vector<std::string> errors;
  run([&](SimTransport& t) {
    const std::vector<Document> mine{{{4}, {0}}};
    const AttentionMask mask = t.rank() == 1 ? AttentionMask::sliding_window(8) : AttentionMask::causal();
    try {
      (void)gather_plan(t, std::span<const Document>(mine), std::nullopt, mask);
    } catch (const invalid_input& e) {
      std::lock_guard lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), static_cast<std::size_t>(W));
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("rank 1 plans with the sliding_window(8) mask but rank 0 with the causal mask"), std::string::npos) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MaskGather, ::testing::Values(1, 2, 3, 5), sim_test::WorldSizeName{"W"});

}  // namespace
