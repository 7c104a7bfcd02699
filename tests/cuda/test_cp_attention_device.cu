// ContextParallelAttention on the device sim: device buffers, the device data
// path and CudaAttentionKernel. Forward (out, log-sum-exp) and backward (dq,
// dk, dv) equal attention over each whole document (the double-precision
// reference): float within 1e-5 relative, 16-bit types within twice the
// error of the same kernel run unsharded in that type. Cases are pairwise
// over world size, heads, mask, dedup and stages; a plan with slices; replan
// over changing plans; an idle rank; the refusals; one stage is bitwise the
// same run to run; the op over DeviceChecksummedTransport. Without a CUDA
// device every test skips.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "attention_op/grid_plans.hpp"
#include "attention_op/run_op.hpp"
#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/slice_plans.hpp"
#include "cpdispatch/cuda/checksummed.hpp"
#include "cpdispatch/cuda/context_parallel.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cuda_test_util.hpp"
#include "device_step.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::RankResult;
using attention_test::RankTensors;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::CpAttentionOptions;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::DeviceSpan;
using cptest::device_step;
using cptest::to_device;
using cptest::to_host;
using cptest::in;
using cptest::out;

template <class E>
using DeviceOp = cpdispatch::ContextParallelAttention<DeviceSimTransport, E>;

static_assert(std::is_same_v<DeviceOp<float>::kernel_type, cpdispatch::cuda::CudaAttentionKernel>);
static_assert(DeviceOp<float>::overlaps);  // the device sim posts: stages overlap the kernel

/// Every rank plans its own share, builds the device op and runs one step.
template <class E>
std::vector<RankResult> run_device_op(const CpWorld& world, const AttentionShape& shape, CpAttentionOptions options) {
  DeviceSimWorld sim(static_cast<int>(world.plan().world_size));
  return attention_test::on_every_rank(sim, world, [&](DeviceSimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    DeviceOp<E> op(t, share, shape, options);
    return device_step<E>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  });
}

using Case = attention_test::OpCase;
using attention_test::random_plan;
using attention_test::shape_of;

const AttentionMask window3 = AttentionMask::sliding_window(3);

// Pairwise over (world size, heads, mask, dedup, stages): every mask meets
// both dedup settings, both head layouts and one and several stages.
const Case cases[] = {
    {"W1_mha_causal_s1", 1, 2, 2, AttentionMask::causal(), false, 1, 51},
    {"W2_gqa_full_dedup_s2", 2, 4, 2, AttentionMask::full(), true, 2, 52},
    {"W3_gqa4_window3_s3", 3, 4, 1, window3, false, 3, 53},
    {"W4_mha_causal_dedup_s4", 4, 1, 1, AttentionMask::causal(), true, 4, 54},
    {"W5_mha_full_s3", 5, 2, 2, AttentionMask::full(), false, 3, 55},
    {"W6_gqa_causal_dedup_s1", 6, 4, 2, AttentionMask::causal(), true, 1, 58},
    {"W7_gqa_window3_dedup_s2", 7, 4, 2, window3, true, 2, 56},
    {"W8_gqa_causal_s4", 8, 4, 2, AttentionMask::causal(), false, 4, 57},
    {"W4_gqa_full_s1", 4, 4, 2, AttentionMask::full(), false, 1, 59},
    {"W3_mha_window3_dedup_s4", 3, 2, 2, window3, true, 4, 60},
};

class CpAttentionDevice : public testing::TestWithParam<Case> {};
INSTANTIATE_TEST_SUITE_P(Pairwise, CpAttentionDevice, testing::ValuesIn(cases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST_P(CpAttentionDevice, EqualsWholeDocumentAttention) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Case& c = GetParam();
  const CpWorld world(random_plan(c.world_size, c.seed, c.mask, c.dedup), shape_of(c), c.mask, c.seed, attention_test::round_to<float>);
  world.expect_equal(run_device_op<float>(world, shape_of(c), {c.dedup, c.stages}), 1e-5);
}

/// A plan with slices (section 2e's worked example: a shared-prefix document
/// and a causal one, W = 2): the device kernel gets the plan's own entries,
/// several per query shard sharing its rows, and equals the reference.
TEST(CpAttentionDeviceSlices, SharedPrefixEqualsTheReference) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape{4, 2, 4, 0.45f};
  for (const bool dedup : {false, true}) {
    const CpWorld world(attention_test::shared_prefix_example(dedup), shape, AttentionMask::causal(), 62, attention_test::round_to<float>);
    for (const int stages : {1, 2}) world.expect_equal(run_device_op<float>(world, shape, {dedup, stages}), 1e-5);
  }
}

/// Head-parallel documents (section 2f) beside dispatched ones: groups of 2
/// ranks and of all of them, key-value heads split or shared, dedup off and
/// on, one stage and several.
TEST(CpAttentionDeviceHeadParallel, EqualsTheReference) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  struct Run {
    int world_size;
    std::int64_t u, heads_q, heads_kv;
    bool dedup;
    int stages;
  };
  for (const Run& run : {Run{4, 2, 4, 2, true, 3}, Run{4, 4, 4, 2, false, 1}, Run{6, 2, 2, 1, false, 4}, Run{3, 3, 3, 3, true, 2}}) {
    SCOPED_TRACE("W = " + std::to_string(run.world_size) + ", u = " + std::to_string(run.u));
    const AttentionShape shape{run.heads_q, run.heads_kv, 4, 0.45f};
    const auto seed = static_cast<std::uint64_t>(70 + run.world_size + run.u);
    const auto plan = attention_test::with_head_parallel(random_plan(run.world_size, seed, AttentionMask::causal(), run.dedup), run.u, seed, true);
    const CpWorld world(plan, shape, AttentionMask::causal(), seed, attention_test::round_to<float>);
    world.expect_equal(run_device_op<float>(world, shape, {run.dedup, run.stages}), 1e-5);
  }
}

/// With one stage, the device op's results are bitwise the same run to run.
TEST(CpAttentionDeviceOneStage, BitwiseTheSameRunToRun) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape{4, 2, 4, 0.45f};
  for (const bool dedup : {false, true}) {
    const CpWorld world(random_plan(4, 61, AttentionMask::causal(), dedup), shape, AttentionMask::causal(), 61, attention_test::round_to<float>);
    const std::vector<RankResult> a = run_device_op<float>(world, shape, {dedup, 1}), b = run_device_op<float>(world, shape, {dedup, 1});
    for (std::size_t r = 0; r < a.size(); ++r) {
      EXPECT_TRUE(a[r].out == b[r].out && a[r].dq == b[r].dq && a[r].dk == b[r].dk && a[r].dv == b[r].dv && a[r].lse == b[r].lse)
          << "rank " << r << (dedup ? ", dedup" : "");
    }
  }
}

// Without dedup: with it, each destination's partial KV-gradient sum is rounded
// to E on the wire (docs/dedup.md), one rounding more than the unsharded run has.
template <class E>
void expect_within_twice_unsharded(bool dedup, int stages) {
  const AttentionShape shape{2, 1, 8, 0.35f};
  const CpWorld sharded(random_plan(4, 63, AttentionMask::causal(), dedup), shape, AttentionMask::causal(), 63, attention_test::round_to<E>);
  const CpWorld whole(CpWorld::unsharded(sharded.plan()), shape, AttentionMask::causal(), 63, attention_test::round_to<E>);
  const std::array<double, 5> got = sharded.relative_errors(run_device_op<E>(sharded, shape, {dedup, stages}));
  const std::array<double, 5> base = whole.relative_errors(run_device_op<E>(whole, shape, {}));
  const char* names[5] = {"out", "dq", "dk", "dv", "lse"};
  for (std::size_t i = 0; i < 5; ++i) EXPECT_TRUE(cpdispatch::testing::within_twice(got[i], base[i])) << names[i] << ", against the unsharded run";
}

TEST(CpAttentionDevice16Bit, Bfloat16WithinTwiceTheUnshardedError) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_within_twice_unsharded<cpdispatch::bfloat16>(false, 1);
  expect_within_twice_unsharded<cpdispatch::bfloat16>(false, 3);
}

TEST(CpAttentionDevice16Bit, Float16WithinTwiceTheUnshardedError) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_within_twice_unsharded<cpdispatch::float16>(false, 1);
  expect_within_twice_unsharded<cpdispatch::float16>(false, 2);
}

/// Rank 2 holds tokens but attends to nothing; rank 3 holds nothing and attends to nothing.
TEST(CpAttentionDeviceIdleRanks, EmptyRankAndRankThatAttendsNothing) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{0, 3, 1}, {1, 2, 1}, {2, 3, 0}}}, {{{1, 4, 0}}}, {{{2, 2, 1}}}};
  const AttentionShape shape{2, 1, 4, 0.5f};
  const CpWorld world(plan, shape, AttentionMask::causal(), 7, attention_test::round_to<float>);
  for (const int stages : {1, 3}) world.expect_equal(run_device_op<float>(world, shape, {false, stages}), 1e-5);
}

/// One op per rank over steps of changing plans (replan), each step equal to the reference.
TEST(CpAttentionDeviceReplan, EveryStepEqualsWholeDocumentAttention) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  constexpr int W = 3, steps = 4;
  const AttentionShape shape{2, 1, 4, 0.4f};
  for (const bool dedup : {false, true}) {
    SCOPED_TRACE(dedup ? "dedup" : "section 2 exchange");
    std::vector<CpWorld> worlds;
    for (int i = 0; i < steps; ++i) {
      const AttentionMask mask = i % 2 ? window3 : AttentionMask::causal();
      worlds.emplace_back(random_plan(W, 70 + static_cast<std::uint64_t>(i), mask, dedup), shape, mask, 70 + static_cast<std::uint64_t>(i),
                          attention_test::round_to<float>);
    }
    std::vector<std::vector<RankResult>> results(steps, std::vector<RankResult>(W));
    DeviceSimWorld sim(W);
    sim.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      DeviceOp<float> op(t, cpdispatch::plan_qkv_for_rank(worlds[0].plan(), t.rank()), shape, {dedup, 3});
      for (int i = 0; i < steps; ++i) {
        const auto share = cpdispatch::plan_qkv_for_rank(worlds[static_cast<std::size_t>(i)].plan(), t.rank());
        if (i > 0) op.replan(share);
        RankResult& got = results[static_cast<std::size_t>(i)][r];
        got = device_step<float>(op, worlds[static_cast<std::size_t>(i)].tensors(r));
        got.q_rev = share.q_rev;
      }
    });
    for (int i = 0; i < steps; ++i) worlds[static_cast<std::size_t>(i)].expect_equal(results[static_cast<std::size_t>(i)], 1e-5);
  }
}

#ifdef CPDISPATCH_CUDA_HOST_HARNESS
// Stream ordering, checked by the cuda-cpu harness: its scheduler runs the
// compute and communication streams' work in the order its seed picks.

/// A deliberately broken device transport: its wait() does not order the
/// compute stream after the exchange (the request is retired only at the
/// end of the step), so the op reads a stage's buffers before they land.
class EarlyReadTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::device;
  using data_path = DeviceSimTransport::data_path;

  explicit EarlyReadTransport(DeviceSimTransport& t) : t_(t) {}
  int rank() const { return t_.rank(); }
  int world_size() const { return t_.world_size(); }
  cudaStream_t stream() const { return t_.stream(); }
  void all_to_all_v(const void* send, std::span<const std::size_t> sc, std::span<const std::size_t> sd, void* recv,
                    std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    t_.all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  cpdispatch::Request post_all_to_all_v(const void* send, std::span<const std::size_t> sc, std::span<const std::size_t> sd, void* recv,
                                        std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    return t_.post_all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  void wait(cpdispatch::Request r) { late_.push_back(r); }
  /// Retires every request (after the step).
  void retire() {
    for (cpdispatch::Request r : late_) t_.wait(r);
    late_.clear();
  }

 private:
  DeviceSimTransport& t_;
  std::vector<cpdispatch::Request> late_;
};

/// One step with stages = 3 over the broken transport, every rank's results.
std::vector<RankResult> run_early_read_op(const CpWorld& world, const AttentionShape& shape) {
  DeviceSimWorld sim(static_cast<int>(world.plan().world_size));
  return attention_test::on_every_rank(sim, world, [&](DeviceSimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    EarlyReadTransport early(t);
    cpdispatch::ContextParallelAttention<EarlyReadTransport, float> op(early, share, shape, {false, 3});
    RankResult mine = device_step<float>(op, world.tensors(static_cast<std::size_t>(t.rank())));
    early.retire();
    return mine;
  });
}

/// Whether every result is finite and within 1e-5 of the reference.
bool exact(const CpWorld& world, const std::vector<RankResult>& results) {
  const std::array<double, 5> e = world.relative_errors(results);
  return std::all_of(e.begin(), e.end(), [](double x) { return std::isfinite(x) && x <= 1e-5; });
}

TEST(CpAttentionDeviceStreams, ReadingAStageBeforeItsWaitIsCaughtAndTheOpIsExactUnderEverySeed) {
  const cuda_harness::SeedGuard restore;
  const AttentionShape shape{2, 1, 4, 0.4f};
  const CpWorld world(random_plan(3, 81, AttentionMask::causal(), false), shape, AttentionMask::causal(), 81, attention_test::round_to<float>);
  int caught = 0;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    cuda_harness::set_seed(seed);
    EXPECT_TRUE(exact(world, run_device_op<float>(world, shape, {false, 3}))) << "the op under seed " << seed;
    cuda_harness::set_seed(seed);
    if (!exact(world, run_early_read_op(world, shape))) ++caught;
  }
  EXPECT_GT(caught, 0) << "reading a stage before its wait went unnoticed under every seed";
}

/// After a first step (which may size the kernel's scratch), a step with
/// stages enqueues its work without one host-synchronising call: with dedup
/// off and on, and with head-parallel documents (groups of 2 of 4 ranks,
/// some with shared-prefix slices) beside dispatched ones.
TEST(CpAttentionDeviceStreams, AStagedStepMakesNoSynchronisingCall) {
  const AttentionShape shape{4, 2, 4, 0.4f};
  for (const int run : {0, 1, 2}) {
    const bool dedup = run == 1, head_parallel = run == 2;
    const cpdispatch::QkvDocumentsPlan plan = head_parallel
                                                  ? attention_test::with_head_parallel(random_plan(4, 84, AttentionMask::causal(), false), 2, 84, true)
                                                  : random_plan(3, 83, AttentionMask::causal(), dedup);
    const CpWorld world(plan, shape, AttentionMask::causal(), 83, attention_test::round_to<float>);
    const auto W = static_cast<std::size_t>(plan.world_size);
    std::vector<std::uint64_t> synchronising(W);
    std::vector<RankResult> results(W);
    DeviceSimWorld sim(static_cast<int>(W));
    sim.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
      DeviceOp<float> op(t, share, shape, {dedup, 3});
      const RankTensors& x = world.tensors(r);
      const std::size_t nq = x.q.size(), nk = x.k.size();
      const DeviceBuffer<float> q = to_device(x.q), k = to_device(x.k), v = to_device(x.v), dout = to_device(x.dout), o = to_device(x.q),
                                dq = to_device(x.q), dk = to_device(x.k), dv = to_device(x.v);
      for (int step = 0; step < 2; ++step) {
        const std::uint64_t before = cuda_harness::synchronizing_calls_on_this_thread();
        op.forward(in(q, nq), in(k, nk), in(v, nk), out(o, nq));
        op.backward(in(dout, nq), out(dq, nq), out(dk, nk), out(dv, nk));
        synchronising[r] = cuda_harness::synchronizing_calls_on_this_thread() - before;
      }
      results[r] = {to_host(o.data(), nq), to_host(dq.data(), nq), to_host(dk.data(), nk), to_host(dv.data(), nk),
                    to_host(op.lse().data(), op.lse().size()), share.q_rev};
      results[r].hp_lse = to_host(op.head_parallel_lse().data(), op.head_parallel_lse().size());
      results[r].hp = share.hp_attn;
      if (head_parallel) {
        EXPECT_FALSE(op.head_parallel().documents.empty()) << "rank " << r;
      }
    });
    for (std::size_t r = 0; r < W; ++r) {
      EXPECT_EQ(synchronising[r], 0u) << "rank " << r << (dedup ? ", dedup" : "") << (head_parallel ? ", head-parallel documents" : "");
    }
    world.expect_equal(results, 1e-5);
  }
}
#endif

// The invariant mode (docs/invariant-attention.md): one batch cut on the
// grid over W ranks gives the bits of the one-rank device run, in packed
// order, for every plan, stage count and dedup setting; that run matches the
// reference; a NaN is refused on every rank.
template <class E>
std::vector<RankResult> invariant_run(const cpdispatch::QkvDocumentsPlan& plan, const AttentionShape& s, bool dedup, int stages) {
  const CpWorld world(plan, s, plan.mask, 77, attention_test::round_to<E>);
  return run_device_op<E>(world, s, attention_test::invariant_options(dedup, stages));
}

template <class E>
void expect_invariant(const AttentionShape& s, const AttentionMask& mask, const std::vector<int>& worlds, double tol, std::int64_t head_parallel = 0) {
  using attention_test::grid_plan;
  using attention_test::Placement;
  const auto one_plan = grid_plan(1, Placement::home, 1, mask, false);
  const std::vector<RankResult> one = invariant_run<E>(one_plan, s, false, 1);
  CpWorld(one_plan, s, mask, 77, attention_test::round_to<E>).expect_equal(one, tol);
  const attention_test::Packed want = attention_test::packed(one, s);
  int n = 0;
  for (const int W : worlds) {
    for (const Placement p : {Placement::anywhere, Placement::cut_further}) {
      const bool dedup = n % 2 == 0;
      const int stages = 1 + n % 3;
      ++n;
      auto plan = grid_plan(W, p, 200 + static_cast<unsigned>(n), mask, dedup);
      if (head_parallel > 0) plan = attention_test::head_parallel_on_grid(plan, head_parallel);
      const std::string run = "W " + std::to_string(W) + ", placement " + std::to_string(static_cast<int>(p)) + ", dedup " + std::to_string(dedup) +
                              ", stages " + std::to_string(stages);
      attention_test::expect_same_bits(attention_test::packed(invariant_run<E>(plan, s, dedup, stages), s), want, run);
    }
  }
}

TEST(CpAttentionDeviceInvariant, EveryWorldSizePlanAndStageCountGivesTheBitsOfOneRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_invariant<float>({4, 2, 8, 0.35f}, AttentionMask::causal(), {2, 3, 4}, 1e-5);
  expect_invariant<float>({2, 1, 8, 0.35f}, AttentionMask::sliding_window(6), {3}, 1e-5);
}

TEST(CpAttentionDeviceInvariant, BFloat16AndHeadParallelDocumentsToo) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_invariant<cpdispatch::bfloat16>({2, 2, 8, 0.35f}, AttentionMask::causal(), {2}, 2e-2);
  expect_invariant<float>({4, 2, 8, 0.35f}, AttentionMask::causal(), {4}, 1e-5, 2);  // key-value heads split by the group
  expect_invariant<float>({4, 1, 8, 0.35f}, AttentionMask::causal(), {2}, 1e-5, 2);  // ... and shared: exact sums go home
}

TEST(CpAttentionDeviceInvariant, ANaNInOneRanksInputIsRefusedOnEveryRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape s{2, 1, 8, 0.35f};
  const auto plan = attention_test::grid_plan(3, attention_test::Placement::anywhere, 9, AttentionMask::causal(), false);
  const CpWorld world(plan, s, AttentionMask::causal(), 77, attention_test::round_to<float>);
  for (const bool in_dout : {false, true}) {
    std::vector<std::string> errors(3);
    DeviceSimWorld sim(3, cpdispatch::DeviceSimOptions{sim_test::hang_timeout});  // a rank left waiting fails, not hangs
    sim.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      RankTensors x = world.tensors(r);
      if (r == 1) (in_dout ? x.dout : x.v)[0] = std::numeric_limits<float>::quiet_NaN();  // first: a later, larger value must not hide it
      DeviceOp<float> op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), s, attention_test::invariant_options(false, 2));
      try {
        device_step<float>(op, x);
      } catch (const cpdispatch::invalid_input& e) {
        errors[r] = e.what();
      }
    });
    attention_test::expect_refused_on_every_rank(errors, in_dout);
  }
}

/// Over DeviceChecksummedTransport the op gives the results it gives over
/// the bare device sim, and each rank's check() counts the segments its
/// exchanges brought from other ranks (blocking and posted, every stage).
TEST(CpAttentionDeviceChecksummed, EqualsTheReferenceWithEverySegmentChecked) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape{4, 2, 4, 0.45f};
  for (const auto& run : {std::pair{true, 1}, std::pair{false, 3}}) {
    const bool dedup = run.first;  // copies, not structured bindings: a lambda below takes them
    const int stages = run.second;
    SCOPED_TRACE(std::string(dedup ? "dedup, " : "") + std::to_string(stages) + " stage(s)");
    const CpWorld world(random_plan(4, 64, AttentionMask::causal(), dedup), shape, AttentionMask::causal(), 64, attention_test::round_to<float>);
    DeviceSimWorld sim(4);
    std::vector<std::uint64_t> checked(4);
    const auto results = attention_test::on_every_rank(sim, world, [&](DeviceSimTransport& t, const cpdispatch::RankQkvMetadata& share) {
      cpdispatch::DeviceChecksummedTransport checked_transport(t);
      cpdispatch::ContextParallelAttention<decltype(checked_transport), float> op(checked_transport, share, shape, {dedup, stages});
      RankResult r = device_step<float>(op, world.tensors(static_cast<std::size_t>(t.rank())));
      checked[static_cast<std::size_t>(t.rank())] = checked_transport.check();
      EXPECT_GT(checked_transport.summed_by_packs(), 0u) << "rank " << t.rank() << ": every exchange read its sent bytes a second time";
      return r;
    });
    world.expect_equal(results, 1e-5);
    // The plan agreement's exchange, then the step's: at least W - 1 segments each, on every rank.
    for (std::size_t r = 0; r < checked.size(); ++r) EXPECT_GE(checked[r], 2u * 3u) << "rank " << r;
  }
}

TEST(CpAttentionDeviceErrors, RefusalsNameTheField) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 1;
  plan.documents = {{{{0, 3, 0}}}};
  const AttentionShape shape{2, 1, 4, 0.5f};
  DeviceSimWorld sim(1);
  sim.run([&](DeviceSimTransport& t) {
    const auto share = cpdispatch::plan_qkv_for_rank(plan, 0);
    attention_test::expect_error([&] { DeviceOp<float>(t, share, shape, {false, 0}); }, "options.stages = 0 must be at least 1");
    attention_test::expect_error([&] { DeviceOp<float>(t, share, shape, {true, 1}); }, "options.dedup is set but the share has no kv_wire");
    attention_test::expect_error([&] { DeviceOp<float>(t, share, {3, 2, 4, 1.0f}); }, "shape.heads_q = 3 is not a multiple of shape.heads_kv = 2");
    attention_test::expect_error([&] { DeviceOp<float>(t, share, shape, {}, cpdispatch::cuda::CudaAttentionKernel(nullptr)); },
                 "the kernel launches on another stream than the transport's");
    DeviceOp<float> op(t, share, shape);
    const DeviceBuffer<float> b(64);
    attention_test::expect_error([&] { op.forward(in(b, 24), in(b, 12), in(b, 11), out(b, 24)); }, "forward: v has 11 elements, but 3 tokens x 1 heads x 4 = 12");
    attention_test::expect_error([&] { op.backward(in(b, 24), out(b, 24), out(b, 12), out(b, 12)); }, "backward needs the forward of the same plan first");
  });
}

}  // namespace
