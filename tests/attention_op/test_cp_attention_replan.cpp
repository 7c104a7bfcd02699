// ContextParallelAttention::replan over 20 steps of changing plans: every
// step equals whole-document attention, and once reserve() has sized the op
// for the largest plan, replan, forward and backward allocate nothing (with
// dedup, once the wire's lists per peer have seen every plan: a second pass
// over the same 20 plans allocates nothing at all; likewise with
// head-parallel documents, which reserve() does not size). This
// program replaces the global operator new to count each rank thread's
// allocations while its op runs (the test kernel's own are not counted).

#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "common/counting_allocator.hpp"
#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/run_op.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace {

using thread_allocations::allocations;
using thread_allocations::counting;
using attention_test::CpWorld;
using cpdispatch::AttentionShape;

/// ExactKernel with counting paused: the op's allocations are under test, not the kernel's.
struct UncountedKernel {
  attention_test::ExactKernel inner;
  template <class... Args>
  void forward(Args&&... args) {
    const bool was = std::exchange(counting, false);
    inner.forward(std::forward<Args>(args)...);
    counting = was;
  }
  template <class... Args>
  void backward(Args&&... args) {
    const bool was = std::exchange(counting, false);
    inner.backward(std::forward<Args>(args)...);
    counting = was;
  }
};
static_assert(cpdispatch::AttentionKernel<UncountedKernel, float>);

constexpr int steps = 20;
const AttentionShape shape{2, 1, 4, 0.5f};

struct ReplanCase {
  int stages;
  bool dedup;
  int head_parallel = 0;  // the degree u of the head-parallel documents every other step has (0: none)
  int world_size() const noexcept { return head_parallel > 0 ? 4 : 3; }
};

cpdispatch::QkvDocumentsPlan step_plan(int step, const ReplanCase& c) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = c.world_size();
  o.num_documents = 2 + step % 4;
  o.max_shards = 3;
  o.max_len = 3 + step % 3;
  o.max_cp_degree = 3;
  cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 700 + static_cast<std::uint64_t>(step));
  plan.dedup = c.dedup;
  if (c.head_parallel > 0 && step % 2 == 1) plan = attention_test::with_head_parallel(std::move(plan), c.head_parallel, 900 + static_cast<std::uint64_t>(step));
  return plan;
}

/// The largest plan of the steps, per rank.
cpdispatch::CpAttentionCapacity capacity_of(const std::vector<cpdispatch::QkvDocumentsPlan>& plans, int rank) {
  cpdispatch::CpAttentionCapacity c;
  for (const auto& plan : plans) {
    const auto s = cpdispatch::plan_qkv_for_rank(plan, rank);
    const auto n = [](std::size_t x) { return static_cast<std::int64_t>(x); };
    c.mlp_tokens = std::max(c.mlp_tokens, s.q_fwd.send_tokens());
    c.q_tokens = std::max(c.q_tokens, s.attn.q_tokens());
    c.kv_tokens = std::max(c.kv_tokens, s.attn.kv_tokens());
    c.shards = std::max({c.shards, n(s.q_fwd.seq_len.size()), n(s.q_rev.seq_len.size()), n(s.kv_rev.seq_len.size())});
    c.copies = std::max(c.copies, n(s.kv_fwd.num_copies));
  }
  return c;
}

void PrintTo(const ReplanCase& c, std::ostream* os) {
  *os << c.stages << " stages" << (c.dedup ? ", dedup" : "") << (c.head_parallel > 0 ? ", head-parallel" : "");
}

class CpAttentionReplan : public testing::TestWithParam<ReplanCase> {};

TEST_P(CpAttentionReplan, TwentyChangingStepsEqualTheReferenceAndAllocateNothingAfterReserve) {
  const ReplanCase c = GetParam();
  const int stages = c.stages, W = c.world_size();
  const bool dedup = c.dedup, second_pass = dedup || c.head_parallel > 0;
  const int passes = second_pass ? 2 : 1;  // the second pass sees no plan larger than one already seen
  std::vector<cpdispatch::QkvDocumentsPlan> plans;
  std::vector<CpWorld> worlds;
  for (int s = 0; s < steps; ++s) {
    plans.push_back(step_plan(s, c));
    worlds.emplace_back(plans.back(), shape, cpdispatch::AttentionMask::causal(), 800 + static_cast<std::uint64_t>(s), attention_test::round_to<float>);
  }
  const std::size_t runs = static_cast<std::size_t>(passes * steps);
  std::vector<std::vector<attention_test::RankResult>> results(runs, std::vector<attention_test::RankResult>(W));
  std::vector<std::vector<std::size_t>> counted(runs, std::vector<std::size_t>(W));
  cpdispatch::SimWorld sim(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, UncountedKernel> op(
        t, cpdispatch::plan_qkv_for_rank(plans[0], t.rank()), shape, {dedup, stages});
    op.reserve(capacity_of(plans, t.rank()));
    for (std::size_t run = 0; run < runs; ++run) {
      const std::size_t s = run % steps;
      const auto share = cpdispatch::plan_qkv_for_rank(plans[s], t.rank());
      const attention_test::RankTensors x = worlds[s].tensors(r);
      std::vector<float> out(x.q.size()), dq(x.q.size()), dk(x.k.size()), dv(x.v.size());
      allocations = 0;
      counting = true;
      op.replan(share);
      op.forward(x.q, x.k, x.v, out);
      op.backward(x.dout, dq, dk, dv);
      counting = false;
      counted[run][r] = allocations;
      results[run][r] = {out, dq, dk, dv, std::vector<float>(op.lse().begin(), op.lse().end()), share.q_rev,
                         std::vector<float>(op.head_parallel_lse().begin(), op.head_parallel_lse().end()), op.head_parallel()};
    }
  });
  for (std::size_t run = 0; run < runs; ++run) {
    SCOPED_TRACE("pass " + std::to_string(run / steps) + ", step " + std::to_string(run % steps));
    worlds[run % steps].expect_equal(results[run], 1e-5);
    // The first step may allocate in the transport (the sim's list of posted exchanges grows once).
    if (run == 0 || (second_pass && run < static_cast<std::size_t>(steps))) continue;
    for (int r = 0; r < W; ++r) EXPECT_EQ(counted[run][static_cast<std::size_t>(r)], 0u) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, CpAttentionReplan, testing::Values(ReplanCase{1, false}, ReplanCase{3, false}, ReplanCase{1, true}, ReplanCase{3, true}, ReplanCase{3, false, 2},
                                         ReplanCase{4, true, 2}),
                         [](const testing::TestParamInfo<ReplanCase>& info) {
                           return "s" + std::to_string(info.param.stages) + (info.param.dedup ? "_dedup" : "") + (info.param.head_parallel > 0 ? "_hp" : "");
                         });

}  // namespace
