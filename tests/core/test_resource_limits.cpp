// Planning refuses, before allocating it, a plan whose memory exceeds its
// PlanLimits: tiny hostile plans (a world of a billion ranks, 30000 ranks
// with one document, a balance problem of a billion ranks) end in an
// invalid_input naming the plan's sizes and the budget, having allocated
// next to nothing. Every allocation is counted (this program replaces the
// global operator new); any single one above 1 GiB fails the test at once
// instead of taking the machine's memory. The JSON readers' limits are in
// tests/cli/test_json_limits.cpp.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "../common/counting_allocator.hpp"

namespace {

using counting_allocator::count;
using counting_allocator::Counted;
using counting_allocator::expect_refused;
using counting_allocator::hundred_mb;
using cpdispatch::PlanLimits;

/// {"kind": "qkv", "world_size": W, "documents": [{"shards": [{"rank": 0, "len": 5, "dst": 0}]}]}
cpdispatch::QkvDocumentsPlan one_document(std::int64_t W) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  plan.documents = {{{{0, 5, 0}}}};
  return plan;
}

TEST(ResourceLimits, BillionRanksOneDocumentIsRefusedByEveryPlanner) {
  const auto plan = one_document(1'000'000'000);
  const std::initializer_list<std::string> names = {"world_size = 1000000000", "1 shards", "limit of 4.0 GiB", "PlanLimits::max_bytes"};
  expect_refused([&] { (void)cpdispatch::plan_qkv(plan); }, names);
  expect_refused([&] { (void)cpdispatch::plan_qkv_for_rank(plan, 0); }, names);
  expect_refused([&] { (void)cpdispatch::plan_kv_wire_for_rank(plan, 0); }, names);
  expect_refused([&] { (void)cpdispatch::plan_qkv(plan, PlanLimits{.max_bytes = std::uint64_t{16} << 30}); },
                 {"world_size = 1000000000", "limit of 16.0 GiB"});
}

TEST(ResourceLimits, NeighboursOfTheBillionRankPlan) {
  for (const std::int64_t W : {std::int64_t{1} << 26, std::int64_t{1} << 31, std::int64_t{1} << 40, std::int64_t{1} << 62}) {
    SCOPED_TRACE(W);
    const auto plan = one_document(W);
    expect_refused([&] { (void)cpdispatch::plan_qkv(plan); }, {"world_size = " + std::to_string(W)});
    expect_refused([&] { (void)cpdispatch::plan_qkv_for_rank(plan, W - 1); }, {"world_size = " + std::to_string(W)});
  }
}

TEST(ResourceLimits, ThirtyThousandRanksGlobalIsRefusedPerRankIsNot) {
  for (const std::int64_t W : {20'000, 30'000, 100'000}) {
    SCOPED_TRACE(W);
    const auto plan = one_document(W);
    expect_refused([&] { (void)cpdispatch::plan_qkv(plan); }, {"world_size = " + std::to_string(W), "1 shards"});
    // One rank's share is O(W): planned, in well under 100 MB.
    cpdispatch::RankQkvMetadata mine;
    const Counted used = count([&] { mine = cpdispatch::plan_qkv_for_rank(plan, 0); });
    EXPECT_LT(used.total, hundred_mb);
    EXPECT_EQ(mine.q_fwd.num_recv_tokens.size(), static_cast<std::size_t>(W + 1));
  }
}

TEST(ResourceLimits, OneDocumentOfManyShardsOnOneRankIsRefused) {
  // W = 1, but S = C = 20000 shards: [W][S][C] and the KV reverse rows grow as S x C.
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 1;
  plan.documents.resize(1);
  plan.documents[0].shards.assign(20'000, cpdispatch::DocumentShard{0, 1, 0});
  expect_refused([&] { (void)cpdispatch::plan_qkv(plan); }, {"20000 shards", "max_cp_degree = 20000"});
  expect_refused([&] { (void)cpdispatch::plan_qkv_for_rank(plan, 0); }, {"20000 shards", "max_cp_degree = 20000"});
}

TEST(ResourceLimits, QueryPlanOfManyRanksIsRefusedItsRankShareIsNot) {
  const std::size_t W = 30'000;
  const auto seq_len = cpdispatch::detail::output_tensor<std::int64_t>({W, 1}, 1);
  const auto dispatch = cpdispatch::detail::output_tensor<std::int64_t>({W, 1}, 0);
  expect_refused([&] { (void)cpdispatch::plan_query(seq_len, dispatch); }, {"plan_query", "world_size = 30000"});
  const Counted used = count([&] { (void)cpdispatch::plan_query_for_rank(seq_len, dispatch, 0); });
  EXPECT_LT(used.total, hundred_mb);
  expect_refused([&] { (void)cpdispatch::plan_query_for_rank(seq_len, dispatch, 0, PlanLimits{.max_bytes = 1 << 20}); },
                 {"plan_query_for_rank", "world_size = 30000", "limit of 1.0 MiB"});
}

TEST(ResourceLimits, BalanceProblemOfABillionRanksIsRefused) {
  cpdispatch::BalanceProblem p;
  p.world_size = 1'000'000'000;
  p.max_cp_degree = 2;
  p.documents = {{{{0, 5}}}};
  expect_refused([&] { (void)cpdispatch::plan_balanced(p); }, {"plan_balanced", "world_size = 1000000000", "1 pieces"});
  expect_refused([&] { (void)cpdispatch::plan_unbalanced(p); }, {"plan_balanced", "world_size = 1000000000"});
  p.world_size = std::int64_t{1} << 40;
  expect_refused([&] { (void)cpdispatch::plan_balanced(p); }, {"world_size = 1099511627776"});
  expect_refused([&] { (void)cpdispatch::plan_cost(one_document(1'000'000)); }, {"plan_cost", "world_size = 1000000"});
}

/// A small random plan under a budget: refused below some budget, and where
/// accepted, what planning actually held at once stays within it (the
/// estimate is an upper bound, so the budget means what it says).
TEST(ResourceLimits, AcceptedPlansStayWithinTheirBudget) {
  for (const std::uint64_t seed : {1, 2, 3}) {
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 48;
    o.num_documents = 120;
    o.max_shards = 6;
    o.max_len = 64;
    const cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
    bool refused_once = false, accepted_once = false;
    for (std::uint64_t budget = 64; budget <= (std::uint64_t{64} << 20); budget *= 2) {
      cpdispatch::QkvMetadata out;
      bool accepted = true;
      const Counted used = count([&] {
        try {
          cpdispatch::plan_qkv(plan, out, PlanLimits{.max_bytes = budget});
        } catch (const cpdispatch::invalid_input&) {
          accepted = false;
        }
      });
      if (!accepted) {
        refused_once = true;
        continue;
      }
      accepted_once = true;
      EXPECT_LE(used.peak, budget) << "seed " << seed;
      const Counted rank_used = count([&] { (void)cpdispatch::plan_qkv_for_rank(plan, 7, PlanLimits{.max_bytes = budget}); });
      EXPECT_LE(rank_used.peak, budget) << "seed " << seed;
      break;
    }
    EXPECT_TRUE(refused_once);
    EXPECT_TRUE(accepted_once);
  }
}

/// The smallest budget (a power of two) `plan` is accepted under, and what
/// it then held at once.
template <class Plan>
std::pair<std::uint64_t, std::size_t> smallest_budget(Plan&& plan) {
  for (std::uint64_t budget = 64; budget <= (std::uint64_t{256} << 20); budget *= 2) {
    bool accepted = true;
    const Counted used = count([&] {
      try {
        plan(PlanLimits{.max_bytes = budget});
      } catch (const cpdispatch::invalid_input&) {
        accepted = false;
      }
    });
    if (accepted) return {budget, used.peak};
  }
  return {0, 0};
}

TEST(ResourceLimits, QueryAndBalancedPlansStayWithinTheirBudget) {
  for (const std::uint64_t seed : {1, 2, 3}) {
    const std::size_t W = 40, S = 6, C = 3;
    auto seq_len = cpdispatch::detail::output_tensor<std::int64_t>({W, S}, 0);
    auto dispatch = cpdispatch::detail::output_tensor<std::int64_t>({W, S, C}, -1);
    for (std::size_t r = 0; r < W; ++r)
      for (std::size_t j = 0; j < S; ++j) {
        seq_len(r, j) = static_cast<std::int64_t>(1 + (r * 7 + j * 3 + seed) % 9);
        for (std::size_t k = 0; k < 1 + (r + j + seed) % C; ++k) dispatch(r, j, k) = static_cast<std::int64_t>((r * 5 + j * 11 + k * 13 + seed) % W);
      }
    const auto [query_budget, query_peak] = smallest_budget([&](const PlanLimits& l) { (void)cpdispatch::plan_query(seq_len, dispatch, l); });
    ASSERT_GT(query_budget, 64u);
    EXPECT_LE(query_peak, query_budget) << "seed " << seed;

    cpdispatch::BalanceProblem p;
    p.world_size = 24;
    p.max_cp_degree = 4;
    for (std::uint64_t d = 0; d < 60; ++d) p.documents.push_back({{{static_cast<std::int64_t>((d * 7 + seed) % 24), static_cast<std::int64_t>(1 + (d * 37 + seed) % 300)}}});
    const auto [balance_budget, balance_peak] = smallest_budget([&](const PlanLimits& l) { (void)cpdispatch::plan_balanced(p, {}, l); });
    ASSERT_GT(balance_budget, 64u);
    EXPECT_LE(balance_peak, balance_budget) << "seed " << seed;
  }
}

/// Equal vectors, or the first index where they differ (a 16385-entry row
/// printed whole says little).
::testing::AssertionResult same(const std::vector<std::int64_t>& got, const std::vector<std::int64_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << got.size() << " entries, expected " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) return ::testing::AssertionFailure() << "[" << i << "] = " << got[i] << ", expected " << want[i];
  return ::testing::AssertionSuccess();
}

TEST(ResourceLimits, PerRankPlanningAt16384RanksIsWellInsideTheDefault) {
  const std::int64_t W = 16384;
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 4 * W;
  o.max_shards = 8;
  o.max_len = 512;
  const cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 11);
  // Well inside: a sixteenth of the default budget is still enough.
  const PlanLimits tight{.max_bytes = cpdispatch::default_plan_max_bytes / 16};
  const std::int64_t R = W / 2;
  cpdispatch::RankQkvMetadata m;
  ASSERT_NO_THROW(m = cpdispatch::plan_qkv_for_rank(plan, R, tight));

  // What rank R must hold, send and receive, worked out from the plan's
  // shards (causal, docs/plan-format.md section 2b): its shards in
  // (document, shard) order; the query shards it receives in order of
  // (home rank, local index), each with its KV group (its document up to
  // its own end); per peer the query and KV tokens each way.
  ASSERT_EQ(plan.mask.type, cpdispatch::MaskType::causal);
  const auto Wu = static_cast<std::size_t>(W);
  std::vector<std::int64_t> lens, dsts;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> arriving(Wu);  // by home: {len, context + len}
  std::vector<std::int64_t> q_in(Wu + 1), q_out(Wu + 1), kv_in(Wu + 1), kv_out(Wu + 1);
  const auto add = [&](std::vector<std::int64_t>& row, std::int64_t peer, std::int64_t n) {
    row[static_cast<std::size_t>(peer)] += n;
    row[Wu] += n;
  };
  for (const auto& doc : plan.documents) {
    std::int64_t context = 0;
    for (std::size_t i = 0; i < doc.shards.size(); ++i) {
      const auto& s = doc.shards[i];
      if (s.rank == R) {
        lens.push_back(s.len);
        dsts.push_back(s.dst);
        add(q_out, s.dst, s.len);
      }
      if (s.dst == R) {
        arriving[static_cast<std::size_t>(s.rank)].push_back({s.len, context + s.len});
        add(q_in, s.rank, s.len);
      }
      for (std::size_t k = 0; k <= i; ++k) {  // query shard i needs KV shards 0..i
        const auto& kv = doc.shards[k];
        if (s.dst == R) add(kv_in, kv.rank, kv.len);
        if (kv.rank == R) add(kv_out, s.dst, kv.len);
      }
      context += s.len;
    }
  }
  std::vector<std::int64_t> seqlens_q, seqlens_kv;
  for (const auto& from_home : arriving)
    for (const auto& [q, kv] : from_home) {
      seqlens_q.push_back(q);
      seqlens_kv.push_back(kv);
    }
  ASSERT_FALSE(lens.empty());
  ASSERT_FALSE(seqlens_q.empty());
  EXPECT_TRUE(same(m.q_fwd.seq_len, lens)) << "q_fwd.seq_len";
  EXPECT_TRUE(same(m.q_fwd.dst_rank, dsts)) << "q_fwd.dst_rank";
  EXPECT_TRUE(same(m.kv_fwd.seq_len, lens)) << "kv_fwd.seq_len";
  EXPECT_TRUE(same(m.q_fwd.num_recv_tokens, q_in)) << "q_fwd.num_recv_tokens";
  EXPECT_TRUE(same(m.q_rev.num_recv_tokens, q_out)) << "q_rev.num_recv_tokens";
  EXPECT_TRUE(same(m.kv_fwd.num_recv_tokens, kv_in)) << "kv_fwd.num_recv_tokens";
  EXPECT_TRUE(same(m.kv_rev.num_recv_tokens, kv_out)) << "kv_rev.num_recv_tokens";
  EXPECT_TRUE(same(m.attn.seqlens_q, seqlens_q)) << "attn.seqlens_q";
  EXPECT_TRUE(same(m.attn.seqlens_kv, seqlens_kv)) << "attn.seqlens_kv";
}

}  // namespace
