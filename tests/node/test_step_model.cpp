// The step-time model of a cluster (docs/node-exchange.md, "Step-time
// model"): hand-computed small cases (grouped-query attention and USP
// among them), more bandwidth never slower, and the node-level exchange
// never more inter-node bytes than dedup, nor dedup than flat; the kernel
// priced by the entries it runs (kernel_rate.hpp): its fit, its curve, and
// a rank's compute as the sum over its entries.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../common/plan_cli.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/model/kernel_rate.hpp"
#include "cpdispatch/model/step_model.hpp"

namespace {

using cpdispatch::ClusterModel;
using cpdispatch::LayerShape;
using cpdispatch::StepTime;
using cpdispatch::Topology;

/// Round numbers: 1 byte a token, 1 FLOP a pair-dim, links of 1 and 0.5 tokens a second.
ClusterModel unit_cluster(std::int64_t ranks_per_node) {
  ClusterModel c;
  c.intra = {1.0, 0.0};
  c.inter = {0.5, 0.0};
  c.attention_flops = 1.0;
  c.ranks_per_node = ranks_per_node;
  return c;
}
LayerShape unit_shape() { return {1, 1, 1, 1}; }

/// Two ranks on two nodes: document 0 (home 0) of 4 tokens, its second shard attended on rank 1.
cpdispatch::QkvDocumentsPlan two_rank_plan() {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 2, 0}, {0, 2, 1}}}};
  return plan;
}

std::vector<StepTime> model(const cpdispatch::QkvDocumentsPlan& plan, const ClusterModel& c, const LayerShape& s) {
  return cpdispatch::model_step(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), cpdispatch::document_lengths(plan),
                                Topology::uniform(plan.world_size, c.ranks_per_node), c, s);
}

/// Round numbers for the kernel's terms: 1 FLOP/s, and each other term its own size.
cpdispatch::KernelRate unit_kernel() {
  cpdispatch::KernelRate k;
  k.peak = 1.0;
  k.pair_seconds = 0.5;
  k.row_seconds = 2.0;
  k.cut_row_seconds = 1.0;
  k.entry_seconds = 10.0;
  return k;
}

TEST(StepModel, HandComputedTwoRanks) {
  const auto rows = model(two_rank_plan(), unit_cluster(1), unit_shape());
  // Rank 1 attends queries 2-3 against keys 0-3: 3 + 4 = 7 pairs, 28 FLOPs forward.
  // Both shards are home on rank 0, so rank 1 receives 2 query tokens (2 bytes, 4 s at
  // 0.5 B/s across nodes), 4 KV tokens (K and V: 8 bytes, 16 s) and sends 2 outputs back (4 s).
  const StepTime& flat = rows[0];
  EXPECT_DOUBLE_EQ(flat.forward_compute, 28.0);
  EXPECT_DOUBLE_EQ(flat.forward_comm, 24.0);
  EXPECT_DOUBLE_EQ(flat.forward, 28.0 + 24.0);  // one stage: nothing hides
  EXPECT_DOUBLE_EQ(flat.backward_compute, 70.0);
  EXPECT_DOUBLE_EQ(flat.step, flat.forward + flat.backward);
  EXPECT_DOUBLE_EQ(flat.inter_node_bytes, 2 * 2 + 4 * 2);  // queries and outputs, K and V
  LayerShape staged = unit_shape();
  staged.stages = 4;
  const StepTime f4 = model(two_rank_plan(), unit_cluster(1), staged)[0];
  // Two ranks have one stage group however many stages are asked for, and rank 1 attends nothing of its
  // own: its kernel waits for the post out (20 s), the outputs' post home for the kernel.
  EXPECT_DOUBLE_EQ(f4.forward, 20.0 + 28.0 + 4.0);
}

TEST(StepModel, RanksAttendEachRoundAsItsStageGroupArrives) {
  // Three ranks on one node (1 B/s), three stages: two stage groups, a home rank's peer at distance 1
  // (the next rank) in group 0, at distance 2 in group 1. Rank 1 attends three 2-token causal documents
  // (3 pairs, 12 FLOPs, 12 s each): C its own (round 0), A from rank 0 (group 0: round 1) and B from
  // rank 2 (group 1: round 2). Out, each group's post carries 2 query and 2 key-value tokens (2 + 4
  // bytes, 6 s): A arrives at 6 s, B at 12 s. Rank 1 attends C, then A (12-24 s), then B (24-36 s); the
  // outputs go home at 36 s (rank 1 sends 2 bytes to each: 4 s).
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.documents = {{{{0, 2, 1}}}, {{{2, 2, 1}}}, {{{1, 2, 1}}}};
  LayerShape shape = unit_shape();
  shape.stages = 3;
  const StepTime flat = model(plan, unit_cluster(3), shape)[0];
  EXPECT_DOUBLE_EQ(flat.forward_comm, 6.0 + 6.0 + 4.0);
  EXPECT_DOUBLE_EQ(flat.forward, 36.0 + 4.0);
  // Backward (30 s a document): the output gradients in two groups (2 bytes each: by 2 s and 4 s); C,
  // A and B end at 30, 60 and 90 s. A's key-value gradients (group 0: 4 bytes, 4 s) go home once round 1
  // is done (60-64 s), B's once round 2 is (90-94 s); then the query gradients (4 bytes, 4 s).
  EXPECT_DOUBLE_EQ(flat.backward_comm, 2.0 + 2.0 + 4.0 + 4.0 + 4.0);
  EXPECT_DOUBLE_EQ(flat.backward, 94.0 + 4.0);
  // With one stage nothing of the exchange hides: the post out (12 s), the kernel (36 s), the outputs.
  EXPECT_DOUBLE_EQ(model(plan, unit_cluster(3), unit_shape())[0].forward, 12.0 + 36.0 + 4.0);
}

TEST(StepModel, ARankWaitsOnlyForThePeersThatSendIt) {
  // Three ranks, each its own node (0.5 B/s), one stage. Out, rank 2 sends the most (queries 2 + 1 tokens,
  // key-values 2 + 7 tokens: 3 + 18 bytes, 42 s), so every rank has its inputs at 42 s. Rank 2 computes
  // the most: its 6-token shard, 21 pairs, 84 s (ranks 0 and 1: 28 and 24 s). Home, rank 0 sends 1 output
  // to rank 2 (done at 72 s), rank 1 two to each of the others (4 bytes, 66-74 s): rank 2 receives its 3
  // bytes (6 s) after its own kernel, 126-132 s. A post does not hold the ranks together: nothing waits for a
  // rank that sends it nothing, and the busiest rank of the way home (rank 1) is not rank 2's critical path
  // (posts one after another at their busiest ranks' times would take 42 + 84 + 8 s).
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.documents = {{{{0, 2, 1}}}, {{{2, 2, 1}}}, {{{2, 6, 2}, {2, 1, 0}}}};
  const StepTime flat = model(plan, unit_cluster(1), unit_shape())[0];
  EXPECT_DOUBLE_EQ(flat.forward_comm, 42.0 + 8.0);  // the busiest ranks' posts, summed, as reported
  EXPECT_DOUBLE_EQ(flat.forward_compute, 84.0);
  EXPECT_DOUBLE_EQ(flat.forward, 42.0 + 84.0 + 6.0);
  // Backward (2.5x): rank 2 sends the output gradients out from 132 s (3 bytes: 138 s), every rank waits
  // for them (one stage); rank 2's kernel 138-348 s; the key-value gradients home: rank 0 sends rank 2
  // 7 tokens' (14 bytes, 208-236 s), rank 1 sends rank 2 2 tokens' (4 bytes, by 214 s); rank 2 receives
  // 18 bytes from 348 s on (36 s: 384 s), then the query gradients (3 bytes, 6 s: 390 s).
  EXPECT_DOUBLE_EQ(flat.backward_comm, 8.0 + 36.0 + 8.0);
  EXPECT_DOUBLE_EQ(flat.step, 348.0 + 36.0 + 6.0);
  // On the timeline, ranks 0 and 1 have their outputs home at 74 s, before rank 2 has even posted its own.
  const auto ranks = cpdispatch::model_plan_trace(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), Topology::uniform(3, 1),
                                                  unit_cluster(1), unit_shape(), false);
  for (std::size_t r : {0u, 1u}) {
    std::int64_t forward_end = 0;
    for (const cpdispatch::TraceEvent& e : ranks[r].events())
      if (std::string(e.call) == "forward") forward_end = std::max(forward_end, e.end_ns);
    EXPECT_EQ(forward_end, 74000000000) << "rank " << r;
  }
}

TEST(StepModel, RanksThatShareNoBytesRunAtTheirOwnPace) {
  // Four ranks on one node (1 B/s), one stage. Document A (2 tokens, home 0) is attended on rank 1,
  // document B (4 tokens, home 2) on rank 3; the two pairs exchange nothing with each other. Rank 1 has A
  // at 6 s (2 + 4 bytes), attends it (3 pairs, 12 s) and sends its outputs home (2 bytes): its forward
  // ends at 20 s, rank 3's at 56 s (12 bytes, 10 pairs, 4 bytes). Rank 1's backward starts at 20 s, not
  // at 56: the output gradients (2 bytes, 22 s), its kernel (30 s, to 52 s), its key-value gradients home
  // (4 bytes, 56 s), its query gradients (2 bytes, 58 s). The step is rank 3's: 56 + 4 + 100 + 8 + 4 s.
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{0, 2, 1}}}, {{{2, 4, 3}}}};
  EXPECT_DOUBLE_EQ(model(plan, unit_cluster(4), unit_shape())[0].step, 172.0);
  const auto ranks = cpdispatch::model_plan_trace(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), Topology::uniform(4, 4),
                                                  unit_cluster(4), unit_shape(), false);
  std::vector<std::string> events;
  for (const cpdispatch::TraceEvent& e : ranks[1].events()) {
    events.push_back(std::string(e.call) + " " + e.name + " " + std::to_string(e.start_ns / 1000000000) + "-" + std::to_string(e.end_ns / 1000000000));
  }
  const std::vector<std::string> expected = {"forward wait 0-6",    "forward kernel 6-18",    "forward wait 18-20", "backward wait 20-22",
                                             "backward kernel 22-52", "backward wait 52-56", "backward wait 56-58"};
  EXPECT_EQ(events, expected);
}

TEST(StepModel, HeadParallelSlabsRideThePostsOfTheDispatchedTensors) {
  // Two ranks on one node (1 B/s, 1 s a peer a post), 2 query and 2 key-value heads of 1 byte: a token's
  // Q or O is 2 bytes, its K and V 4. Document 0 (4 tokens) is head-parallel over both ranks (u = 2):
  // each rank sends the other its 2 tokens on 1 query head and 1 key-value head, 3 bytes a token out and
  // 1 home. Document 1 (2 tokens, home 0) is attended on rank 1: 2 query tokens and their key-values out
  // (4 + 8 bytes), 2 outputs home (4 bytes).
  ClusterModel c = unit_cluster(2);
  c.intra.latency = 1.0;
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.head_parallel_degree = 2;
  plan.documents = {{{{0, 2, 0}, {1, 2, 1}}}, {{{0, 2, 1}}}};
  plan.documents[0].head_parallel = true;
  const StepTime flat = model(plan, c, {2, 1, 1, 1, 2})[0];
  // Out: rank 0 sends 6 + 4 + 8 bytes in one post (18 s + 1 s); home: rank 1 sends 2 + 4 bytes (6 s + 1 s).
  // Five separate collectives would pay five latencies: 29 s.
  EXPECT_DOUBLE_EQ(flat.forward_comm, 19.0 + 7.0);
  // Rank 1 attends half the heads of document 0 (10 pairs: 5) and document 1 (3 pairs): 4 x 8 x 2 FLOPs.
  EXPECT_DOUBLE_EQ(flat.forward_compute, 64.0);
  EXPECT_DOUBLE_EQ(flat.forward, 64.0 + 26.0);
}

TEST(StepModel, ItsTimelineNamesTheOpsEventsOnEachRank) {
  // The plan of RanksAttendEachRoundAsItsStageGroupArrives, rank 1's events (seconds): its three kernel
  // rounds, the wait for the outputs' post home; backward from 40 s on, its rounds (30 s each), the wait
  // for group 1's key-value gradients (home at 94 s; group 0's at 64 s, before the rank is done) and for
  // the query gradients. A wait for what is already there takes no time; it is there, as in the op's.
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.documents = {{{{0, 2, 1}}}, {{{2, 2, 1}}}, {{{1, 2, 1}}}};
  LayerShape shape = unit_shape();
  shape.stages = 3;
  const auto ranks = cpdispatch::model_plan_trace(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), Topology::uniform(3, 3),
                                                  unit_cluster(3), shape, false);
  ASSERT_EQ(ranks.size(), 3u);
  std::vector<std::string> events;
  for (const cpdispatch::TraceEvent& e : ranks[1].events()) {
    events.push_back(std::string(e.call) + " " + e.name + " " + std::to_string(e.group) + " " + std::to_string(e.start_ns / 1000000000) + "-" +
                     std::to_string(e.end_ns / 1000000000));
  }
  const std::vector<std::string> expected = {
      "forward kernel 0 0-12",      "forward wait 0 12-12",     "forward kernel 1 12-24",    "forward wait 1 24-24",     "forward kernel 2 24-36",
      "forward wait 0 36-40",       "backward kernel 0 40-70",  "backward wait 0 70-70",     "backward kernel 1 70-100", "backward wait 1 100-100",
      "backward kernel 2 100-130",  "backward wait 0 130-130",  "backward wait 1 130-134",   "backward wait 0 134-138"};
  EXPECT_EQ(events, expected);
  // Rank 0 attends nothing: it waits for both groups, then for the outputs home.
  ASSERT_FALSE(ranks[0].events().empty());
  EXPECT_EQ(ranks[0].events()[0].end_ns, 6000000000);
  EXPECT_EQ(ranks[0].events().back().end_ns, 138000000000);
}

TEST(StepModel, HeadParallelDocumentsAreAttendedOnceEverySlabHasArrived) {
  // The plan above on two nodes (0.5 B/s, 1 s a peer a post), in two stages (one stage group on two
  // ranks). Out: rank 0 sends 18 bytes (37 s); home: rank 1 sends 6 (13 s). Rank 1's document 1
  // (24 FLOPs) and its half of document 0 (40 FLOPs) both wait for the post out; the outputs go home
  // after the kernel.
  ClusterModel c = unit_cluster(1);
  c.inter.latency = 1.0;
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.head_parallel_degree = 2;
  plan.documents = {{{{0, 2, 0}, {1, 2, 1}}}, {{{0, 2, 1}}}};
  plan.documents[0].head_parallel = true;
  const StepTime flat = model(plan, c, {2, 1, 1, 2, 2})[0];
  EXPECT_DOUBLE_EQ(flat.forward, 37.0 + 24.0 + 40.0 + 13.0);
  // Backward: the output gradients out (13 s), rank 1's backward of document 1 (60 s), whose key-value
  // gradients then go home (8 bytes: 17 s) while it attends its half of document 0 (100 s), then the
  // query gradients of both and the slabs' key-value gradients home (rank 1 sends 4 + 6 bytes: 21 s).
  EXPECT_DOUBLE_EQ(flat.backward, 13.0 + 60.0 + 100.0 + 21.0);
}

TEST(StepModel, AHeadParallelDocumentIsAttendedInTheRoundItIsWhole) {
  // Four ranks on one node (1 B/s), four stages: three stage groups (a peer at distance 1, 2, 3 in group
  // 0, 1, 2). Two query and key-value heads of 1 byte (Q or O 2 bytes a token, K and V 4). Document H
  // (4 tokens, 2 on each of ranks 0 and 1) is head-parallel over them (u = 2): each attends it whole
  // on one head (10 pairs, 40 s). Document D (2 tokens, home 2) is attended on rank 1 (3 pairs on two
  // heads, 24 s). Out: group 0 carries rank 0's slab to rank 1 (3 bytes a token: 6 s); group 1 nothing;
  // group 2 rank 1's slab to rank 0 and D (4 + 8 bytes) to rank 1, which receives 12 bytes: 12 s. Rank
  // 1 has H whole after group 0 (6 s) and attends it (6-46 s) while group 2 travels, then D (46-70 s);
  // rank 0 has H whole at 18 s (58 s). The outputs go home at 70 s: rank 1 sends 4 + 2 bytes (6 s).
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.head_parallel_degree = 2;
  plan.documents = {{{{0, 2, 0}, {1, 2, 1}}}, {{{2, 2, 1}}}};
  plan.documents[0].head_parallel = true;
  const StepTime flat = model(plan, unit_cluster(4), {2, 1, 1, 4, 2})[0];
  EXPECT_DOUBLE_EQ(flat.forward_comm, 6.0 + 0.0 + 12.0 + 6.0);
  EXPECT_DOUBLE_EQ(flat.forward, 70.0 + 6.0);  // after every group, H would end at 18 + 24 + 40 s
}

TEST(StepModel, ARankThatOnlyReceivesPaysALatencyAPeer) {
  // Three ranks on one node (1 B/s, 1 s a peer a post). Documents 0 and 1 (2 tokens each, homes 0 and 1)
  // are attended on rank 2, which sends nothing out and receives from two peers: 2 query tokens (2 bytes)
  // and 2 key-value tokens (4 bytes) from each, 12 bytes and 2 latencies: 14 s (ranks 0 and 1: 6 + 1 s).
  // Home, rank 2 sends 2 outputs to each: 4 bytes and 2 latencies, 6 s. Backward, three posts: the output
  // gradients out (6 s), the key-value gradients home (rank 2 sends 4 bytes to each: 8 bytes and 2
  // latencies, 10 s), the query gradients home (6 s).
  ClusterModel c = unit_cluster(3);
  c.intra.latency = 1.0;
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.documents = {{{{0, 2, 2}}}, {{{1, 2, 2}}}};
  const auto rows = model(plan, c, unit_shape());
  for (std::size_t form : {0u, 1u}) {  // flat and dedup send the same key-values here
    SCOPED_TRACE(rows[form].scheme);
    EXPECT_DOUBLE_EQ(rows[form].forward_comm, 14.0 + 6.0);
    EXPECT_DOUBLE_EQ(rows[form].forward_compute, 4.0 * (3 + 3));  // rank 2: two 2-token causal documents
    EXPECT_DOUBLE_EQ(rows[form].forward, 24.0 + 20.0);
    EXPECT_DOUBLE_EQ(rows[form].backward, 2.5 * 24.0 + 6.0 + 10.0 + 6.0);
  }
}

TEST(StepModel, AKeyValueHeadSharedByTheGroupGoesWholeToEachRank) {
  // Two ranks on two nodes (0.5 B/s, 1 s a peer a post), 2 query heads and 1 key-value head of 1 byte.
  // Document 0 (4 tokens, 2 a rank) is head-parallel over both (u = 2): a rank keeps 1 query head and needs
  // the one key-value head whole, so it sends the other its 2 tokens at 1 byte of Q and 2 of K and V: 6 bytes,
  // 12 s + 1 s; home, 1 byte of O a token: 2 bytes, 4 s + 1 s.
  ClusterModel c = unit_cluster(1);
  c.inter.latency = 1.0;
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.head_parallel_degree = 2;
  plan.documents = {{{{0, 2, 0}, {1, 2, 1}}}};
  plan.documents[0].head_parallel = true;
  const LayerShape shape{2, 1, 1, 1, 1};
  const StepTime flat = model(plan, c, shape)[0];
  EXPECT_DOUBLE_EQ(flat.forward_comm, 13.0 + 5.0);
  // Each rank attends the whole document (10 pairs) on one of the two query heads: 5 pairs x 4 x 2 heads.
  EXPECT_DOUBLE_EQ(flat.forward_compute, 40.0);
  EXPECT_DOUBLE_EQ(flat.step, 40.0 + 18.0 + 2.5 * 40.0 + 18.0);
  // Priced by the kernel: each rank runs one entry, the document whole on one head: 4 x 10 FLOPs at 1 FLOP/s,
  // 10 pairs x 0.5 s, 4 cut rows x (2 + 1) s and 10 s for the entry.
  c.kernel = cpdispatch::KernelRates{unit_kernel(), unit_kernel()};
  const StepTime priced = model(plan, c, shape)[0];
  EXPECT_DOUBLE_EQ(priced.forward_compute, 40.0 + 5.0 + 12.0 + 10.0);
  EXPECT_DOUBLE_EQ(priced.forward_comm, 18.0);
}

TEST(StepModel, SlidingWindowHandComputedOnTwoNodes) {
  // One document of 8 tokens under a window of 3 keys: 1 + 2 + 3 x 6 = 21 pairs. The zig-zag ring over
  // two ranks on two nodes (0.5 B/s): 10.5 pairs a rank, 42 FLOPs; one ring step of the group's 4
  // tokens of K and V (8 bytes, 16 s).
  const auto window = cpdispatch::AttentionMask::sliding_window(3);
  const StepTime ring = cpdispatch::model_zigzag_ring({8}, window, 2, unit_cluster(1), unit_shape());
  EXPECT_DOUBLE_EQ(ring.forward_compute, 42.0);
  EXPECT_DOUBLE_EQ(ring.forward_comm, 16.0);
  EXPECT_DOUBLE_EQ(ring.forward, 42.0 + 16.0);
  EXPECT_DOUBLE_EQ(ring.backward, 2.5 * 42.0 + 32.0);
  // A window as long as the document is causal: 36 pairs, 72 FLOPs a rank.
  EXPECT_DOUBLE_EQ(cpdispatch::model_zigzag_ring({8}, cpdispatch::AttentionMask::sliding_window(8), 2, unit_cluster(1), unit_shape()).forward_compute, 72.0);
  // Priced by the kernel: 4 query chunks of 2 tokens; each chunk sees 3 pairs of its own (the diagonal) and
  // 3 of the chunk before (2 for its first row, 1 for its second): 7 entries of 2 x 2 rows, 3 pairs, cut,
  // each 12 + 1.5 + 2 x 3 + 10 = 29.5 s; a rank runs half of them.
  ClusterModel c = unit_cluster(1);
  c.kernel = cpdispatch::KernelRates{unit_kernel(), unit_kernel()};
  EXPECT_DOUBLE_EQ(cpdispatch::model_zigzag_ring({8}, window, 2, c, unit_shape()).forward_compute, 7 * 29.5 / 2);
  // The plan: rank 1 attends the second half of the document, whose 4 queries see 3 keys each (12 pairs,
  // 48 FLOPs); its key-value group takes rank 0's shard whole.
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.mask = window;
  plan.documents = {{{{0, 4, 0}, {1, 4, 1}}}};
  const StepTime flat = model(plan, unit_cluster(1), unit_shape())[0];
  EXPECT_DOUBLE_EQ(flat.forward_compute, 48.0);
  // Out: 4 key-value tokens (K and V, 8 bytes) from rank 0, 16 s; nothing goes home.
  EXPECT_DOUBLE_EQ(flat.forward_comm, 16.0);
}

TEST(StepModel, SlicesHandComputedOnTwoNodes) {
  // One document of 8 tokens in two causal blocks of 4 (10 pairs each). Ulysses over 2 ranks on two nodes
  // (2 query heads, one a rank): 20 pairs on one head each, 80 FLOPs.
  const std::vector<std::vector<cpdispatch::AttentionSlice>> slices{
      {{0, 4, 0, 4, cpdispatch::SliceType::causal}, {4, 8, 4, 8, cpdispatch::SliceType::causal}}};
  LayerShape two_heads = unit_shape();
  two_heads.heads_q = 2;
  const auto causal = cpdispatch::AttentionMask::causal();
  EXPECT_DOUBLE_EQ(cpdispatch::model_ulysses({8}, causal, 2, unit_cluster(1), two_heads, slices).forward_compute, 80.0);
  // The ring: 20 pairs, 10 a rank, 40 FLOPs on one head.
  EXPECT_DOUBLE_EQ(cpdispatch::model_zigzag_ring({8}, causal, 2, unit_cluster(1), unit_shape(), slices).forward_compute, 40.0);
  ClusterModel c = unit_cluster(1);
  c.kernel = cpdispatch::KernelRates{unit_kernel(), unit_kernel()};
  // Ulysses by the kernel: each slice an entry of 4 cut rows on one head: 40 + 5 + 4 x 3 + 10 = 67 s, two of them.
  EXPECT_DOUBLE_EQ(cpdispatch::model_ulysses({8}, causal, 2, c, two_heads, slices).forward_compute, 2 * 67.0);
  // The ring by the kernel: chunks of 2; the diagonal's 4 chunk pairs (3 pairs, cut: 29.5 s) and chunk 1 against
  // 0 and 3 against 2 (whole: 16 + 2 + 2 x 2 + 10 = 32 s); the others see nothing. A rank runs half.
  EXPECT_DOUBLE_EQ(cpdispatch::model_zigzag_ring({8}, causal, 2, c, unit_shape(), slices).forward_compute, (4 * 29.5 + 2 * 32.0) / 2);
}

TEST(StepModel, UspByTheKernelWithTwoGroupsOnTwoNodes) {
  // W = 4 on two nodes of 2, groups of 2, 2 query heads (one a rank); one causal document of 8 tokens in
  // 4 chunks of 2: 6 whole chunk pairs (32 s each) and 4 on the diagonal (29.5 s), a group half of them.
  ClusterModel c = unit_cluster(2);
  c.kernel = cpdispatch::KernelRates{unit_kernel(), unit_kernel()};
  LayerShape s = unit_shape();
  s.heads_q = 2;
  const StepTime t = cpdispatch::model_usp({8}, cpdispatch::AttentionMask::causal(), 4, 2, c, s);
  ASSERT_TRUE(t.feasible);
  EXPECT_DOUBLE_EQ(t.forward_compute, (6 * 32.0 + 4 * 29.5) / 2);
  // The links as without the kernel: the all-to-all in the node (2 tokens x (2 + 2) bytes x 2 tensors = 16,
  // half of it to the other rank: 8 s) and one ring step to the other node (4 tokens of K and V on one
  // head: 8 bytes, 16 s).
  EXPECT_DOUBLE_EQ(t.forward_comm, 8.0 + 16.0);
  EXPECT_DOUBLE_EQ(t.forward, 8.0 + t.forward_compute + 16.0);
}

TEST(StepModel, ZigZagRingHandComputed) {
  // W = 2, one causal document of 3 tokens padded to 4: 10 pairs, 5 a rank, 20 FLOPs.
  // One ring step passing 2 tokens of K and V (4 bytes) over one link (intra, 1 B/s).
  const StepTime t = cpdispatch::model_zigzag_ring({3}, cpdispatch::AttentionMask::causal(), 2, unit_cluster(2), unit_shape());
  EXPECT_DOUBLE_EQ(t.forward_compute, 20.0);
  EXPECT_DOUBLE_EQ(t.forward_comm, 4.0);
  EXPECT_DOUBLE_EQ(t.forward, 20.0 + 4.0);
  EXPECT_DOUBLE_EQ(t.backward_comm, 8.0);
}

TEST(StepModel, UlyssesNeedsHeadsDivisibleByRanks) {
  LayerShape s = unit_shape();
  s.heads_q = 3;
  EXPECT_FALSE(cpdispatch::model_ulysses({8}, cpdispatch::AttentionMask::causal(), 2, unit_cluster(2), s).feasible);
  s.heads_q = 4;
  const StepTime t = cpdispatch::model_ulysses({8}, cpdispatch::AttentionMask::causal(), 2, unit_cluster(2), s);
  ASSERT_TRUE(t.feasible);
  // 4 tokens a rank x 4 heads = 16 bytes a tensor; four tensors, half leaving the rank: 32 s.
  EXPECT_DOUBLE_EQ(t.forward_comm, 32.0);
}

TEST(StepModel, GroupedQueryAttentionMovesFewerKeyValues) {
  // Four query heads, two key-value heads: a token's Q or O is 4 bytes, its K or V 2.
  LayerShape s = unit_shape();
  s.heads_q = 4;
  s.heads_kv = 2;
  // Ulysses, W = 2: 4 tokens a rank, Q, K, V, O = 4 + 2 + 2 + 4 = 12 bytes a token, 48 a rank, half leaving it: 24 s.
  const StepTime u = cpdispatch::model_ulysses({8}, cpdispatch::AttentionMask::causal(), 2, unit_cluster(2), s);
  ASSERT_TRUE(u.feasible);
  EXPECT_DOUBLE_EQ(u.forward_comm, 24.0);
  // Compute follows the query heads: 36 pairs, 18 a rank, x 4 FLOPs x 4 heads.
  EXPECT_DOUBLE_EQ(u.forward_compute, 288.0);
  s.heads_kv = 1;  // one key-value head cannot be split over two ranks
  EXPECT_FALSE(cpdispatch::model_ulysses({8}, cpdispatch::AttentionMask::causal(), 2, unit_cluster(2), s).feasible);
  // The plan: rank 1 receives 2 query tokens (8 bytes, 16 s across nodes), 4 key-value tokens (K and V of one
  // head: 8 bytes, 16 s) and sends 2 outputs back (16 s); with four key-value heads the key-values take 64 s.
  EXPECT_DOUBLE_EQ(model(two_rank_plan(), unit_cluster(1), s)[0].forward_comm, 48.0);
  s.heads_kv = 0;
  EXPECT_DOUBLE_EQ(model(two_rank_plan(), unit_cluster(1), s)[0].forward_comm, 96.0);
}

TEST(StepModel, UspHandComputed) {
  // W = 4 on two nodes of 2, groups of u = 2 (one a node), 4 query and 2 key-value heads; one causal document
  // of 8 tokens (2 groups: padded to a multiple of 4, so 8), 36 pairs, 9 a rank, 4 x 9 x 4 = 144 FLOPs.
  LayerShape s = unit_shape();
  s.heads_q = 4;
  s.heads_kv = 2;
  const StepTime t = cpdispatch::model_usp({8}, cpdispatch::AttentionMask::causal(), 4, 2, unit_cluster(2), s);
  ASSERT_TRUE(t.feasible);
  EXPECT_EQ(t.scheme, "usp u=2");
  EXPECT_DOUBLE_EQ(t.forward_compute, 144.0);
  // All-to-all in the node: 2 tokens a rank x 12 bytes = 24, half to the other rank of the group: 12 s.
  // One ring step to the other node: the group's 4 tokens on 1 key-value head, K and V: 8 bytes, 16 s.
  EXPECT_DOUBLE_EQ(t.forward_comm, 12.0 + 16.0);
  EXPECT_DOUBLE_EQ(t.forward, 12.0 + 144.0 + 16.0);  // one ring step: one stage, nothing hides
  EXPECT_DOUBLE_EQ(t.backward, 12.0 + 2.5 * 144.0 + 32.0);
  EXPECT_DOUBLE_EQ(t.inter_node_bytes, 4 * 8.0);  // every rank's successor is on the other node
  // Groups across the nodes instead (ranks_per_node 1): the all-to-all leaves the node (0.5 B/s), 24 s.
  EXPECT_DOUBLE_EQ(cpdispatch::model_usp({8}, cpdispatch::AttentionMask::causal(), 4, 2, unit_cluster(1), s).forward_comm, 24.0 + 16.0);
}

TEST(StepModel, UspEndsAreTheRingAndUlyssesAndAGroupPerNodeIsA2aP2p) {
  const std::vector<std::int64_t> docs{13, 7, 30};
  LayerShape s{8, 4, 2, 2, 4};
  const ClusterModel c = unit_cluster(2);
  const auto mask = cpdispatch::AttentionMask::causal();
  const auto same = [](const StepTime& a, const StepTime& b) {
    EXPECT_DOUBLE_EQ(a.step, b.step);
    EXPECT_DOUBLE_EQ(a.forward_comm, b.forward_comm);
    EXPECT_DOUBLE_EQ(a.inter_node_bytes, b.inter_node_bytes);
  };
  same(cpdispatch::model_usp(docs, mask, 8, 1, c, s), cpdispatch::model_zigzag_ring(docs, mask, 8, c, s));
  same(cpdispatch::model_usp(docs, mask, 8, 8, c, s), cpdispatch::model_ulysses(docs, mask, 8, c, s));
  same(cpdispatch::model_usp(docs, mask, 8, 2, c, s), cpdispatch::model_hierarchical(docs, mask, 8, c, s));
  EXPECT_EQ(cpdispatch::usp_groups(8, s), (std::vector<std::int64_t>{2, 4}));
  const StepTime best = cpdispatch::model_usp_best(docs, mask, 8, c, s);
  ASSERT_TRUE(best.feasible);
  for (const std::int64_t u : {2, 4}) EXPECT_LE(best.step, cpdispatch::model_usp(docs, mask, 8, u, c, s).step) << u;
  EXPECT_DOUBLE_EQ(best.step, cpdispatch::model_usp(docs, mask, 8, best.group, c, s).step);
  EXPECT_FALSE(cpdispatch::model_usp_best(docs, mask, 2, c, s).feasible);  // W = 2: no group between the ring and Ulysses
  s.heads_kv = 2;  // two key-value heads: groups of 4 cannot split them
  EXPECT_EQ(cpdispatch::usp_groups(8, s), (std::vector<std::int64_t>{2}));
  EXPECT_FALSE(cpdispatch::model_usp(docs, mask, 8, 4, c, s).feasible);
  EXPECT_FALSE(cpdispatch::model_usp(docs, mask, 6, 4, c, LayerShape{4, 4, 2, 2}).feasible);  // 4 does not divide W = 6
  EXPECT_THROW(cpdispatch::model_usp(docs, mask, 8, 0, c, s), cpdispatch::invalid_input);
  EXPECT_THROW(cpdispatch::model_usp(docs, mask, 8, 9, c, s), cpdispatch::invalid_input);
}

TEST(StepModel, MostKeyValueTokensOfARank) {
  // Both shards of one document attended on rank 1: shard 0 goes there for both query shards (two copies)
  // and shard 1 for the second; deduplicated, each shard crosses once.
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 2, 1}, {0, 3, 1}}}};
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  EXPECT_DOUBLE_EQ(cpdispatch::max_kv_tokens_per_rank(m.kv_fwd, false), 2 + 2 + 3);
  EXPECT_DOUBLE_EQ(cpdispatch::max_kv_tokens_per_rank(m.kv_fwd, true), 2 + 3);
}

cpdispatch::QkvDocumentsPlan four_rank_plan() {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  // One long document spread over all ranks, its tail attended on the other node.
  plan.documents = {{{{0, 4, 0}, {1, 4, 2}, {2, 4, 3}, {3, 4, 1}}}, {{{1, 3, 3}}}};
  return plan;
}

TEST(StepModel, MoreBandwidthNeverSlower) {
  LayerShape s{2, 4, 2, 2};
  for (double scale : {1.0, 2.0, 10.0}) {
    ClusterModel slow = unit_cluster(2), fast = slow;
    fast.intra.bandwidth *= scale * 1.5;
    fast.inter.bandwidth *= scale * 2;
    const auto a = model(four_rank_plan(), slow, s), b = model(four_rank_plan(), fast, s);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_LE(b[i].step, a[i].step) << a[i].scheme;
      EXPECT_LE(b[i].forward_comm, a[i].forward_comm) << a[i].scheme;
    }
  }
}

TEST(StepModel, NodeLevelNeverMoreInterNodeBytesThanDedupThanFlat) {
  const auto rows = model(four_rank_plan(), unit_cluster(2), unit_shape());
  EXPECT_LE(rows[2].inter_node_bytes, rows[1].inter_node_bytes);
  EXPECT_LE(rows[1].inter_node_bytes, rows[0].inter_node_bytes);
  EXPECT_LT(rows[2].inter_node_bytes, rows[0].inter_node_bytes);  // the shard needed by two ranks of node 1 crosses once
}

/// One document of 4 x 64 tokens, a piece on each of 4 ranks: balancing it cuts it, which moves key-values.
cpdispatch::BalanceProblem spanning_document() {
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 8;
  p.documents = {{{{0, 64}, {1, 64}, {2, 64}, {3, 64}}}};
  return p;
}

/// The modelled step of plan_balanced at `slack`, flat exchange.
double step_at(const cpdispatch::BalanceProblem& p, double slack, const ClusterModel& c, const Topology& t) {
  cpdispatch::BalanceOptions o;
  o.cost_slack = slack;
  const auto plan = cpdispatch::plan_balanced(p, o);
  return cpdispatch::model_plan(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), t, c, unit_shape())[0].step;
}

TEST(StepModel, PlanForClusterKeepsTheFastestSlack) {
  const cpdispatch::BalanceProblem p = spanning_document();
  const Topology t = Topology::uniform(4, 4);
  for (const double bandwidth : {1e-3, 1.0, 1e9}) {  // links binding, both, compute binding
    SCOPED_TRACE("bandwidth " + std::to_string(bandwidth));
    ClusterModel c = unit_cluster(4);
    c.intra = c.inter = {bandwidth, 0.0};
    const cpdispatch::ClusterPlan chosen = cpdispatch::plan_for_cluster(p, c, unit_shape(), t);
    double best = 0;
    for (std::size_t i = 0; i < std::size(cpdispatch::cluster_slacks); ++i) {
      const double step = step_at(p, cpdispatch::cluster_slacks[i], c, t);
      if (i == 0 || step < best) best = step;
    }
    EXPECT_DOUBLE_EQ(chosen.modelled.step, best);
    EXPECT_DOUBLE_EQ(step_at(p, chosen.cost_slack, c, t), chosen.modelled.step);
    EXPECT_EQ(chosen.plan.world_size, 4);
  }
  // Where compute binds, the best-balanced plan is kept; where the links bind, a less balanced one moving fewer bytes wins.
  ClusterModel fast = unit_cluster(4), slow = unit_cluster(4);
  fast.intra = fast.inter = {1e9, 0.0};
  slow.intra = slow.inter = {1e-3, 0.0};
  EXPECT_EQ(cpdispatch::plan_for_cluster(p, fast, unit_shape(), t).cost_slack, cpdispatch::cluster_slacks[0]);
  const cpdispatch::ClusterPlan bound = cpdispatch::plan_for_cluster(p, slow, unit_shape(), t);
  EXPECT_LT(bound.modelled.step, step_at(p, cpdispatch::cluster_slacks[0], slow, t));
  EXPECT_THROW(cpdispatch::plan_for_cluster(p, slow, unit_shape(), t, {}, std::span<const double>()), cpdispatch::invalid_input);
}

/// A batch of four ranks on two nodes of two, one byte a token of Q and of K and V.
cpdispatch::BalanceProblem two_node_batch(std::vector<cpdispatch::BalanceDocument> documents) {
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 4;
  p.documents = std::move(documents);
  return p;
}

TEST(StepModel, PlanForClusterWeighsTheLinksAndThePairsAsTheClusterDoes) {
  // 4 query heads, 2 key-value heads of 1 byte; the nodes' links 1 B/s inside, `inter` between.
  const LayerShape shape{4, 1, 1, 1, 2};
  const Topology topology = Topology::uniform(4, 2);
  cpdispatch::BalanceOptions automatic;
  automatic.head_parallel = cpdispatch::HeadParallel::automatic;
  const auto chosen = [&](const cpdispatch::BalanceProblem& p, double inter, double flops, const cpdispatch::BalanceOptions& o) {
    ClusterModel c = unit_cluster(2);
    c.inter.bandwidth = inter;
    c.attention_flops = flops;
    return cpdispatch::plan_for_cluster(p, c, shape, topology, o);
  };
  {
    // Between nodes a byte costs 2 (0.5 B/s): the document on ranks 1 and 2 sends less head-parallel over
    // all four ranks than its dispatch does across the nodes -- not so where a byte between nodes weighed 9
    // (the balancer's default). The model agrees: the plan with it head-parallel is the faster.
    const auto p = two_node_batch({{{{3, 72}}}, {{{1, 200}, {2, 141}}}});
    const cpdispatch::ClusterPlan with = chosen(p, 0.5, 64, automatic), without = chosen(p, 0.5, 64, {});
    EXPECT_EQ(with.plan.head_parallel_degree, 4);
    ASSERT_EQ(with.plan.documents.size(), 2u);
    EXPECT_TRUE(with.plan.documents[1].head_parallel);
    EXPECT_LT(with.modelled.step, without.modelled.step);
  }
  {
    // Slow attention (8 FLOP/s: a pair on every head, forward and backward, weighs 7 / 8 of a byte unit):
    // the long document over ranks 1-3 goes head-parallel for its work, split four ways, not for its bytes.
    const auto p = two_node_batch({{{{3, 86}}}, {{{2, 22}}}, {{{1, 44}, {2, 148}, {3, 201}}}, {{{3, 135}}}, {{{3, 80}}}});
    const cpdispatch::ClusterPlan with = chosen(p, 0.125, 8, automatic), without = chosen(p, 0.125, 8, {});
    EXPECT_EQ(with.plan.head_parallel_degree, 4);
    ASSERT_EQ(with.plan.documents.size(), 5u);
    EXPECT_TRUE(with.plan.documents[2].head_parallel);
    EXPECT_LT(with.modelled.step, 0.95 * without.modelled.step);
  }
}

TEST(StepModel, BadInputIsRefused) {
  ClusterModel c = unit_cluster(2);
  c.inter.bandwidth = 0;
  EXPECT_THROW(model(four_rank_plan(), c, unit_shape()), cpdispatch::invalid_input);
  LayerShape s = unit_shape();
  s.stages = 0;
  EXPECT_THROW(model(four_rank_plan(), unit_cluster(2), s), cpdispatch::invalid_input);
  for (const std::int64_t heads_kv : {-1, 3}) {  // key-value heads must divide the query heads
    LayerShape g{4, 1, 1, 1, heads_kv};
    EXPECT_THROW(model(four_rank_plan(), unit_cluster(2), g), cpdispatch::invalid_input) << heads_kv;
  }
}

/// `message` of the invalid_input `fn` throws; empty when it throws none.
template <class Fn>
std::string refusal(Fn&& fn) {
  try {
    fn();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return {};
}

TEST(KernelRate, OneRateReproducesTheModelWithoutIt) {
  LayerShape s{4, 8, 2, 2, 2};
  ClusterModel plain = unit_cluster(2), with = plain;
  with.kernel = cpdispatch::KernelRates::constant(plain.attention_flops);
  const auto a = model(four_rank_plan(), plain, s), b = model(four_rank_plan(), with, s);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].scheme);
    EXPECT_EQ(a[i].feasible, b[i].feasible);
    EXPECT_DOUBLE_EQ(a[i].forward_compute, b[i].forward_compute);
    EXPECT_DOUBLE_EQ(a[i].backward_compute, b[i].backward_compute);
    EXPECT_DOUBLE_EQ(a[i].step, b[i].step);
  }
  // And both still give the hand-computed 28 FLOPs of rank 1 in the two-rank plan.
  ClusterModel one = unit_cluster(1);
  one.kernel = cpdispatch::KernelRates::constant(1.0);
  EXPECT_DOUBLE_EQ(model(two_rank_plan(), one, unit_shape())[0].forward_compute, 28.0);
}

TEST(KernelRate, PlanComputeIsTheSumOverItsEntries) {
  // Two-rank plan: rank 0 attends query shard 0 against its own 2 keys (2 x 2 causal, 3 pairs, cut), rank 1
  // query shard 1 against keys 0-3 (2 x 4 bottom-right causal, 7 pairs, cut). Forward with unit_kernel:
  // rank 1: 28 FLOPs / 1 + 7 x 0.5 + 2 rows x (2 + 1) + 10 = 47.5; rank 0: 12 + 1.5 + 6 + 10 = 29.5.
  // Backward at 2 FLOP/s and nothing else: rank 1 2.5 x 28 / 2 = 35.
  cpdispatch::KernelRate backward;
  backward.peak = 2.0;
  ClusterModel c = unit_cluster(1);
  c.kernel = cpdispatch::KernelRates{unit_kernel(), backward};
  const auto per_rank = cpdispatch::plan_compute_seconds(cpdispatch::plan_qkv(two_rank_plan()), *c.kernel, 1, 1);
  ASSERT_EQ(per_rank.size(), 2u);
  EXPECT_DOUBLE_EQ(per_rank[0].forward, 29.5);
  EXPECT_DOUBLE_EQ(per_rank[1].forward, 47.5);
  EXPECT_DOUBLE_EQ(per_rank[1].backward, 35.0);
  const StepTime flat = model(two_rank_plan(), c, unit_shape())[0];
  EXPECT_DOUBLE_EQ(flat.forward_compute, 47.5);
  EXPECT_DOUBLE_EQ(flat.backward_compute, 35.0);
  EXPECT_DOUBLE_EQ(flat.forward, 47.5 + 24.0);  // one stage: the links' 24 s as before
}

TEST(KernelRate, PeersRunTheirChunksAndWholeDocuments) {
  ClusterModel c = unit_cluster(2);
  c.kernel = cpdispatch::KernelRates{unit_kernel(), unit_kernel()};
  const auto causal = cpdispatch::AttentionMask::causal();
  // Ring, W = 2: one causal document of 8 tokens in 4 chunks of 2; 6 chunk pairs below the diagonal (2 x 2
  // whole: 16 + 4 x 0.5 + 2 x 2 + 10 = 32 s) and 4 on it (2 x 2 causal, 3 pairs: 12 + 1.5 + 2 x 3 + 10 =
  // 29.5 s), each rank half of them.
  const StepTime ring = cpdispatch::model_zigzag_ring({8}, causal, 2, c, unit_shape());
  EXPECT_DOUBLE_EQ(ring.forward_compute, (6 * 32.0 + 4 * 29.5) / 2);
  // Ulysses, W = 2, 2 heads: every rank the whole document (36 pairs) on one head: 144 + 18 + 8 x 3 + 10.
  LayerShape two_heads = unit_shape();
  two_heads.heads_q = 2;
  EXPECT_DOUBLE_EQ(cpdispatch::model_ulysses({8}, causal, 2, c, two_heads).forward_compute, 196.0);
}

TEST(KernelRate, FitRecoversKnownParameters) {
  cpdispatch::KernelRate truth;
  truth.peak = 50e9;
  truth.pair_seconds = 2e-9;
  truth.row_seconds = 1e-7;
  truth.cut_row_seconds = 3e-7;
  truth.entry_seconds = 5e-6;
  const auto causal = cpdispatch::AttentionMask::causal(), full = cpdispatch::AttentionMask::full();
  for (const double flop_factor : {1.0, 2.5}) {
    std::vector<cpdispatch::KernelSample> samples;
    for (std::int64_t L = 64; L <= 4096; L *= 2)
      for (const auto& [heads, dim] : {std::pair<std::int64_t, std::int64_t>{1, 128}, {8, 64}})
        for (const auto e : {cpdispatch::group_entry(L, L, causal, heads, dim), cpdispatch::group_entry(L, L, full, heads, dim),
                             cpdispatch::group_entry(L / 4, L, causal, heads, dim)}) {
          samples.push_back({e, truth.seconds(e, flop_factor * e.forward_flops())});
        }
    const cpdispatch::KernelRate fit = cpdispatch::fit_kernel_rate(samples, flop_factor);
    EXPECT_NEAR(fit.peak / truth.peak, 1.0, 1e-6) << flop_factor;
    EXPECT_NEAR(fit.pair_seconds / truth.pair_seconds, 1.0, 1e-6);
    EXPECT_NEAR(fit.row_seconds / truth.row_seconds, 1.0, 1e-6);
    EXPECT_NEAR(fit.cut_row_seconds / truth.cut_row_seconds, 1.0, 1e-6);
    EXPECT_NEAR(fit.entry_seconds / truth.entry_seconds, 1.0, 1e-6);
  }
}

TEST(KernelRate, LongerEntriesRunFaster) {
  cpdispatch::KernelRate k;
  k.peak = 50e9;
  k.row_seconds = 1e-6;
  k.entry_seconds = 1e-5;
  double previous = 0;
  for (std::int64_t L = 128; L <= 16384; L *= 2) {
    const auto e = cpdispatch::group_entry(L, L, cpdispatch::AttentionMask::causal(), 8, 64);
    const double rate = k.rate(e, e.forward_flops());
    EXPECT_GT(rate, previous) << L;
    EXPECT_LT(rate, k.peak) << L;
    previous = rate;
  }
  EXPECT_GT(previous, 0.9 * k.peak);  // saturating: the longest runs near peak
}

TEST(KernelRate, BadParametersAreRefusedByName) {
  const auto named = [](cpdispatch::KernelRate k, const char* field) {
    EXPECT_NE(refusal([&] { k.check(); }).find(field), std::string::npos) << field;
    ClusterModel c = unit_cluster(2);
    c.kernel = cpdispatch::KernelRates{unit_kernel(), k};
    EXPECT_NE(refusal([&] { model(four_rank_plan(), c, unit_shape()); }).find(std::string("KernelRates.backward: ") + field), std::string::npos) << field;
  };
  cpdispatch::KernelRate k = unit_kernel();
  k.peak = 0;
  named(k, "peak");
  k = unit_kernel();
  k.row_seconds = -1;
  named(k, "row_seconds");
  k = unit_kernel();
  k.entry_seconds = std::numeric_limits<double>::quiet_NaN();
  named(k, "entry_seconds");
  EXPECT_NE(refusal([] { cpdispatch::KernelRate::constant(-5); }).find("peak"), std::string::npos);
  // Too few samples, and a sample without time, are refused too.
  const auto e = cpdispatch::group_entry(64, 64, cpdispatch::AttentionMask::causal(), 1, 64);
  std::vector<cpdispatch::KernelSample> samples(3, {e, 1e-3});
  EXPECT_NE(refusal([&] { cpdispatch::fit_kernel_rate(samples); }).find("at least 5"), std::string::npos);
  samples.resize(6, {e, 1e-3});
  samples[4].seconds = 0;
  EXPECT_NE(refusal([&] { cpdispatch::fit_kernel_rate(samples); }).find("samples[4]"), std::string::npos);
}

#ifdef CPDISPATCH_PLAN_EXE
using SimulateRun = plan_cli::CliRun;

/// cpdispatch-plan simulate on a file holding `plan`, then `args`.
SimulateRun simulate(const std::string& plan, const std::string& args) {
  return plan_cli::run_cli("step-model-", plan, args, "simulate");
}

constexpr const char* cli_plan =
    R"({"world_size": 4, "documents": [{"shards": [{"rank": 0, "len": 4, "dst": 0}, {"rank": 1, "len": 4, "dst": 2}, {"rank": 2, "len": 4, "dst": 3}]}]})";

/// The table's rows: the scheme, then its eight numbers (times in ms, then inter-node MB).
std::vector<std::pair<std::string, std::vector<double>>> table_rows(const std::string& out) {
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::vector<std::string> w{std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
    if (w.size() < 9 || w[0] == "scheme" || w[0] == "world_size") continue;
    std::string scheme = w[0];
    for (std::size_t i = 1; i + 8 < w.size(); ++i) scheme += " " + w[i];
    std::vector<double> values;
    for (std::size_t i = w.size() - 8; i < w.size(); ++i) values.push_back(w[i] == "n/a" ? -1.0 : std::stod(w[i]));
    rows.emplace_back(scheme, values);
  }
  return rows;
}

TEST(StepModel, SimulatePrintsEverySchemeAndRefusesBadOptions) {
  // One document of three 4096-token shards on two nodes of two ranks; rank 3 attends the last shard
  // against all 12288 keys: 4096 x 8192 + 4096 x 4097 / 2 = 41945088 pairs, x 4 x 64 x 8 heads at 400 TFLOP/s.
  const std::string plan =
      R"({"world_size": 4, "documents": [{"shards": [{"rank": 0, "len": 4096, "dst": 0}, {"rank": 1, "len": 4096, "dst": 2}, {"rank": 2, "len": 4096, "dst": 3}]}]})";
  const SimulateRun run = simulate(plan, "--ranks-per-node 2 --heads 8 --heads-kv 2 --head-dim 64 --stages 2");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("world_size 4, nodes 2, heads 8, key-value heads 2, head_dim 64, stages 2"), std::string::npos) << run.out;
  const auto rows = table_rows(run.out);
  ASSERT_EQ(rows.size(), 7u) << run.out;
  EXPECT_EQ(rows[4].first, "ulysses");
  EXPECT_EQ(rows[4].second, std::vector<double>(8, -1.0));
  EXPECT_NEAR(rows[0].second[0], 41945088.0 * 4 * 64 * 8 / 400e12 * 1e3, 0.0006) << run.out;
  // Every number is the model's on the same plan, cluster and layer (to the printed digits).
  cpdispatch::QkvDocumentsPlan same;
  same.world_size = 4;
  same.documents = {{{{0, 4096, 0}, {1, 4096, 2}, {2, 4096, 3}}}};
  ClusterModel h100 = ClusterModel::h100_ib();
  h100.ranks_per_node = 2;
  const LayerShape shape{8, 64, 2, 2, 2};
  const std::vector<StepTime> expected = model(same, h100, shape);
  ASSERT_EQ(expected.size(), rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const StepTime& t = expected[i];
    SCOPED_TRACE(t.scheme);
    EXPECT_EQ(rows[i].first, t.scheme);
    if (!t.feasible) {  // Ulysses cannot split 2 key-value heads over 4 ranks: "n/a"
      EXPECT_EQ(rows[i].second, std::vector<double>(8, -1.0));
      continue;
    }
    const double ms[] = {t.forward_compute, t.forward_comm, t.forward, t.backward_compute, t.backward_comm, t.backward, t.step};
    for (std::size_t k = 0; k < 7; ++k) EXPECT_NEAR(rows[i].second[k], ms[k] * 1e3, 0.0005 + 1e-9 * ms[k] * 1e3) << "column " << k;
    EXPECT_NEAR(rows[i].second[7], t.inter_node_bytes / 1e6, 0.05);
    EXPECT_GT(t.step, 0.0);
  }
  // The options do reach the model: another head count gives other compute times.
  const SimulateRun more_heads = simulate(plan, "--ranks-per-node 2 --heads 16 --heads-kv 2 --head-dim 64 --stages 2");
  ASSERT_EQ(more_heads.status, 0) << more_heads.err;
  const auto doubled = table_rows(more_heads.out);
  ASSERT_EQ(doubled.size(), 7u);
  EXPECT_NEAR(doubled[0].second[0], 2 * rows[0].second[0], 0.0015);
  // A sliced plan's model counts its slices, the same as the library's.
  // A plan with slices: the peers count the same pairs as the plan.
  const std::string sliced =
      R"({"world_size": 2, "documents": [{"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 0, "len": 2, "dst": 0}, {"rank": 1, "len": 3, "dst": 1}],)"
      R"( "slices": [{"q": [0, 3], "k": [0, 3], "type": "causal"}, {"q": [3, 5], "k": [0, 5], "type": "causal"},)"
      R"( {"q": [5, 8], "k": [0, 3], "type": "full"}, {"q": [5, 8], "k": [5, 8], "type": "causal"}]}]})";
  const SimulateRun with_slices = simulate(sliced, "--ranks-per-node 1");
  ASSERT_EQ(with_slices.status, 0) << with_slices.err;
  const auto sliced_rows = table_rows(with_slices.out);
  ASSERT_EQ(sliced_rows.size(), 7u) << with_slices.out;
  EXPECT_EQ(sliced_rows[4].first, "ulysses");
  EXPECT_EQ(sliced_rows[6], std::make_pair(std::string("usp"), std::vector<double>(8, -1.0)));  // W = 2: no group size between
  for (const auto& [scheme, values] : sliced_rows) {
    if (scheme == "usp") continue;
    // Too small to show in ms, but each row is there with numbers: none negative, every step at least its parts.
    for (const double v : values) EXPECT_GE(v, 0.0) << scheme;
    EXPECT_GE(values[6] + 0.0015, values[2] + values[5]) << scheme;
  }
  const SimulateRun bad_cluster = simulate(cli_plan, "--cluster a100");
  EXPECT_EQ(bad_cluster.status, 2);
  EXPECT_NE(bad_cluster.err.find("--cluster is h100 or h200"), std::string::npos) << bad_cluster.err;
  const SimulateRun bad_heads = simulate(cli_plan, "--heads 0");
  EXPECT_EQ(bad_heads.status, 2);
  EXPECT_NE(bad_heads.err.find("--heads needs a whole number"), std::string::npos) << bad_heads.err;
}
#endif

}  // namespace
