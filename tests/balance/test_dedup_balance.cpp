// Balancing for the deduplicated KV exchange (BalanceOptions::dedup): the
// plans stay valid, never balance worse nor move more wire bytes than the
// plans balanced without it (counted independently, by plan_kv_wire), and
// where it pays they put two shards of one document on one rank.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "balance_helpers.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/workload/workload.hpp"

namespace {

using baltest::I;
using cpdispatch::BalanceOptions;
using cpdispatch::BalanceProblem;
using cpdispatch::QkvDocumentsPlan;

BalanceOptions with_dedup() {
  BalanceOptions o;
  o.dedup = true;
  return o;
}

/// Key-value tokens the deduplicated exchange sends between ranks (section 2c).
I wire_kv_tokens(const QkvDocumentsPlan& plan) {
  return cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(cpdispatch::plan_qkv(plan)).fwd);
}

/// Bytes on the wire with dedup: queries attended off their home, and the wire's key-values.
I wire_bytes(const BalanceProblem& p, const QkvDocumentsPlan& plan) {
  return cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes).query_bytes + p.kv_bytes * wire_kv_tokens(plan);
}

I max_cost(const QkvDocumentsPlan& plan) { return cpdispatch::plan_cost(plan).max_attention(); }

/// Whether some rank attends two shards of one document that it is not home to
/// (with dedup it receives their shared key-values once).
bool shares_a_rank(const QkvDocumentsPlan& plan) {
  for (const auto& doc : plan.documents)
    for (std::size_t i = 0; i < doc.shards.size(); ++i)
      for (std::size_t j = i + 1; j < doc.shards.size(); ++j)
        if (doc.shards[i].dst == doc.shards[j].dst && doc.shards[j].dst != doc.shards[j].rank) return true;
  return false;
}

/// A packed batch of heavy-tailed lengths over W ranks (long documents span ranks).
BalanceProblem random_batch(std::uint64_t seed) {
  cpdispatch::Rng rng(seed);
  const I tokens = 30 + static_cast<I>(seed % 4) * 60;
  std::vector<I> sample;
  for (int i = 0; i < 32; ++i) sample.push_back(rng.below(6) == 0 ? rng.between(1, 3 * tokens) : rng.between(1, tokens / 8 + 1));
  BalanceProblem p;
  p.world_size = 1 + static_cast<I>(seed % 9);
  p.documents = cpdispatch::draw_workload(sample, p.world_size, tokens, rng);
  p.max_cp_degree = std::max<I>(1 + static_cast<I>(seed % 6), static_cast<I>(cpdispatch::widest_span(p.documents)));
  p.q_bytes = 1 + static_cast<I>(seed % 3);
  p.kv_bytes = 1 + static_cast<I>(seed % 2);
  return p;
}

TEST(DedupBalance, PlansAreValidAndNeverWorseThanBalancingWithout) {
  int fewer = 0, shared = 0;
  for (std::uint64_t seed = 1; seed <= 80; ++seed) {
    const BalanceProblem p = random_batch(seed);
    SCOPED_TRACE("seed " + std::to_string(seed) + ", W " + std::to_string(p.world_size) + ", C " + std::to_string(p.max_cp_degree));
    const QkvDocumentsPlan plain = cpdispatch::plan_balanced(p), dedup = cpdispatch::plan_balanced(p, with_dedup());
    ASSERT_TRUE(baltest::valid_packed_plan(p, dedup));
    EXPECT_LE(max_cost(dedup), max_cost(plain));
    EXPECT_LE(wire_bytes(p, dedup), wire_bytes(p, plain));
    fewer += wire_bytes(p, dedup) < wire_bytes(p, plain);
    shared += shares_a_rank(dedup);
  }
  // The option does change plans on these batches, and does co-locate shards.
  EXPECT_GT(fewer, 5);
  EXPECT_GT(shared, 5);
}

TEST(DedupBalance, ReceiveCapacitiesAndPerRankDocumentsStillHold) {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    BalanceProblem p = random_batch(seed);
    // Room for the whole batch on every rank but the KV groups of balancing: each rank at most twice its own tokens plus its largest document.
    I widest = 0;
    std::vector<I> held(static_cast<std::size_t>(p.world_size), 0);
    for (const auto& doc : p.documents) {
      I len = 0;
      for (const auto& pc : doc.pieces) len += pc.len, held[static_cast<std::size_t>(pc.rank)] += pc.len;
      widest = std::max(widest, len);
    }
    for (I h : held) p.recv_capacity.push_back(2 * h + widest);
    SCOPED_TRACE("seed " + std::to_string(seed));
    ASSERT_TRUE(baltest::valid_packed_plan(p, cpdispatch::plan_balanced(p, with_dedup())));
  }
  BalanceProblem per_rank;
  per_rank.world_size = 3;
  per_rank.max_cp_degree = 4;
  per_rank.docs = {{900, 40, 7}, {30}, {300, 20}};
  const QkvDocumentsPlan plan = cpdispatch::plan_balanced(per_rank, with_dedup());
  ASSERT_TRUE(baltest::valid_plan(per_rank, cpdispatch::to_rank_plan(plan)));
  EXPECT_LE(max_cost(plan), max_cost(cpdispatch::plan_balanced(per_rank)));
}

// Rank 1 holds document 1 (11 tokens) and the first 5 tokens of document 2,
// whose other 9 are on rank 0; rank 2 holds a 6-token document. Balanced
// without dedup, rank 2 takes the front of document 1 and of document 2's
// second piece, receiving key-values of both; with dedup it takes all of
// document 2 up to token 9 -- two shards, from ranks 1 and 0 -- and the
// second shard's context is already there.
TEST(DedupBalance, TwoShardsOfOneDocumentShareARankAndMoveFewerKeyValues) {
  BalanceProblem p;
  p.world_size = 3;
  p.max_cp_degree = 3;
  p.documents = {{{{2, 6}}}, {{{1, 11}}}, {{{1, 5}, {0, 9}}}};
  const QkvDocumentsPlan plain = cpdispatch::plan_balanced(p), dedup = cpdispatch::plan_balanced(p, with_dedup());
  ASSERT_TRUE(baltest::valid_packed_plan(p, dedup));
  EXPECT_FALSE(shares_a_rank(plain));
  const auto& doc = dedup.documents[2].shards;
  ASSERT_GE(doc.size(), 2u);
  EXPECT_EQ(doc[0].dst, doc[1].dst);
  EXPECT_NE(doc[0].rank, doc[1].rank);
  EXPECT_EQ(max_cost(dedup), max_cost(plain));  // equal balance
  EXPECT_LT(wire_kv_tokens(dedup), wire_kv_tokens(plain));
  EXPECT_LE(cpdispatch::plan_cost(dedup).query_bytes, cpdispatch::plan_cost(plain).query_bytes);
  // Without dedup the same plan would copy document 2's first shard twice to that rank.
  EXPECT_GT(cpdispatch::off_rank_tokens(cpdispatch::plan_qkv(dedup).kv_fwd), wire_kv_tokens(dedup));
}

TEST(DedupBalance, EdgeSettingsPlanAndFailAsWithout) {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    BalanceProblem p = random_batch(seed);
    p.max_cp_degree = static_cast<I>(cpdispatch::widest_span(p.documents));  // as few shards as the pieces allow
    p.q_bytes = static_cast<I>(seed % 2);  // 0: only key-values weigh
    p.kv_bytes = static_cast<I>(seed % 3 == 0 ? 0 : 3);
    SCOPED_TRACE("seed " + std::to_string(seed));
    const QkvDocumentsPlan dedup = cpdispatch::plan_balanced(p, with_dedup());
    ASSERT_TRUE(baltest::valid_packed_plan(p, dedup));
    EXPECT_LE(max_cost(dedup), max_cost(cpdispatch::plan_balanced(p)));
  }
  // Capacities too small for any plan fail the same way with dedup.
  BalanceProblem tight;
  tight.world_size = 2;
  tight.max_cp_degree = 2;
  tight.documents = {{{{0, 50}}}, {{{1, 40}}}};
  tight.recv_capacity = {30, 60};
  EXPECT_EQ(baltest::message_of<cpdispatch::capacity_error>([&] { cpdispatch::plan_balanced(tight, with_dedup()); }),
            baltest::message_of<cpdispatch::capacity_error>([&] { cpdispatch::plan_balanced(tight); }));
}

TEST(DedupBalance, OffByDefaultAndDeterministic) {
  const BalanceProblem p = random_batch(51);
  EXPECT_FALSE(BalanceOptions{}.dedup);
  EXPECT_EQ(cpdispatch::plan_balanced(p, with_dedup()).documents, cpdispatch::plan_balanced(p, with_dedup()).documents);
  BalanceOptions off;
  off.dedup = false;
  EXPECT_EQ(cpdispatch::plan_balanced(p, off).documents, cpdispatch::plan_balanced(p).documents);
}

// The planning grid with dedup: the sharing constructions and the pass that
// moves single shards cut nothing new, so every cut stays on the grid, and
// balancing for dedup costs no balance against the grid's plan without it.
TEST(DedupBalance, EveryCutFallsOnTheGrid) {
  std::size_t cuts = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const BalanceProblem p = random_batch(seed);
    const I G = 2 + static_cast<I>(seed % 5) * 3;
    SCOPED_TRACE("seed " + std::to_string(seed) + ", G " + std::to_string(G));
    BalanceOptions plain_options;
    plain_options.grid = G;
    BalanceOptions dedup_options = with_dedup();
    dedup_options.grid = G;
    const QkvDocumentsPlan plain = cpdispatch::plan_balanced(p, plain_options), dedup = cpdispatch::plan_balanced(p, dedup_options);
    ASSERT_TRUE(baltest::valid_packed_plan(p, dedup));
    const ::testing::AssertionResult on = baltest::cuts_on_grid(p, dedup, G);
    ASSERT_TRUE(on);
    cuts += static_cast<std::size_t>(std::stoul(on.message()));
    EXPECT_LE(max_cost(dedup), max_cost(plain));
    EXPECT_LE(wire_bytes(p, dedup), wire_bytes(p, plain));
  }
  EXPECT_GT(cuts, 20u);
}

}  // namespace
