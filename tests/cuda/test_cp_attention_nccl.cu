// ContextParallelAttention on NcclTransport, a GPU a rank: the default mode
// equals whole-document attention, and the invariant mode gives, at every
// world size the machine has GPUs for, the bits of the one-rank device run
// (packed order). Without two CUDA devices every test skips (the cuda-cpu
// harness's NCCL double has four).

#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
