// ContextParallelAttention over the transport adapters: the call sequence of
// its stages on a posting mock, equality over SimulatedLinkTransport, and
// faults injected by FaultInjectingTransport surfacing on every rank (rows
// of the fault matrix, "fault-matrix |" lines as tests/faults prints them).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "attention_op/run_op.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"

namespace {

using namespace std::chrono_literals;
using attention_test::CpWorld;
using attention_test::ExactKernel;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::testing::Fault;
using cpdispatch::testing::FaultInjectingTransport;
using cpdispatch::testing::FaultRule;
using cpdispatch::testing::TransportCall;
using testing::_;
using testing::HasSubstr;
using testing::Return;

const AttentionShape shape{2, 1, 4, 0.5f};

cpdispatch::QkvDocumentsPlan plan_of(int W, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = W + 2;
  o.max_shards = 3;
  o.max_len = 4;
  return cpdispatch::random_documents_plan(o, seed);
}

/// Two ranks, one document across both: rank 0 receives and sends in every stage.
cpdispatch::QkvDocumentsPlan two_rank_plan() {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 2, 1}, {1, 3, 0}}}, {{{1, 2, 1}, {0, 2, 0}}}};
  return plan;
}

// The mocks below hold rank 0's share alone, so their ops skip the plan agreement (the third option).
TEST(CpAttentionMock, StagesPostEveryExchangeAndWaitForEach) {
  testing::StrictMock<cpdispatch::testing::MockPostedAllToAllTransport> t(0, 2);
  const auto share = cpdispatch::plan_qkv_for_rank(two_rank_plan(), 0);
  cpdispatch::ContextParallelAttention<cpdispatch::testing::MockPostedAllToAllTransport, float, ExactKernel> op(t, share, shape, {false, 3, false});
  const auto T = static_cast<std::size_t>(op.mlp_tokens());
  std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
  // Forward: one posted stage (W - 1 = 1 stage group) for Q, K and V, then the outputs home.
  // Backward: dout by stage, the KV gradients of the stage, dq home: three posts.
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(5).WillRepeatedly(Return(cpdispatch::Request{9}));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(5);
  op.forward(q, kv, kv, out);
  op.backward(q, dq, dk, dv);
  EXPECT_EQ(op.kernel().forward_calls, 2) << "local keys, then the stage's";
}

TEST(CpAttentionMock, WithDedupTheKeyValuesAndTheirGradientsRideTheStagesToo) {
  testing::StrictMock<cpdispatch::testing::MockPostedAllToAllTransport> t(0, 2);
  cpdispatch::QkvDocumentsPlan plan = two_rank_plan();
  plan.dedup = true;
  const auto share = cpdispatch::plan_qkv_for_rank(plan, 0);
  cpdispatch::ContextParallelAttention<cpdispatch::testing::MockPostedAllToAllTransport, float, ExactKernel> op(t, share, shape, {true, 3, false});
  const auto T = static_cast<std::size_t>(op.mlp_tokens());
  std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
  // Forward: Q, K and V over the wire in one posted stage, then the outputs home; no blocking exchange.
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(2).WillRepeatedly(Return(cpdispatch::Request{9}));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(2);
  op.forward(q, kv, kv, out);
  EXPECT_EQ(op.kernel().forward_calls, 2) << "local keys, then the stage's";
  testing::Mock::VerifyAndClearExpectations(&t);
  // Backward: dout by stage, the stage's dk and dv over the wire (one post), dq home; no blocking exchange.
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(3).WillRepeatedly(Return(cpdispatch::Request{9}));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(3);
  op.backward(q, dq, dk, dv);
}

// Rank 0 of 3 with 3 stages: its key-values from rank 2 arrive in round 1 (ring distance 1), from rank 1 in round 2.
// Document X (home 2) is attended only in round 1, so its key-value gradients are complete after round 1.
cpdispatch::QkvDocumentsPlan three_rank_plan(bool dedup) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.dedup = dedup;
  plan.documents = {{{{0, 2, 0}}}, {{{2, 3, 0}}}, {{{1, 3, 0}}}};
  return plan;
}

class CpAttentionGradientStages : public testing::TestWithParam<bool> {};

TEST_P(CpAttentionGradientStages, AStagesKeyValueGradientsGoHomeBeforeTheLastRoundComputes) {
  const bool dedup = GetParam();
  testing::StrictMock<cpdispatch::testing::MockPostedAllToAllTransport> t(0, 3);
  const auto share = cpdispatch::plan_qkv_for_rank(three_rank_plan(dedup), 0);
  cpdispatch::ContextParallelAttention<cpdispatch::testing::MockPostedAllToAllTransport, float, ExactKernel> op(t, share, shape, {dedup, 3, false});
  const auto T = static_cast<std::size_t>(op.mlp_tokens());
  std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(3).WillRepeatedly(Return(cpdispatch::Request{9}));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(3);
  op.forward(q, kv, kv, out);
  testing::Mock::VerifyAndClearExpectations(&t);
  // Backward: dout of both stages, then (after rounds 0 and 1) the first stage's key-value gradients,
  // then round 2, its key-value gradients and dq: five posts, each noting how many kernel calls preceded it.
  std::vector<int> calls_before_post;
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(5).WillRepeatedly(testing::Invoke([&](auto&&...) {
    calls_before_post.push_back(op.kernel().backward_calls);
    return cpdispatch::Request{9};
  }));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(5);
  op.backward(q, dq, dk, dv);
  ASSERT_EQ(op.kernel().backward_calls, 3) << "one kernel call a round";
  EXPECT_EQ(calls_before_post, (std::vector<int>{0, 0, 2, 3, 3})) << "the first stage's key-value gradients go home while round 2 is left";
}

INSTANTIATE_TEST_SUITE_P(Dedup, CpAttentionGradientStages, testing::Bool(), [](const testing::TestParamInfo<bool>& i) { return i.param ? "dedup" : "plain"; });

// Rank 0 of 3 with 3 stages, as above, and one head-parallel document (u = 3)
// on ranks 1 and 2 (2 tokens each): its slabs ride the posts of the stage
// group of their pair, beside the dispatched shards, and its kernel runs
// once the last group has arrived.
TEST(CpAttentionMock, HeadParallelSlabsRideTheirPairsStageGroupAndAreAttendedAfterTheLast) {
  const AttentionShape hp_shape{3, 1, 4, 0.5f};  // one query head a rank of the group, the key-value head replicated
  cpdispatch::QkvDocumentsPlan plan = three_rank_plan(false);
  plan.head_parallel_degree = 3;
  cpdispatch::PackedDocument hp;
  hp.head_parallel = true;
  hp.shards = {{1, 2, 1}, {2, 2, 2}};
  plan.documents.push_back(hp);
  testing::StrictMock<cpdispatch::testing::MockPostedAllToAllTransport> t(0, 3);
  cpdispatch::ContextParallelAttention<cpdispatch::testing::MockPostedAllToAllTransport, float, ExactKernel> op(
      t, cpdispatch::plan_qkv_for_rank(plan, 0), hp_shape, {false, 3, false});
  const auto T = static_cast<std::size_t>(op.mlp_tokens());
  std::vector<float> q(T * 12, 0.5f), kv(T * 4, 0.25f), out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
  std::vector<std::vector<std::size_t>> received;  // per post, the bytes from each peer
  std::vector<int> calls_at_wait;
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(3).WillRepeatedly(testing::Invoke([&](auto&&, auto&&, auto&&, auto&&, auto counts, auto&&) {
    received.emplace_back(counts.begin(), counts.end());
    return cpdispatch::Request{9};
  }));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(3).WillRepeatedly([&](auto&&) { calls_at_wait.push_back(op.kernel().forward_calls); });
  op.forward(q, kv, kv, out);
  ASSERT_EQ(received.size(), 3u);
  // The pair (2, 0) is in the first group, (1, 0) in the second: each brings its 2 head-parallel tokens (16 bytes of
  // Q, K and V slabs each a token) and its dispatched document (3 tokens of 48 + 16 + 16 bytes) in one post.
  EXPECT_EQ(received[0][2], 2u * 48u + 3u * 80u);
  EXPECT_EQ(received[0][1], 0u);
  EXPECT_EQ(received[1][1], 2u * 48u + 3u * 80u);
  EXPECT_EQ(received[1][2], 0u);
  EXPECT_EQ(calls_at_wait, (std::vector<int>{1, 2, 4})) << "round 0's local keys, round 1's, then round 2's and the head-parallel documents";
  testing::Mock::VerifyAndClearExpectations(&t);
  std::vector<int> backward_at_wait;
  EXPECT_CALL(t, post_all_to_all_v(_, _, _, _, _, _)).Times(5).WillRepeatedly(Return(cpdispatch::Request{9}));
  EXPECT_CALL(t, wait(cpdispatch::Request{9})).Times(5).WillRepeatedly([&](auto&&) { backward_at_wait.push_back(op.kernel().backward_calls); });
  op.backward(q, dq, dk, dv);
  ASSERT_EQ(backward_at_wait.size(), 5u);
  EXPECT_EQ(backward_at_wait[1], 2) << "local keys and round 1 before the second group's dout is awaited";
  EXPECT_EQ(op.kernel().backward_calls, 4) << "three rounds, then the head-parallel documents";
}

TEST(CpAttentionSimulatedLink, StagesOverASimulatedLinkEqualTheReference) {
  const CpWorld world(plan_of(4, 61), shape, AttentionMask::causal(), 61, attention_test::round_to<float>);
  std::vector<attention_test::RankResult> results(4);
  cpdispatch::SimWorld sim(4, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& inner) {
    cpdispatch::SimulatedLinkTransport<cpdispatch::SimTransport> t(inner, cpdispatch::LinkModel{10us, 1e9});
    const auto share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
    cpdispatch::ContextParallelAttention<decltype(t), float, ExactKernel> op(t, share, shape, {false, 2});
    const auto r = static_cast<std::size_t>(t.rank());
    results[r] = attention_test::step<float>(op, world.tensors(r));
    results[r].q_rev = share.q_rev;
  });
  world.expect_equal(results, 1e-5);
}

// ---- faults ---------------------------------------------------------------------

struct Outcome {
  bool threw = false, timeout = false;
  int code = 0;
  std::string what;
  double ms = 0;
};

struct FaultCase {
  TransportCall call;
  Fault fault;
  int stages;
};

void PrintTo(const FaultCase& c, std::ostream* os) {
  *os << cpdispatch::testing::call_name(c.call) << "_" << cpdispatch::testing::fault_name(c.fault) << "_s" << c.stages;
}

class CpAttentionFaults : public testing::TestWithParam<FaultCase> {};

/// A fault on the last rank's first exchange of the step: every rank throws within the sim's timeout.
TEST_P(CpAttentionFaults, SurfaceOnEveryRank) {
  const FaultCase c = GetParam();
  constexpr int W = 4;
  const CpWorld world(plan_of(W, 62), shape, AttentionMask::causal(), 62, attention_test::round_to<float>);
  std::vector<Outcome> out(W);
  cpdispatch::SimWorld sim(W, cpdispatch::SimOptions{400ms});
  const cpdispatch::testing::FaultOptions options{.error_code = 77, .stall = 600ms, .short_bytes = 4};
  try {
    sim.run([&](cpdispatch::SimTransport& inner) {
      FaultInjectingTransport t(inner, {FaultRule{c.call, 1, c.fault, W - 1}}, options);
      const auto r = static_cast<std::size_t>(t.rank());
      const auto share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
      // No plan agreement: its exchange at construction is outside the step timed here, and a rank still
      // leaving it when the faulty one aborts the world would throw there.
      cpdispatch::ContextParallelAttention<decltype(t), float, ExactKernel> op(t, share, shape, {false, c.stages, false});
      const auto start = std::chrono::steady_clock::now();
      try {
        attention_test::step<float>(op, world.tensors(r));
      } catch (const cpdispatch::timeout_error& e) {
        out[r] = {true, true, 0, e.what(), 0};
      } catch (const cpdispatch::backend_error& e) {
        out[r] = {true, false, e.code(), e.what(), 0};
      } catch (const std::exception& e) {
        out[r] = {true, false, 0, e.what(), 0};
      }
      out[r].ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    });
  } catch (const cpdispatch::error&) {
    // A rank that caught its fault and returned while others waited fails the run: expected.
  }
  double others = 0;
  for (int r = 0; r + 1 < W; ++r) others = std::max(others, out[static_cast<std::size_t>(r)].ms);
  std::printf("fault-matrix | ContextParallelAttention stages=%d | sim | %s in %s | W=%d | faulty rank %.0f ms | others %.0f ms\n", c.stages,
              cpdispatch::testing::fault_name(c.fault), cpdispatch::testing::call_name(c.call), W, out.back().ms, others);
  for (int r = 0; r < W; ++r) EXPECT_TRUE(out[static_cast<std::size_t>(r)].threw) << "rank " << r << " returned normally";
  if (c.fault == Fault::error) {
    EXPECT_EQ(out.back().code, 77);
    EXPECT_THAT(out.back().what, HasSubstr("injected error"));
    EXPECT_THAT(out.back().what, HasSubstr("ContextParallelAttention::forward (rank 3 of 4): exchange failed: "));
  }
  if (c.fault == Fault::stall) {
    EXPECT_TRUE(out.back().timeout) << out.back().what;
  }
}

INSTANTIATE_TEST_SUITE_P(Sim, CpAttentionFaults,
                         testing::Values(FaultCase{TransportCall::post_all_to_all_v, Fault::error, 3},
                                         FaultCase{TransportCall::post_all_to_all_v, Fault::stall, 2},
                                         FaultCase{TransportCall::post_all_to_all_v, Fault::short_delivery, 3},
                                         FaultCase{TransportCall::wait, Fault::error, 2},
                                         FaultCase{TransportCall::post_all_to_all_v, Fault::error, 1},
                                         FaultCase{TransportCall::wait, Fault::stall, 3}),
                         [](const testing::TestParamInfo<FaultCase>& info) {
                           return std::string(cpdispatch::testing::call_name(info.param.call)) + "_" +
                                  cpdispatch::testing::fault_name(info.param.fault) + "_s" + std::to_string(info.param.stages);
                         });

}  // namespace
