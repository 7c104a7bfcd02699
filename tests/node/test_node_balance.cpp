// Topology-aware balancing (place_on_topology, plan_balanced with a
// topology): the same balance as the topology-blind plan (every rank's
// attention cost is some rank's cost of the blind plan), never more weighted
// bytes, and on batches of the ProLong and WLB-LLM samples at most half the
// key-value tokens between nodes of rank-level dedup on the blind plan.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/balance/topology_balance.hpp"
#include "cpdispatch/workload/workload.hpp"

namespace {

using cpdispatch::Topology;

/// Bytes of a plan's exchanges weighted as place_on_topology weighs them, and those between nodes.
struct Weighted {
  double weighted = 0;
  std::int64_t inter_node = 0;
};

Weighted weigh(const cpdispatch::QkvDocumentsPlan& plan, const Topology& t, double ratio, std::int64_t kv_bytes = 1) {
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, 1, kv_bytes);
  Weighted out;
  const auto W = static_cast<std::size_t>(plan.world_size);
  for (std::size_t s = 0; s < W; ++s)
    for (std::size_t d = 0; d < W; ++d) {
      const std::int64_t b = cost.sent(s, d);
      const bool across = !t.same_node(static_cast<std::int64_t>(s), static_cast<std::int64_t>(d));
      out.weighted += static_cast<double>(b) * (across ? ratio : 1.0);
      if (across) out.inter_node += b;
    }
  return out;
}

std::vector<std::int64_t> sorted_attention(const cpdispatch::QkvDocumentsPlan& plan) {
  std::vector<std::int64_t> a = cpdispatch::plan_cost(plan).attention;
  std::sort(a.begin(), a.end());
  return a;
}

TEST(NodeBalance, SameBalanceAndNeverMoreWeightedBytesOnRandomBatches) {
  for (std::int64_t W : {2, 5, 8, 12}) {
    for (const auto& nodes : {Topology::uniform(W, 4), Topology::uniform(W, 2), Topology::from_nodes([&] {
           std::vector<std::int64_t> m(static_cast<std::size_t>(W));
           for (std::int64_t r = 0; r < W; ++r) m[static_cast<std::size_t>(r)] = r % 2 == 0 || W < 2 ? 0 : 1;
           return m;
         }())}) {
      for (std::uint64_t seed = 0; seed < 3; ++seed) {
        cpdispatch::Rng rng(seed * 7 + static_cast<std::uint64_t>(W));
        cpdispatch::BalanceProblem p;
        p.world_size = W;
        p.max_cp_degree = 4;
        p.kv_bytes = 2;
        for (std::int64_t r = 0; r < W; ++r) p.docs.push_back({rng.between(1, 300), rng.between(1, 60)});
        const cpdispatch::QkvDocumentsPlan blind = cpdispatch::plan_balanced(p);
        const cpdispatch::QkvDocumentsPlan placed = cpdispatch::plan_balanced(p, {}, nodes, 9.0);
        SCOPED_TRACE("W " + std::to_string(W) + " seed " + std::to_string(seed));
        EXPECT_LE(cpdispatch::plan_cost(placed).max_attention(), cpdispatch::plan_cost(blind).max_attention());
        EXPECT_EQ(cpdispatch::plan_cost(placed).total_attention(), cpdispatch::plan_cost(blind).total_attention());
        EXPECT_LE(weigh(placed, nodes, 9.0, 2).weighted, weigh(blind, nodes, 9.0, 2).weighted);
        const cpdispatch::QkvDocumentsPlan relabelled = cpdispatch::relabel_attention_ranks(blind, p, nodes, 9.0);
        EXPECT_EQ(sorted_attention(relabelled), sorted_attention(blind));
        EXPECT_LE(weigh(relabelled, nodes, 9.0, 2).weighted, weigh(blind, nodes, 9.0, 2).weighted);
        (void)cpdispatch::plan_qkv(placed);  // a valid plan
      }
    }
  }
}

std::vector<std::int64_t> sample(const std::string& name) {
  std::ifstream in(std::filesystem::path(CPDISPATCH_DOC_LENGTHS_DIR) / (name + ".json"));
  return nlohmann::json::parse(in).get<std::vector<std::int64_t>>();
}

// The benchmark's configuration (two nodes of 8 ranks, 32K tokens a rank, a
// layer's bytes, C = 8 or a document's span, batches 0-7): the node-level
// exchange on the topology-aware plan sends at most half the key-value tokens
// between nodes that rank-level dedup sends on the topology-blind plan, at a
// largest rank cost no higher in any batch.
TEST(NodeBalance, NodeLevelSendsAtMostHalfOfBlindDedupBetweenNodesOnTheSamples) {
  const std::int64_t W = 16;
  const Topology nodes = Topology::uniform(W, 8);
  for (const std::string name : {"prolong", "wlbllm"}) {
    const std::vector<std::int64_t> lengths = sample(name);
    std::int64_t blind_dedup = 0, aware_node_level = 0;
    for (std::uint64_t seed = 0; seed < 8; ++seed) {
      cpdispatch::BalanceProblem p;
      p.world_size = W;
      p.q_bytes = 8192;
      p.kv_bytes = 4096;
      p.documents = cpdispatch::draw_workload(lengths, W, 32 * 1024, seed);
      p.max_cp_degree = std::max<std::int64_t>(8, static_cast<std::int64_t>(cpdispatch::widest_span(p.documents)));
      const cpdispatch::QkvDocumentsPlan blind = cpdispatch::plan_balanced(p);
      const cpdispatch::QkvDocumentsPlan aware = cpdispatch::plan_balanced(p, {}, nodes);
      EXPECT_LE(cpdispatch::plan_cost(aware).max_attention(), cpdispatch::plan_cost(blind).max_attention()) << name << " seed " << seed;
      blind_dedup += cpdispatch::node_token_counts(cpdispatch::plan_qkv(blind).kv_fwd, nodes).dedup;
      aware_node_level += cpdispatch::node_token_counts(cpdispatch::plan_qkv(aware).kv_fwd, nodes).node_level;
    }
    EXPECT_LE(2 * aware_node_level, blind_dedup) << name << ": node-level " << aware_node_level << " against blind dedup " << blind_dedup;
  }
}

// Ranks 0, 1 (node 0) and 2, 3 (node 1) are all at the largest cost: each of
// two documents attends its second shard on the other node, and no rank has
// room for a plain move, so only trading the two shards brings both home.
TEST(NodeBalance, FullRanksTradeShardsBackIntoTheirNodes) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{0, 10, 0}, {0, 10, 2}}}, {{{2, 10, 2}, {2, 10, 0}}}, {{{1, 20, 1}}}, {{{3, 20, 3}}}};
  const Topology nodes = Topology::uniform(4, 2);
  const cpdispatch::BalanceProblem p = cpdispatch::balance_problem_of(plan);
  ASSERT_EQ(cpdispatch::node_token_counts(cpdispatch::plan_qkv(plan).kv_fwd, nodes).node_level, 40);
  const cpdispatch::QkvDocumentsPlan placed = cpdispatch::place_on_topology(plan, p, nodes);
  EXPECT_EQ(cpdispatch::node_token_counts(cpdispatch::plan_qkv(placed).kv_fwd, nodes).node_level, 0);
  EXPECT_EQ(weigh(placed, nodes, 9.0).inter_node, 0);
  EXPECT_EQ(sorted_attention(placed), sorted_attention(plan));
}

// Every rank is at the largest cost, and every other rank's share is cheapest
// where it is. Document A (home rank 2, node 1) attends on rank 0 (node 0),
// and three small documents of rank 0 attend on rank 3 (node 1). No shard of
// rank 3 alone, nor two of them, makes room for A: only sending all three home
// (to the rank A leaves) brings everything home.
TEST(NodeBalance, AFullRankSendsSeveralShardsAwayToTakeOneHome) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{2, 9, 0}}}, {{{0, 9, 0}}}, {{{0, 9, 0}}}, {{{0, 5, 3}}}, {{{0, 5, 3}}}, {{{0, 5, 3}}}, {{{3, 9, 3}}}, {{{3, 9, 3}}},
                    {{{1, 9, 1}}}, {{{1, 9, 1}}}, {{{1, 9, 1}}}, {{{2, 9, 2}}}, {{{2, 9, 2}}}, {{{2, 9, 2}}}};
  const Topology nodes = Topology::uniform(4, 2);
  const cpdispatch::BalanceProblem p = cpdispatch::balance_problem_of(plan);
  ASSERT_EQ(cpdispatch::plan_cost(plan).attention, (std::vector<std::int64_t>{135, 135, 135, 135}));
  ASSERT_EQ(cpdispatch::node_token_counts(cpdispatch::plan_qkv(plan).kv_fwd, nodes).node_level, 24);
  const cpdispatch::QkvDocumentsPlan placed = cpdispatch::place_on_topology(plan, p, nodes);
  EXPECT_EQ(cpdispatch::node_token_counts(cpdispatch::plan_qkv(placed).kv_fwd, nodes).node_level, 0);
  EXPECT_EQ(weigh(placed, nodes, 9.0).inter_node, 0);
  EXPECT_EQ(sorted_attention(placed), sorted_attention(plan));
}

TEST(NodeBalance, RefusesABadRatioOrTopology) {
  cpdispatch::BalanceProblem p;
  p.world_size = 2;
  p.max_cp_degree = 2;
  p.docs = {{4}, {2}};
  EXPECT_THROW((void)cpdispatch::plan_balanced(p, {}, Topology::uniform(2, 1), 0.0), cpdispatch::invalid_input);
  EXPECT_THROW((void)cpdispatch::plan_balanced(p, {}, Topology::uniform(3, 1)), cpdispatch::invalid_input);
}

}  // namespace
