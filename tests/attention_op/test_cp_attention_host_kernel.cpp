// ContextParallelAttention over its default kernel, HostAttentionKernel:
// float equals whole-document attention within 1e-5; 16-bit types stay
// within twice the error of the same kernel run unsharded in that type; one
// stage gives the same bytes for every kernel thread count; a staged pass in
// which a query row sees no key leaves the merged result exact and finite;
// a plan with slices (its own entries, sharing rows) is exact, and so is
// one with head-parallel documents.

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/run_op.hpp"
#include "attention_op/slice_plans.hpp"
#include "cpdispatch/attention.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::RankResult;
using attention_test::run_op;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::HostAttentionKernel;

static_assert(std::is_same_v<cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float>::kernel_type, HostAttentionKernel>);

cpdispatch::QkvDocumentsPlan plan_of(int world_size, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = world_size;
  o.num_documents = world_size + 2;
  o.max_shards = 4;
  o.max_len = 6;
  return cpdispatch::random_documents_plan(o, seed);
}

/// One kernel thread per rank: the ranks are threads already.
const cpdispatch::HostAttentionOptions one_thread{1, 4, 4};

TEST(CpAttentionHostKernel, FloatEqualsWholeDocumentAttention) {
  const AttentionShape shape{4, 2, 8, 0.35f};
  for (const int stages : {1, 3}) {
    const CpWorld world(plan_of(5, 41), shape, AttentionMask::causal(), 41, attention_test::round_to<float>);
    world.expect_equal(run_op<float, HostAttentionKernel>(world, shape, {false, stages}, one_thread), 1e-5);
  }
}

template <class E>
void expect_within_twice_unsharded(int stages, const cpdispatch::QkvDocumentsPlan& plan = plan_of(4, 43)) {
  const AttentionShape shape{2, 1, 8, 0.35f};
  const CpWorld sharded(plan, shape, AttentionMask::causal(), 43, attention_test::round_to<E>);
  const CpWorld whole(CpWorld::unsharded(sharded.plan()), shape, AttentionMask::causal(), 43, attention_test::round_to<E>);
  const std::array<double, 5> got = sharded.relative_errors(run_op<E, HostAttentionKernel>(sharded, shape, {false, stages}, one_thread));
  const std::array<double, 5> base = whole.relative_errors(run_op<E, HostAttentionKernel>(whole, shape, {}, one_thread));
  const char* names[5] = {"out", "dq", "dk", "dv", "lse"};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(cpdispatch::testing::within_twice(got[i], base[i])) << names[i] << " with " << stages << " stages, against the unsharded run";
  }
}

TEST(CpAttentionHostKernel, Bfloat16WithinTwiceTheUnshardedError) {
  expect_within_twice_unsharded<cpdispatch::bfloat16>(1);
  expect_within_twice_unsharded<cpdispatch::bfloat16>(2);
}

TEST(CpAttentionHostKernel, Float16WithinTwiceTheUnshardedError) {
  expect_within_twice_unsharded<cpdispatch::float16>(1);
  expect_within_twice_unsharded<cpdispatch::float16>(4);
}

/// Section 2e's worked example (a shared-prefix document with slices and a
/// causal one, W = 2): the kernel gets the plan's own entries, several per
/// query shard sharing its rows, and equals the reference.
TEST(CpAttentionHostKernel, SharedPrefixSlicesEqualWholeDocumentAttention) {
  const AttentionShape shape{4, 2, 8, 0.35f};
  const CpWorld world(attention_test::shared_prefix_example(), shape, AttentionMask::causal(), 59, attention_test::round_to<float>);
  for (const int stages : {1, 2}) {
    world.expect_equal(run_op<float, HostAttentionKernel>(world, shape, {false, stages}, cpdispatch::HostAttentionOptions{1, 2, 2}), 1e-5);
  }
}

/// Head-parallel documents (section 2f) beside dispatched ones, some with
/// slices: float equals the reference; in bfloat16, with the one key-value
/// head shared by both ranks of a group (its gradients summed at home), the
/// error stays within twice the unsharded run's.
TEST(CpAttentionHostKernel, HeadParallelDocuments) {
  const AttentionShape shape{4, 2, 8, 0.35f};
  const CpWorld world(attention_test::with_head_parallel(plan_of(4, 45), 4, 45, true), shape, AttentionMask::causal(), 45,
                      attention_test::round_to<float>);
  for (const int stages : {1, 2}) world.expect_equal(run_op<float, HostAttentionKernel>(world, shape, {false, stages}, one_thread), 1e-5);
  expect_within_twice_unsharded<cpdispatch::bfloat16>(3, attention_test::with_head_parallel(plan_of(4, 43), 2, 43, true));
}

/// Every byte of every rank's out, lse, dq, dk and dv of `b` equals `a`'s
/// (bytes, not ==: +0 and -0 differ, and a NaN equals its own bytes).
void expect_same_bytes(const std::vector<RankResult>& a, const std::vector<RankResult>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const std::array<std::pair<const char*, std::vector<float> RankResult::*>, 5> tensors{
      {{"out", &RankResult::out}, {"lse", &RankResult::lse}, {"dq", &RankResult::dq}, {"dk", &RankResult::dk}, {"dv", &RankResult::dv}}};
  for (std::size_t r = 0; r < a.size(); ++r) {
    for (const auto& [name, member] : tensors) {
      const std::vector<float>&x = a[r].*member, &y = b[r].*member;
      ASSERT_EQ(x.size(), y.size()) << what << ", rank " << r << ", " << name;
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0) {
          ADD_FAILURE() << what << ", rank " << r << ", " << name << "[" << i << "]: " << std::hexfloat << x[i] << " vs " << y[i]
                        << " (first differing element)";
          break;
        }
      }
    }
  }
}

/// The claim of CpAttentionOptions::stages = 1 with the shipped kernel: its
/// threads share the work out differently from run to run and from count to
/// count, yet out, lse and the gradients come out as the same bytes. Which
/// thread takes which block is up to the scheduler (helpers that wake late
/// find no work left), so the calls are long enough for the helpers to join
/// and each count runs several times.
TEST(CpAttentionHostKernel, OneStageIsBitwiseTheSameForEveryThreadCount) {
  const AttentionShape shape{4, 2, 16, 0.25f};
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(7)}) {
    for (const bool dedup : {false, true}) {
      cpdispatch::RandomDocumentsOptions o;
      o.world_size = 3;
      o.num_documents = 5;
      o.max_shards = 4;
      o.max_len = 32;
      cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 47);
      plan.mask = mask;
      plan.dedup = dedup;
      const CpWorld world(plan, shape, mask, 47, attention_test::round_to<float>);
      const cpdispatch::HostAttentionOptions blocks{1, 4, 8};  // small: many blocks to share out
      const auto one = run_op<float, HostAttentionKernel>(world, shape, {dedup, 1}, blocks);
      world.expect_equal(one, 1e-5);  // the bytes compared below are right ones
      for (const int threads : {2, 3}) {
        for (int run = 0; run < 2; ++run) {
          const std::string what = std::string(mask.type == cpdispatch::MaskType::causal ? "causal" : "window 7") + (dedup ? ", dedup" : "") +
                                   ", " + std::to_string(threads) + " threads, run " + std::to_string(run);
          expect_same_bytes(one, run_op<float, HostAttentionKernel>(world, shape, {dedup, 1}, cpdispatch::HostAttentionOptions{threads, 4, 8}),
                            what);
        }
      }
    }
  }
}

/// HostAttentionKernel that counts the query rows its forward calls leave
/// without a key (lse -infinity, each row once per call): the staged case
/// below must produce some. With Folds false it declares that it cannot
/// fold entries sharing rows, so the op attends a round's parts in passes.
template <bool Folds>
class EmptyRowCountingKernel {
 public:
  static constexpr bool folds_shared_rows = Folds;

  EmptyRowCountingKernel(const cpdispatch::HostAttentionOptions& options, std::atomic<int>* const& empty_rows)
      : kernel_(options), empty_rows_(empty_rows) {}

  template <class E>
  void forward(const AttentionShape& s, std::span<const cpdispatch::AttentionEntry> entries, std::span<const E> q, std::span<const E> k,
               std::span<const E> v, std::span<E> out, std::span<float> lse) {
    if constexpr (!Folds) check_.separate_rows("EmptyRowCountingKernel", "forward", entries);
    kernel_.forward(s, entries, q, k, v, out, lse);
    const auto tokens = static_cast<std::int64_t>(lse.size()) / s.heads_q;
    std::vector<bool> counted(static_cast<std::size_t>(tokens), false);
    for (const cpdispatch::AttentionEntry& e : entries) {
      for (std::int64_t j = e.q_start; j < e.q_start + e.q_len; ++j) {
        if (counted[static_cast<std::size_t>(j)]) continue;
        counted[static_cast<std::size_t>(j)] = true;
        for (std::int64_t h = 0; h < s.heads_q; ++h) {
          if (lse[static_cast<std::size_t>(h * tokens + j)] == -std::numeric_limits<float>::infinity()) ++*empty_rows_;
        }
      }
    }
  }

  template <class E>
  void backward(const AttentionShape& s, std::span<const cpdispatch::AttentionEntry> entries, std::span<const E> q, std::span<const E> k,
                std::span<const E> v, std::span<const E> out, std::span<const float> lse, std::span<const E> dout, std::span<E> dq,
                std::span<E> dk, std::span<E> dv) {
    if constexpr (!Folds) check_.separate_rows("EmptyRowCountingKernel", "backward", entries);
    kernel_.backward(s, entries, q, k, v, out, lse, dout, dq, dk, dv);
  }

 private:
  HostAttentionKernel kernel_;
  std::atomic<int>* empty_rows_;
  cpdispatch::detail::attention::CallCheck check_;
};

// Three ranks in three stages: rank X receives from home rank h in round
// (X - h) mod 3, and an entry's part is attended in the later round of its
// queries' and its keys' arrival. Document 0: shards [0, 2) on rank 0,
// [2, 3) on rank 1, [3, 6) on rank 2, the last attended on rank 0, under a
// window of 3. Its KV group is all three shards (query 3 sees key 1); its
// parts on rank 0 are keys 0-1 (round 1, with the queries), key 2 (round 2)
// and keys 3-5 (round 1). A kernel that cannot fold shared rows attends keys
// 0-1 in a pass of its own, before keys 3-5, and queries 4 and 5 see none of
// them: their first partial output is empty while their running log-sum-exp
// is still -infinity. A kernel that folds them attends round 1 in one call,
// where queries 4 and 5 see keys 3-5; query 5 sees nothing in round 2 (key
// 2) alone. Either way every query row outside a round's call merges an
// empty part too. Document 1 is the same shape rotated to rank 1 (homes 1,
// 2, 0); document 2 gives rank 2 an entry of its own.
cpdispatch::QkvDocumentsPlan empty_first_pass_plan(bool dedup) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 3;
  plan.mask = AttentionMask::sliding_window(3);
  plan.dedup = dedup;
  plan.documents = {{{{0, 2, 0}, {1, 1, 1}, {2, 3, 0}}}, {{{1, 2, 1}, {2, 1, 2}, {0, 3, 1}}}, {{{2, 4, 2}}}};
  return plan;
}

void expect_all_finite(const std::vector<RankResult>& results, const std::string& what) {
  for (std::size_t r = 0; r < results.size(); ++r) {
    for (const auto& [name, x] : {std::pair{"out", &results[r].out}, std::pair{"lse", &results[r].lse}, std::pair{"dq", &results[r].dq},
                                  std::pair{"dk", &results[r].dk}, std::pair{"dv", &results[r].dv}}) {
      for (std::size_t i = 0; i < x->size(); ++i) {
        if (!std::isfinite((*x)[i])) {
          ADD_FAILURE() << what << ", rank " << r << ", " << name << "[" << i << "] = " << (*x)[i] << "; the reference is finite everywhere";
          break;
        }
      }
    }
  }
}

template <bool Folds>
void expect_staged_empty_rows_exact(int want_empty_rows) {
  const AttentionShape shape{2, 1, 4, 0.5f};
  for (const bool dedup : {false, true}) {
    const cpdispatch::QkvDocumentsPlan plan = empty_first_pass_plan(dedup);
    const CpWorld world(plan, shape, plan.mask, 53, attention_test::round_to<float>);
    std::atomic<int> empty_rows{0};
    const auto results = run_op<float, EmptyRowCountingKernel<Folds>>(world, shape, {dedup, 3}, one_thread, &empty_rows);
    const std::string what = std::string(dedup ? "dedup" : "no dedup") + (Folds ? ", folding kernel" : ", kernel in passes");
    EXPECT_EQ(empty_rows.load(), want_empty_rows) << what << ": the passes are no longer the ones described above";
    expect_all_finite(results, what);  // a NaN fails here, whatever the tolerance check below makes of it
    world.expect_equal(results, 1e-5);
  }
}

TEST(CpAttentionHostKernel, StagedPassWhereARowSeesNoKeyEqualsWholeDocumentAttention) {
  // In documents 0 and 1, both heads: queries 4 and 5 in the pass of keys
  // 0-1 (their first), query 5 in that of key 2 (after keys 3-5).
  expect_staged_empty_rows_exact<false>(12);
  // Round 1 in one call: only query 5 in the call of key 2.
  expect_staged_empty_rows_exact<true>(4);
}

}  // namespace
