// Balancing under an attention mask (docs/plan-format.md, section 2d): the
// cost counts the (query, key) pairs the mask lets through, the bytes what
// the mask sends (pair by pair, as the planned metadata sends them), the plan
// carries the mask and leaves C to planning, and a full or sliding-window
// batch balances as well as a causal one on the real length samples (median
// <= 1.03 of the bound, never above 1.10).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "balance_helpers.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "../common/sanitized.hpp"

namespace {

using baltest::I;
using cpdispatch::AttentionMask;

std::vector<I> load_sample(const std::string& name) {
  std::ifstream in(std::filesystem::path(CPDISPATCH_DOC_LENGTHS_DIR) / (name + ".json"));
  if (!in) return {};
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

/// Pairs position by position, straight from the mask's definition.
I brute_pairs(const AttentionMask& mask, I context, I len, I doc_len) {
  I n = 0;
  for (I p = context; p < context + len; ++p)
    for (I t = 0; t < doc_len; ++t) n += mask.sees(p, t) ? 1 : 0;
  return n;
}

TEST(MaskBalance, AttentionPairsCountWhatTheMaskLetsThrough) {
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(1),
                                    AttentionMask::sliding_window(5), AttentionMask::sliding_window(40)}) {
    for (I context = 0; context < 30; context += 7)
      for (I len = 0; len < 25; len += 4) {
        EXPECT_EQ(cpdispatch::attention_pairs(mask, context, len, 60), brute_pairs(mask, context, len, 60)) << to_string(mask);
        // A planned group: keys from the first needed shard; the kernel's count agrees.
        EXPECT_EQ(cpdispatch::entry_pairs(mask, len, context + len), cpdispatch::attention_pairs(mask, context, len, context + len));
      }
  }
}

TEST(MaskBalance, PlanCostCountsTheMasksPairsAndBytes) {
  cpdispatch::QkvDocumentsPlan p;
  p.world_size = 2;
  p.documents = {{{{0, 3, 1}, {0, 2, 0}, {1, 4, 1}, {1, 3, 0}}}, {{{1, 2, 1}}}};
  p.mask = AttentionMask::sliding_window(4);
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(p);
  EXPECT_EQ(cost.attention, (std::vector<I>{2 * 4 + 3 * 4, (1 + 2 + 3) + 4 * 4 + (1 + 2)}));
  // KV bytes as the plan sends them: the planned kv_fwd's off-rank tokens.
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(p);
  I off_rank = 0;
  for (std::size_t d = 0; d < 2; ++d) off_rank += meta.kv_fwd.num_recv_tokens(d, 1 - d);
  EXPECT_EQ(cost.kv_bytes, off_rank);
  EXPECT_EQ(cost.kv_tokens, (std::vector<I>{12, 14}));
  EXPECT_EQ(cost.mask, p.mask);
}

/// Every mask kind: causal, full, and windows from one token (a query sees
/// only itself) to wider than any document of the random plans below.
std::vector<AttentionMask> every_mask() {
  return {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(1), AttentionMask::sliding_window(3),
          AttentionMask::sliding_window(17), AttentionMask::sliding_window(200)};
}

/// A random documents-form plan: documents of 1-5 shards of 1-30 tokens,
/// every shard with its own home and destination (documents span ranks, and
/// one rank may attend several query shards of a document).
cpdispatch::QkvDocumentsPlan random_documents_plan(cpdispatch::Rng& rng, I W, const AttentionMask& mask) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  plan.mask = mask;
  plan.documents.resize(static_cast<std::size_t>(rng.between(1, 6)));
  for (auto& doc : plan.documents) {
    doc.shards.resize(static_cast<std::size_t>(rng.between(1, 5)));
    for (auto& s : doc.shards) s = {rng.between(0, W - 1), rng.between(1, 30), rng.between(0, W - 1)};
  }
  return plan;
}

/// The same in per-rank form: every document whole on one rank.
cpdispatch::QkvPlan random_rank_plan(cpdispatch::Rng& rng, I W, const AttentionMask& mask) {
  cpdispatch::QkvPlan plan;
  plan.world_size = W;
  plan.mask = mask;
  plan.ranks.resize(static_cast<std::size_t>(W));
  for (auto& rank : plan.ranks) {
    rank.docs.resize(static_cast<std::size_t>(rng.between(0, 3)));
    for (auto& doc : rank.docs) {
      const auto n = static_cast<std::size_t>(rng.between(1, 5));
      for (std::size_t k = 0; k < n; ++k) doc.shard_len.push_back(rng.between(1, 30)), doc.dst.push_back(rng.between(0, W - 1));
    }
  }
  return plan;
}

/// plan_cost's byte matrix, pair by pair, is what the planned metadata sends:
/// rank s sends rank d the queries and key-value copies d receives from s
/// (num_recv_tokens is indexed [destination][source]); the diagonal moves
/// nothing. Query and key-value bytes per token differ, so that neither
/// stands in for the other.
template <class Plan>
void expect_bytes_match_metadata(const Plan& plan) {
  constexpr I q_bytes = 3, kv_bytes = 7;
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, q_bytes, kv_bytes);
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  const auto W = static_cast<std::size_t>(plan.world_size);
  ASSERT_EQ(cost.bytes.size(), W * W);
  I queries = 0, copies = 0;
  for (std::size_t s = 0; s < W; ++s)
    for (std::size_t d = 0; d < W; ++d) {
      const I q = s == d ? 0 : m.q_fwd.num_recv_tokens(d, s), kv = s == d ? 0 : m.kv_fwd.num_recv_tokens(d, s);
      EXPECT_EQ(cost.sent(s, d), q_bytes * q + kv_bytes * kv) << "rank " << s << " -> rank " << d;
      queries += q, copies += kv;
    }
  EXPECT_EQ(cost.query_bytes, q_bytes * queries);
  EXPECT_EQ(cost.kv_bytes, kv_bytes * copies);
  EXPECT_EQ(cost.bytes_moved, cost.query_bytes + cost.kv_bytes);
  for (std::size_t d = 0; d < W; ++d) EXPECT_EQ(cost.kv_tokens[d], m.kv_fwd.num_recv_tokens(d, W)) << "rank " << d;
}

TEST(MaskBalance, PlanCostSendsWhatTheMetadataSendsPairByPair) {
  cpdispatch::Rng rng(11);
  for (const AttentionMask& mask : every_mask()) {
    for (int i = 0; i < 40; ++i) {
      const I W = 1 + i % 5;
      SCOPED_TRACE(to_string(mask) + " W=" + std::to_string(W) + " plan " + std::to_string(i));
      expect_bytes_match_metadata(random_documents_plan(rng, W, mask));
      expect_bytes_match_metadata(random_rank_plan(rng, W, mask));
      if (HasFailure()) return;
    }
  }
}

// The same on balanced packed batches: the plans the SVG draws. (A window
// of one token costs every rank its own tokens, which draw_workload makes
// equal: nothing would move.)
TEST(MaskBalance, BalancedPlansCostWhatTheMetadataSendsPairByPair) {
  const std::vector<I> lengths{3, 20, 90, 400, 1500};
  for (const AttentionMask& mask : every_mask()) {
    if (mask == AttentionMask::sliding_window(1)) continue;
    I moved = 0;
    for (std::uint64_t seed = 0; seed < 3; ++seed) {
      SCOPED_TRACE(to_string(mask) + " seed " + std::to_string(seed));
      cpdispatch::BalanceProblem p;
      p.world_size = 4;
      p.documents = cpdispatch::draw_workload(lengths, 4, 600, seed);
      p.max_cp_degree = std::max<I>(4, static_cast<I>(cpdispatch::widest_span(p.documents)));
      p.mask = mask;
      const cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);
      expect_bytes_match_metadata(plan);
      moved += cpdispatch::plan_cost(plan).bytes_moved;
    }
    EXPECT_GT(moved, 0) << to_string(mask) << ": no plan moves anything, so the check above saw only zeros";
  }
}

TEST(MaskBalance, PlansCarryTheMaskAndPlanUnderIt) {
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 4;
  p.documents = cpdispatch::draw_workload(std::vector<I>{5, 40, 300, 1200}, 4, 1000, std::uint64_t{3});
  p.max_cp_degree = std::max<I>(4, static_cast<I>(cpdispatch::widest_span(p.documents)));
  for (const AttentionMask& mask : {AttentionMask::full(), AttentionMask::sliding_window(64)}) {
    p.mask = mask;
    const auto plan = cpdispatch::plan_balanced(p);
    EXPECT_EQ(plan.mask, mask);
    EXPECT_FALSE(plan.max_cp_degree.has_value());  // planning derives C from the mask
    ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));  // C: checked below, not written
    for (const auto& doc : plan.documents) EXPECT_LE(static_cast<I>(doc.shards.size()), p.max_cp_degree);
    EXPECT_NO_THROW((void)cpdispatch::plan_qkv(plan));
    EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), 1.10 * cpdispatch::balance_lower_bound(p)) << to_string(mask);
  }
}

TEST(MaskBalance, ReceiveCapacitiesNeedTheCausalMask) {
  cpdispatch::BalanceProblem p;
  p.world_size = 2;
  p.max_cp_degree = 2;
  p.docs = {{4}, {4}};
  p.recv_capacity = {100, 100};
  p.mask = AttentionMask::full();
  try {
    (void)cpdispatch::plan_balanced(p);
    ADD_FAILURE() << "no exception";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("recv_capacity"), std::string::npos) << e.what();
  }
}

// As for the causal mask: on packed batches of the real samples, every plan
// within 1.10 of the bound and the median within 1.03, for a full mask and
// windows of 4096 and 512 tokens.
TEST(MaskBalance, RealWorkloadsBalanceNearTheBound) {
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    ASSERT_FALSE(sample.empty()) << "cannot read " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (const AttentionMask& mask : {AttentionMask::full(), AttentionMask::sliding_window(4096), AttentionMask::sliding_window(512)}) {
      for (I W : {8, 16}) {
        std::vector<double> ratios;
        for (std::uint64_t seed = 0; seed < cptest::cases<std::uint64_t>(5, 3); ++seed) {
          SCOPED_TRACE(std::string(name) + " " + to_string(mask) + " W=" + std::to_string(W) + " seed " + std::to_string(seed));
          cpdispatch::BalanceProblem p;
          p.world_size = W;
          p.documents = cpdispatch::draw_workload(sample, W, 16384, seed);
          p.max_cp_degree = std::max<I>(8, static_cast<I>(cpdispatch::widest_span(p.documents)));
          p.mask = mask;
          const auto plan = cpdispatch::plan_balanced(p);
          ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));
          for (const auto& doc : plan.documents) ASSERT_LE(static_cast<I>(doc.shards.size()), p.max_cp_degree);
          ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / cpdispatch::balance_lower_bound(p));
          EXPECT_LE(ratios.back(), 1.10);
        }
        std::sort(ratios.begin(), ratios.end());
        EXPECT_LE(ratios[ratios.size() / 2], 1.03);
      }
    }
  }
}

// The planning grid (BalanceOptions::grid) under every mask: the masked
// planner cuts pieces only at multiples of the grid in the packed coordinate,
// on random batches whose ranks are no multiple of the grid, and on the real
// samples stays as near the grid's own bound as without it.
TEST(MaskBalance, EveryCutFallsOnTheGrid) {
  std::size_t cuts = 0;
  for (const AttentionMask& mask : {AttentionMask::full(), AttentionMask::sliding_window(1), AttentionMask::sliding_window(37),
                                    AttentionMask::sliding_window(300)}) {
    for (std::uint64_t seed = 0; seed < 12; ++seed) {
      const I W = 2 + static_cast<I>(seed % 5), G = std::vector<I>{3, 16, 64}[seed % 3];
      SCOPED_TRACE(to_string(mask) + " seed " + std::to_string(seed) + ", G " + std::to_string(G));
      cpdispatch::BalanceProblem p;
      p.world_size = W;
      p.documents = cpdispatch::draw_workload(std::vector<I>{3, 20, 90, 400, 1500}, W, 601 + 37 * static_cast<I>(seed), seed);
      p.max_cp_degree = std::max<I>(4, static_cast<I>(cpdispatch::widest_span(p.documents)));
      p.mask = mask;
      cpdispatch::BalanceOptions o;
      o.grid = G;
      o.dedup = seed % 2 == 1;
      const auto plan = cpdispatch::plan_balanced(p, o);
      ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));
      for (const auto& doc : plan.documents) ASSERT_LE(static_cast<I>(doc.shards.size()), p.max_cp_degree);
      const ::testing::AssertionResult on = baltest::cuts_on_grid(p, plan, G);
      ASSERT_TRUE(on);
      cuts += static_cast<std::size_t>(std::stoul(on.message()));
      const double bound = cpdispatch::balance_lower_bound(p, o);
      EXPECT_GE(bound, cpdispatch::balance_lower_bound(p));
      EXPECT_GE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), bound - 0.5);
      EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), 1.25 * bound);
    }
  }
  EXPECT_GT(cuts, 50u);  // 78 cuts
  // The bound cuts on the grid: one document of 256 tokens, at most two shards, under the full mask (a
  // shard of q tokens costs 256 q): 128 + 128 without a grid; on a grid of 100, 100 + 156 or 200 + 56.
  cpdispatch::BalanceProblem one;
  one.world_size = 4;
  one.max_cp_degree = 2;
  one.docs = {{256}, {}, {}, {}};
  one.mask = AttentionMask::full();
  cpdispatch::BalanceOptions hundred;
  hundred.grid = 100;
  EXPECT_DOUBLE_EQ(cpdispatch::balance_lower_bound(one), 128.0 * 256);
  EXPECT_DOUBLE_EQ(cpdispatch::balance_lower_bound(one, hundred), 156.0 * 256);
  const auto halves = cpdispatch::plan_balanced(one, hundred);
  ASSERT_EQ(halves.documents[0].shards.size(), 2u);
  EXPECT_EQ(halves.documents[0].shards[0].len, 100);
  // The real samples, the grid of the invariant mode: as near its bound as without the grid (1.03, 1.10).
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    ASSERT_FALSE(sample.empty()) << "cannot read " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (const AttentionMask& mask : {AttentionMask::full(), AttentionMask::sliding_window(4096)}) {
      std::vector<double> ratios;
      for (std::uint64_t seed = 0; seed < 5; ++seed) {
        SCOPED_TRACE(std::string(name) + " " + to_string(mask) + " seed " + std::to_string(seed));
        cpdispatch::BalanceProblem p;
        p.world_size = 16;
        p.documents = cpdispatch::draw_workload(sample, 16, 16384, seed);
        p.max_cp_degree = std::max<I>(8, static_cast<I>(cpdispatch::widest_span(p.documents)));
        p.mask = mask;
        cpdispatch::BalanceOptions o;
        o.grid = cpdispatch::invariant_grid;
        const auto plan = cpdispatch::plan_balanced(p, o);
        ASSERT_TRUE(baltest::cuts_on_grid(p, plan, o.grid));
        ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / cpdispatch::balance_lower_bound(p, o));
        EXPECT_LE(ratios.back(), 1.10);
      }
      std::sort(ratios.begin(), ratios.end());
      EXPECT_LE(ratios[ratios.size() / 2], 1.03);
    }
  }
}

}  // namespace
