// Node-level KV exchange planning (docs/node-exchange.md): the page's worked
// example, per-rank planning against the global one, and the inter-node token
// counts against a direct count over the entries.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "node_cases.hpp"

namespace {

using cpdispatch::NodePiece;
using cpdispatch::RankNodeWire;
using cpdispatch::Topology;
using P = NodePiece;

/// The worked example of docs/node-exchange.md: W = 4, ranks_per_node = 2.
cpdispatch::QkvDocumentsPlan worked_example() {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{0, 2, 2}, {0, 3, 3}, {1, 1, 2}, {1, 2, 0}}}, {{{3, 4, 1}}}};
  return plan;
}

std::vector<std::size_t> splits(std::vector<std::size_t> per_peer) {
  std::vector<std::size_t> out(1, 0);
  for (std::size_t n : per_peer) out.push_back(out.back() + n);
  return out;
}

TEST(NodeWirePlan, WorkedExampleMatchesTheDocumentedWire) {
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(worked_example());
  const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(meta.kv_fwd, Topology::uniform(4, 2));
  const std::vector<std::int64_t> source = {2, 2, 0, -1, 3, 3, 0, -1, 2, 1, -1, -1, 1, -1, -1, -1,
                                            -1, -1, -1, -1, -1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1};
  EXPECT_EQ(std::vector<std::int64_t>(node.source.data(), node.source.data() + node.source.numel()), source);
  ASSERT_EQ(node.ranks.size(), 4u);
  const RankNodeWire& r0 = node.ranks[0];
  EXPECT_EQ(r0.between.send, (std::vector<P>{{2, 2, 0, 0, false}, {3, 3, 2, 2, false}}));
  EXPECT_EQ(r0.between.send_splits, splits({0, 0, 1, 1}));
  EXPECT_TRUE(r0.between.recv.empty());
  EXPECT_EQ(r0.inside.send, (std::vector<P>{{0, 2, 0, 10, false}, {0, 3, 2, 12, false}}));
  EXPECT_EQ(r0.inside.recv, (std::vector<P>{{0, 2, 0, 0, false}, {0, 3, 2, 2, false}, {1, 1, 5, 5, false}, {1, 2, 6, 6, false}}));
  EXPECT_EQ(r0.inside.recv_splits, splits({2, 2, 0, 0}));
  EXPECT_EQ(r0.replica_mask, (std::vector<std::uint8_t>{1, 0, 1, 0, 1, 0, 1, 0}));
  EXPECT_EQ(r0.wire_tokens, 8);
  EXPECT_EQ(r0.mlp_tokens, 5);

  const RankNodeWire& r1 = node.ranks[1];
  EXPECT_EQ(r1.between.send, (std::vector<P>{{2, 1, 0, 0, false}}));
  EXPECT_EQ(r1.between.recv, (std::vector<P>{{3, 4, 0, 0, false}}));
  EXPECT_EQ(r1.inside.send, (std::vector<P>{{0, 1, 0, 3, false}, {0, 2, 1, 1, false}, {1, 4, 0, -1, true}}));
  EXPECT_EQ(r1.inside.recv, (std::vector<P>{{1, 4, 0, -1, false}}));
  EXPECT_EQ(r1.relay_offset, (std::vector<std::int64_t>{0}));
  EXPECT_EQ(r1.gather_splits, (std::vector<std::size_t>{0, 0}));
  EXPECT_EQ(r1.replica_mask, (std::vector<std::uint8_t>{1, 1, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(r1.relay_tokens, 4);

  const RankNodeWire& r2 = node.ranks[2];
  EXPECT_TRUE(r2.between.send.empty());
  EXPECT_EQ(r2.between.recv, (std::vector<P>{{0, 2, 0, 0, false}, {1, 1, 2, 2, false}}));
  EXPECT_EQ(r2.inside.send, (std::vector<P>{{2, 2, 0, -1, true}, {2, 1, 2, -1, true}, {3, 2, 0, 0, true}}));
  EXPECT_EQ(r2.inside.recv, (std::vector<P>{{2, 2, 0, -1, false}, {2, 1, 5, -1, false}, {3, 3, 2, 2, false}}));
  EXPECT_EQ(r2.relay_offset, (std::vector<std::int64_t>{0, 2}));
  EXPECT_EQ(r2.relay_wire_offset, (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(r2.gather_splits, (std::vector<std::size_t>{0, 1, 1}));
  EXPECT_EQ(r2.gather_offset, (std::vector<std::int64_t>{0}));
  EXPECT_EQ(r2.relay_tokens, 3);
  EXPECT_EQ(r2.gather_tokens, 2);
  EXPECT_EQ(r2.wire_tokens, 6);

  const RankNodeWire& r3 = node.ranks[3];
  EXPECT_EQ(r3.between.send, (std::vector<P>{{1, 4, 0, 0, false}}));
  EXPECT_EQ(r3.between.recv, (std::vector<P>{{0, 3, 0, 0, false}}));
  EXPECT_EQ(r3.inside.send, (std::vector<P>{{2, 3, 0, 0, true}, {3, 3, 0, -1, true}}));
  EXPECT_EQ(r3.inside.recv, (std::vector<P>{{2, 2, 0, 0, false}, {3, 3, 2, -1, false}}));
  EXPECT_EQ(r3.relay_wire_offset, (std::vector<std::int64_t>{2}));
  EXPECT_EQ(r3.gather_offset, (std::vector<std::int64_t>{0}));
  EXPECT_EQ(r3.replica_mask, (std::vector<std::uint8_t>{1, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(r3.gather_tokens, 3);
  EXPECT_EQ(r3.relay_tokens, 3);
  EXPECT_EQ(r0.relay_tokens, 0);
  EXPECT_EQ(r0.gather_tokens, 0);
  EXPECT_EQ(r1.gather_tokens, 0);
  EXPECT_EQ(r1.wire_tokens, 4);
  EXPECT_EQ(r3.wire_tokens, 5);

  EXPECT_EQ(cpdispatch::node_token_counts(meta.kv_fwd, Topology::uniform(4, 2)), (cpdispatch::NodeTokenCounts{17, 15, 10, 8}));
}

TEST(NodeWirePlan, PerRankPlanningEqualsTheGlobalPlan) {
  for (const node_test::Case& c : node_test::cases()) {
    SCOPED_TRACE(c.name);
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(c.plan);
    const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(meta.kv_fwd, c.topology);
    for (std::int64_t r = 0; r < c.plan.world_size; ++r) {
      EXPECT_EQ(cpdispatch::plan_node_wire_for_rank(meta.kv_fwd, c.topology, r), node.ranks[static_cast<std::size_t>(r)]) << "rank " << r;
    }
  }
}

/// Direct counts: every kv_fwd copy, every distinct (shard, destination) and
/// every distinct (shard, destination node) off the home's node.
cpdispatch::NodeTokenCounts direct_counts(const cpdispatch::Metadata& kv, const Topology& t) {
  cpdispatch::NodeTokenCounts out;
  const auto W = static_cast<std::size_t>(kv.world_size);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < kv.max_seqs(); ++g) {
      std::vector<bool> rank_seen(W, false), node_seen(static_cast<std::size_t>(t.num_nodes()), false);
      for (std::size_t c = 0; c < kv.num_copies(); ++c) {
        const std::int64_t d = kv.dst_rank(r, g, c);
        if (d < 0 || t.same_node(d, static_cast<std::int64_t>(r))) continue;
        const std::int64_t len = kv.seq_len(r, g);
        out.flat += len;
        if (!rank_seen[static_cast<std::size_t>(d)]) out.dedup += len;
        if (!node_seen[static_cast<std::size_t>(t.node_of(d))]) out.node_level += len;
        rank_seen[static_cast<std::size_t>(d)] = true;
        node_seen[static_cast<std::size_t>(t.node_of(d))] = true;
      }
    }
  }
  return out;
}

TEST(NodeWirePlan, InterNodeTokensCountEachShardOncePerDestinationNode) {
  for (const node_test::Case& c : node_test::cases()) {
    SCOPED_TRACE(c.name);
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(c.plan);
    cpdispatch::NodeTokenCounts got = cpdispatch::node_token_counts(meta.kv_fwd, c.topology);
    const cpdispatch::NodeTokenCounts want = direct_counts(meta.kv_fwd, c.topology);
    EXPECT_EQ(got.flat, want.flat);
    EXPECT_EQ(got.dedup, want.dedup);
    EXPECT_EQ(got.node_level, want.node_level);
    EXPECT_LE(got.node_level, got.dedup);
    EXPECT_LE(got.dedup, got.flat);
    // One node: nothing crosses; one rank per node: node-level is the rank-level wire.
    if (c.topology.num_nodes() == 1) {
      EXPECT_EQ(got.flat, 0);
    }
    if (c.topology.num_nodes() == c.plan.world_size) {
      EXPECT_EQ(got.node_level, got.dedup);
      EXPECT_EQ(got.dedup + got.inside, cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(meta).fwd));
    }
  }
}

TEST(NodeWirePlan, NodeKeysNumberNodesByTheirFirstRank) {
  EXPECT_EQ(Topology::from_node_keys({5, 5, 2, 5, 2}), Topology::from_nodes({0, 0, 1, 0, 1}));
  EXPECT_EQ(Topology::from_node_keys({7}).num_nodes(), 1);
}

TEST(NodeWirePlan, BadTopologiesAreRefusedByName) {
  EXPECT_THROW(Topology::uniform(4, 0), cpdispatch::invalid_input);
  EXPECT_THROW(Topology::from_nodes({0, 2, 0}), cpdispatch::invalid_input);  // node 1 empty
  EXPECT_THROW(Topology::from_nodes({0, -1}), cpdispatch::invalid_input);
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(worked_example());
  try {
    (void)cpdispatch::plan_node_wire(meta.kv_fwd, Topology::uniform(3, 1));
    ADD_FAILURE() << "a 3-rank topology for a 4-rank plan was accepted";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("world_size = 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)cpdispatch::plan_node_wire_for_rank(meta.kv_fwd, Topology::uniform(4, 2), 4), cpdispatch::invalid_input);
}

}  // namespace
