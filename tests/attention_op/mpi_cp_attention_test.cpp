// ContextParallelAttention over MPI (one process per rank): each rank's
// output and gradients equal whole-document attention, with one stage and
// with stages over the posted all-to-all (grouped MPI_Isend / MPI_Irecv),
// on plain plans and on plans with slices (section 2e), dedup off and on;
// a rank that fails mid-step is named on every rank; the invariant mode gives
// every rank the bits of the run on one rank.

#include <mpi.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "attention_op/exact_kernel.hpp"
#include "attention_op/grid_plans.hpp"
#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/run_op.hpp"
#include "attention_op/slice_plans.hpp"
#include "cpdispatch/attention.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/mpi.hpp"

namespace {

using attention_test::CpWorld;

static_assert(cpdispatch::posted_all_to_all_v<cpdispatch::MpiTransport>);

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

cpdispatch::QkvDocumentsPlan plan_of(int W, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = W + 3;
  o.max_shards = 4;
  o.max_len = 5;
  return cpdispatch::random_documents_plan(o, seed);
}

/// This rank's output, lse and gradients equal the reference over whole documents (plain ones under plan.mask).
template <class Kernel, class... KernelArgs>
void expect_rank_equals_reference(const cpdispatch::QkvDocumentsPlan& plan, cpdispatch::CpAttentionOptions op_options, std::uint64_t seed,
                                  cpdispatch::MpiTransportOptions options, const KernelArgs&... args) {
  const cpdispatch::AttentionShape shape{4, 2, 4, 0.45f};
  const CpWorld world(plan, shape, plan.mask, seed, attention_test::round_to<float>);
  cpdispatch::MpiTransport t(MPI_COMM_WORLD, options);
  const auto r = static_cast<std::size_t>(t.rank());
  const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
  cpdispatch::ContextParallelAttention<cpdispatch::MpiTransport, float, Kernel> op(t, share, shape, op_options, Kernel(args...));
  std::vector<attention_test::RankResult> mine{attention_test::step<float>(op, world.tensors(r))};
  mine[0].q_rev = share.q_rev;
  mine[0].hp = share.hp_attn;
  world.expect_equal(mine, 1e-5, r);
}

TEST(MpiCpAttention, OneStageEqualsWholeDocumentAttention) {
  expect_rank_equals_reference<attention_test::ExactKernel>(plan_of(world_size(), 51), {false, 1}, 51, {});
}

TEST(MpiCpAttention, StagesOverPostedExchangesEqualWholeDocumentAttention) {
  expect_rank_equals_reference<attention_test::ExactKernel>(plan_of(world_size(), 52), {false, 3}, 52, {});
}

TEST(MpiCpAttention, StagesWithATimeoutAndTheHostKernel) {
  cpdispatch::MpiTransportOptions o;
  o.timeout = std::chrono::milliseconds(60000);
  expect_rank_equals_reference<cpdispatch::HostAttentionKernel>(plan_of(world_size(), 53), {false, 4}, 53, o, cpdispatch::HostAttentionOptions{1, 4, 4});
}

// The invariant mode over MPI: every rank's out, lse, dq, dk and dv are the
// bits of the same batch attended on one rank (computed here, on the sim).
TEST(MpiCpAttention, InvariantModeGivesTheBitsOfOneRank) {
  using attention_test::Placement;
  const cpdispatch::AttentionShape s{4, 2, 8, 0.35f};
  const auto causal = cpdispatch::AttentionMask::causal();
  const cpdispatch::HostAttentionOptions kernel{1, 16, 32};
  const CpWorld one(attention_test::grid_plan(1, Placement::home, 1, causal, false), s, causal, 77, attention_test::round_to<float>);
  const attention_test::Packed want =
      attention_test::packed(attention_test::run_op<float, cpdispatch::HostAttentionKernel>(one, s, attention_test::invariant_options(false, 1), kernel), s);
  struct Run {
    Placement placement;
    bool dedup;
    int stages;
  };
  for (const Run& run : {Run{Placement::anywhere, false, 1}, Run{Placement::cut_further, true, 3}}) {
    const cpdispatch::QkvDocumentsPlan plan = attention_test::grid_plan(world_size(), run.placement, 200 + run.stages, causal, run.dedup);
    const CpWorld world(plan, s, causal, 77, attention_test::round_to<float>);
    cpdispatch::MpiTransport t(MPI_COMM_WORLD, {});
    const auto r = static_cast<std::size_t>(t.rank());
    const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    cpdispatch::ContextParallelAttention<cpdispatch::MpiTransport, float> op(t, share, s, attention_test::invariant_options(run.dedup, run.stages),
                                                                             cpdispatch::HostAttentionKernel(kernel));
    attention_test::RankResult mine = attention_test::step<float>(op, world.tensors(r));
    mine.q_rev = share.q_rev;
    attention_test::expect_rank_same_bits(want, mine, r, plan, s);
  }
}

// Plans with slices (slice_plans.hpp: shared prefix, block causal,
// prefix-LM, a random mix of the four slice types, inverse and bi-causal
// bands, plain documents beside them), GQA, dedup off and on, one stage and
// several: every rank's share of them equals whole-document attention.
TEST(MpiCpAttention, SlicePlansEqualWholeDocumentAttention) {
  for (const bool dedup : {false, true}) {
    for (const int stages : {1, 3}) {
      SCOPED_TRACE(std::to_string(stages) + " stage(s)" + (dedup ? ", dedup" : ""));
      const std::uint64_t seed = 61 + (dedup ? 1 : 0);
      expect_rank_equals_reference<attention_test::ExactKernel>(attention_test::random_slice_plan(world_size(), seed, dedup), {dedup, stages},
                                                                seed, {});
    }
  }
}

// The same through the host kernel (entries sharing rows folded), plain
// documents under a window, 2 and 4 stages.
TEST(MpiCpAttention, SlicePlansWithTheHostKernel) {
  for (const bool dedup : {false, true}) {
    const int stages = dedup ? 4 : 2;
    SCOPED_TRACE(std::to_string(stages) + " stages" + (dedup ? ", dedup" : ""));
    const cpdispatch::QkvDocumentsPlan plan = attention_test::random_slice_plan(world_size(), 63, dedup, cpdispatch::AttentionMask::sliding_window(3));
    expect_rank_equals_reference<cpdispatch::HostAttentionKernel>(plan, {dedup, stages}, 63, {}, cpdispatch::HostAttentionOptions{1, 4, 4});
  }
}

// Head-parallel documents (section 2f) beside dispatched ones, in groups of
// 2 ranks and of all of them (the key-value heads then shared by 2 ranks),
// dedup off and on, one stage and several.
TEST(MpiCpAttention, HeadParallelPlansEqualWholeDocumentAttention) {
  const int W = world_size();
  for (const int u : {2, W}) {
    if (W % u != 0 || 4 % u != 0) continue;  // the shape's 4 query heads split over u
    for (const bool dedup : {false, true}) {
      const int stages = dedup ? 1 : 3;
      SCOPED_TRACE("u = " + std::to_string(u) + ", " + std::to_string(stages) + " stage(s)" + (dedup ? ", dedup" : ""));
      const std::uint64_t seed = 71 + static_cast<std::uint64_t>(u) + (dedup ? 1 : 0);
      cpdispatch::QkvDocumentsPlan plan = attention_test::with_head_parallel(plan_of(W, seed), u, seed, true);
      plan.dedup = dedup;
      expect_rank_equals_reference<attention_test::ExactKernel>(plan, {dedup, stages}, seed, {});
    }
  }
}

// The last rank fails its second posted exchange (a forward stage) before
// reaching MPI: every rank throws within the timeout, the others naming it
// (the MPI transport's outcome agreement), and none returns.
TEST(MpiCpAttention, ARankThatFailsMidStepIsNamedOnEveryRank) {
  using Faulty = cpdispatch::testing::FaultInjectingTransport<cpdispatch::MpiTransport>;
  const int W = world_size(), faulty = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  const cpdispatch::AttentionShape shape{4, 2, 4, 0.45f};
  const CpWorld world(plan_of(W, 54), shape, cpdispatch::AttentionMask::causal(), 54, attention_test::round_to<float>);
  cpdispatch::MpiTransportOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  cpdispatch::MpiTransport mpi(MPI_COMM_WORLD, options);
  using cpdispatch::testing::Fault, cpdispatch::testing::FaultRule, cpdispatch::testing::TransportCall;
  Faulty t(mpi, {FaultRule{TransportCall::post_all_to_all_v, 2, Fault::error, faulty}}, {.error_code = 77});
  const auto r = static_cast<std::size_t>(t.rank());
  const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
  cpdispatch::ContextParallelAttention<Faulty, float, attention_test::ExactKernel> op(t, share, shape, {false, 3});
  try {
    (void)attention_test::step<float>(op, world.tensors(r));
    ADD_FAILURE() << "rank " << r << " finished the step";
  } catch (const cpdispatch::backend_error& e) {
    if (t.rank() == faulty) {
      EXPECT_EQ(e.code(), 77) << e.what();
    } else {
      EXPECT_NE(std::string(e.what()).find("rank(s) " + std::to_string(faulty) + " reported no outcome in time"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
