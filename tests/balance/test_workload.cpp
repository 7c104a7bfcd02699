// The packed-batch generator, and the balanced planner on batches drawn from
// the real document-length samples of the project's data/ folder.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "balance_helpers.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/workload.hpp"

namespace {

using baltest::I;
using ::testing::HasSubstr;

/// The length sample `name` (prolong, wlbllm) of data/; empty when it cannot be read.
std::vector<I> load_sample(const std::string& name) {
  const std::filesystem::path file = std::filesystem::path(CPDISPATCH_DOC_LENGTHS_DIR) / (name + ".json");
  std::ifstream in(file);
  if (!in) return {};
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

using Batch = std::vector<cpdispatch::BalanceDocument>;

/// Tokens per rank of a packed batch.
std::vector<I> rank_tokens(const Batch& b, I W) {
  std::vector<I> out(static_cast<std::size_t>(W), 0);
  for (const auto& doc : b)
    for (const auto& pc : doc.pieces) out[static_cast<std::size_t>(pc.rank)] += pc.len;
  return out;
}

TEST(DrawWorkload, FillsEveryRankExactlyWithDocumentsEndToEnd) {
  const std::vector<I> sample{1, 5, 17, 300, 2000, 9000};
  for (I budget : {1, 16, 1000, 20000}) {
    const Batch b = cpdispatch::draw_workload(sample, 6, budget, std::uint64_t{42});
    EXPECT_EQ(rank_tokens(b, 6), std::vector<I>(6, budget));
    I next_rank = 0;  // pieces come rank after rank: a document continues on the next rank
    for (std::size_t i = 0; i < b.size(); ++i) {
      const auto& pieces = b[i].pieces;
      ASSERT_FALSE(pieces.empty());
      EXPECT_TRUE(b[i].slices.empty());
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        EXPECT_GT(pieces[k].len, 0);
        EXPECT_TRUE(pieces[k].rank == next_rank || (k == 0 && pieces[k].rank == next_rank - 1)) << i << ", " << k;
        if (k > 0) {
          EXPECT_EQ(pieces[k].rank, pieces[k - 1].rank + 1) << "documents[" << i << "] skips a rank";
        }
        next_rank = pieces[k].rank + 1;
      }
    }
  }
}

TEST(DrawWorkload, IsSeededAndKeepsEveryDocumentWhole) {
  const std::vector<I> sample{3, 40, 500, 6, 7, 8, 9, 10};
  const Batch a = cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{1});
  EXPECT_EQ(a, cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{1}));
  EXPECT_NE(a, cpdispatch::draw_workload(sample, 4, 200, std::uint64_t{2}));
  EXPECT_GT(cpdispatch::spanning_documents(a), 0u);
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {  // every document but the last (cut at the end) has a sampled length
    I len = 0;
    for (const auto& pc : a[i].pieces) len += pc.len;
    EXPECT_NE(std::find(sample.begin(), sample.end(), len), sample.end()) << "documents[" << i << "] has " << len << " tokens";
  }
}

TEST(DrawWorkload, ALongDocumentSpansConsecutiveRanks) {
  // Documents of 10 tokens, 4 per rank: 4 | 4 | 2 + (new) 2 | 4 (cut at the end).
  const Batch b = cpdispatch::draw_workload(std::vector<I>{10}, 4, 4, std::uint64_t{0});
  const Batch want = {{{{0, 4}, {1, 4}, {2, 2}}}, {{{2, 2}, {3, 4}}}};
  EXPECT_EQ(b, want);
  EXPECT_EQ(cpdispatch::spanning_documents(b), 2u);
  EXPECT_EQ(cpdispatch::widest_span(b), 3u);
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

// What README.md and docs/planning.md claim, on a small scale (bench_balance
// covers the full grid): the balanced plan within 1.1% of the lower bound at
// the median, and within 4.1% in the worst batch, on packed batches whose
// long documents span ranks. The bounds are the claims as printed, up to
// their rounding (1.1% covers up to 1.15%). Measured here: every row's
// median 1.0100-1.0110, every batch at most 1.0110 -- by design, since the
// planner reaches the smallest target to within 0.1% and then trades up to
// its cost_slack of 1% for fewer bytes; a planner that gives away 1-2% more
// balance passes a looser bound.
TEST(RealWorkloads, BalancedPlansAreValidAndWithinTheClaimedBound) {
  constexpr double median_claim = 1.0115, worst_claim = 1.0415;
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    ASSERT_FALSE(sample.empty()) << "cannot read " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (I W : {8, 16}) {
      for (I C : {8, 16}) {
        const std::string row = std::string(name) + " W=" + std::to_string(W) + " C=" + std::to_string(C);
        std::vector<double> ratios;
        for (std::uint64_t seed = 0; seed < 5; ++seed) {
          SCOPED_TRACE(row + " seed " + std::to_string(seed));
          cpdispatch::BalanceProblem p;
          p.world_size = W;
          p.max_cp_degree = C;
          p.documents = cpdispatch::draw_workload(sample, W, 16384, seed);
          p.max_cp_degree = std::max<I>(C, static_cast<I>(cpdispatch::widest_span(p.documents)));
          const auto plan = cpdispatch::plan_balanced(p);
          ASSERT_TRUE(baltest::valid_packed_plan(p, plan));
          ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / cpdispatch::balance_lower_bound(p));
          EXPECT_LE(ratios.back(), worst_claim);
        }
        std::sort(ratios.begin(), ratios.end());
        const double median = ratios[ratios.size() / 2];
        EXPECT_LE(median, median_claim) << row;
        std::printf("%s: largest rank cost / lower bound, median %.5f, worst %.5f\n", row.c_str(), median, ratios.back());
      }
    }
  }
}

// The planning grid of the invariant mode (64 tokens) on the same batches,
// and at W = 64: the lower bound on the grid stays within 0.5% of the bound
// without it at the median of every row (measured: at most 1.0017; in the
// worst batch 1.0070, prolong W=16 C=8 seed 2: a document of 32858 tokens
// over 3 ranks whose 8 shards near its end are ~2800 tokens long, where a
// block of 64 weighs), and the plans on the grid keep the claims against it
// (at W = 64 that takes the balancer's search for a room that fits a shard
// on the grid: without it, plans reached 1.12 of the bound).
TEST(RealWorkloads, TheGridOfTheInvariantModeKeepsTheBoundAndTheBalance) {
  constexpr double bound_median_claim = 1.005, bound_worst = 1.01, median_claim = 1.0115, worst_claim = 1.0415;
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    ASSERT_FALSE(sample.empty()) << "cannot read " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (I W : {8, 16, 64}) {
      for (I C : {8, 16}) {
        const std::string row = std::string(name) + " W=" + std::to_string(W) + " C=" + std::to_string(C);
        std::vector<double> bounds, ratios;
        for (std::uint64_t seed = 0; seed < 5; ++seed) {
          SCOPED_TRACE(row + " seed " + std::to_string(seed));
          cpdispatch::BalanceProblem p;
          p.world_size = W;
          p.documents = cpdispatch::draw_workload(sample, W, 16384, seed);
          p.max_cp_degree = std::max<I>(C, static_cast<I>(cpdispatch::widest_span(p.documents)));
          cpdispatch::BalanceOptions o;
          o.grid = cpdispatch::invariant_grid;
          ASSERT_FALSE(cpdispatch::first_off_grid(p, o.grid));  // ranks of 16384 tokens: the loader's cuts are on it
          const auto plan = cpdispatch::plan_balanced(p, o);
          ASSERT_TRUE(baltest::valid_packed_plan(p, plan));
          ASSERT_FALSE(cpdispatch::first_off_grid(plan, o.grid));
          const double bound = cpdispatch::balance_lower_bound(p, o);
          bounds.push_back(bound / cpdispatch::balance_lower_bound(p));
          ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / bound);
          EXPECT_LE(bounds.back(), bound_worst);
          EXPECT_LE(ratios.back(), worst_claim);
        }
        std::sort(bounds.begin(), bounds.end());
        std::sort(ratios.begin(), ratios.end());
        EXPECT_LE(bounds[bounds.size() / 2], bound_median_claim) << row;
        EXPECT_LE(ratios[ratios.size() / 2], median_claim) << row;
        std::printf("%s, grid %lld: bound / bound without it, median %.5f, worst %.5f; largest rank cost / bound, median %.5f, worst %.5f\n",
                    row.c_str(), static_cast<long long>(cpdispatch::invariant_grid), bounds[bounds.size() / 2], bounds.back(),
                    ratios[ratios.size() / 2], ratios.back());
      }
    }
  }
}

}  // namespace
