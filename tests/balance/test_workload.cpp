// The workload generator, and the balanced planner on batches drawn from the
// real document-length samples (../shared/data/doc-lengths).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "balance_helpers.hpp"
#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/workload.hpp"

namespace {

using baltest::I;
using ::testing::HasSubstr;

/// The length sample `name` (prolong, wlbllm), or empty when the data folder is absent.
std::vector<I> load_sample(const std::string& name) {
  const std::filesystem::path file = std::filesystem::path(CPDISPATCH_DOC_LENGTHS_DIR) / (name + ".json");
  std::ifstream in(file);
  if (!in) return {};
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

TEST(DrawWorkload, FillsEveryRankExactly) {
  const std::vector<I> sample{1, 5, 17, 300, 2000, 9000};
  for (I budget : {1, 16, 1000, 20000}) {
    const auto ranks = cpdispatch::draw_workload(sample, 6, budget, std::uint64_t{42});
    ASSERT_EQ(ranks.size(), 6u);
    for (const auto& docs : ranks) {
      EXPECT_EQ(std::accumulate(docs.begin(), docs.end(), I{0}), budget);
      for (I len : docs) EXPECT_GT(len, 0);
    }
  }
}

TEST(DrawWorkload, IsSeededAndDrawsFromTheSample) {
  const std::vector<I> sample{3, 4, 5, 6, 7, 8, 9, 10};
  const auto a = cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{1});
  EXPECT_EQ(a, cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{1}));
  EXPECT_NE(a, cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{2}));
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::size_t i = 1; i + 1 < a[r].size(); ++i)  // only a rank's first (carried) and last (cut) may be pieces
      EXPECT_NE(std::find(sample.begin(), sample.end(), a[r][i]), sample.end()) << r << ", " << i;
}

TEST(DrawWorkload, CutsALongDocumentAndCarriesTheRest) {
  // Documents of 10 tokens, 4 per rank: 4 | 4 | 2 (the rest) + 2 | 4 ...
  const auto ranks = cpdispatch::draw_workload(std::vector<I>{10}, 4, 4, std::uint64_t{0});
  EXPECT_EQ(ranks, (std::vector<std::vector<I>>{{4}, {4}, {2, 2}, {4}}));
}

TEST(DrawWorkload, RejectsBadArguments) {
  using cpdispatch::invalid_input;
  const std::vector<I> ok{5};
  EXPECT_THAT(baltest::message_of<invalid_input>([] { cpdispatch::draw_workload(std::vector<I>{}, 2, 8, std::uint64_t{0}); }),
              HasSubstr("sample is empty"));
  EXPECT_THAT(baltest::message_of<invalid_input>([] { cpdispatch::draw_workload(std::vector<I>{4, 0}, 2, 8, std::uint64_t{0}); }),
              HasSubstr("sample[1] = 0"));
  EXPECT_THAT(baltest::message_of<invalid_input>([&] { cpdispatch::draw_workload(ok, 0, 8, std::uint64_t{0}); }), HasSubstr("world_size = 0"));
  EXPECT_THAT(baltest::message_of<invalid_input>([&] { cpdispatch::draw_workload(ok, 2, -1, std::uint64_t{0}); }),
              HasSubstr("tokens_per_rank = -1"));
}

// The targets on a small scale (the benchmark covers the full grid):
// imbalance at most 1.10 on every batch and 1.03 at the median.
TEST(RealWorkloads, BalancedPlansAreValidAndNearTheBound) {
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    if (sample.empty()) GTEST_SKIP() << "no " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (I W : {8, 16}) {
      for (I C : {4, 8}) {
        std::vector<double> ratios;
        for (std::uint64_t seed = 0; seed < 5; ++seed) {
          SCOPED_TRACE(std::string(name) + " W=" + std::to_string(W) + " C=" + std::to_string(C) + " seed " + std::to_string(seed));
          cpdispatch::BalanceProblem p;
          p.world_size = W;
          p.max_cp_degree = C;
          p.docs = cpdispatch::draw_workload(sample, W, 16384, seed);
          const auto plan = cpdispatch::plan_balanced(p);
          ASSERT_TRUE(baltest::valid_plan(p, plan));
          ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / cpdispatch::balance_lower_bound(p));
          EXPECT_LE(ratios.back(), 1.10);
        }
        std::sort(ratios.begin(), ratios.end());
        EXPECT_LE(ratios[ratios.size() / 2], 1.03);
      }
    }
  }
}

}  // namespace
