// ContextParallelAttention on NcclTransport, a GPU a rank: the default mode
// equals whole-document attention, and the invariant mode gives, at every
// world size the machine has GPUs for, the bits of the one-rank device run
// (packed order); a rank that never joins the step is reported by the
// others' op (the transport's watchdog). Without two CUDA devices every test
// skips (the cuda-cpu harness's NCCL double has eight).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "attention_op/grid_plans.hpp"
#include "attention_op/run_op.hpp"
#include "cpdispatch/cuda/context_parallel.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cuda_test_util.hpp"
#include "device_step.hpp"
#include "nccl_world.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::RankResult;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::CpAttentionOptions;

/// GPUs for NCCL ranks (at most 4), or 0 when fewer than two.
int nccl_ranks() {
  int devices = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  return devices < 2 ? 0 : std::min(devices, 4);
}

/// Runs a step on every rank of `world` over transport world `ranks` (run(f) calls f(transport) on each rank).
template <class E, class Ranks>
std::vector<RankResult> run_op(Ranks&& ranks, const CpWorld& world, const AttentionShape& s, CpAttentionOptions o) {
  return attention_test::on_every_rank(ranks, world, [&](auto& t, const cpdispatch::RankQkvMetadata& share) {
    cpdispatch::ContextParallelAttention<std::remove_reference_t<decltype(t)>, E> op(t, share, s, o);
    return cptest::device_step<E>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  });
}

struct NcclRanks {
  int world_size;
  template <class F>
  void run(F&& f) {
    cptest::run_nccl(world_size, f);
  }
};

TEST(CpAttentionNccl, EqualsWholeDocumentAttention) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int ranks = nccl_ranks();
  if (ranks == 0) GTEST_SKIP() << "NCCL needs a GPU a rank";
  const AttentionShape s{4, 2, 8, 0.35f};
  for (int W = 2; W <= ranks; ++W) {
    const bool dedup = W % 2 == 0;
    const CpWorld world(attention_test::random_plan(W, 90 + static_cast<unsigned>(W), AttentionMask::causal(), dedup), s, AttentionMask::causal(), 90,
                        attention_test::round_to<float>);
    world.expect_equal(run_op<float>(NcclRanks{W}, world, s, {dedup, 2}), 1e-5);
  }
}

TEST(CpAttentionNcclInvariant, EveryWorldSizeGivesTheBitsOfTheOneRankRun) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int ranks = nccl_ranks();
  if (ranks == 0) GTEST_SKIP() << "NCCL needs a GPU a rank";
  using attention_test::grid_plan;
  using attention_test::Placement;
  const AttentionShape s{4, 2, 8, 0.35f};
  const AttentionMask causal = AttentionMask::causal();
  const CpWorld one(grid_plan(1, Placement::home, 1, causal, false), s, causal, 77, attention_test::round_to<float>);
  cpdispatch::DeviceSimWorld sim(1);
  const attention_test::Packed want = attention_test::packed(run_op<float>(sim, one, s, attention_test::invariant_options(false, 1)), s);
  for (int W = 2; W <= ranks; ++W) {
    const bool dedup = W % 2 == 1;
    const CpWorld world(grid_plan(W, Placement::cut_further, 400 + static_cast<unsigned>(W), causal, dedup), s, causal, 77, attention_test::round_to<float>);
    attention_test::expect_same_bits(attention_test::packed(run_op<float>(NcclRanks{W}, world, s, attention_test::invariant_options(dedup, W)), s), want,
                                     "NCCL, W " + std::to_string(W));
  }
}

// A rank that builds its op, then stalls and never joins the step: every
// other rank's watchdog aborts its communicator within the deadline, and its
// op's next call throws, naming the exchange and the post found stuck.
TEST(CpAttentionNcclWatchdog, ARankThatNeverJoinsTheStepIsReportedByTheOthersOp) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = std::min(nccl_ranks(), 3);
  if (W == 0) GTEST_SKIP() << "NCCL needs a GPU a rank";
  const AttentionShape s{2, 1, 8, 0.35f};
  const CpWorld world(attention_test::random_plan(W, 95, AttentionMask::causal(), false), s, AttentionMask::causal(), 95, attention_test::round_to<float>);
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  cptest::run_nccl_with_a_stalled_rank(W, std::chrono::milliseconds(200), [&](cpdispatch::NcclTransport& t, bool stalled) {
    cpdispatch::ContextParallelAttention<cpdispatch::NcclTransport, float> op(t, cpdispatch::plan_qkv_for_rank(world.plan(), t.rank()), s);
    if (stalled) return;  // built its op (the plan agreement is a collective), never joins the step
    const auto me = static_cast<std::size_t>(t.rank());
    const attention_test::RankTensors x = world.tensors(me);
    const auto q = cptest::to_device(x.q), k = cptest::to_device(x.k), v = cptest::to_device(x.v), out = cptest::to_device(x.q);
    try {
      op.forward(cptest::in(q, x.q.size()), cptest::in(k, x.k.size()), cptest::in(v, x.v.size()), cptest::out(out, x.q.size()));
      CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));  // ends once the watchdog aborted the communicator
      op.backward(cptest::in(out, x.q.size()), cptest::out(q, x.q.size()), cptest::out(k, x.k.size()), cptest::out(v, x.v.size()));
    } catch (const cpdispatch::timeout_error& e) {
      errors[me] = e.what();
    }
  });
  for (int r = 0; r + 1 < W; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_THAT(e, ::testing::HasSubstr("ContextParallelAttention::backward (rank " + std::to_string(r) + " of " + std::to_string(W) + "): exchange failed"));
    EXPECT_THAT(e, ::testing::HasSubstr("NcclTransport: posted exchange #"));
    EXPECT_THAT(e, ::testing::HasSubstr("(NcclTransportOptions::deadline = 200 ms)"));
  }
}

}  // namespace
