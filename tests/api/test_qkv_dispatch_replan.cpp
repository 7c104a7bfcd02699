// QkvDispatch::replan over changing plans: every step moves the same bytes as
// a QkvDispatch built for that step, and once the object has seen every plan
// (a first pass over them), a second pass replans and runs forward and
// backward without a single allocation, with and without dedup. This program replaces the global
// operator new to count each rank thread's allocations.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/counting_allocator.hpp"
#include "../common/sim_world_fixture.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using thread_allocations::allocations;
using thread_allocations::counting;
using namespace cpdispatch;

constexpr int W = 3, steps = 12;
constexpr std::size_t q_token_elems = 3, kv_token_elems = 4;

QkvDocumentsPlan step_plan(int step, bool dedup = false) {
  RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 2 + step % 4;
  o.max_shards = 3;
  o.max_len = 3 + step % 3;
  o.max_cp_degree = 3;
  QkvDocumentsPlan plan = random_documents_plan(o, 900 + static_cast<std::uint64_t>(step));
  plan.dedup = dedup;
  return plan;
}

std::vector<float> values(std::size_t n, int rank, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((static_cast<int>(i) * 7 + rank * 13 + salt) % 61 - 30);
  return v;
}

/// What one step moves: the four outputs.
struct Moved {
  std::vector<float> q_attn, kv_attn, dq, dkv;
  friend bool operator==(const Moved&, const Moved&) = default;
};

/// One step through `qkv` into `out`, whose buffers are sized beforehand (so the step itself allocates nothing).
template <class T>
void step(QkvDispatch<T, float>& qkv, const std::vector<float>& q, const std::vector<float>& kv, Moved& out) {
  qkv.forward_q(q, out.q_attn);
  qkv.forward_kv(kv, out.kv_attn);
  qkv.reverse_q(out.q_attn, out.dq);
  qkv.reverse_kv(out.kv_attn, out.dkv);
}

template <class T>
Moved sized_for(const QkvDispatch<T, float>& qkv) {
  return {std::vector<float>(qkv.q_attention_size()), std::vector<float>(qkv.kv_attention_size()), std::vector<float>(qkv.q_mlp_size()),
          std::vector<float>(qkv.kv_mlp_size())};
}

template <class Wrap>
void second_pass_allocates_nothing(bool dedup) {
  std::vector<QkvDocumentsPlan> plans;
  for (int s = 0; s < steps; ++s) plans.push_back(step_plan(s, dedup));
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& sim) {
    Wrap t(sim);
    using T = std::remove_reference_t<decltype(t.get())>;
    QkvDispatch<T, float> reused(t.get(), plan_qkv_for_rank(plans[0], sim.rank()), q_token_elems, kv_token_elems, {.dedup = dedup});
    for (int pass = 0; pass < 2; ++pass) {
      for (int s = 0; s < steps; ++s) {
        SCOPED_TRACE("pass " + std::to_string(pass) + " step " + std::to_string(s) + " rank " + std::to_string(sim.rank()));
        const RankQkvMetadata share = plan_qkv_for_rank(plans[static_cast<std::size_t>(s)], sim.rank());
        QkvDispatch<T, float> fresh(t.get(), share, q_token_elems, kv_token_elems, {.dedup = dedup});
        const auto q = values(fresh.q_mlp_size(), sim.rank(), s), kv = values(fresh.kv_mlp_size(), sim.rank(), s + 100);
        Moved expected = sized_for(fresh), got = expected;
        step(fresh, q, kv, expected);
        allocations = 0;
        counting = true;
        reused.replan(share);
        step(reused, q, kv, got);
        counting = false;
        EXPECT_TRUE(got == expected);
        if (pass == 1) {
          EXPECT_EQ(allocations, 0u);
        }
      }
    }
  });
}

using sim_test::Packing;
using sim_test::Pieces;

TEST(QkvDispatchReplan, ASecondPassOverChangingPlansAllocatesNothingWithPieces) { second_pass_allocates_nothing<Pieces>(false); }
TEST(QkvDispatchReplan, ASecondPassOverChangingPlansAllocatesNothingWithStaging) { second_pass_allocates_nothing<Packing>(false); }
TEST(QkvDispatchReplan, DedupASecondPassAllocatesNothingWithPieces) { second_pass_allocates_nothing<Pieces>(true); }
TEST(QkvDispatchReplan, DedupASecondPassAllocatesNothingWithStaging) { second_pass_allocates_nothing<Packing>(true); }

void a_refused_share_keeps_the_previous_plan(bool dedup) {
  const QkvDocumentsPlan first = step_plan(0, dedup), second = step_plan(1, dedup), third = step_plan(2, dedup);
  SimWorld world(W, SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    const RankQkvMetadata share = plan_qkv_for_rank(first, t.rank());
    QkvDispatch<SimTransport, float> qkv(t, share, q_token_elems, kv_token_elems, {.dedup = dedup});
    RankQkvMetadata mixed = plan_qkv_for_rank(second, t.rank());
    // The queries would plan; the key-values do not belong together.
    if (dedup) mixed.kv_wire->rev = plan_qkv_for_rank(third, t.rank()).kv_wire->rev;
    else mixed.kv_rev = plan_qkv_for_rank(third, t.rank()).kv_rev;
    EXPECT_THROW(qkv.replan(mixed), invalid_input);
    QkvDispatch<SimTransport, float> fresh(t, share, q_token_elems, kv_token_elems, {.dedup = dedup});
    const auto q = values(fresh.q_mlp_size(), t.rank(), 1), kv = values(fresh.kv_mlp_size(), t.rank(), 2);
    Moved expected = sized_for(fresh), got = expected;
    step(fresh, q, kv, expected);
    step(qkv, q, kv, got);
    EXPECT_TRUE(got == expected) << "rank " << t.rank();
    EXPECT_EQ(qkv.attention().cu_seqlens_q, fresh.attention().cu_seqlens_q);
  });
}

TEST(QkvDispatchReplan, ARefusedShareKeepsThePreviousPlan) { a_refused_share_keeps_the_previous_plan(false); }
TEST(QkvDispatchReplan, DedupARefusedShareKeepsThePreviousPlan) { a_refused_share_keeps_the_previous_plan(true); }

}  // namespace
