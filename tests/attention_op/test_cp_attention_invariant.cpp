// ContextParallelAttention's invariant mode: one batch, packed and cut over
// W ranks on the grid, gives bitwise the same out, lse, dq, dk and dv (in
// packed order) for every world size, plan (attended at home, anywhere, cut
// further on the grid, load-balanced on the grid), stage count, dedup setting and thread count, equal
// to the run with W = 1 and to the double reference within the default
// mode's tolerance, documents with slices (a shared prefix, prefix-LM) and
// head-parallel documents beside causal ones; shares cut off the grid,
// key-value heads shared by ranks and kernels without the mode are refused.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_op/grid_plans.hpp"
#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/run_op.hpp"
#include "common/sanitized.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/balance/balance.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::RankResult;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::CpAttentionOptions;
using cpdispatch::HostAttentionKernel;
using cpdispatch::HostAttentionOptions;
using cpdispatch::QkvDocumentsPlan;
using attention_test::grid;
using attention_test::grid_plan;
using attention_test::invariant_options;
using attention_test::packed;
using attention_test::Packed;
using attention_test::Placement;

template <class E>
std::vector<RankResult> run(const CpWorld& world, const AttentionShape& s, CpAttentionOptions o, int threads) {
  return attention_test::run_op<E, HostAttentionKernel>(world, s, o, HostAttentionOptions{threads, 16, 32});
}

/// The batch's world (its data drawn per document, the same for every plan).
template <class E>
CpWorld world_of(const QkvDocumentsPlan& plan, const AttentionShape& s, const AttentionMask& mask) {
  return CpWorld(plan, s, mask, 77, attention_test::round_to<E>);
}

template <class E>
void check_every_run(const AttentionShape& s, const AttentionMask& mask, const std::vector<int>& worlds, double tol, bool slices = false) {
  const CpWorld one = world_of<E>(grid_plan(1, Placement::home, 1, mask, false, 0, slices), s, mask);
  const auto base = run<E>(one, s, invariant_options(false, 1), 1);
  one.expect_equal(base, tol);
  const Packed want = packed(base, s);
  int n = 0;
  for (int W : worlds) {
    for (Placement p : {Placement::home, Placement::anywhere, Placement::cut_further}) {
      const bool dedup = n % 2 == 1;
      const int stages = 1 + n % 3, threads = 1 + n % 3;
      ++n;
      const std::string name = "W " + std::to_string(W) + ", placement " + std::to_string(static_cast<int>(p)) + ", dedup " + std::to_string(dedup) +
                               ", stages " + std::to_string(stages) + ", threads " + std::to_string(threads);
      SCOPED_TRACE(name);
      const CpWorld world = world_of<E>(grid_plan(W, p, 100 + static_cast<unsigned>(n), mask, dedup, 0, slices), s, mask);
      expect_same_bits(packed(run<E>(world, s, invariant_options(dedup, stages), threads), s), want, name);
    }
  }
}

TEST(CpAttentionInvariant, EveryWorldSizePlanAndStageCountGivesTheBitsOfOneRank) {
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(6)}) {
    SCOPED_TRACE(to_string(mask));
    check_every_run<float>({4, 2, 8, 0.35f}, mask, cptest::sanitized ? std::vector<int>{3, 8} : std::vector<int>{2, 3, 4, 8}, 1e-5);
  }
}

/// The load-balanced plan of the batch on grid_plan's MLP layout, every cut on the grid.
QkvDocumentsPlan balanced(int W, const AttentionMask& mask, bool dedup, bool slices) {
  const QkvDocumentsPlan layout = grid_plan(W, Placement::home, 1, mask, false, 0, slices);
  cpdispatch::BalanceProblem p;
  p.world_size = W;
  p.mask = mask;
  p.max_cp_degree = 2 * W;  // room to re-cut documents that span ranks
  for (const cpdispatch::PackedDocument& d : layout.documents) {
    cpdispatch::BalanceDocument doc;
    for (const cpdispatch::DocumentShard& x : d.shards) doc.pieces.push_back({x.rank, x.len});
    doc.slices = d.slices;
    p.documents.push_back(doc);
  }
  cpdispatch::BalanceOptions o;
  o.grid = grid;
  o.dedup = dedup;
  QkvDocumentsPlan plan = cpdispatch::plan_balanced(p, o);
  plan.mask = mask;
  plan.dedup = dedup;
  return plan;
}

TEST(CpAttentionInvariant, BalancedPlansOnTheGridToo) {
  const AttentionShape s{4, 2, 8, 0.35f};
  for (const bool slices : {false, true}) {
    const AttentionMask mask = AttentionMask::causal();
    const CpWorld one = world_of<float>(grid_plan(1, Placement::home, 1, mask, false, 0, slices), s, mask);
    const Packed want = packed(run<float>(one, s, invariant_options(false, 1), 1), s);
    for (const int W : {2, 3, 4, 8}) {
      const bool dedup = W % 2 == 0;
      const QkvDocumentsPlan plan = balanced(W, mask, dedup, slices);
      EXPECT_NO_THROW(cpdispatch::check_grid(plan, grid));
      const CpWorld world = world_of<float>(plan, s, mask);
      expect_same_bits(packed(run<float>(world, s, invariant_options(dedup, 1 + W % 3), 2), s), want,
                       "balanced, W " + std::to_string(W) + (slices ? ", slices" : ""));
    }
  }
}

TEST(CpAttentionInvariant, DocumentsWithSlicesToo) {
  check_every_run<float>({4, 2, 8, 0.35f}, AttentionMask::causal(), {2, 4, 5}, 1e-5, true);
}

TEST(CpAttentionInvariant, BFloat16AndMultiHeadToo) {
  check_every_run<cpdispatch::bfloat16>({2, 2, 8, 0.35f}, AttentionMask::causal(), {2, 5}, 2e-2);
}

/// What each rank's op construction threw (empty: nothing).
std::vector<std::string> construction_errors(const QkvDocumentsPlan& plan, CpAttentionOptions o) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  std::vector<std::string> errors(W);
  cpdispatch::SimWorld sim(plan.world_size, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    try {
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float> op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), {2, 1, 4, 0.5f}, o);
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  return errors;
}

TEST(CpAttentionInvariant, ACutOffTheGridIsRefusedOnEveryRank) {
  for (bool agreement : {true, false}) {
    CpAttentionOptions o = invariant_options(false, 1);
    o.check_plan_agreement = agreement;
    // Rank 1's layout starts 3 tokens past a grid point, inside the second document.
    const auto errors = construction_errors(grid_plan(3, Placement::anywhere, 5, AttentionMask::causal(), false, 3), o);
    int naming = 0;
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("off the grid of 8 tokens"), std::string::npos) << e;
      naming += e.find("starts at packed position") != std::string::npos || e.find("starts inside its document") != std::string::npos;
    }
    EXPECT_GE(naming, 1);
  }
  // On the grid, nothing is refused.
  for (const std::string& e : construction_errors(grid_plan(3, Placement::anywhere, 5, AttentionMask::causal(), false), invariant_options(false, 1))) {
    EXPECT_EQ(e, "");
  }
}

/// Head-parallel documents of degree u at each world size of `worlds` give the bits of one rank.
void check_head_parallel(const AttentionShape& s, std::int64_t u, const std::vector<int>& worlds, unsigned seed) {
  const AttentionMask causal = AttentionMask::causal();
  const CpWorld one = world_of<float>(grid_plan(1, Placement::home, 1, causal, false), s, causal);
  const Packed want = packed(run<float>(one, s, invariant_options(false, 1), 1), s);
  int n = 0;
  for (const int W : worlds) {
    for (const Placement p : {Placement::anywhere, Placement::cut_further}) {
      const bool dedup = n % 2 == 0;
      const int stages = 1 + n % 2;
      ++n;
      const QkvDocumentsPlan plan = attention_test::head_parallel_on_grid(grid_plan(W, p, seed + static_cast<unsigned>(n), causal, dedup), u);
      int documents = 0;
      for (const auto& d : plan.documents) documents += d.head_parallel;
      ASSERT_GE(documents, 1) << "W " << W;
      const CpWorld world = world_of<float>(plan, s, causal);
      expect_same_bits(packed(run<float>(world, s, invariant_options(dedup, stages), 1 + n % 3), s), want,
                       "W " + std::to_string(W) + ", degree " + std::to_string(u) + ", " + std::to_string(documents) +
                           " head-parallel documents, stages " + std::to_string(stages));
    }
  }
}

TEST(CpAttentionInvariant, HeadParallelDocumentsToo) { check_head_parallel({4, 2, 8, 0.35f}, 2, {2, 4, 6}, 300); }

// Fewer key-value heads than the degree: the ranks that share a key-value
// head send its gradients home as exact sums, summed there as integers.
TEST(CpAttentionInvariant, HeadParallelDocumentsWithSharedKeyValueHeadsToo) {
  check_head_parallel({4, 2, 8, 0.35f}, 4, {4, 8}, 400);
  check_head_parallel({4, 1, 8, 0.35f}, 2, {2, 4}, 500);
}

TEST(CpAttentionInvariant, RanksThatDisagreeOnTheModeOrGridAreNamedOnEveryRank) {
  const QkvDocumentsPlan plan = grid_plan(3, Placement::anywhere, 4, AttentionMask::causal(), false);
  for (const bool grid_only : {false, true}) {
    std::vector<std::string> errors(3);
    cpdispatch::SimWorld sim(3, cpdispatch::SimOptions{sim_test::hang_timeout});
    sim.run([&](cpdispatch::SimTransport& t) {
      CpAttentionOptions o = invariant_options(false, 1);
      if (t.rank() == 1) {
        if (grid_only) o.grid = 2 * grid; else o.invariant = false;
      }
      try {
        cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float> op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), {2, 1, 4, 0.5f}, o);
      } catch (const cpdispatch::invalid_input& e) {
        errors[static_cast<std::size_t>(t.rank())] = e.what();
      }
    });
    for (const std::string& e : errors) EXPECT_NE(e.find("rank(s) 1 hold another configuration"), std::string::npos) << e;
  }
}

// A NaN first in one rank's input, larger values after it: every rank
// refuses the step (none waits in an exchange for a rank whose kernel threw):
// in v, the forward's kernels are agreed on; in dout, every rank's bounds
// hold the NaN.
TEST(CpAttentionInvariant, ANaNInOneRanksInputIsRefusedOnEveryRank) {
  const AttentionShape s{2, 1, 8, 0.35f};
  const QkvDocumentsPlan plan = grid_plan(3, Placement::anywhere, 9, AttentionMask::causal(), false);
  const CpWorld world = world_of<float>(plan, s, AttentionMask::causal());
  for (const bool in_dout : {false, true}) {
    std::vector<std::string> errors(3);
    cpdispatch::SimWorld sim(3, cpdispatch::SimOptions{sim_test::hang_timeout});
    sim.run([&](cpdispatch::SimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      attention_test::RankTensors x = world.tensors(r);
      if (r == 1) (in_dout ? x.dout : x.v)[0] = std::numeric_limits<float>::quiet_NaN();
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, HostAttentionKernel> op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), s,
                                                                                                   invariant_options(false, 2), HostAttentionKernel({1, 16, 32}));
      try {
        attention_test::step<float>(op, x);
      } catch (const cpdispatch::invalid_input& e) {
        errors[r] = e.what();
      }
    });
    attention_test::expect_refused_on_every_rank(errors, in_dout);
  }
}

TEST(CpAttentionInvariant, RefusesKernelsWithoutTheModeAndBadGrids) {
  CpAttentionOptions bad = invariant_options(false, 1);
  bad.grid = 0;
  for (const std::string& e : construction_errors(grid_plan(2, Placement::home, 3, AttentionMask::causal(), false), bad)) {
    EXPECT_NE(e.find("options.grid = 0 must be in [1, 2^40]"), std::string::npos) << e;
  }
  cpdispatch::SimWorld sim(1, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    attention_test::expect_error(
        [&] {
          cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, attention_test::ExactKernel> op(
              t, cpdispatch::plan_qkv_for_rank(grid_plan(1, Placement::home, 3, AttentionMask::causal(), false), 0), {2, 1, 4, 0.5f},
              invariant_options(false, 1));
        },
        "the kernel has no invariant mode");
  });
}

}  // namespace
