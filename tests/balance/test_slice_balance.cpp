// Balancing documents with slices (docs/plan-format.md, section 2e): a query
// shard costs its allowed pairs and needs a set of key-value shards, which
// the cost counts pair by pair as the planned metadata sends them; the lower
// bound uses that cost; the plan carries every document's slices unchanged;
// shared-prefix batches (a prompt with several responses) balance as near
// the bound as masked batches do; the balance JSON reads slices and names a
// bad one by its path.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "balance_helpers.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/check/coverage.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/io/json.hpp"
#include "cpdispatch/model/step_model.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "../common/sanitized.hpp"

namespace {

using baltest::I;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionSlice;
using cpdispatch::BalanceDocument;
using cpdispatch::BalanceProblem;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::SliceType;
using Slices = std::vector<AttentionSlice>;
using ::testing::HasSubstr;

std::vector<I> load_sample(const std::string& name) {
  std::ifstream in(std::filesystem::path(CPDISPATCH_DOC_LENGTHS_DIR) / (name + ".json"));
  if (!in) return {};
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

/// A prompt of `prompt` tokens, then responses of the given lengths: the
/// prompt attends causally; each response sees the whole prompt and itself
/// causally, not the responses before it (RL's shared prefix).
Slices shared_prefix(I prompt, const std::vector<I>& responses) {
  Slices out{{0, prompt, 0, prompt, SliceType::causal}};
  I start = prompt;
  for (I len : responses) {
    out.push_back({start, start + len, 0, prompt, SliceType::full});
    out.push_back({start, start + len, start, start + len, SliceType::causal});
    start += len;
  }
  return out;
}

/// Random slices of a document of `len` tokens that share no pair: the
/// queries cut into runs, each run seeing one or two disjoint key ranges in
/// a random shape that holds a pair.
Slices random_slices(cpdispatch::Rng& rng, I len) {
  Slices out;
  for (I qa = 0; qa < len;) {
    const I qb = std::min(len, qa + rng.between(1, 12));
    for (I ka = rng.between(0, len - 1), n = rng.between(1, 2); n > 0 && ka < len; --n) {
      const I kb = rng.between(ka + 1, len);
      auto type = static_cast<SliceType>(rng.between(0, 3));
      if (type == SliceType::bi_causal && kb - ka < qb - qa) type = SliceType::causal;  // bi_causal needs kb - ka >= qb - qa
      out.push_back({qa, qb, ka, kb, type});
      ka = kb + rng.between(0, 3);
    }
    qa = qb;
  }
  return out;
}

/// Whether the query at p sees the key at t: some slice holds the pair
/// inside its band (straight from section 2e's definition), else the mask.
bool sees(const Slices& slices, const AttentionMask& mask, I p, I t) {
  if (slices.empty()) return mask.sees(p, t);
  return std::any_of(slices.begin(), slices.end(), [&](const AttentionSlice& s) {
    return s.q_begin <= p && p < s.q_end && s.k_begin <= t && t < s.k_end && s.band().contains(t - p);
  });
}

/// Attention pairs, KV group tokens and bytes of a plan counted pair by
/// pair: query shard i needs KV shard k when one of its queries sees one
/// of k's keys.
struct PairCount {
  std::vector<I> attention, kv_tokens, bytes;
};
PairCount count_by_pair(const QkvDocumentsPlan& plan, I q_bytes, I kv_bytes) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  PairCount c{std::vector<I>(W, 0), std::vector<I>(W, 0), std::vector<I>(W * W, 0)};
  for (const auto& doc : plan.documents) {
    std::vector<I> start{0};
    for (const auto& s : doc.shards) start.push_back(start.back() + s.len);
    for (std::size_t i = 0; i < doc.shards.size(); ++i) {
      const auto d = static_cast<std::size_t>(doc.shards[i].dst), home = static_cast<std::size_t>(doc.shards[i].rank);
      if (d != home) c.bytes[home * W + d] += q_bytes * doc.shards[i].len;
      for (std::size_t k = 0; k < doc.shards.size(); ++k) {
        I pairs = 0;
        for (I p = start[i]; p < start[i + 1]; ++p)
          for (I t = start[k]; t < start[k + 1]; ++t) pairs += sees(doc.slices, plan.mask, p, t) ? 1 : 0;
        c.attention[d] += pairs;
        if (pairs == 0) continue;
        c.kv_tokens[d] += doc.shards[k].len;
        const auto from = static_cast<std::size_t>(doc.shards[k].rank);
        if (from != d) c.bytes[from * W + d] += kv_bytes * doc.shards[k].len;
      }
    }
  }
  return c;
}

/// A random documents-form plan, documents of 1-5 shards of 1-12 tokens on
/// random homes and destinations, about two in three with random slices.
QkvDocumentsPlan random_slice_plan(cpdispatch::Rng& rng, I W) {
  QkvDocumentsPlan plan;
  plan.world_size = W;
  plan.documents.resize(static_cast<std::size_t>(rng.between(1, 5)));
  for (auto& doc : plan.documents) {
    doc.shards.resize(static_cast<std::size_t>(rng.between(1, 5)));
    I len = 0;
    for (auto& s : doc.shards) s = {rng.between(0, W - 1), rng.between(1, 12), rng.between(0, W - 1)}, len += s.len;
    if (rng.between(0, 2) > 0) doc.slices = random_slices(rng, len);
  }
  return plan;
}

TEST(SliceBalance, CostCountsTheAllowedPairsAndTheNeededSets) {
  cpdispatch::Rng rng(5);
  for (int i = 0; i < 200; ++i) {
    const QkvDocumentsPlan plan = random_slice_plan(rng, 1 + i % 4);
    const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, 3, 7);
    const PairCount want = count_by_pair(plan, 3, 7);
    ASSERT_EQ(cost.attention, want.attention) << "plan " << i;
    ASSERT_EQ(cost.kv_tokens, want.kv_tokens) << "plan " << i;
    ASSERT_EQ(cost.bytes, want.bytes) << "plan " << i;
  }
}

/// plan_cost's byte matrix, pair by pair, is what the planned metadata sends
/// (num_recv_tokens is [destination][source]); the KV tokens are the planned
/// groups. Query and key-value bytes differ so that neither stands in for
/// the other.
void expect_bytes_match_metadata(const QkvDocumentsPlan& plan) {
  constexpr I q_bytes = 3, kv_bytes = 7;
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, q_bytes, kv_bytes);
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  const auto W = static_cast<std::size_t>(plan.world_size);
  for (std::size_t s = 0; s < W; ++s)
    for (std::size_t d = 0; d < W; ++d) {
      const I q = s == d ? 0 : m.q_fwd.num_recv_tokens(d, s), kv = s == d ? 0 : m.kv_fwd.num_recv_tokens(d, s);
      EXPECT_EQ(cost.sent(s, d), q_bytes * q + kv_bytes * kv) << "rank " << s << " -> rank " << d;
    }
  for (std::size_t d = 0; d < W; ++d) EXPECT_EQ(cost.kv_tokens[d], m.kv_fwd.num_recv_tokens(d, W)) << "rank " << d;
}

// Needs plan_qkv to plan slices (section 2e).
TEST(SliceBalance, PlanCostSendsWhatTheMetadataSendsPairByPair) {
  cpdispatch::Rng rng(11);
  for (int i = 0; i < 120; ++i) {
    SCOPED_TRACE("plan " + std::to_string(i));
    expect_bytes_match_metadata(random_slice_plan(rng, 1 + i % 5));
    if (HasFailure()) return;
  }
}

/// A packed batch of `sample` lengths in which every document of at least
/// 8 tokens is a prompt (a quarter of it) and 1-4 responses.
BalanceProblem shared_prefix_batch(const std::vector<I>& sample, I W, I tokens_per_rank, std::uint64_t seed) {
  BalanceProblem p;
  p.world_size = W;
  p.documents = cpdispatch::draw_workload(sample, W, tokens_per_rank, seed);
  p.max_cp_degree = std::max<I>(8, static_cast<I>(cpdispatch::widest_span(p.documents)));
  cpdispatch::Rng rng(seed + 100);
  for (BalanceDocument& doc : p.documents) {
    I len = 0;
    for (const auto& pc : doc.pieces) len += pc.len;
    if (len < 8) continue;
    const I prompt = len / 4, n = rng.between(1, 4);
    std::vector<I> responses(static_cast<std::size_t>(n), (len - prompt) / n);
    responses.back() += (len - prompt) % n;
    doc.slices = shared_prefix(prompt, responses);
  }
  return p;
}

// Needs plan_qkv to plan slices.
TEST(SliceBalance, BalancedSlicePlansCostWhatTheMetadataSendsPairByPair) {
  I moved = 0;
  for (std::uint64_t seed = 0; seed < 4; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const BalanceProblem p = shared_prefix_batch({3, 20, 90, 400, 1500}, 4, 600, seed);
    for (const bool dedup : {false, true}) {
      cpdispatch::BalanceOptions options;
      options.dedup = dedup;
      const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p, options);
      ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));
      expect_bytes_match_metadata(plan);
      moved += cpdispatch::plan_cost(plan).bytes_moved;
    }
  }
  EXPECT_GT(moved, 0) << "no plan moves anything, so the check above saw only zeros";
}

// One document on rank 0, W = 2, C = 2: a prompt of 4 tokens and two
// responses of 2. Query positions cost 1, 2, 3, 4 (prompt) and 4 + 1, 4 + 2
// (each response): 32 pairs. The mean is 16; the best cut into two shards is
// after position 4 (15 | 17), so the bound is 17, and the plan reaches it.
// The second shard (positions 5..7) needs the first (the prompt) and itself.
TEST(SliceBalance, ASharedPrefixDocumentCutAtItsBound) {
  BalanceProblem p;
  p.world_size = 2;
  p.max_cp_degree = 2;
  p.documents = {{{{0, 8}}, shared_prefix(4, {2, 2})}};
  EXPECT_EQ(cpdispatch::balance_lower_bound(p), 17.0);
  const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);
  EXPECT_EQ(plan.documents[0].shards, (std::vector<cpdispatch::DocumentShard>{{0, 5, 0}, {0, 3, 1}}));
  EXPECT_EQ(plan.documents[0].slices, p.documents[0].slices);
  EXPECT_FALSE(plan.max_cp_degree.has_value());  // planning derives C from the needed sets
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan);
  EXPECT_EQ(cost.attention, (std::vector<I>{15, 17}));
  EXPECT_EQ(cost.kv_tokens, (std::vector<I>{5, 8}));
  EXPECT_EQ(cost.bytes_moved, 3 + 5 + 3);  // its queries, the prompt's shard, its own key-values
}

TEST(SliceBalance, ReceiveCapacitiesCountTheNeededSets) {
  BalanceProblem p;
  p.world_size = 2;
  p.max_cp_degree = 2;
  p.documents = {{{{0, 8}}, shared_prefix(4, {2, 2})}};
  p.recv_capacity = {5, 8};  // exactly the groups above: a prefix count (8 on rank 1 plus 5) would not fit
  const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);
  ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));
  EXPECT_EQ(cpdispatch::plan_cost(plan).kv_tokens, (std::vector<I>{5, 8}));
  p.recv_capacity = {5, 7};  // no cut fits: the shard with the responses needs the prompt too
  EXPECT_THAT(baltest::message_of<cpdispatch::capacity_error>([&] { cpdispatch::plan_balanced(p); }),
              HasSubstr("KV groups (the shards their queries need)"));
}

TEST(SliceBalance, ARefusedSliceIsNamed) {
  BalanceProblem p;
  p.world_size = 2;
  p.max_cp_degree = 2;
  p.documents = {{{{0, 4}}}, {{{1, 3}, {0, 5}}, {{0, 8, 0, 9, SliceType::full}}}};
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::plan_balanced(p); }),
              HasSubstr("plan_balanced: documents[1].slices[0] (q [0, 8), k [0, 9)) reaches outside the document (8 tokens)"));
  p.documents[1].slices = {{0, 8, 0, 8, SliceType::full}, {3, 3, 0, 2, SliceType::causal}};
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::balance_lower_bound(p); }),
              HasSubstr("documents[1].slices[1] (q [3, 3), k [0, 2)) is empty"));
  // The rest is planning's rule, checked as planning checks it, so that a balanced plan always plans.
  p.documents[1].slices = {{0, 8, 0, 2, SliceType::bi_causal}};
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::plan_balanced(p); }),
              HasSubstr("documents[1].slices[0] (bi_causal, q [0, 8], k [0, 2]) has no (query, key) pair inside its band"));
  p.documents[1].slices = {{0, 8, 0, 8, SliceType::causal}, {4, 8, 0, 2, SliceType::full}};
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::plan_unbalanced(p); }),
              HasSubstr("documents[1].slices[0] and documents[1].slices[1] share the pair"));
  QkvDocumentsPlan plan;
  plan.world_size = 1;
  plan.documents = {{{{0, 2, 0}}, {{-1, 2, 0, 2, SliceType::full}}}};
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::plan_cost(plan); }),
              HasSubstr("plan_cost: documents[0].slices[0] (q [-1, 2), k [0, 2)) reaches outside"));
}

// Like the masked batches (tests/balance/test_mask_balance.cpp): on the real
// samples every plan within 1.10 of the bound and the median within 1.03.
TEST(SliceBalance, SharedPrefixBatchesBalanceNearTheBound) {
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> sample = load_sample(name);
    ASSERT_FALSE(sample.empty()) << "cannot read " << name << ".json under " << CPDISPATCH_DOC_LENGTHS_DIR;
    for (I W : {8, 16}) {
      std::vector<double> ratios;
      for (std::uint64_t seed = 0; seed < cptest::cases<std::uint64_t>(5, 3); ++seed) {
        SCOPED_TRACE(std::string(name) + " W=" + std::to_string(W) + " seed " + std::to_string(seed));
        const BalanceProblem p = shared_prefix_batch(sample, W, 16384, seed);
        const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);
        for (std::size_t i = 0; i < plan.documents.size(); ++i) {
          ASSERT_EQ(plan.documents[i].slices, p.documents[i].slices) << "documents[" << i << "]";
          ASSERT_LE(static_cast<I>(plan.documents[i].shards.size()), p.max_cp_degree);
        }
        ratios.push_back(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / cpdispatch::balance_lower_bound(p));
        EXPECT_LE(ratios.back(), 1.10);
      }
      std::sort(ratios.begin(), ratios.end());
      EXPECT_LE(ratios[ratios.size() / 2], 1.03) << name << " W=" << W;
    }
  }
}

/// Bytes of a plan as the deduplicated exchange sends them, pair by pair:
/// queries off their home, and each needed KV shard once per destination.
I wire_bytes_by_pair(const QkvDocumentsPlan& plan) {
  I bytes = 0;
  for (const auto& doc : plan.documents) {
    std::vector<I> start{0};
    for (const auto& s : doc.shards) start.push_back(start.back() + s.len);
    std::vector<std::pair<I, std::size_t>> sent;  // (destination, KV shard)
    for (std::size_t i = 0; i < doc.shards.size(); ++i) {
      const auto& q = doc.shards[i];
      if (q.dst != q.rank) bytes += q.len;
      for (std::size_t k = 0; k < doc.shards.size(); ++k) {
        bool needed = false;
        for (I p = start[i]; p < start[i + 1] && !needed; ++p)
          for (I t = start[k]; t < start[k + 1] && !needed; ++t) needed = sees(doc.slices, plan.mask, p, t);
        if (!needed || doc.shards[k].rank == q.dst || std::find(sent.begin(), sent.end(), std::pair{q.dst, k}) != sent.end()) continue;
        sent.emplace_back(q.dst, k);
        bytes += doc.shards[k].len;
      }
    }
  }
  return bytes;
}

// With dedup the plan is counted in wire bytes of the needed sets: it sends
// fewer of them than the plan balanced for flat bytes, as well balanced.
TEST(SliceBalance, DedupCountsTheNeededSetsOnTheWire) {
  I flat_total = 0, dedup_total = 0;
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const BalanceProblem p = shared_prefix_batch({3, 20, 90, 400, 1500}, 4, 600, seed);
    const double bound = cpdispatch::balance_lower_bound(p);
    cpdispatch::BalanceOptions options;
    const QkvDocumentsPlan flat = cpdispatch::plan_balanced(p, options);
    options.dedup = true;
    const QkvDocumentsPlan dedup = cpdispatch::plan_balanced(p, options);
    EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(flat).max_attention()), 1.10 * bound);
    EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(dedup).max_attention()), 1.10 * bound);
    flat_total += wire_bytes_by_pair(flat);
    dedup_total += wire_bytes_by_pair(dedup);
  }
  EXPECT_LT(dedup_total, flat_total) << "wire bytes of the needed sets, balanced for dedup and for flat bytes";
}

// Documents without slices beside documents with them keep the problem's
// mask: the plan carries it, their pairs are the mask's, and the batch
// balances near the bound under each mask.
TEST(SliceBalance, PlainDocumentsBesideSlicedOnesKeepTheMask) {
  BalanceProblem p = shared_prefix_batch({3, 20, 90, 400}, 4, 500, 2);
  for (std::size_t i = 0; i < p.documents.size(); i += 2) p.documents[i].slices.clear();
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(16)}) {
    p.mask = mask;
    const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p);
    EXPECT_EQ(plan.mask, mask);
    EXPECT_EQ(cpdispatch::plan_cost(plan).total_attention(), baltest::total_packed_cost(p)) << to_string(mask);
    for (std::size_t i = 0; i < plan.documents.size(); ++i) EXPECT_EQ(plan.documents[i].slices, p.documents[i].slices);
    EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), 1.10 * cpdispatch::balance_lower_bound(p)) << to_string(mask);
  }
}

TEST(SliceBalance, StepModelPeersCountTheSlicePairs) {
  const cpdispatch::ClusterModel cluster = cpdispatch::ClusterModel::h100_ib();
  const cpdispatch::LayerShape shape;
  const std::vector<Slices> slices{shared_prefix(4, {2, 2})};  // 32 pairs; causal: 36
  const auto with = cpdispatch::model_zigzag_ring({8}, AttentionMask::causal(), 2, cluster, shape, slices);
  const auto without = cpdispatch::model_zigzag_ring({8}, AttentionMask::causal(), 2, cluster, shape);
  EXPECT_DOUBLE_EQ(with.forward_compute * 36, without.forward_compute * 32);
  const auto ulysses = cpdispatch::model_ulysses({8}, AttentionMask::causal(), 2, cluster, shape, slices);
  EXPECT_DOUBLE_EQ(ulysses.forward_compute * 36, cpdispatch::model_ulysses({8}, AttentionMask::causal(), 2, cluster, shape).forward_compute * 32);
  QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 5, 0}, {0, 3, 1}}, slices[0]}};
  EXPECT_EQ(cpdispatch::document_slices(plan), slices);
}

// Needs plan_qkv to plan slices: the plan's own rows come from its cost and
// metadata; without the documents' slices the peers would count the mask.
TEST(SliceBalance, StepModelOfASlicePlanNeedsItsSlices) {
  QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 5, 0}, {0, 3, 1}}, shared_prefix(4, {2, 2})}};
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan);
  const cpdispatch::Topology topology = cpdispatch::Topology::uniform(2, 2);
  const auto rows = cpdispatch::model_step(m, cost, cpdispatch::document_lengths(plan), topology, cpdispatch::ClusterModel::h100_ib(),
                                           cpdispatch::LayerShape{}, cpdispatch::document_slices(plan));
  EXPECT_EQ(rows.size(), 7u);
  EXPECT_THAT(baltest::message_of<cpdispatch::invalid_input>([&] {
                cpdispatch::model_step(m, cost, cpdispatch::document_lengths(plan), topology, cpdispatch::ClusterModel::h100_ib(),
                                       cpdispatch::LayerShape{});
              }),
              HasSubstr("pass document_slices(plan)"));
}

TEST(SliceBalanceJson, ReadsSlicesAndWritesThemWithThePlan) {
  const nlohmann::json j = cpdispatch::parse_json(R"({"world_size": 2, "max_cp_degree": 2, "documents": [
    {"pieces": [{"rank": 0, "len": 8}], "slices": [{"q": [0, 4], "k": [0, 4], "type": "causal"},
      {"q": [4, 6], "k": [0, 4], "type": "full"}, {"q": [4, 6], "k": [4, 6], "type": "causal"},
      {"q": [6, 8], "k": [0, 4], "type": "full"}, {"q": [6, 8], "k": [6, 8], "type": "causal"}]},
    {"pieces": [{"rank": 1, "len": 3}], "slices": [{"q": [0, 3], "k": [0, 3], "type": "bi_causal"}]},
    {"pieces": [{"rank": 1, "len": 2}]}]})");
  const BalanceProblem p = cpdispatch::balance_problem_from_json(j);
  ASSERT_EQ(p.documents.size(), 3u);
  EXPECT_EQ(p.documents[0].slices, shared_prefix(4, {2, 2}));
  EXPECT_EQ(p.documents[1].slices, (Slices{{0, 3, 0, 3, SliceType::bi_causal}}));
  EXPECT_TRUE(p.documents[2].slices.empty());
  const nlohmann::json out = cpdispatch::balanced_plan_to_json(cpdispatch::plan_balanced(p), false);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(out.at("documents")[i].at("slices"), j.at("documents")[i].at("slices")) << i;
  EXPECT_FALSE(out.at("documents")[2].contains("slices"));
}

TEST(SliceBalanceJson, BadSlicesAreNamedByTheirPath) {
  auto reading_error = [](const std::string& slices) {
    const std::string text = R"({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 4}]},
      {"pieces": [{"rank": 0, "len": 3}, {"rank": 1, "len": 5}], "slices": )" + slices + "}]}";
    return baltest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::balance_problem_from_json(cpdispatch::parse_json(text)); });
  };
  EXPECT_THAT(reading_error("[]"), HasSubstr("documents[1].slices: an empty list"));
  EXPECT_THAT(reading_error(R"({"q": [0, 1]})"), HasSubstr("documents[1].slices: expected an array"));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8], "k": [0, 9], "type": "full"}])"),
              HasSubstr("documents[1].slices[0].k = [0, 9] reaches outside the document (8 tokens)"));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8], "k": [0, 8], "type": "full"}, {"q": [-1, 2], "k": [0, 8], "type": "full"}])"),
              HasSubstr("documents[1].slices[1].q = [-1, 2] reaches outside the document (8 tokens)"));
  EXPECT_THAT(reading_error(R"([{"q": [5, 5], "k": [0, 8], "type": "full"}])"), HasSubstr("documents[1].slices[0].q = [5, 5] is empty"));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8, 9], "k": [0, 8], "type": "full"}])"), HasSubstr("documents[1].slices[0].q has 3 entries"));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8], "k": [0, 8], "type": "diagonal"}])"),
              HasSubstr("documents[1].slices[0].type: unknown slice type \"diagonal\""));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8], "k": [0, 8]}])"), HasSubstr("documents[1].slices[0]: missing \"type\""));
  EXPECT_THAT(reading_error(R"([{"q": [0, 8], "k": [0, 8], "type": "full", "band": 3}])"),
              HasSubstr("documents[1].slices[0]: unknown key \"band\""));
}

// The planning grid with slices: shared-prefix documents (and plain ones
// beside them) are cut only at multiples of the grid in the packed
// coordinate, their slices unchanged, and the plan attends every allowed
// pair exactly once.
TEST(SliceBalance, EveryCutFallsOnTheGrid) {
  std::size_t cuts = 0;
  for (std::uint64_t seed = 0; seed < 16; ++seed) {
    const I W = 2 + static_cast<I>(seed % 5), G = std::vector<I>{5, 16, 64}[seed % 3];
    SCOPED_TRACE("seed " + std::to_string(seed) + ", W " + std::to_string(W) + ", G " + std::to_string(G));
    BalanceProblem p = shared_prefix_batch({3, 20, 90, 400, 1500}, W, 577 + 29 * static_cast<I>(seed), seed);
    if (seed % 4 == 3) p.mask = AttentionMask::sliding_window(100);  // for the documents left without slices
    for (std::size_t i = seed % 2; i < p.documents.size(); i += 3) p.documents[i].slices.clear();
    cpdispatch::BalanceOptions o;
    o.grid = G;
    o.dedup = seed % 2 == 0;
    const QkvDocumentsPlan plan = cpdispatch::plan_balanced(p, o);
    ASSERT_TRUE(baltest::valid_packed_plan(p, plan, false));
    const ::testing::AssertionResult on = baltest::cuts_on_grid(p, plan, G);
    ASSERT_TRUE(on);
    cuts += static_cast<std::size_t>(std::stoul(on.message()));
    EXPECT_NO_THROW(cpdispatch::verify_coverage(plan, cpdispatch::plan_qkv(plan)));
    EXPECT_GE(static_cast<double>(cpdispatch::plan_cost(plan).max_attention()), cpdispatch::balance_lower_bound(p, o) - 0.5);
  }
  EXPECT_GT(cuts, 50u);
}

}  // namespace
