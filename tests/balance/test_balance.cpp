// Load-balanced planning of documents given per rank: plans are valid, conserve and count cost
// exactly, round-trip through the simulation, balance, respect capacities,
// and fail with messages that name what is wrong.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "balance_helpers.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace {

using baltest::I;
using cpdispatch::BalanceProblem;
using cpdispatch::PlanCost;
using cpdispatch::QkvPlan;
using ::testing::HasSubstr;

BalanceProblem problem(std::vector<std::vector<I>> docs, I C) {
  BalanceProblem p;
  p.world_size = static_cast<I>(docs.size());
  p.max_cp_degree = C;
  p.docs = std::move(docs);
  return p;
}

/// W ranks of random documents: mostly short, a few long (heavy-tailed like real data).
BalanceProblem random_problem(std::uint64_t seed, I W, I C, I tokens_per_rank) {
  cpdispatch::Rng rng(seed);
  std::vector<std::vector<I>> docs(static_cast<std::size_t>(W));
  for (auto& rank : docs) {
    I left = tokens_per_rank;
    while (left > 0) {
      const I len = std::min(left, rng.below(8) == 0 ? rng.between(1, tokens_per_rank) : rng.between(1, tokens_per_rank / 16 + 1));
      rank.push_back(len);
      left -= len;
    }
  }
  return problem(std::move(docs), C);
}

// Plans of per-rank problems keep every document on one rank: their per-rank form.
QkvPlan balanced(const BalanceProblem& p, const cpdispatch::BalanceOptions& o = {}) { return cpdispatch::to_rank_plan(cpdispatch::plan_balanced(p, o)); }
QkvPlan greedy(const BalanceProblem& p) { return cpdispatch::to_rank_plan(cpdispatch::plan_greedy(p)); }
QkvPlan unbalanced(const BalanceProblem& p) { return cpdispatch::to_rank_plan(cpdispatch::plan_unbalanced(p)); }

double imbalance(const BalanceProblem& p, const QkvPlan& plan) {
  return static_cast<double>(cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes).max_attention()) / cpdispatch::balance_lower_bound(p);
}

TEST(AttentionCost, CountsCausalTokenPairs) {
  EXPECT_EQ(cpdispatch::attention_cost(0, 1), 1);
  EXPECT_EQ(cpdispatch::attention_cost(0, 4), 10);  // 1 + 2 + 3 + 4
  EXPECT_EQ(cpdispatch::attention_cost(4, 2), 11);  // 5 + 6
  for (I p = 0; p < 20; ++p)
    for (I q = 0; q < 20; ++q) {
      I pairs = 0;
      for (I t = p; t < p + q; ++t) pairs += t + 1;
      EXPECT_EQ(cpdispatch::attention_cost(p, q), pairs) << p << ", " << q;
    }
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([] { cpdispatch::attention_cost(-1, 2); }), HasSubstr("context = -1"));
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([] { cpdispatch::attention_cost(1, I{1} << 62); }), HasSubstr("overflow"));
}

TEST(PlanCost, MatchesAPerTokenCountAndTheMetadata) {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const I W = 1 + static_cast<I>(seed % 6), C = 1 + static_cast<I>(seed % 4);
    const BalanceProblem p = random_problem(seed, W, C, 60);
    for (const QkvPlan& plan : {balanced(p), greedy(p), unbalanced(p)}) {
      const I qb = 3, kvb = 5;
      const PlanCost cost = cpdispatch::plan_cost(plan, qb, kvb);
      const baltest::Count want = baltest::count_by_token(plan, qb, kvb);
      EXPECT_EQ(cost.attention, want.attention);
      EXPECT_EQ(cost.bytes, want.bytes);
      // ... and what the metadata sends off each rank, with the KV tokens each rank holds.
      const auto m = cpdispatch::plan_qkv(plan);
      const auto Wu = static_cast<std::size_t>(W);
      I total = 0;
      for (std::size_t s = 0; s < Wu; ++s)
        for (std::size_t d = 0; d < Wu; ++d) {
          const I sent = s == d ? 0 : qb * m.q_fwd.num_recv_tokens(d, s) + kvb * m.kv_fwd.num_recv_tokens(d, s);
          EXPECT_EQ(cost.sent(s, d), sent) << s << " -> " << d;
          total += sent;
        }
      EXPECT_EQ(cost.bytes_moved, total);
      EXPECT_EQ(cost.bytes_moved, cost.query_bytes + cost.kv_bytes);
      for (std::size_t d = 0; d < Wu; ++d) EXPECT_EQ(cost.kv_tokens[d], m.kv_fwd.num_recv_tokens(d, Wu));
    }
  }
}

TEST(PlanCost, CountsEveryKvCopyOfZigZagPairs) {
  // One document of 4 shards; shards 0 and 3 attend on rank 1 (a zig-zag
  // pairing): KV shard 0 is copied to rank 1 twice, once per query shard.
  QkvPlan plan;
  plan.world_size = 2;
  plan.ranks.resize(2);
  plan.ranks[0].docs.push_back({{2, 3, 3, 2}, {1, 0, 0, 1}});
  const PlanCost c = cpdispatch::plan_cost(plan, 1, 1);
  EXPECT_EQ(c.query_bytes, 2 + 2);
  EXPECT_EQ(c.kv_bytes, 2 + 10);  // shard 0's group (2 tokens) + shard 3's group (all 10)
  EXPECT_EQ(c.sent(0, 1), 16);
  EXPECT_EQ(c.attention[1], cpdispatch::attention_cost(0, 2) + cpdispatch::attention_cost(8, 2));
}

TEST(PlanBalanced, PlansAreValidAndRoundTrip) {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const I W = 1 + static_cast<I>(seed % 8), C = 1 + static_cast<I>(seed % 5);
    BalanceProblem p = random_problem(seed, W, C, 40 + static_cast<I>(seed % 3) * 100);
    p.q_bytes = 1 + static_cast<I>(seed % 3);
    p.kv_bytes = 1 + static_cast<I>(seed % 2);
    const QkvPlan plan = balanced(p);
    ASSERT_TRUE(baltest::valid_plan(p, plan));
    ASSERT_TRUE(baltest::round_trip(plan));
    const PlanCost cost = cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes);
    const PlanCost none = cpdispatch::plan_cost(unbalanced(p), p.q_bytes, p.kv_bytes);
    EXPECT_LE(cost.max_attention(), none.max_attention());
    EXPECT_GE(static_cast<double>(cost.max_attention()), cpdispatch::balance_lower_bound(p) - 0.5);  // it is a lower bound
  }
}

TEST(PlanBalanced, BalancesLargerBatches) {
  for (std::uint64_t seed = 100; seed < 110; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (I C : {4, 8}) {
      const BalanceProblem p = random_problem(seed, 16, C, 8192);
      const QkvPlan plan = balanced(p);
      ASSERT_TRUE(baltest::valid_plan(p, plan));
      EXPECT_LE(imbalance(p, plan), 1.03);
      const QkvPlan greedy_plan = greedy(p);
      ASSERT_TRUE(baltest::valid_plan(p, greedy_plan));
    }
  }
}

TEST(PlanBalanced, IsDeterministic) {
  const BalanceProblem p = random_problem(7, 12, 4, 3000);
  const QkvPlan a = balanced(p), b = balanced(p);
  for (std::size_t r = 0; r < a.ranks.size(); ++r)
    for (std::size_t i = 0; i < a.ranks[r].docs.size(); ++i) {
      EXPECT_EQ(a.ranks[r].docs[i].shard_len, b.ranks[r].docs[i].shard_len);
      EXPECT_EQ(a.ranks[r].docs[i].dst, b.ranks[r].docs[i].dst);
    }
}

TEST(PlanBalanced, SingleDocumentIsCutIntoCEqualCostShards) {
  for (I C : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE("C = " + std::to_string(C));
    const BalanceProblem p = problem({{1000}, {}, {}, {}, {}, {}, {}, {}}, C);
    const QkvPlan plan = balanced(p);
    ASSERT_TRUE(baltest::valid_plan(p, plan));
    ASSERT_TRUE(baltest::round_trip(plan));
    const auto& doc = plan.ranks[0].docs[0];
    EXPECT_EQ(static_cast<I>(doc.shard_len.size()), C);
    for (std::size_t i = 1; i < doc.shard_len.size(); ++i) EXPECT_LE(doc.shard_len[i], doc.shard_len[i - 1]);  // later shards are shorter
    EXPECT_LE(imbalance(p, plan), 1.011);
  }
}

TEST(PlanBalanced, EqualDocumentsStayHome) {
  const BalanceProblem p = problem({{500, 20, 20}, {500, 20, 20}, {500, 20, 20}, {500, 20, 20}}, 4);
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  const PlanCost cost = cpdispatch::plan_cost(plan);
  EXPECT_EQ(cost.bytes_moved, 0);
  EXPECT_EQ(cost.max_over_mean(), 1.0);
}

TEST(PlanBalanced, OneHugeDocumentAmongTinyOnes) {
  std::vector<std::vector<I>> docs(8, std::vector<I>(50, 3));
  docs[5].insert(docs[5].begin() + 10, 4000);
  const BalanceProblem p = problem(docs, 8);
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  ASSERT_TRUE(baltest::round_trip(plan));
  EXPECT_LE(imbalance(p, plan), 1.03);
  EXPECT_GT(plan.ranks[5].docs[10].shard_len.size(), 1u);
  // The tiny documents stay home: only the huge one is worth cutting.
  for (std::size_t r = 0; r < 8; ++r)
    for (std::size_t i = 0; i < docs[r].size(); ++i)
      if (docs[r][i] == 3) {
        EXPECT_EQ(plan.ranks[r].docs[i].dst, std::vector<I>{static_cast<I>(r)}) << r << ", " << i;
      }
}

TEST(PlanBalanced, OneRank) {
  const BalanceProblem p = problem({{5, 900, 7}}, 4);
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  for (const auto& doc : plan.ranks[0].docs) EXPECT_EQ(doc.dst, std::vector<I>{0});
  EXPECT_EQ(cpdispatch::plan_cost(plan).bytes_moved, 0);
}

TEST(PlanBalanced, DocumentsShorterThanC) {
  const BalanceProblem p = problem({{1, 2, 3, 2, 1, 3}, {}, {1}, {}}, 8);
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));  // every shard has at least one token
  ASSERT_TRUE(baltest::round_trip(plan));
  const BalanceProblem single = problem({{3}, {}, {}, {}}, 8);
  const QkvPlan cut = balanced(single);
  ASSERT_TRUE(baltest::valid_plan(single, cut));
  EXPECT_LE(cut.ranks[0].docs[0].shard_len.size(), 3u);
}

TEST(PlanBalanced, NoDocumentsAtAll) {
  const BalanceProblem p = problem({{}, {}, {}}, 2);
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  EXPECT_EQ(cpdispatch::balance_lower_bound(p), 0.0);
}

TEST(PlanBalanced, WeighsQueryAndKvBytes) {
  // With expensive key-values, moving a document's head (whose KV group is
  // only itself) beats moving its tail (whose KV group is the whole document).
  BalanceProblem p = problem({{2000}, {}}, 2);
  p.kv_bytes = 8;
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  const auto& doc = plan.ranks[0].docs[0];
  ASSERT_EQ(doc.dst.size(), 2u);
  EXPECT_EQ(doc.dst, (std::vector<I>{1, 0}));  // the head goes, the tail stays home
  EXPECT_LE(imbalance(p, plan), 1.011);
}

TEST(PlanBalanced, CostLimitTradesBalanceForBytes) {
  const BalanceProblem p = random_problem(11, 16, 4, 4096);
  const PlanCost tight = cpdispatch::plan_cost(balanced(p));
  cpdispatch::BalanceOptions loose;
  loose.cost_limit = tight.max_attention() * 13 / 10;
  const PlanCost relaxed = cpdispatch::plan_cost(balanced(p, loose));
  EXPECT_LE(relaxed.max_attention(), loose.cost_limit);
  EXPECT_LE(relaxed.bytes_moved, tight.bytes_moved);
  loose.cost_limit = cpdispatch::plan_cost(unbalanced(p)).max_attention();
  EXPECT_EQ(cpdispatch::plan_cost(balanced(p, loose)).bytes_moved, 0);
}

TEST(PlanBalanced, RespectsReceiveCapacities) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    BalanceProblem p = random_problem(seed, 6, 4, 500);
    I longest = 0;
    for (const auto& r : p.docs)
      for (I len : r) longest = std::max(longest, len);
    p.recv_capacity.assign(6, std::max<I>(longest, 650));
    const QkvPlan plan = balanced(p);
    ASSERT_TRUE(baltest::valid_plan(p, plan));  // checks kv_tokens <= recv_capacity
  }
}

TEST(PlanBalanced, CapacityForcesDocumentsAway) {
  // Rank 0 may hold 100 KV tokens, so its 300 tokens of documents must leave
  // even though balance alone would not ask for it.
  BalanceProblem p = problem({{100, 100, 100}, {100}, {100}, {100}}, 2);
  p.recv_capacity = {100, 1000, 1000, 1000};
  const QkvPlan plan = balanced(p);
  ASSERT_TRUE(baltest::valid_plan(p, plan));
  EXPECT_LE(cpdispatch::plan_cost(plan).kv_tokens[0], 100);
}

TEST(PlanBalanced, InfeasibleCapacityNamesRankAndAmounts) {
  BalanceProblem p = problem({{50, 700}, {30}}, 4);
  p.recv_capacity = {600, 650};
  const std::string m = baltest::message_of<cpdispatch::capacity_error>([&] { balanced(p); });
  EXPECT_THAT(m, HasSubstr("docs[0][1] has 700 tokens"));
  EXPECT_THAT(m, HasSubstr("largest recv_capacity is 650 tokens (rank 1)"));
  p.recv_capacity = {700, 70};
  const std::string total = baltest::message_of<cpdispatch::capacity_error>([&] { balanced(p); });
  EXPECT_THAT(total, HasSubstr("total 770 tokens, but the documents hold 780"));
}

TEST(PlanBalanced, RejectsMalformedProblems) {
  using cpdispatch::invalid_input;
  auto msg = [](BalanceProblem p) { return baltest::message_of<invalid_input>([&] { balanced(p); }); };
  EXPECT_THAT(msg(problem({}, 2)), HasSubstr("world_size = 0"));
  BalanceProblem p = problem({{4}, {5}}, 2);
  p.world_size = 3;
  EXPECT_THAT(msg(p), HasSubstr("docs has 2 ranks, but world_size = 3"));
  EXPECT_THAT(msg(problem({{4}, {5, 0}}, 2)), HasSubstr("docs[1][1] = 0 must be positive"));
  EXPECT_THAT(msg(problem({{4}}, 0)), HasSubstr("max_cp_degree = 0"));
  EXPECT_THAT(msg(problem({{4}}, cpdispatch::max_supported_cp_degree + 1)), HasSubstr("max_cp_degree = 65537 exceeds"));
  p = problem({{4}, {5}}, 2);
  p.recv_capacity = {10};
  EXPECT_THAT(msg(p), HasSubstr("recv_capacity has 1 entries"));
  p.recv_capacity = {10, -1};
  EXPECT_THAT(msg(p), HasSubstr("recv_capacity[1] = -1"));
  p = problem({{4}, {5}}, 2);
  p.kv_bytes = -2;
  EXPECT_THAT(msg(p), HasSubstr("kv_bytes = -2"));
  EXPECT_THAT(msg(problem({{I{1} << 40}}, 2)), HasSubstr("overflows 64 bits"));
}

TEST(PlanBalanced, ThePlanningPageSnippet) {  // docs/planning.md, "Load-balanced planning"
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 8;                                   // C: the most shards per document
  // A packed batch: every document's pieces in causal order, {home rank, tokens}.
  p.documents = {{{{0, 11000}, {1, 2000}}},              // starts on rank 0, continues on rank 1
                 {{{1, 9000}, {2, 11000}, {3, 3000}}},   // spans ranks 1 to 3
                 {{{3, 8000}}}};
  // (or p.docs = {{...}, ...}: the lengths of the whole documents on each rank)
  p.q_bytes = 8192;                                      // optional: bytes per query token,
  p.kv_bytes = 4096;                                     //   per key-value token

  cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);  // deterministic
  cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);        // ready to dispatch
  cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes);
  // cost.attention[r], cost.max_over_mean(), cost.bytes_moved, cost.sent(src, dst)
  double bound = cpdispatch::balance_lower_bound(p);     // no plan's max is below this

  ASSERT_TRUE(baltest::valid_packed_plan(p, plan));
  EXPECT_EQ(meta.attn.seqlens_q.size(), 4u);
  EXPECT_LE(static_cast<double>(cost.max_attention()), bound * 1.011);
  EXPECT_GT(static_cast<double>(cpdispatch::plan_cost(cpdispatch::plan_unbalanced(p)).max_attention()), bound * 1.5);
}

TEST(LowerBound, IsTheMeanOrTheCheapestCutOfTheCostliestDocument) {
  EXPECT_EQ(cpdispatch::balance_lower_bound(problem({{10}, {10}}, 2)), 55.0);           // the mean
  EXPECT_EQ(cpdispatch::balance_lower_bound(problem({{4}, {}, {}, {}}, 4)), 4.0);       // shards 1,2,3,4: the last costs 4
  EXPECT_EQ(cpdispatch::balance_lower_bound(problem({{4}, {}, {}, {}}, 2)), 6.0);       // [0,3) = 6, [3,4) = 4
  EXPECT_EQ(cpdispatch::balance_lower_bound(problem({{2}, {}, {}, {}}, 8)), 2.0);       // at most 2 shards of one token
  // Never above what a plan reaches.
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const BalanceProblem p = random_problem(seed, 5, 3, 200);
    EXPECT_LE(cpdispatch::balance_lower_bound(p), static_cast<double>(cpdispatch::plan_cost(balanced(p)).max_attention()));
  }
}

TEST(PlanGreedy, MovesUntilWithinTenPercentOrStuck) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const BalanceProblem p = random_problem(seed, 8, 8, 2000);
    const QkvPlan plan = greedy(p);
    ASSERT_TRUE(baltest::valid_plan(p, plan));
    ASSERT_TRUE(baltest::round_trip(plan));
  }
  // Many small documents: greedy reaches its 10%.
  std::vector<std::vector<I>> docs(8);
  for (std::size_t r = 0; r < 8; ++r) docs[r].assign(10 + 10 * r, 20);
  const BalanceProblem p = problem(docs, 4);
  EXPECT_LE(imbalance(p, greedy(p)), 1.10);
  EXPECT_GT(imbalance(p, unbalanced(p)), 1.5);
}

// The planning grid on documents per rank (whole documents: every shard
// boundary is the balancer's cut): on a multiple of the grid in the packed
// coordinate, rank 0's documents first; the plan valid, near the grid's
// bound, with its capacities; a bad grid named.
TEST(PlanBalanced, PerRankDocumentsAreCutOnTheGrid) {
  std::size_t cuts = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    BalanceProblem p = random_problem(seed, 2 + static_cast<I>(seed % 7), 2 + static_cast<I>(seed % 5), 700 + 33 * static_cast<I>(seed));
    if (seed % 5 == 0) p.recv_capacity.assign(static_cast<std::size_t>(p.world_size), 2100 + 66 * static_cast<I>(seed));
    cpdispatch::BalanceOptions o;
    o.grid = std::vector<I>{8, 13, 64}[seed % 3];
    o.dedup = seed % 4 == 0;
    SCOPED_TRACE("seed " + std::to_string(seed) + ", grid " + std::to_string(o.grid));
    const QkvPlan plan = balanced(p, o);
    ASSERT_TRUE(baltest::valid_plan(p, plan));
    const ::testing::AssertionResult on = baltest::cuts_on_grid(p, cpdispatch::to_documents(plan), o.grid);
    ASSERT_TRUE(on);
    cuts += static_cast<std::size_t>(std::stoul(on.message()));
    EXPECT_FALSE(cpdispatch::first_off_grid(plan, o.grid));
    const double bound = cpdispatch::balance_lower_bound(p, o);
    EXPECT_GE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), bound - 0.5);
    EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), 1.25 * bound);
  }
  EXPECT_GT(cuts, 50u);
  cpdispatch::BalanceOptions bad;
  bad.grid = 0;
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { balanced(problem({{4}, {5}}, 2), bad); }),
              HasSubstr("plan_balanced: BalanceOptions::grid = 0 must be in [1, 2^40]"));
}

}  // namespace
