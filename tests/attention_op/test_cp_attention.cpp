// ContextParallelAttention equals attention over each whole document (the
// double-precision reference), forward and backward, on the sim transport.
// Cases are chosen pairwise over world size, heads, mask, dedup and stages.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attention_op/head_parallel_plans.hpp"
#include "attention_op/run_op.hpp"
#include "attention_op/slice_plans.hpp"
#include "cpdispatch/attention/call_check.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/attention/step_trace.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::ExactKernel;
using attention_test::run_op;
using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::CpAttentionOptions;

using Case = attention_test::OpCase;
using attention_test::plan_of;
using attention_test::shape_of;

class CpAttentionTest : public testing::TestWithParam<Case> {};

TEST_P(CpAttentionTest, EqualsWholeDocumentAttention) {
  const Case& c = GetParam();
  const CpWorld world(plan_of(c), shape_of(c), c.mask, c.seed, attention_test::round_to<float>);
  world.expect_equal(run_op<float>(world, shape_of(c), CpAttentionOptions{c.dedup, c.stages}), 1e-5);
}

const AttentionMask window3 = AttentionMask::sliding_window(3), window6 = AttentionMask::sliding_window(6);

// Pairwise over (world size, heads, mask, dedup, stages): every mask meets
// every stage count and both dedup settings; W = 1..8.
const Case cases[] = {
    {"W1_mha_causal_s1", 1, 2, 2, AttentionMask::causal(), false, 1, 11},
    {"W2_gqa_full_s2", 2, 4, 2, AttentionMask::full(), false, 2, 12},
    {"W3_gqa4_window3_s3_dedup", 3, 4, 1, window3, true, 3, 13},
    {"W4_mha_causal_s4_dedup", 4, 1, 1, AttentionMask::causal(), true, 4, 14},
    {"W5_gqa_full_s1_dedup", 5, 2, 1, AttentionMask::full(), true, 1, 15},
    {"W6_mha_window6_s3", 6, 2, 2, window6, false, 3, 16},
    {"W7_gqa_causal_s2", 7, 4, 2, AttentionMask::causal(), false, 2, 17},
    {"W8_mha_window3_s4", 8, 2, 2, window3, false, 4, 18},
    {"W8_gqa_causal_s1_dedup", 8, 4, 2, AttentionMask::causal(), true, 1, 19},
    {"W1_gqa_window3_s3", 1, 4, 2, window3, false, 3, 20},
    {"W3_mha_full_s4", 3, 2, 2, AttentionMask::full(), false, 4, 22},
    {"W5_gqa_window6_s2_dedup", 5, 4, 2, window6, true, 2, 23},
    {"W6_gqa_causal_s1", 6, 2, 1, AttentionMask::causal(), false, 1, 24},
    {"W4_mha_window3_s1_dedup", 4, 2, 2, window3, true, 1, 25},
    {"W7_mha_full_s3_dedup", 7, 2, 2, AttentionMask::full(), true, 3, 26},
    {"W2_gqa_window6_s4", 2, 4, 1, window6, false, 4, 27},
};

INSTANTIATE_TEST_SUITE_P(Pairwise, CpAttentionTest, testing::ValuesIn(cases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

/// A case of the op with head-parallel documents mixed with dispatched ones:
/// groups of u ranks, heads that split over them (heads_kv < u: each
/// key-value head shared by u / heads_kv ranks of the group).
struct HeadParallelCase {
  const char* name;
  int world_size;
  std::int64_t u, heads_q, heads_kv;
  AttentionMask mask;
  bool dedup;
  int stages;
  bool prefix;  // shared-prefix slices on some head-parallel documents
  std::uint64_t seed;
};

void PrintTo(const HeadParallelCase& c, std::ostream* os) { *os << c.name; }

class CpAttentionHeadParallel : public testing::TestWithParam<HeadParallelCase> {};

TEST_P(CpAttentionHeadParallel, EqualsWholeDocumentAttention) {
  const HeadParallelCase& c = GetParam();
  const cpdispatch::QkvDocumentsPlan plan =
      attention_test::with_head_parallel(attention_test::random_plan(c.world_size, c.seed, c.mask, c.dedup), c.u, c.seed, c.prefix);
  const AttentionShape shape{c.heads_q, c.heads_kv, 4, 0.45f};
  const CpWorld world(plan, shape, c.mask, c.seed, attention_test::round_to<float>);
  world.expect_equal(run_op<float>(world, shape, CpAttentionOptions{c.dedup, c.stages}), 1e-5);
}

// u among the divisors of W (2 and W where they exist); every mask meets
// every stage count, dedup on and off, MHA, GQA and shared key-value heads.
const HeadParallelCase head_parallel_cases[] = {
    {"W1_u1_mha_causal_s1", 1, 1, 2, 2, AttentionMask::causal(), false, 1, false, 41},
    {"W2_u2_gqa_full_s2_dedup", 2, 2, 4, 2, AttentionMask::full(), true, 2, true, 42},
    {"W2_u1_gqa4_causal_s3", 2, 1, 4, 1, AttentionMask::causal(), false, 3, false, 43},
    {"W3_u3_gqa_window3_s3", 3, 3, 6, 3, window3, false, 3, true, 44},
    {"W4_u2_shared_kv_causal_s4_dedup", 4, 2, 4, 1, AttentionMask::causal(), true, 4, true, 45},
    {"W4_u4_shared_kv_full_s1", 4, 4, 4, 2, AttentionMask::full(), false, 1, true, 46},
    {"W5_u5_mha_causal_s2", 5, 5, 5, 5, AttentionMask::causal(), false, 2, false, 47},
    {"W6_u2_mha_window6_s3_dedup", 6, 2, 2, 2, window6, true, 3, false, 48},
    {"W6_u6_shared_kv_causal_s4", 6, 6, 6, 2, AttentionMask::causal(), false, 4, true, 49},
    {"W7_u7_shared_kv_full_s1_dedup", 7, 7, 7, 1, AttentionMask::full(), true, 1, false, 50},
    {"W8_u2_mha_causal_s2_dedup", 8, 2, 4, 4, AttentionMask::causal(), true, 2, true, 51},
    {"W8_u8_gqa_window3_s3", 8, 8, 8, 2, window3, false, 3, false, 52},
    {"W8_u4_gqa_causal_s1_dedup", 8, 4, 8, 8, AttentionMask::causal(), true, 1, true, 53},
};

INSTANTIATE_TEST_SUITE_P(Pairwise, CpAttentionHeadParallel, testing::ValuesIn(head_parallel_cases),
                         [](const testing::TestParamInfo<HeadParallelCase>& info) { return std::string(info.param.name); });

TEST(CpAttentionHeadParallelRefusals, HeadsThatDoNotSplitOverTheGroupsAreNamed) {
  const auto plan = attention_test::with_head_parallel(attention_test::random_plan(4, 7, AttentionMask::causal(), false), 4, 7);
  const auto refusal = [&](const AttentionShape& shape) {
    std::string message;
    cpdispatch::SimWorld sim(4, cpdispatch::SimOptions{sim_test::hang_timeout});
    sim.run([&](cpdispatch::SimTransport& t) {
      try {
        cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(t, cpdispatch::plan_qkv_for_rank(plan, t.rank()), shape);
      } catch (const cpdispatch::invalid_input& e) {
        if (t.rank() == 0) message = e.what();
      }
    });
    return message;
  };
  EXPECT_EQ(refusal({2, 2, 4, 0.5f}),
            "ContextParallelAttention (rank 0 of 4): shape.heads_q = 2 is not divisible by the plan's head_parallel_degree = 4 "
            "(each rank of a group attends heads_q / u query heads)");
  EXPECT_EQ(refusal({12, 3, 4, 0.5f}),
            "ContextParallelAttention (rank 0 of 4): shape.heads_kv = 3 neither divides nor is divisible by the plan's head_parallel_degree = 4");
}

TEST(CpAttentionHeadParallelRefusals, AShareWhoseDegreeDisagreesWithItsCopiesIsNamed) {
  const auto plan = attention_test::with_head_parallel(attention_test::random_plan(4, 7, AttentionMask::causal(), false), 4, 7);
  std::string message;
  cpdispatch::SimWorld sim(4, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    share.hp_attn.degree = 2;  // the slices still send each shard to 4 ranks
    try {
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(t, share, {4, 4, 4, 0.5f});
    } catch (const cpdispatch::invalid_input& e) {
      if (t.rank() == 0) message = e.what();
    }
  });
  EXPECT_EQ(message, "ContextParallelAttention (rank 0 of 4): share.hp_fwd holds 4 copies of each shard but share.hp_attn.degree = 2 (not one plan's share)");
}

TEST(CpAttentionHeadParallelRefusals, AShareWhoseHeadParallelSliceListsOtherTokensThanTheMlpLayoutIsNamed) {
  const auto plan = attention_test::with_head_parallel(attention_test::random_plan(4, 7, AttentionMask::causal(), false), 4, 7);
  std::string message;
  cpdispatch::SimWorld sim(4, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    const std::int64_t mlp = share.q_fwd.send_tokens();
    cpdispatch::RankMetadata& hp = share.hp_fwd;  // one more shard of 3 tokens, sent nowhere: the exchanges would read past q
    hp.seq_len.push_back(3);
    hp.num_seqs += 1;
    for (std::size_t c = 0; c < hp.num_copies; ++c) hp.dst_rank.push_back(-1), hp.dst_offset.push_back(0);
    share.hp_rev.recv_seq_lens->push_back(3);  // and no copy of it comes back
    for (std::size_t c = 0; c < share.hp_rev.mask_copies; ++c) share.hp_rev.seq_recv_mask->push_back(0);
    try {
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(t, share, {4, 4, 4, 0.5f});
    } catch (const cpdispatch::invalid_input& e) {
      if (t.rank() == 0) message = e.what() + std::string(" | ") + std::to_string(mlp);
    }
  });
  EXPECT_THAT(message, ::testing::StartsWith("ContextParallelAttention (rank 0 of 4): share.hp_fwd lists "));
  const std::string mlp = message.substr(message.rfind(" | ") + 3);
  EXPECT_THAT(message, ::testing::HasSubstr(" tokens of this rank's MLP layout, share.q_fwd " + mlp + " (not one plan's share)"));
}

/// SimTransport without post_all_to_all_v: the op exchanges in blocking calls where it would post.
class BlockingOnlyTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  explicit BlockingOnlyTransport(cpdispatch::SimTransport& sim) : sim_(sim) {}
  int rank() const { return sim_.rank(); }
  int world_size() const { return sim_.world_size(); }
  void all_to_all_v(const void* send, std::span<const std::size_t> sc, std::span<const std::size_t> sd, void* recv,
                    std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    sim_.all_to_all_v(send, sc, sd, recv, rc, rd);
  }

 private:
  cpdispatch::SimTransport& sim_;
};

static_assert(cpdispatch::posted_all_to_all_v<cpdispatch::SimTransport>);
static_assert(!cpdispatch::posted_all_to_all_v<BlockingOnlyTransport>);

TEST(CpAttentionTransports, StagesOverABlockingOnlyTransportEqualTheReference) {
  const Case c{"W4", 4, 2, 1, AttentionMask::causal(), false, 3, 31};
  const CpWorld world(plan_of(c), shape_of(c), c.mask, c.seed, attention_test::round_to<float>);
  cpdispatch::SimWorld sim(4, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.expect_equal(attention_test::on_every_rank(sim, world, [&](cpdispatch::SimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    BlockingOnlyTransport blocking(t);
    cpdispatch::ContextParallelAttention<BlockingOnlyTransport, float, ExactKernel> op(blocking, share, shape_of(c), {false, 3});
    return attention_test::step<float>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  }), 1e-5);
}

/// Rank 2 holds tokens but attends to nothing; rank 3 holds nothing and attends to nothing.
cpdispatch::QkvDocumentsPlan idle_ranks_plan() {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.documents = {{{{0, 3, 1}, {1, 2, 1}, {2, 3, 0}}}, {{{1, 4, 0}}}, {{{2, 2, 1}}}};
  return plan;
}

TEST(CpAttentionIdleRanks, EmptyRankAndRankThatAttendsNothing) {
  const AttentionShape shape{2, 1, 4, 0.5f};
  const CpWorld world(idle_ranks_plan(), shape, AttentionMask::causal(), 7, attention_test::round_to<float>);
  world.expect_equal(run_op<float>(world, shape, {}), 1e-5);
}

// ---- plans with slices (section 2e): the op attends the plan's own entries ----

using cpdispatch::AttentionSlice;
using cpdispatch::SliceType;

/// Section 2e's worked example (W = 2); then a second pair over three
/// ranks: a prompt of 4 shared by responses of 3 and 5 in shards that cut
/// through them, and the banded document (inverse and bi-causal slices);
/// then slices that leave query and key rows uncovered.
std::vector<cpdispatch::QkvDocumentsPlan> slice_plans(bool dedup) {
  const cpdispatch::QkvDocumentsPlan a = attention_test::shared_prefix_example(dedup);
  cpdispatch::QkvDocumentsPlan b;
  b.world_size = 3;
  b.dedup = dedup;
  b.documents = {{{{0, 3, 2}, {1, 3, 0}, {2, 2, 1}, {2, 4, 2}},
                  {{0, 4, 0, 4, SliceType::causal}, {4, 7, 0, 4, SliceType::full}, {4, 7, 4, 7, SliceType::causal},
                   {7, 12, 0, 4, SliceType::full}, {7, 12, 7, 12, SliceType::causal}}},
                 attention_test::banded_document({1, 1}, {0, 2}),
                 {{{2, 3, 0}, {0, 3, 1}}}};
  // Rows no slice covers: query 4 sees nothing, keys 2 and 3 are not in query
  // shard 0's entries and keys 0 and 1 not in shard 1's (both groups hold them).
  cpdispatch::QkvDocumentsPlan c;
  c.world_size = 2;
  c.dedup = dedup;
  c.documents = {{{{0, 4, 1}, {1, 4, 0}}, {{0, 4, 0, 2, SliceType::full}, {5, 8, 2, 8, SliceType::causal}}},
                 {{{1, 3, 1}, {0, 2, 0}}}};
  return {a, b, c};
}

TEST(CpAttentionSlices, SharedPrefixAndBandsEqualTheReference) {
  const AttentionShape shape{2, 1, 4, 0.45f};
  for (const bool dedup : {false, true}) {
    for (const cpdispatch::QkvDocumentsPlan& plan : slice_plans(dedup)) {
      const CpWorld world(plan, shape, AttentionMask::causal(), 17, attention_test::round_to<float>);
      for (const int stages : {1, 2, 3}) {
        SCOPED_TRACE("W = " + std::to_string(plan.world_size) + ", stages " + std::to_string(stages) + (dedup ? ", dedup" : ""));
        world.expect_equal(run_op<float>(world, shape, CpAttentionOptions{dedup, stages}), 1e-5);
      }
    }
  }
}

class CpAttentionRandomSlices : public testing::TestWithParam<Case> {};

/// Random slice plans (slice_plans.hpp: a document of every kind, the
/// banded one, plain ones under the case's mask), four seeds a case, equal the reference.
TEST_P(CpAttentionRandomSlices, EqualsWholeDocumentAttention) {
  const Case& c = GetParam();
  for (std::uint64_t seed = c.seed; seed < c.seed + 400; seed += 100) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CpWorld world(attention_test::random_slice_plan(c.world_size, seed, c.dedup, c.mask), shape_of(c), c.mask, seed,
                        attention_test::round_to<float>);
    world.expect_equal(run_op<float>(world, shape_of(c), CpAttentionOptions{c.dedup, c.stages}), 1e-5);
  }
}

// GQA in every case; pairwise over (world size, heads, mask, dedup, stages):
// W = 1..8, every stage count 1..4 with and without dedup.
const Case slice_cases[] = {
    {"W1_gqa_causal_s1", 1, 4, 2, AttentionMask::causal(), false, 1, 71},
    {"W2_gqa4_full_s2_dedup", 2, 4, 1, AttentionMask::full(), true, 2, 72},
    {"W3_gqa_window3_s3", 3, 2, 1, window3, false, 3, 73},
    {"W4_gqa_causal_s4_dedup", 4, 4, 2, AttentionMask::causal(), true, 4, 74},
    {"W5_gqa4_window6_s1_dedup", 5, 4, 1, window6, true, 1, 75},
    {"W6_gqa_full_s3", 6, 4, 2, AttentionMask::full(), false, 3, 76},
    {"W7_gqa_causal_s2", 7, 2, 1, AttentionMask::causal(), false, 2, 77},
    {"W8_gqa4_window3_s4", 8, 4, 1, window3, false, 4, 78},
    {"W8_gqa_full_s1_dedup", 8, 2, 1, AttentionMask::full(), true, 1, 79},
    {"W6_gqa4_causal_s2_dedup", 6, 4, 1, AttentionMask::causal(), true, 2, 80},
    {"W3_gqa_window6_s4_dedup", 3, 4, 2, window6, true, 4, 81},
    {"W5_gqa_causal_s3_dedup", 5, 2, 1, AttentionMask::causal(), true, 3, 82},
};

INSTANTIATE_TEST_SUITE_P(Pairwise, CpAttentionRandomSlices, testing::ValuesIn(slice_cases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

/// Rows and keys no entry covers (the third slice plan) are cleared on an op
/// that attended another plan first, whose outputs and gradients fill its buffers.
TEST(CpAttentionSlices, RowsNoEntryCoversAreClearedOnAReusedOp) {
  const AttentionShape shape{2, 1, 4, 0.45f};
  const CpWorld before(plan_of({"W2", 2, 2, 1, AttentionMask::full(), false, 1, 29}), shape, AttentionMask::full(), 29,
                       attention_test::round_to<float>);
  const CpWorld after(slice_plans(false)[2], shape, AttentionMask::causal(), 31, attention_test::round_to<float>);
  for (const int stages : {1, 2}) {
    SCOPED_TRACE("stages " + std::to_string(stages));
    std::vector<attention_test::RankResult> results(2);
    cpdispatch::SimWorld sim(2, cpdispatch::SimOptions{sim_test::hang_timeout});
    sim.run([&](cpdispatch::SimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(
          t, cpdispatch::plan_qkv_for_rank(before.plan(), t.rank()), shape, {false, stages});
      (void)attention_test::step<float>(op, before.tensors(r));
      const auto share = cpdispatch::plan_qkv_for_rank(after.plan(), t.rank());
      op.replan(share);
      results[r] = attention_test::step<float>(op, after.tensors(r));
      results[r].q_rev = share.q_rev;
    });
    after.expect_equal(results, 1e-5);
  }
}

/// A head-parallel document (section 2f) whose slices leave rows and keys
/// uncovered: its query row 4 sees nothing, and keys 2 to 4 are seen by no
/// query. It is run on an op that attended the same document whole (causal)
/// first, which filled every row's outputs and gradients: the uncovered
/// rows' outputs and the uncovered keys' gradients must come back 0 (and
/// row 4's log-sum-exp minus infinity), not what the first plan left.
TEST(CpAttentionHeadParallel, RowsAndKeysNoEntryCoversAreClearedOnAReusedOp) {
  const AttentionShape shape{4, 2, 4, 0.45f};
  cpdispatch::QkvDocumentsPlan whole;
  whole.world_size = 2;
  whole.head_parallel_degree = 2;
  whole.documents = {{{{0, 4, 0}, {1, 4, 1}}}, {{{1, 3, 0}, {0, 2, 0}}}};
  whole.documents[0].head_parallel = true;
  cpdispatch::QkvDocumentsPlan holed = whole;
  holed.documents[0].slices = {{0, 4, 0, 2, SliceType::full}, {5, 8, 5, 8, SliceType::causal}};
  const CpWorld before(whole, shape, AttentionMask::causal(), 37, attention_test::round_to<float>);
  const CpWorld after(holed, shape, AttentionMask::causal(), 39, attention_test::round_to<float>);
  for (const int stages : {1, 2}) {
    SCOPED_TRACE("stages " + std::to_string(stages));
    std::vector<attention_test::RankResult> results(2);
    cpdispatch::SimWorld sim(2, cpdispatch::SimOptions{sim_test::hang_timeout});
    sim.run([&](cpdispatch::SimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(
          t, cpdispatch::plan_qkv_for_rank(before.plan(), t.rank()), shape, {false, stages});
      (void)attention_test::step<float>(op, before.tensors(r));
      const auto share = cpdispatch::plan_qkv_for_rank(after.plan(), t.rank());
      op.replan(share);
      results[r] = attention_test::step<float>(op, after.tensors(r));
      results[r].q_rev = share.q_rev;
      results[r].hp = share.hp_attn;
    });
    after.expect_equal(results, 1e-5);
    // Row 4 is rank 1's first MLP row (the first of the document's second shard): its output is 0.
    const auto row = static_cast<std::size_t>(shape.heads_q * shape.head_dim);
    ASSERT_GE(results[1].out.size(), row);
    for (std::size_t i = 0; i < row; ++i) EXPECT_EQ(results[1].out[i], 0.0f) << "output of row 4, element " << i;
  }
}

/// ExactKernel declaring that it cannot fold entries sharing rows, and
/// refusing a call whose entries share a row.
struct SeparateRowsKernel : ExactKernel {
  static constexpr bool folds_shared_rows = false;
  template <class E>
  void forward(const AttentionShape& s, std::span<const AttentionEntry> entries, std::span<const E> q, std::span<const E> k,
               std::span<const E> v, std::span<E> out, std::span<float> lse) {
    cpdispatch::detail::attention::CallCheck().separate_rows("SeparateRowsKernel", "forward", entries);
    ExactKernel::forward(s, entries, q, k, v, out, lse);
  }
  template <class E>
  void backward(const AttentionShape& s, std::span<const AttentionEntry> entries, std::span<const E> q, std::span<const E> k,
                std::span<const E> v, std::span<const E> out, std::span<const float> lse, std::span<const E> dout, std::span<E> dq,
                std::span<E> dk, std::span<E> dv) {
    cpdispatch::detail::attention::CallCheck().separate_rows("SeparateRowsKernel", "backward", entries);
    ExactKernel::backward(s, entries, q, k, v, out, lse, dout, dq, dk, dv);
  }
};

/// Entries coloured into passes of which none holds a query row twice: each
/// to the first pass free at its first row (rows [2, 6) and [6, 9) touch, so
/// share pass 1), as few passes as the most entries on one row (three, on row 5).
TEST(CpAttentionSlices, QueryRowPassesColourSharedRowsIntoFewestPasses) {
  const std::vector<AttentionEntry> entries{{2, 4, 0, 1, {}}, {0, 9, 1, 1, {}}, {6, 3, 2, 1, {}}, {4, 2, 3, 1, {}}, {9, 1, 4, 1, {}}};
  const std::vector<std::size_t> by_start{1, 0, 3, 2, 4};
  std::vector<std::size_t> pass(entries.size(), 99);
  std::vector<std::int64_t> ends;
  cpdispatch::detail::query_row_passes(by_start, [&](std::size_t i) -> const AttentionEntry& { return entries[i]; }, pass, ends);
  EXPECT_EQ(pass, (std::vector<std::size_t>{1, 0, 1, 2, 0}));
  EXPECT_EQ(ends.size(), 3u);
}

/// A kernel that cannot fold shared rows gets the passes of a staged step
/// (each call's entries share no row) and equals the reference; a plan whose
/// own entries share rows is refused for it.
TEST(CpAttentionSlices, AKernelThatCannotFoldIsGivenSeparateRowsOrRefused) {
  const AttentionShape shape{2, 1, 4, 0.45f};
  for (const bool dedup : {false, true}) {
    for (const std::uint64_t seed : {23u, 24u}) {  // seed 24: entries with two parts in one round
      const CpWorld world(plan_of({"W4", 4, 2, 1, AttentionMask::causal(), dedup, 3, seed}), shape, AttentionMask::causal(), seed,
                          attention_test::round_to<float>);
      world.expect_equal(run_op<float, SeparateRowsKernel>(world, shape, CpAttentionOptions{dedup, 3}), 1e-5);
    }
  }
  cpdispatch::SimWorld sim(2, cpdispatch::SimOptions{sim_test::hang_timeout});
  const cpdispatch::QkvDocumentsPlan plan = slice_plans(false)[0];
  sim.run([&](cpdispatch::SimTransport& t) {
    const auto share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    using SeparateOp = cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, SeparateRowsKernel>;
    // Both ranks attend a response's query shard, whose two entries (the prompt, itself) share its rows.
    attention_test::expect_error([&] { SeparateOp(t, share, shape); }, "share query rows");
  });
}

}  // namespace

namespace {

/// Runs body(share, transport) on one rank of a world of one.
template <class F>
void on_one_rank(F&& body) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 1;
  plan.documents = {{{{0, 3, 0}}}};
  cpdispatch::SimWorld sim(1, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) { body(cpdispatch::plan_qkv_for_rank(plan, 0), t); });
}

using Op = cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel>;

TEST(CpAttentionErrors, BadShapeAndOptionsAreNamed) {
  on_one_rank([](const cpdispatch::RankQkvMetadata& share, cpdispatch::SimTransport& t) {
    attention_test::expect_error([&] { Op(t, share, {3, 2, 4, 1.0f}); }, "shape.heads_q = 3 is not a multiple of shape.heads_kv = 2");
    attention_test::expect_error([&] { Op(t, share, {2, 2, 0, 1.0f}); }, "shape.head_dim = 0");
    attention_test::expect_error([&] { Op(t, share, {2, 2, 4, 0.0f}); }, "shape.softmax_scale");
    attention_test::expect_error([&] { Op(t, share, {2, 2, 4, 1.0f}, {false, 0}); }, "options.stages = 0");
    attention_test::expect_error([&] { Op(t, share, {2, 2, 4, 1.0f}, {true, 1}); }, "options.dedup is set but the share has no kv_wire");
  });
}

TEST(CpAttentionErrors, ReplanWithDedupRefusesAShareWithoutWireSlices) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 1;
  plan.documents = {{{{0, 3, 0}}}};
  plan.dedup = true;
  cpdispatch::SimWorld sim(1, cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    const auto with_wire = cpdispatch::plan_qkv_for_rank(plan, 0);
    ASSERT_TRUE(with_wire.kv_wire.has_value());
    Op op(t, with_wire, {2, 2, 4, 1.0f}, {true, 2});
    plan.dedup = false;
    const auto without = cpdispatch::plan_qkv_for_rank(plan, 0);
    attention_test::expect_error([&] { op.replan(without); }, "options.dedup is set but the share has no kv_wire");
  });
}

TEST(CpAttentionErrors, WrongBufferSizesAndBackwardFirstAreNamed) {
  on_one_rank([](const cpdispatch::RankQkvMetadata& share, cpdispatch::SimTransport& t) {
    Op op(t, share, {2, 1, 4, 1.0f});
    std::vector<float> q(3 * 8), kv(3 * 4), out(3 * 8), small(5);
    attention_test::expect_error([&] { op.backward(q, out, kv, kv); }, "backward needs the forward");
    attention_test::expect_error([&] { op.forward(q, small, kv, out); }, "k has 5 elements, but 3 tokens x 1 heads x 4 = 12");
    op.forward(q, kv, kv, out);
    std::vector<float> dk(3 * 4), dv(3 * 4);
    attention_test::expect_error([&] { op.backward(q, small, dk, dv); }, "dq has 5 elements");
  });
}

/// A step with options.trace: each rank's timeline has every part of the
/// step (posts with their bytes, waits, unpacks, kernel passes and merges per
/// round, fan-out, fan-in, the gradients' sum), each event inside the step's
/// time and in order, and the results are those of an untraced step.
TEST(CpAttentionTrace, RecordsEveryPartOfAStepOnEveryRank) {
  const int W = 4;
  const Case c{"trace", W, 4, 2, AttentionMask::causal(), true, 3, 31};
  const CpWorld world(plan_of(c), shape_of(c), c.mask, c.seed, attention_test::round_to<float>);
  const auto origin = cpdispatch::StepTrace::Clock::now();
  std::vector<cpdispatch::StepTrace> traces;
  for (int r = 0; r < W; ++r) traces.emplace_back(r, origin);
  cpdispatch::SimWorld sim(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  const auto traced = attention_test::on_every_rank(sim, world, [&](cpdispatch::SimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    CpAttentionOptions o{c.dedup, c.stages};
    o.trace = &traces[static_cast<std::size_t>(t.rank())];
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(t, share, shape_of(c), o);
    return attention_test::step<float>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  });
  const auto plain = run_op<float>(world, shape_of(c), CpAttentionOptions{c.dedup, c.stages});
  const auto end = cpdispatch::StepTrace::Clock::now();
  const auto span_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - origin).count();
  std::int64_t posted = 0;
  std::size_t events = 0;
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto& mine = traced[static_cast<std::size_t>(r)];
    const auto& want = plain[static_cast<std::size_t>(r)];
    EXPECT_EQ(mine.out, want.out);
    EXPECT_EQ(mine.dk, want.dk);
    std::set<std::string> seen;
    std::int64_t last = 0;
    int forward_kernels = 0;
    for (const cpdispatch::TraceEvent& e : traces[static_cast<std::size_t>(r)].events()) {
      seen.insert(std::string(e.call) + " " + e.name);
      EXPECT_LE(0, e.start_ns);
      EXPECT_LE(e.start_ns, e.end_ns);
      EXPECT_LE(e.end_ns, span_ns);
      EXPECT_LE(last, e.start_ns) << e.call << " " << e.name << " starts before the event recorded before it ended";
      last = e.end_ns;
      if (std::string(e.name) == "post") posted += e.bytes;
      forward_kernels += std::string(e.call) == "forward" && std::string(e.name) == "kernel";
    }
    for (const char* part : {"forward post", "forward wait", "forward unpack", "forward kernel", "forward merge", "forward fan-out", "backward post",
                             "backward wait", "backward kernel", "backward merge", "backward fan-in", "backward combine"}) {
      EXPECT_TRUE(seen.count(part)) << part;
    }
    EXPECT_GE(forward_kernels, 2) << "with stages, one kernel pass a round at least";
    events += traces[static_cast<std::size_t>(r)].events().size();
  }
  EXPECT_GT(posted, 0);
  // Chrome trace-event JSON: a process per rank and one complete event per recorded event.
  std::ostringstream json;
  std::vector<const cpdispatch::StepTrace*> all;
  for (const auto& t : traces) all.push_back(&t);
  cpdispatch::write_chrome_trace(json, all);
  const std::string text = json.str();
  EXPECT_EQ(text.rfind("{\"traceEvents\":[", 0), 0u);
  std::size_t complete = 0;
  for (std::size_t at = text.find("\"ph\":\"X\""); at != std::string::npos; at = text.find("\"ph\":\"X\"", at + 1)) ++complete;
  EXPECT_EQ(complete, events);
  EXPECT_NE(text.find("\"name\":\"rank 3\""), std::string::npos);
}

/// With stages, a head-parallel document is attended in the round its last
/// slab arrives, not after every round: on some rank a head-parallel
/// kernel pass runs before the wait for the last stage group, forward and
/// backward, and the results are whole-document attention.
TEST(CpAttentionTrace, HeadParallelDocumentsAreAttendedInTheRoundTheyAreWhole) {
  const int W = 4;
  const AttentionShape shape{4, 4, 4, 0.45f};
  const cpdispatch::QkvDocumentsPlan plan =
      attention_test::with_head_parallel(attention_test::random_plan(W, 61, AttentionMask::causal(), false), W, 61);
  const CpWorld world(plan, shape, AttentionMask::causal(), 61, attention_test::round_to<float>);
  const auto origin = cpdispatch::StepTrace::Clock::now();
  std::vector<cpdispatch::StepTrace> traces;
  for (int r = 0; r < W; ++r) traces.emplace_back(r, origin);
  cpdispatch::SimWorld sim(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  const auto results = attention_test::on_every_rank(sim, world, [&](cpdispatch::SimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    CpAttentionOptions o{false, 3};
    o.trace = &traces[static_cast<std::size_t>(t.rank())];
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float, ExactKernel> op(t, share, shape, o);
    return attention_test::step<float>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  });
  world.expect_equal(results, 1e-5);
  // Three stages: stage groups 0 and 1; the inputs' wait for group 1 is the call's first wait of group 1.
  for (const std::string call : {"forward", "backward"}) {
    bool early = false;
    for (const cpdispatch::StepTrace& trace : traces) {
      std::size_t first_hp = trace.events().size(), last_group = trace.events().size();
      for (std::size_t i = 0; i < trace.events().size(); ++i) {
        const cpdispatch::TraceEvent& e = trace.events()[i];
        if (call != e.call) continue;
        if (std::string(e.name) == "kernel (head-parallel)") first_hp = std::min(first_hp, i);
        if (std::string(e.name) == "wait" && e.group == 1) last_group = std::min(last_group, i);
      }
      early = early || first_hp < last_group;
    }
    EXPECT_TRUE(early) << call << ": every rank attends its head-parallel documents only after the last stage group has arrived";
  }
}

}  // namespace
