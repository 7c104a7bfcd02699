// The per-rank API: gather_plan / gather_documents_plan build the identical
// global plan on every rank from each rank's own documents, and QkvDispatch
// moves typed queries and key-values exactly as two Dispatchers do.

#include <gtest/gtest.h>

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "../common/sim_world_fixture.hpp"
#include "cpdispatch/execute/gather_plan.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using namespace cpdispatch;

class GatherPlan : public sim_test::WorldSizeTest {};
class QkvDispatchSim : public sim_test::WorldSizeTest {};

bool same_plan(const QkvPlan& a, const QkvPlan& b) {
  if (a.world_size != b.world_size || a.max_cp_degree != b.max_cp_degree || a.ranks.size() != b.ranks.size()) return false;
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const auto& x = a.ranks[r].docs;
    const auto& y = b.ranks[r].docs;
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i].shard_len != y[i].shard_len || x[i].dst != y[i].dst) return false;
  }
  return true;
}

/// A documents-form plan whose documents span ranks: document i has shards
/// on ranks i % W, (i + 1) % W, ..., in a pattern that repeats homes and
/// destinations.
QkvDocumentsPlan spanning_plan(std::int64_t W) {
  QkvDocumentsPlan plan;
  plan.world_size = W;
  for (std::int64_t i = 0; i < 2 * W + 1; ++i) {
    PackedDocument doc;
    const std::int64_t n = 1 + i % 4;
    for (std::int64_t k = 0; k < n; ++k) doc.shards.push_back(DocumentShard{(i + k / 2) % W, 3 + (i * 7 + k) % 5, (i * 3 + k) % W});
    plan.documents.push_back(doc);
  }
  return plan;
}

/// Rank r's shards of `plan` in MLP-layout order, keyed by a document number
/// that is not the index (the keys only need to sort the same way).
std::vector<LocalShard> local_shards(const QkvDocumentsPlan& plan, std::int64_t rank) {
  std::vector<LocalShard> out;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    for (std::size_t k = 0; k < shards.size(); ++k)
      if (shards[k].rank == rank)
        out.push_back(LocalShard{100 + 10 * static_cast<std::int64_t>(i), static_cast<std::int64_t>(k), shards[k].len, shards[k].dst});
  }
  return out;
}

TEST_P(GatherPlan, EveryRankGetsThePlanOfEveryRanksDocuments) {
  const int W = GetParam();
  const QkvPlan expected = create_qkv_dispatch(W, 48, 3, 1, 11);
  std::mutex mu;
  std::vector<QkvPlan> got(static_cast<std::size_t>(W));
  run([&](SimTransport& t) {
    const auto& mine = expected.ranks[static_cast<std::size_t>(t.rank())].docs;
    QkvPlan plan = gather_plan(t, std::span<const Document>(mine), expected.max_cp_degree);
    std::lock_guard lock(mu);
    got[static_cast<std::size_t>(t.rank())] = std::move(plan);
  });
  for (int r = 0; r < W; ++r) EXPECT_TRUE(same_plan(got[static_cast<std::size_t>(r)], expected)) << "rank " << r;
}

TEST_P(GatherPlan, DocumentsThatSpanRanksAreReassembledInKeyOrder) {
  const int W = GetParam();
  const QkvDocumentsPlan expected = spanning_plan(W);
  std::mutex mu;
  std::vector<QkvDocumentsPlan> got(static_cast<std::size_t>(W));
  run([&](SimTransport& t) {
    const auto mine = local_shards(expected, t.rank());
    QkvDocumentsPlan plan = gather_documents_plan(t, std::span<const LocalShard>(mine));
    std::lock_guard lock(mu);
    got[static_cast<std::size_t>(t.rank())] = std::move(plan);
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(got[static_cast<std::size_t>(r)].world_size, W);
    EXPECT_EQ(got[static_cast<std::size_t>(r)].documents, expected.documents) << "rank " << r;
  }
}

/// Runs gather_documents_plan with rank `bad`'s shards replaced by `edit`
/// of them; returns the message every rank threw (they must agree).
template <class Edit>
std::string gather_error(int W, int bad, Edit edit) {
  const QkvDocumentsPlan plan = spanning_plan(W);
  std::mutex mu;
  std::vector<std::string> messages;
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    auto mine = local_shards(plan, t.rank());
    if (t.rank() == bad) edit(mine);
    try {
      gather_documents_plan(t, std::span<const LocalShard>(mine));
    } catch (const invalid_input& e) {
      std::lock_guard lock(mu);
      messages.emplace_back(e.what());
    }
  });
  EXPECT_EQ(messages.size(), static_cast<std::size_t>(W)) << "every rank must throw";
  for (const auto& m : messages) EXPECT_EQ(m, messages.front());
  return messages.empty() ? std::string() : messages.front();
}

TEST(GatherPlanErrors, EveryRankNamesTheSameBadShard) {
  // A shard listed by two ranks: rank 2 also claims shard 0 of the last
  // document (key 160), which lives on rank 0.
  const std::string twice = gather_error(3, 2, [](std::vector<LocalShard>& s) { s.push_back(LocalShard{160, 0, 3, 0}); });
  EXPECT_NE(twice.find("document 160 shard 0 is given twice: by rank 0"), std::string::npos) << twice;
  // A shard listed twice by one rank breaks its MLP-layout order.
  EXPECT_NE(gather_error(3, 1, [](std::vector<LocalShard>& s) { s.push_back(s.back()); }).find("does not come after"), std::string::npos);
  // A missing shard: document 100 (index 0, one shard on rank 0) loses it; the
  // message names the document and the missing shard number.
  EXPECT_NE(gather_error(3, 0, [](std::vector<LocalShard>& s) { s.front().index = 1; }).find("document 100 has no shard 0"),
            std::string::npos);
  // A rank whose list is not in MLP-layout order.
  const std::string order = gather_error(3, 2, [](std::vector<LocalShard>& s) { std::swap(s.front(), s.back()); });
  EXPECT_NE(order.find("rank 2: gather_documents_plan: local[1]"), std::string::npos) << order;
}

INSTANTIATE_TEST_SUITE_P(Sim, GatherPlan, testing::Values(1, 2, 3, 5), sim_test::WorldSizeName{"W"});

/// q/kv MLP buffers of rank r: distinct values per (rank, element).
template <class E>
std::vector<E> values(std::size_t n, int rank, int salt) {
  std::vector<E> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = E(static_cast<float>((static_cast<int>(i) * 7 + rank * 13 + salt) % 61 - 30));
  return v;
}

template <class E>
void round_trip_matches_two_dispatchers(int W) {
  const QkvMetadata meta = plan_qkv(create_qkv_dispatch(W, 64, 3, W >= 2 ? 2 : 1, 5));
  constexpr std::size_t q_token_elems = 3, kv_token_elems = 5;
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    QkvDispatch<SimTransport, E> qkv(t, meta, q_token_elems, kv_token_elems);
    Dispatcher q(t, meta.q_fwd, meta.q_rev, q_token_elems * sizeof(E));
    Dispatcher kv(t, meta.kv_fwd, meta.kv_rev, kv_token_elems * sizeof(E));
    const auto q_mlp = values<E>(qkv.q_mlp_size(), t.rank(), 1);
    const auto kv_mlp = values<E>(qkv.kv_mlp_size(), t.rank(), 2);
    std::vector<E> q_attn(qkv.q_attention_size()), kv_attn(qkv.kv_attention_size());
    std::vector<E> q_ref(q_attn.size()), kv_ref(kv_attn.size());
    qkv.forward_q(q_mlp, q_attn);
    q.forward(std::as_bytes(std::span(q_mlp)), std::as_writable_bytes(std::span(q_ref)));
    qkv.forward_kv(kv_mlp, kv_attn);
    kv.forward(std::as_bytes(std::span(kv_mlp)), std::as_writable_bytes(std::span(kv_ref)));
    EXPECT_TRUE(q_attn == q_ref) << "rank " << t.rank();
    EXPECT_TRUE(kv_attn == kv_ref) << "rank " << t.rank();
    // Backward: the query round trip is exact; the KV sum equals the dispatcher's combine.
    std::vector<E> dq(q_mlp.size()), dkv(kv_mlp.size()), dkv_ref(kv_mlp.size());
    std::vector<E> replica(kv.required_bytes().replica_bytes / sizeof(E));
    qkv.reverse_q(q_attn, dq);
    EXPECT_TRUE(dq == q_mlp) << "rank " << t.rank();
    qkv.reverse_kv(kv_attn, dkv);
    kv.reverse_combine(std::as_bytes(std::span(kv_attn)), std::as_writable_bytes(std::span(replica)),
                       std::as_writable_bytes(std::span(dkv_ref)), element_type_of<E>());
    EXPECT_TRUE(dkv == dkv_ref) << "rank " << t.rank();
    // The attention layout of this rank, sized like the buffers.
    const RankAttentionLayout& a = qkv.attention();
    EXPECT_EQ(a.cu_seqlens_q, meta.attn.cu_seqlens_q[static_cast<std::size_t>(t.rank())]);
    EXPECT_EQ(static_cast<std::size_t>(a.q_tokens()) * q_token_elems, q_attn.size());
    EXPECT_EQ(static_cast<std::size_t>(a.kv_tokens()) * kv_token_elems, kv_attn.size());
  });
}

TEST_P(QkvDispatchSim, PerRankPlanningGivesTheSameExchange) {
  const int W = GetParam();
  const QkvPlan plan = create_qkv_dispatch(W, 64, 3, W >= 2 ? 2 : 1, 9);
  const QkvMetadata global = plan_qkv(plan);
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    QkvDispatch<SimTransport, float> from_global(t, global, 2, 3);
    QkvDispatch<SimTransport, float> from_share(t, plan_qkv_for_rank(plan, t.rank()), 2, 3);
    EXPECT_EQ(from_share.attention().cu_seqlens_kv, from_global.attention().cu_seqlens_kv);
    ASSERT_EQ(from_share.kv_attention_size(), from_global.kv_attention_size());
    const auto kv = values<float>(from_share.kv_mlp_size(), t.rank(), 4);
    std::vector<float> a(from_share.kv_attention_size()), b(a.size()), da(kv.size()), db(kv.size());
    from_global.forward_kv(kv, a);
    from_share.forward_kv(kv, b);
    EXPECT_TRUE(a == b) << "rank " << t.rank();
    from_global.reverse_kv(a, da);
    from_share.reverse_kv(b, db);
    EXPECT_TRUE(da == db) << "rank " << t.rank();
  });
}

TEST_P(QkvDispatchSim, FloatMatchesTwoDispatchers) { round_trip_matches_two_dispatchers<float>(GetParam()); }
TEST_P(QkvDispatchSim, Bfloat16MatchesTwoDispatchers) { round_trip_matches_two_dispatchers<bfloat16>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Sim, QkvDispatchSim, testing::Values(1, 2, 4), sim_test::WorldSizeName{"W"});

TEST(QkvDispatchErrors, ShortSpansAndZeroWidthsAreNamed) {
  const QkvMetadata meta = plan_qkv(create_qkv_dispatch(2, 32, 2, 2, 3));
  SimWorld world(2, SimOptions{sim_test::hang_timeout});
  EXPECT_THROW(world.run([&](SimTransport& t) { QkvDispatch<SimTransport, float> qkv(t, meta, 0, 4); }), invalid_input);
  world.run([&](SimTransport& t) {
    QkvDispatch<SimTransport, float> qkv(t, meta, 2, 2);
    std::vector<float> mlp(qkv.q_mlp_size()), attn(qkv.q_attention_size() - 1);
    try {
      qkv.forward_q(mlp, attn);
      ADD_FAILURE() << "a short attention buffer must be refused";
    } catch (const capacity_error& e) {
      EXPECT_NE(std::string(e.what()).find("attention"), std::string::npos) << e.what();
    }
  });
}

}  // namespace

namespace {

using namespace cpdispatch;

class QkvDispatchDedupSim : public sim_test::WorldSizeTest {};

/// A plan whose shards have several copies (so the wire has copies to merge), with dedup asked for.
QkvPlan dedup_plan(int W, std::int64_t tokens, std::uint64_t seed) {
  QkvPlan plan = create_qkv_dispatch(W, tokens, 3, W >= 4 ? 4 : W >= 2 ? 2 : 1, seed);
  plan.dedup = true;
  return plan;
}

/// forward_kv then reverse_kv of integer-valued key-values through `qkv`.
struct KvRound {
  std::vector<float> attention, grad;
};
KvRound kv_round(QkvDispatch<SimTransport, float>& qkv, int rank, int salt) {
  const auto kv = values<float>(qkv.kv_mlp_size(), rank, salt);
  KvRound out{std::vector<float>(qkv.kv_attention_size()), std::vector<float>(kv.size())};
  qkv.forward_kv(kv, out.attention);
  qkv.reverse_kv(out.attention, out.grad);
  return out;
}

TEST_P(QkvDispatchDedupSim, WireGivesThePlainExchangesResults) {
  const int W = GetParam();
  const QkvPlan plan = dedup_plan(W, 48, 7);
  run([&](SimTransport& t) {
    const RankQkvMetadata share = plan_qkv_for_rank(plan, t.rank());
    ASSERT_TRUE(share.kv_wire.has_value());
    QkvDispatch<SimTransport, float> wire(t, share, 2, 3, QkvDispatchOptions{.dedup = true});
    QkvDispatch<SimTransport, float> plain(t, share, 2, 3);
    EXPECT_TRUE(wire.dedup());
    EXPECT_EQ(wire.attention().cu_seqlens_kv, plain.attention().cu_seqlens_kv);
    ASSERT_EQ(wire.kv_attention_size(), plain.kv_attention_size());
    ASSERT_EQ(wire.kv_mlp_size(), plain.kv_mlp_size());
    const KvRound a = kv_round(wire, t.rank(), 3);
    const KvRound b = kv_round(plain, t.rank(), 3);
    EXPECT_TRUE(a.attention == b.attention) << "rank " << t.rank();
    EXPECT_TRUE(a.grad == b.grad) << "rank " << t.rank();  // integer sums: exact in any order
    EXPECT_THROW(wire.key_values(), invalid_input);
  });
}

INSTANTIATE_TEST_SUITE_P(Sim, QkvDispatchDedupSim, testing::Values(1, 2, 3, 4, 5, 6), sim_test::WorldSizeName{"W"});

TEST(QkvDispatchErrors, DedupWithoutWireSlicesNamesKvWire) {
  QkvPlan plan = dedup_plan(2, 32, 3);
  plan.dedup = false;
  SimWorld world(2, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    const RankQkvMetadata share = plan_qkv_for_rank(plan, t.rank());
    try {
      QkvDispatch<SimTransport, float> qkv(t, share, 2, 2, QkvDispatchOptions{.dedup = true});
      ADD_FAILURE() << "a share without kv_wire must be refused under dedup";
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find("kv_wire"), std::string::npos) << e.what();
    }
  });
}

TEST(QkvDispatchReplan, ChangingPlansMatchAFreshObject) {
  constexpr int W = 3;
  const std::vector<QkvPlan> plans = {dedup_plan(W, 48, 1), dedup_plan(W, 24, 2), dedup_plan(W, 60, 3), dedup_plan(W, 36, 4)};
  for (const bool dedup : {false, true}) {
    SimWorld world(W, SimOptions{sim_test::hang_timeout});
    world.run([&](SimTransport& t) {
      QkvDispatch<SimTransport, float> reused(t, plan_qkv_for_rank(plans.front(), t.rank()), 2, 3, QkvDispatchOptions{.dedup = dedup});
      for (std::size_t step = 0; step < plans.size(); ++step) {
        const RankQkvMetadata share = plan_qkv_for_rank(plans[step], t.rank());
        if (step > 0) reused.replan(share);
        QkvDispatch<SimTransport, float> fresh(t, share, 2, 3, QkvDispatchOptions{.dedup = dedup});
        EXPECT_EQ(reused.attention().cu_seqlens_q, fresh.attention().cu_seqlens_q);
        ASSERT_EQ(reused.q_attention_size(), fresh.q_attention_size());
        const auto q = values<float>(fresh.q_mlp_size(), t.rank(), static_cast<int>(step));
        std::vector<float> qa(fresh.q_attention_size()), qb(qa.size());
        reused.forward_q(q, qa);
        fresh.forward_q(q, qb);
        EXPECT_TRUE(qa == qb) << "step " << step << " rank " << t.rank();
        const KvRound a = kv_round(reused, t.rank(), static_cast<int>(step));
        const KvRound b = kv_round(fresh, t.rank(), static_cast<int>(step));
        EXPECT_TRUE(a.attention == b.attention && a.grad == b.grad) << "step " << step << " dedup " << dedup << " rank " << t.rank();
      }
    });
  }
}

TEST(QkvDispatchReplan, AShareWithoutWireKeepsThePreviousPlan) {
  constexpr int W = 2;
  const QkvPlan first = dedup_plan(W, 32, 5);
  QkvPlan bare = dedup_plan(W, 40, 6);
  bare.dedup = false;
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    const RankQkvMetadata share = plan_qkv_for_rank(first, t.rank());
    QkvDispatch<SimTransport, float> qkv(t, share, 2, 3, QkvDispatchOptions{.dedup = true});
    EXPECT_THROW(qkv.replan(plan_qkv_for_rank(bare, t.rank())), invalid_input);
    QkvDispatch<SimTransport, float> fresh(t, share, 2, 3, QkvDispatchOptions{.dedup = true});
    const KvRound a = kv_round(qkv, t.rank(), 1);
    const KvRound b = kv_round(fresh, t.rank(), 1);
    EXPECT_TRUE(a.attention == b.attention && a.grad == b.grad) << "rank " << t.rank();
  });
}

}  // namespace
