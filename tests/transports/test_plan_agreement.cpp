// Plan agreement of QkvDispatch (on by default) and of a Dispatcher that asks
// for it: shares of different plans throw on every rank naming the ranks and
// the first difference, a refused replan keeps the previous plan on every
// rank, and a plan costs one all_to_all_v (none per call).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace qkv_agreement_test {

using cpdispatch::QkvDispatch;
using cpdispatch::QkvDispatchOptions;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using testing::HasSubstr;

constexpr std::size_t q_elems = 3, kv_elems = 4;

QkvDocumentsPlan random_plan(int W, std::uint64_t seed, bool dedup = false) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 2 * W;
  o.max_shards = 3;
  o.max_len = 5;
  QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
  plan.dedup = dedup;
  return plan;
}

/// Document d: 4 tokens on rank d, attended on rank d + 1; rank W-1's `extra` more.
QkvDocumentsPlan ring_plan(int W, std::int64_t extra = 0) {
  QkvDocumentsPlan plan;
  plan.world_size = W;
  for (int d = 0; d < W; ++d) plan.documents.push_back({{{d, 4 + (d == W - 1 ? extra : 0), (d + 1) % W}}});
  return plan;
}

/// Runs body(transport) on every rank; what each threw as invalid_input (empty: nothing).
std::vector<std::string> errors_on_every_rank(int W, const std::function<void(SimTransport&)>& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    try {
      body(t);
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  return errors;
}

class QkvAgreement : public testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, QkvAgreement, testing::Values(2, 3, 4), [](const testing::TestParamInfo<int>& i) { return "W" + std::to_string(i.param); });

TEST_P(QkvAgreement, SharesOfOnePlanAgreeWithAndWithoutDedup) {
  const int W = GetParam();
  for (bool dedup : {false, true}) {
    const QkvDocumentsPlan plan = random_plan(W, 3, dedup);
    const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
      QkvDispatch<SimTransport, float> qkv(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), q_elems, kv_elems, {dedup});
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "") << (dedup ? "dedup" : "plain");
  }
}

TEST_P(QkvAgreement, OtherTokenCountsThrowOnEveryRank) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = ring_plan(W), longer = ring_plan(W, 2);
  const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
    QkvDispatch<SimTransport, float> qkv(t, cpdispatch::plan_qkv_for_rank(t.rank() == W - 1 ? longer : plan, t.rank()), q_elems, kv_elems);
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)],
                HasSubstr("QkvDispatch::replan (rank " + std::to_string(r) + " of " + std::to_string(W) + "): the ranks were handed plans that disagree: rank " +
                          std::to_string(W - 1) + " sends 6 query tokens to rank 0, which expects 4"));
  }
}

TEST_P(QkvAgreement, AShareOfAnotherWorldOnOneRankThrowsOnEveryRank) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 4), wider = random_plan(W + 1, 4);
  const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
    QkvDispatch<SimTransport, float> qkv(t, cpdispatch::plan_qkv_for_rank(t.rank() == 0 ? wider : plan, t.rank()), q_elems, kv_elems);
  });
  EXPECT_THAT(errors[0], HasSubstr("world_size = " + std::to_string(W + 1)));
  for (int r = 1; r < W; ++r) EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("rank(s) 0 were handed a plan of world_size " + std::to_string(W + 1)));
}

TEST_P(QkvAgreement, ARefusedReplanKeepsThePreviousPlanOnEveryRank) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 5), other = random_plan(W, 6);
  std::vector<std::size_t> before(static_cast<std::size_t>(W)), after(static_cast<std::size_t>(W));
  const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    QkvDispatch<SimTransport, float> qkv(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), q_elems, kv_elems);
    before[r] = qkv.q_mlp_size();
    try {
      qkv.replan(cpdispatch::plan_qkv_for_rank(t.rank() == 1 ? other : plan, t.rank()));
    } catch (const cpdispatch::invalid_input&) {
      after[r] = qkv.q_mlp_size();
      std::vector<float> q(qkv.q_mlp_size(), 1.0f), qa(qkv.q_attention_size());
      qkv.forward_q(q, qa);  // the previous plan still runs, on every rank together
      throw;
    }
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("rank(s) ")) << "rank " << r;
    EXPECT_EQ(after[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)]) << "rank " << r;
  }
}

TEST_P(QkvAgreement, OneExchangePerShareAndNonePerCall) {
  const int W = GetParam();
  const QkvDocumentsPlan plan = random_plan(W, 7), next = random_plan(W, 8);
  std::vector<std::vector<int>> calls(static_cast<std::size_t>(W));
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::seconds(60)});
  world.run([&](SimTransport& t) {
    for (bool check : {true, false}) {
      testing::NiceMock<cpdispatch::testing::RecordingTransport<SimTransport>> rec(t);
      int n = 0;
      EXPECT_CALL(rec, all_to_all_v).WillRepeatedly([&](auto... args) {
        ++n;
        t.all_to_all_v(args...);
      });
      QkvDispatch<decltype(rec), float> qkv(rec, cpdispatch::plan_qkv_for_rank(plan, t.rank()), q_elems, kv_elems, QkvDispatchOptions{false, check});
      auto& mine = calls[static_cast<std::size_t>(t.rank())];
      mine.push_back(n);
      n = 0;
      std::vector<float> q(qkv.q_mlp_size(), 1.0f), qa(qkv.q_attention_size()), kv(qkv.kv_mlp_size(), 1.0f), kva(qkv.kv_attention_size());
      qkv.forward_q(q, qa);
      qkv.forward_kv(kv, kva);
      mine.push_back(n);
      n = 0;
      qkv.replan(cpdispatch::plan_qkv_for_rank(next, t.rank()));
      mine.push_back(n);
    }
  });
  for (int r = 0; r < W; ++r) {
    // construction, two forwards, replan: with the check, then without
    EXPECT_EQ(calls[static_cast<std::size_t>(r)], (std::vector<int>{1, 2, 1, 0, 2, 0})) << "rank " << r;
  }
}

TEST_P(QkvAgreement, ADispatcherChecksWhenAskedAndOnlyThen) {
  const int W = GetParam();
  const auto plan = cpdispatch::plan_qkv(ring_plan(W)), longer = cpdispatch::plan_qkv(ring_plan(W, 1));
  const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
    const auto& m = t.rank() == W - 1 ? longer : plan;
    cpdispatch::Dispatcher unchecked(t, m.q_fwd.get_slice(t.rank()), m.q_rev.get_slice(t.rank()), 8);  // the default: no collective
    cpdispatch::Dispatcher checked(t, m.q_fwd.get_slice(t.rank()), m.q_rev.get_slice(t.rank()), 8, {.check_plan_agreement = true});
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("Dispatcher (rank " + std::to_string(r) + " of " + std::to_string(W) +
                                                              "): the ranks were handed plans that disagree: rank " + std::to_string(W - 1) +
                                                              " sends 5 tokens to rank 0, which expects 4"));
  }
}

TEST_P(QkvAgreement, ADispatcherReplanChecksToo) {
  const int W = GetParam();
  const auto plan = cpdispatch::plan_qkv(ring_plan(W)), longer = cpdispatch::plan_qkv(ring_plan(W, 1));
  std::vector<int> kept(static_cast<std::size_t>(W), 0);
  const auto errors = errors_on_every_rank(W, [&](SimTransport& t) {
    const int r = t.rank();
    cpdispatch::Dispatcher d(t, plan.q_fwd.get_slice(r), plan.q_rev.get_slice(r), 8, {.check_plan_agreement = true});
    const auto sizes = d.required_bytes();
    try {
      const auto& m = r == 0 ? longer : plan;
      d.replan(m.q_fwd.get_slice(r), m.q_rev.get_slice(r));
    } catch (const cpdispatch::invalid_input&) {
      kept[static_cast<std::size_t>(r)] = d.required_bytes() == sizes;
      throw;
    }
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("the ranks were handed plans that disagree")) << "rank " << r;
    EXPECT_EQ(kept[static_cast<std::size_t>(r)], 1) << "rank " << r;
  }
}

}  // namespace qkv_agreement_test
