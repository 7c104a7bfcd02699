// Plan agreement over MPI (one process per rank): shares of different plans
// make ContextParallelAttention and QkvDispatch throw on every process, with
// the same verdict, and nobody waits in an exchange.

#include <mpi.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "attention_op/exact_kernel.hpp"
#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/mpi.hpp"

namespace {

using testing::HasSubstr;

const cpdispatch::AttentionShape shape{2, 1, 4, 0.5f};
using Op = cpdispatch::ContextParallelAttention<cpdispatch::MpiTransport, float, attention_test::ExactKernel>;

/// Document d: 4 tokens on rank d, attended on rank d + 1; rank W-1's `extra` more.
cpdispatch::QkvDocumentsPlan ring_plan(int W, std::int64_t extra = 0) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  for (int d = 0; d < W; ++d) plan.documents.push_back({{{d, 4 + (d == W - 1 ? extra : 0), (d + 1) % W}}});
  return plan;
}

cpdispatch::QkvDocumentsPlan random_plan(int W, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = W + 3;
  o.max_shards = 3;
  o.max_len = 5;
  return cpdispatch::random_documents_plan(o, seed);
}

/// What `body` threw as invalid_input on this process ("" if nothing).
template <class F>
std::string error_of(F&& body) {
  try {
    body();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "";
}

TEST(MpiPlanAgreement, OtherTokenCountsOnOneProcessThrowOnEvery) {
  cpdispatch::MpiTransport t(MPI_COMM_WORLD);
  const int W = t.world_size(), r = t.rank();
  const auto plan = ring_plan(W), longer = ring_plan(W, 3);
  const std::string e = error_of([&] { Op op(t, cpdispatch::plan_qkv_for_rank(r == W - 1 ? longer : plan, r), shape, {}); });
  EXPECT_THAT(e, HasSubstr("ContextParallelAttention::replan (rank " + std::to_string(r) + " of " + std::to_string(W) +
                           "): the ranks were handed plans that disagree: rank " + std::to_string(W - 1) + " sends 7 query tokens to rank 0, which expects 4"));
}

TEST(MpiPlanAgreement, AnotherWorldSizeOnOneProcessIsNamedOnTheOthers) {
  cpdispatch::MpiTransport t(MPI_COMM_WORLD);
  const int W = t.world_size(), r = t.rank();
  const auto plan = random_plan(W, 3), wider = random_plan(W + 1, 3);
  const std::string e = error_of([&] { Op op(t, cpdispatch::plan_qkv_for_rank(r == 1 ? wider : plan, r), shape, {false, 2}); });
  if (r == 1) {
    EXPECT_THAT(e, HasSubstr("world_size = " + std::to_string(W + 1)));
  } else {
    EXPECT_THAT(e, HasSubstr("rank(s) 1 were handed a plan of world_size " + std::to_string(W + 1)));
  }
}

TEST(MpiPlanAgreement, AReplanToAnotherBatchThrowsOnEveryProcessAndTheNextAgrees) {
  cpdispatch::MpiTransport t(MPI_COMM_WORLD);
  const int W = t.world_size(), r = t.rank();
  const auto plan = random_plan(W, 5), other = random_plan(W, 6);
  Op op(t, cpdispatch::plan_qkv_for_rank(plan, r), shape, {false, 3});
  const std::string e = error_of([&] { op.replan(cpdispatch::plan_qkv_for_rank(r == 0 ? other : plan, r)); });
  EXPECT_THAT(e, HasSubstr("the ranks were handed plans that disagree"));
  op.replan(cpdispatch::plan_qkv_for_rank(other, r));
  const auto T = static_cast<std::size_t>(op.mlp_tokens());
  std::vector<float> q(T * 8, 0.5f), kv(T * 4, 0.25f), out(q.size());
  op.forward(q, kv, kv, out);
}

TEST(MpiPlanAgreement, QkvDispatchThrowsOnEveryProcess) {
  cpdispatch::MpiTransport t(MPI_COMM_WORLD);
  const int W = t.world_size(), r = t.rank();
  const auto plan = ring_plan(W), longer = ring_plan(W, 2);
  const std::string e = error_of([&] { cpdispatch::QkvDispatch<cpdispatch::MpiTransport, float> qkv(t, cpdispatch::plan_qkv_for_rank(r == W - 1 ? longer : plan, r), 3, 4); });
  EXPECT_THAT(e, HasSubstr("QkvDispatch::replan (rank " + std::to_string(r) + " of " + std::to_string(W) + "): the ranks were handed plans that disagree: rank " +
                           std::to_string(W - 1) + " sends 6 query tokens to rank 0, which expects 4"));
}

}  // namespace
