// Per-rank planning of the deduplicated KV exchange: plan_kv_wire_for_rank
// (and plan_qkv_for_rank with a wire output) equals the global
// plan_kv_wire(plan_qkv(plan)).get_slice(rank) for every rank, on random,
// repeated-destination, zig-zag and empty-rank plans of both forms; and a
// KvWireDispatcher built from it moves the same bytes as one built from the
// global wire metadata (sim, every rank).

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "../common/sim_world_fixture.hpp"
#include "../common/same_slice.hpp"
#include "dedup_cases.hpp"

namespace {

using cpdispatch::KvFanList;
using cpdispatch::RankKvWire;
using cpdispatch::RankMetadata;
using cpdispatch::Rng;

using cptest::same_slice;

::testing::AssertionResult same_wire(const RankKvWire& got, const RankKvWire& want) {
  if (auto fwd = same_slice(got.fwd, want.fwd, "kv_wire_fwd"); !fwd) return fwd;
  if (auto rev = same_slice(got.rev, want.rev, "kv_wire_rev"); !rev) return rev;
  if (!(got.fan == want.fan)) return ::testing::AssertionFailure() << "fan list differs";
  return ::testing::AssertionSuccess();
}

/// Every rank's per-rank wire against the global slice, through both entry
/// points of the per-rank form where the plan has one.
template <class Plan>
::testing::AssertionResult every_rank_matches(const Plan& plan) {
  const cpdispatch::KvWireMetadata global = cpdispatch::plan_kv_wire(cpdispatch::plan_qkv(plan));
  cpdispatch::RankQkvMetadata share;
  cpdispatch::RankPlanWorkspace workspace;
  RankKvWire reused;
  for (std::int64_t r = 0; r < plan.world_size; ++r) {
    const RankKvWire want = global.get_slice(r);
    auto same = same_wire(cpdispatch::plan_kv_wire_for_rank(plan, r), want);
    if (!same) return same << " (rank " << r << ")";
    if constexpr (std::is_same_v<Plan, cpdispatch::QkvPlan>) {
      cpdispatch::plan_qkv_for_rank(plan, r, share, workspace, &reused);  // storage reused from the previous rank
      same = same_wire(reused, want);
      if (!same) return same << " (rank " << r << ", planned with reused storage)";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(DedupRankPlanning, PerRankFormEqualsTheGlobalSlices) {
  Rng rng(1401);
  for (int i = 0; i < 200; ++i) {
    const std::int64_t W = i % 10 == 0 ? rng.between(7, 64) : rng.between(1, 6);
    ASSERT_TRUE(every_rank_matches(dedup_test::random_plan(rng, W, i % 2 == 0))) << "plan " << i;
  }
  for (std::int64_t W : {1, 2, 3, 8, 16}) ASSERT_TRUE(every_rank_matches(dedup_test::zigzag_plan(W, 2, 6 * W))) << "zig-zag W = " << W;
}

TEST(DedupRankPlanning, DocumentsFormEqualsTheGlobalSlices) {
  Rng rng(1402);
  for (int i = 0; i < 200; ++i) {
    const std::int64_t W = i % 10 == 0 ? rng.between(7, 64) : rng.between(1, 6);  // few documents on many ranks: empty ranks
    ASSERT_TRUE(every_rank_matches(dedup_test::random_documents_plan(rng, W, i % 2 == 0))) << "plan " << i;
  }
  for (std::int64_t W : {1, 2, 3, 8, 16}) ASSERT_TRUE(every_rank_matches(dedup_test::zigzag_documents_plan(W, 3))) << "zig-zag W = " << W;
}

// A rank with nothing to send or receive gets empty slices of the right shape.
TEST(DedupRankPlanning, AnEmptyRankHasEmptySlices) {
  cpdispatch::QkvPlan plan;
  plan.world_size = 3;
  plan.ranks.resize(3);
  plan.ranks[0].docs.push_back({{4, 2}, {1, 1}});
  const RankKvWire idle = cpdispatch::plan_kv_wire_for_rank(plan, 2);
  EXPECT_TRUE(idle.fwd.dst_rank.empty());
  EXPECT_TRUE(idle.rev.dst_rank.empty());
  EXPECT_EQ(idle.fwd.num_recv_tokens, (std::vector<std::int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(idle.fan.num_entries(), 0u);
  EXPECT_EQ(idle.fan.copy_splits, (std::vector<std::size_t>{0}));
  const RankKvWire busy = cpdispatch::plan_kv_wire_for_rank(plan, 1);
  EXPECT_EQ(busy.fan.seq_len, (std::vector<std::int64_t>{4, 2}));  // shard 0 once for both copies: not twice
  EXPECT_EQ(busy.fan.copy_splits, (std::vector<std::size_t>{0, 2, 3}));
}

TEST(DedupRankPlanning, RankOutsideTheWorldIsInvalidInput) {
  const cpdispatch::QkvPlan plan = dedup_test::zigzag_plan(2, 1, 4);
  EXPECT_THROW((void)cpdispatch::plan_kv_wire_for_rank(plan, 2), cpdispatch::invalid_input);
  EXPECT_THROW((void)cpdispatch::plan_kv_wire_for_rank(cpdispatch::to_documents(plan), -1), cpdispatch::invalid_input);
}

using Bytes = std::vector<std::byte>;

/// On every rank: KvWireDispatcher from the per-rank wire and from the global
/// slice, the same input; forward and backward bytes must be identical.
template <class Plan>
void same_bytes_on_every_rank(const Plan& plan) {
  const cpdispatch::KvWireMetadata global = cpdispatch::plan_kv_wire(cpdispatch::plan_qkv(plan));
  const auto W = static_cast<int>(plan.world_size);
  constexpr std::size_t token_bytes = 3 * sizeof(std::int32_t);
  cpdispatch::SimWorld world(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& t) {
    cpdispatch::KvWireDispatcher<cpdispatch::SimTransport> mine(t, cpdispatch::plan_kv_wire_for_rank(plan, t.rank()), token_bytes);
    cpdispatch::KvWireDispatcher<cpdispatch::SimTransport> sliced(t, global, token_bytes);
    const auto& s = mine.required_bytes();
    const auto& g = sliced.required_bytes();
    EXPECT_EQ(s.mlp_bytes, g.mlp_bytes);
    EXPECT_EQ(s.attention_bytes, g.attention_bytes);
    EXPECT_EQ(s.wire_bytes, g.wire_bytes);
    EXPECT_EQ(s.replica_bytes, g.replica_bytes);
    Bytes mlp(s.mlp_bytes), dattn(s.attention_bytes);
    for (std::size_t i = 0; i < mlp.size(); ++i) mlp[i] = static_cast<std::byte>((i * 7 + static_cast<std::size_t>(t.rank()) * 13) & 0xff);
    for (std::size_t i = 0; i < dattn.size(); ++i) dattn[i] = static_cast<std::byte>((i * 5 + 3) & 0xff);
    Bytes attn_a(s.attention_bytes, std::byte{0x5A}), attn_b(s.attention_bytes, std::byte{0xA5});
    mine.forward(mlp, attn_a);
    sliced.forward(mlp, attn_b);
    EXPECT_EQ(attn_a, attn_b) << "forward, rank " << t.rank();
    Bytes wire(s.wire_bytes), replica(s.replica_bytes), grad_a(s.mlp_bytes), grad_b(s.mlp_bytes);
    mine.reverse_combine(dattn, wire, replica, grad_a, cpdispatch::ElementType::int32);
    sliced.reverse_combine(dattn, wire, replica, grad_b, cpdispatch::ElementType::int32);
    EXPECT_EQ(grad_a, grad_b) << "backward, rank " << t.rank();
  });
}

TEST(DedupRankPlanning, DispatcherFromPerRankWireMovesTheSameBytes) {
  Rng rng(1403);
  for (int W = 1; W <= 5; ++W) {
    SCOPED_TRACE("W = " + std::to_string(W));
    same_bytes_on_every_rank(dedup_test::zigzag_plan(W, 2, 6 * W));
    same_bytes_on_every_rank(dedup_test::zigzag_documents_plan(W, 3));
    for (int i = 0; i < 3; ++i) {
      same_bytes_on_every_rank(dedup_test::random_plan(rng, W, i % 2 == 0));
      same_bytes_on_every_rank(dedup_test::random_documents_plan(rng, W, i % 2 == 0));
    }
  }
}

}  // namespace
