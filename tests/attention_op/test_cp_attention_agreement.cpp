// Plan agreement of ContextParallelAttention: ranks handed shares of
// different plans (another batch, another world size, other token counts)
// all throw at construction or replan, with the same verdict naming the
// ranks and the first field that differs; agreeing shares cost one
// all_to_all_v per plan and none per step.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attention_op/exact_kernel.hpp"
#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace cp_agreement_test {

using attention_test::ExactKernel;
using cpdispatch::ContextParallelAttention;
using cpdispatch::CpAttentionOptions;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::RankQkvMetadata;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using testing::HasSubstr;

const cpdispatch::AttentionShape shape{2, 1, 4, 0.5f};
using Op = ContextParallelAttention<SimTransport, float, ExactKernel>;

QkvDocumentsPlan random_plan(int W, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 2 * W;
  o.max_shards = 3;
  o.max_len = 6;
  return cpdispatch::random_documents_plan(o, seed);
}

/// Document d: 4 tokens on rank d, attended on rank d + 1; rank W-1's first `extra` more.
QkvDocumentsPlan ring_plan(int W, std::int64_t extra = 0) {
  QkvDocumentsPlan plan;
  plan.world_size = W;
  for (int d = 0; d < W; ++d) plan.documents.push_back({{{d, 4 + (d == W - 1 ? extra : 0), (d + 1) % W}}});
  return plan;
}

/// Ranks 0..W-2 as ring_plan; rank W-1 holds two documents attended on rank 0, of `first` and `second` tokens.
QkvDocumentsPlan two_documents_to_rank0(int W, std::int64_t first, std::int64_t second) {
  QkvDocumentsPlan plan;
  plan.world_size = W;
  for (int d = 0; d + 1 < W; ++d) plan.documents.push_back({{{d, 4, d + 1}}});
  plan.documents.push_back({{{W - 1, first, 0}}});
  plan.documents.push_back({{{W - 1, second, 0}}});
  return plan;
}

/// Each rank builds its op from share_of(rank); what each threw (empty: nothing).
std::vector<std::string> construction_errors(int W, const std::function<RankQkvMetadata(int)>& share_of, CpAttentionOptions o = {}) {
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    try {
      Op op(t, share_of(t.rank()), shape, o);
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  return errors;
}

/// The verdict without the "(rank r of W)" in front, which differs by rank.
std::string verdict_of(const std::string& e) {
  const auto at = e.find("): ");
  return at == std::string::npos ? e : e.substr(at + 3);
}

class CpAgreement : public testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, CpAgreement, testing::Values(2, 3, 4), [](const testing::TestParamInfo<int>& i) { return "W" + std::to_string(i.param); });

TEST_P(CpAgreement, SharesOfOnePlanAgree) {
  const int W = GetParam();
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    const QkvDocumentsPlan plan = random_plan(W, seed);
    for (const CpAttentionOptions o : {CpAttentionOptions{false, 1}, CpAttentionOptions{false, 3}}) {
      const auto errors = construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(plan, r); }, o);
      for (int r = 0; r < W; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r << ", seed " << seed;
    }
  }
}

TEST_P(CpAgreement, AnotherBatchOnOneRankThrowsOnEveryRankNamingIt) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 11), other = random_plan(W, 12);
  const auto errors = construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(r == W - 1 ? other : plan, r); });
  for (int r = 0; r < W; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_THAT(e, HasSubstr("ContextParallelAttention::replan (rank " + std::to_string(r) + " of " + std::to_string(W) + "): the ranks were handed plans that disagree"));
    EXPECT_THAT(e, HasSubstr(std::to_string(W - 1))) << "the rank with the other batch is named";
    EXPECT_EQ(verdict_of(e), verdict_of(errors[0])) << "rank " << r << " reached another verdict";
  }
  if (W > 2) {
    EXPECT_THAT(errors[0], HasSubstr("; rank(s) " + std::to_string(W - 1) + " disagree with the rest"));
  }
}

TEST_P(CpAgreement, AnotherWorldSizeOnOneRankThrowsOnEveryRank) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 5), wider = random_plan(W + 1, 5);
  const auto errors = construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(r == W - 1 ? wider : plan, r); });
  // The rank itself refuses its share with its own reason; the others name it and the two world sizes.
  EXPECT_THAT(errors[static_cast<std::size_t>(W - 1)], HasSubstr("world_size = " + std::to_string(W + 1)));
  for (int r = 0; r + 1 < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("rank(s) " + std::to_string(W - 1) + " were handed a plan of world_size " + std::to_string(W + 1) +
                                                              " (the first of them), but the transport has " + std::to_string(W) + " ranks"));
  }
}

TEST_P(CpAgreement, OtherTokenCountsNameTheSenderTheReceiverAndBothCounts) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = ring_plan(W), longer = ring_plan(W, 3);
  const auto errors = construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(r == W - 1 ? longer : plan, r); });
  const std::string pair = W == 2 ? "0, 1" : "0, " + std::to_string(W - 1);
  for (int r = 0; r < W; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_THAT(e, HasSubstr("rank " + std::to_string(W - 1) + " sends 7 query tokens to rank 0, which expects 4 (1 of " + std::to_string(W * (W - 1)) +
                             " sender-receiver pairs differ); rank(s) " + pair + " disagree"));
  }
}

TEST_P(CpAgreement, TheSameCountsInAnotherDocumentLayoutAreCaught) {
  const int W = GetParam();
  // Rank W-1 sends rank 0 five tokens either way, but as 3 + 2 where rank 0 expects 2 + 3.
  const QkvDocumentsPlan plan = two_documents_to_rank0(W, 2, 3), swapped = two_documents_to_rank0(W, 3, 2);
  const auto errors = construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(r == W - 1 ? swapped : plan, r); });
  const std::string pair = "0, " + std::to_string(W - 1);
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("rank " + std::to_string(W - 1) + " sends rank 0 the tokens it expects, but not to the places it expects them (another document layout) (1 of " +
                             std::to_string(W * (W - 1)) + " sender-receiver pairs differ); rank(s) " + pair + " disagree"));
  }
}

TEST_P(CpAgreement, AnotherOptionOnOneRankIsNamed) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 7);
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    try {
      Op op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), shape, {false, t.rank() == 1 ? 2 : 1});
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) EXPECT_THAT(e, HasSubstr("rank(s) 1 hold another configuration (token widths, options) than rank(s) 0"));
}

TEST_P(CpAgreement, AReplanToDisagreeingSharesThrowsEverywhereAndAnAgreeingOneRecovers) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 21), next = random_plan(W, 22), wrong = ring_plan(W, 1);
  std::vector<std::string> errors(static_cast<std::size_t>(W)), after(static_cast<std::size_t>(W));
  std::vector<int> recovered(static_cast<std::size_t>(W), 0);
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    const auto share = cpdispatch::plan_qkv_for_rank(plan, r);
    Op op(t, share, shape, {});
    try {
      op.replan(cpdispatch::plan_qkv_for_rank(r == 0 ? wrong : next, r));
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
    const auto T = static_cast<std::size_t>(op.mlp_tokens());
    std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size());
    try {
      op.forward(q, kv, kv, out);
    } catch (const cpdispatch::invalid_input& e) {
      after[static_cast<std::size_t>(r)] = e.what();
    }
    op.replan(cpdispatch::plan_qkv_for_rank(next, r));
    const auto T2 = static_cast<std::size_t>(op.mlp_tokens());
    std::vector<float> q2(T2 * 8, 0.5f), kv2(T2 * 4, 0.25f), out2(q2.size());
    op.forward(q2, kv2, kv2, out2);
    recovered[static_cast<std::size_t>(r)] = 1;
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("the ranks were handed plans that disagree")) << "rank " << r;
    EXPECT_THAT(after[static_cast<std::size_t>(r)], HasSubstr("forward needs a plan")) << "rank " << r;
    EXPECT_EQ(recovered[static_cast<std::size_t>(r)], 1);
  }
}

TEST_P(CpAgreement, TurnedOffNoRankChecks) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = ring_plan(W), longer = ring_plan(W, 3);
  const auto errors =
      construction_errors(W, [&](int r) { return cpdispatch::plan_qkv_for_rank(r == W - 1 ? longer : plan, r); }, CpAttentionOptions{false, 1, false});
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// The transport calls: one all_to_all_v per plan (construction, replan), none
// added to a step, none at all when turned off.
TEST_P(CpAgreement, OneExchangePerPlanAndNoneInAStep) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 31), next = random_plan(W, 32);
  struct Counts {
    int construct = 0, step = 0, replan = 0;
  };
  std::vector<Counts> on(static_cast<std::size_t>(W)), off(static_cast<std::size_t>(W));
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    for (bool check : {true, false}) {
      testing::NiceMock<cpdispatch::testing::RecordingTransport<SimTransport>> rec(t);
      int calls = 0;
      EXPECT_CALL(rec, all_to_all_v).WillRepeatedly([&](auto... args) {
        ++calls;
        t.all_to_all_v(args...);
      });
      Counts& c = (check ? on : off)[static_cast<std::size_t>(r)];
      ContextParallelAttention<decltype(rec), float, ExactKernel> op(rec, cpdispatch::plan_qkv_for_rank(plan, r), shape, {false, 1, check});
      c.construct = calls;
      const auto T = static_cast<std::size_t>(op.mlp_tokens());
      std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
      calls = 0;
      op.forward(q, kv, kv, out);
      op.backward(q, dq, dk, dv);
      c.step = calls;
      calls = 0;
      op.replan(cpdispatch::plan_qkv_for_rank(next, r));
      c.replan = calls;
    }
  });
  for (int r = 0; r < W; ++r) {
    const Counts &a = on[static_cast<std::size_t>(r)], &b = off[static_cast<std::size_t>(r)];
    EXPECT_EQ(a.construct, 1) << "rank " << r;
    EXPECT_EQ(a.replan, 1) << "rank " << r;
    EXPECT_EQ(b.construct, 0) << "rank " << r;
    EXPECT_EQ(b.replan, 0) << "rank " << r;
    EXPECT_EQ(a.step, b.step) << "rank " << r << ": the check adds nothing to a step";
    EXPECT_GT(a.step, 0) << "rank " << r;
  }
}

}  // namespace cp_agreement_test
