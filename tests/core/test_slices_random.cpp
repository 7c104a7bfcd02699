// Slices (docs/plan-format.md, section 2e) on random plans: shared-prefix,
// block-causal, prefix-LM and random mixes of the four slice types, mixed
// with plain documents, W = 1..8. Checked by brute force from the metadata
// alone: every allowed (query, key) pair of every document lies in exactly
// one entry of one query shard, each KV group holds exactly the KV shards its
// query shard needs; each rank's share equals the global plan; and the
// shared-pair check agrees with a grid of every pair.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "random_slices.hpp"
#include "rank_share.hpp"

namespace {

using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionSlice;
using cpdispatch::PackedDocument;
using cpdispatch::QkvDocumentsPlan;
using cptest::I;
using cptest::draw;
using cptest::length_of;
using cptest::random_slice;
using cptest::slice_sees;
using Rng = cptest::SliceRng;

/// Whether query p of `doc` sees key t: its slices, or else the plan's mask.
bool sees(const PackedDocument& doc, const AttentionMask& mask, I p, I t) {
  if (doc.slices.empty()) return mask.sees(p, t);
  for (const AttentionSlice& s : doc.slices) {
    if (slice_sees(s, p, t)) return true;
  }
  return false;
}

/// A random documents-form plan whose documents have slices of every kind,
/// or none (then the plan's mask holds).
QkvDocumentsPlan random_slice_plan(std::uint64_t seed) {
  Rng rng(seed);
  QkvDocumentsPlan plan;
  plan.world_size = draw(rng, 1, 8);
  const I W = plan.world_size;
  switch (seed % 3) {
    case 0: plan.mask = AttentionMask::causal(); break;
    case 1: plan.mask = AttentionMask::full(); break;
    default: plan.mask = AttentionMask::sliding_window(draw(rng, 1, 12)); break;
  }
  const I documents = draw(rng, 1, 6);
  for (I d = 0; d < documents; ++d) plan.documents.push_back(cptest::random_slice_document(rng, W));
  plan.dedup = seed % 2 == 0;
  return plan;
}

/// Where a shard of the plan is: its document, its first position there, its length.
struct ShardPlace {
  std::size_t doc = 0, shard = 0;
  I start = 0, len = 0;
};

/// Each rank's MLP layout: its shards in (document, shard) order, with their
/// starts on the rank, rebuilt from the plan by section 2b's rule.
std::vector<std::vector<std::pair<I, ShardPlace>>> mlp_layout(const QkvDocumentsPlan& plan) {
  std::vector<std::vector<std::pair<I, ShardPlace>>> out(static_cast<std::size_t>(plan.world_size));
  std::vector<I> at(out.size(), 0);
  for (std::size_t d = 0; d < plan.documents.size(); ++d) {
    I pos = 0;
    for (std::size_t k = 0; k < plan.documents[d].shards.size(); ++k) {
      const auto& s = plan.documents[d].shards[k];
      const auto r = static_cast<std::size_t>(s.rank);
      out[r].push_back({at[r], {d, k, pos, s.len}});
      at[r] += s.len;
      pos += s.len;
    }
  }
  return out;
}

const ShardPlace& shard_at(const std::vector<std::pair<I, ShardPlace>>& rank, I offset) {
  for (const auto& [start, place] : rank) {
    if (start == offset) return place;
  }
  ADD_FAILURE() << "no shard starts at " << offset;
  return rank.front().second;
}

/// Counts, from the metadata alone, how often each (query, key) pair of each
/// document is attended: query shards from q_rev, KV buffers from kv_fwd,
/// pairs from attn.entries. Also checks each KV group holds exactly the KV
/// shards its query shard needs, in increasing order.
::testing::AssertionResult covers_every_pair_once(const QkvDocumentsPlan& plan, const cpdispatch::QkvMetadata& m) {
  const auto layout = mlp_layout(plan);
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (m.attn.entries.size() != W) return ::testing::AssertionFailure() << "attn.entries has " << m.attn.entries.size() << " ranks";
  // Every KV token each destination holds: (shard, position in the document).
  std::vector<std::vector<std::pair<const ShardPlace*, I>>> kv(W);
  for (std::size_t d = 0; d < W; ++d) kv[d].assign(static_cast<std::size_t>(m.attn.cu_seqlens_kv[d].back()), {nullptr, 0});
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < layout[r].size(); ++g) {
      const ShardPlace& place = layout[r][g].second;
      for (std::size_t c = 0; c < m.kv_fwd.num_copies(); ++c) {
        const I d = m.kv_fwd.dst_rank(r, g, c);
        if (d < 0) continue;
        for (I t = 0; t < place.len; ++t) {
          auto& token = kv[static_cast<std::size_t>(d)][static_cast<std::size_t>(m.kv_fwd.dst_offset(r, g, c) + t)];
          if (token.first) return ::testing::AssertionFailure() << "two KV copies overlap at rank " << d;
          token = {&place, place.start + t};
        }
      }
    }
  }
  std::vector<std::vector<std::vector<int>>> count(plan.documents.size());
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto L = static_cast<std::size_t>(length_of(plan.documents[i]));
    count[i].assign(L, std::vector<int>(L, 0));
  }
  for (std::size_t d = 0; d < W; ++d) {
    if (m.attn.entries[d].size() != m.attn.seqlens_q[d].size()) return ::testing::AssertionFailure() << "rank " << d << ": entries per query shard";
    for (std::size_t a = 0; a < m.attn.seqlens_q[d].size(); ++a) {
      const ShardPlace& q = shard_at(layout[static_cast<std::size_t>(m.q_rev.dst_rank(d, a))], m.q_rev.dst_offset(d, a));
      const PackedDocument& doc = plan.documents[q.doc];
      const I group = m.attn.cu_seqlens_kv[d][a], lk = m.attn.seqlens_kv[d][a];
      // The group: the KV shards of q's document that q needs, increasing, each whole.
      std::vector<std::size_t> group_shards;
      for (I t = 0; t < lk; ++t) {
        const auto& [place, pos] = kv[d][static_cast<std::size_t>(group + t)];
        if (!place || place->doc != q.doc) return ::testing::AssertionFailure() << "rank " << d << " group " << a << ": column " << t;
        if (group_shards.empty() || group_shards.back() != place->shard) group_shards.push_back(place->shard);
      }
      std::vector<std::size_t> needed;
      for (std::size_t k = 0; k < doc.shards.size(); ++k) {
        const auto& kp = layout[static_cast<std::size_t>(doc.shards[k].rank)];
        const ShardPlace* place = nullptr;
        for (const auto& [start, p] : kp) place = p.doc == q.doc && p.shard == k ? &p : place;
        bool any = false;
        for (I p = q.start; p < q.start + q.len && !any; ++p)
          for (I t = place->start; t < place->start + place->len && !any; ++t) any = sees(doc, plan.mask, p, t);
        if (any) needed.push_back(k);
      }
      if (group_shards != needed) return ::testing::AssertionFailure() << "rank " << d << " group " << a << " holds other KV shards than it needs";
      for (const AttentionEntry& e : m.attn.entries[d][a]) {
        if (e.q_start < 0 || e.q_start + e.q_len > q.len || e.kv_start < 0 || e.kv_start + e.kv_len > lk) {
          return ::testing::AssertionFailure() << "rank " << d << " group " << a << ": an entry leaves its shard or group";
        }
        for (I j = e.q_start; j < e.q_start + e.q_len; ++j)
          for (I t = e.kv_start; t < e.kv_start + e.kv_len; ++t)
            if (e.allows(j, t)) ++count[q.doc][static_cast<std::size_t>(q.start + j)][static_cast<std::size_t>(kv[d][static_cast<std::size_t>(group + t)].second)];
      }
    }
  }
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    for (std::size_t p = 0; p < count[i].size(); ++p)
      for (std::size_t t = 0; t < count[i].size(); ++t) {
        const int want = sees(plan.documents[i], plan.mask, static_cast<I>(p), static_cast<I>(t)) ? 1 : 0;
        if (count[i][p][t] != want) {
          return ::testing::AssertionFailure() << "documents[" << i << "]: pair (" << p << ", " << t << ") attended " << count[i][p][t]
                                               << " times, expected " << want;
        }
      }
  }
  return ::testing::AssertionSuccess();
}

TEST(SlicesRandom, EveryAllowedPairInExactlyOneEntry) {
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed);
    if (!cpdispatch::detail::has_slices(plan)) continue;
    const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
    ASSERT_TRUE(covers_every_pair_once(plan, m)) << "seed " << seed;
  }
}

TEST(SlicesRandom, EachRanksShareEqualsTheGlobalPlan) {
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed);
    ASSERT_TRUE(cptest::every_rank_matches(plan)) << "seed " << seed << " W " << plan.world_size << " dedup " << plan.dedup;
  }
}

TEST(SlicesRandom, KvShardsNobodyNeedsOccurAndStayHome) {
  std::size_t unneeded = 0;
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed);
    const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
    const auto& dst = m.kv_fwd.dst_rank;
    for (std::size_t r = 0; r < dst.size(0); ++r)
      for (std::size_t g = 0; g < dst.size(1); ++g) {
        if (m.kv_fwd.seq_len(r, g) == 0 || dst(r, g, 0) >= 0) continue;
        ++unneeded;
        for (std::size_t c = 0; c < dst.size(2); ++c) ASSERT_EQ((*m.kv_rev.seq_recv_mask)(r, g, c), 0) << "seed " << seed;
      }
    (void)cpdispatch::plan_node_wire(m.kv_fwd, cpdispatch::Topology::uniform(plan.world_size, 2));  // accepts them too
  }
  EXPECT_GT(unneeded, 10u);  // the random mixes leave some KV shards to nobody
}

/// "documents[d].slices[a] and documents[d].slices[b] share the pair (query p, key t)" read back.
bool read_shared(const std::string& message, std::size_t& d, std::size_t& a, std::size_t& b, long long& p, long long& t) {
  const auto at = message.find("documents[");
  std::size_t d2 = 0;
  return at != std::string::npos &&
         std::sscanf(message.c_str() + at, "documents[%zu].slices[%zu] and documents[%zu].slices[%zu] share the pair (query %lld, key %lld)", &d, &a,
                     &d2, &b, &p, &t) == 6 &&
         d2 == d;
}

TEST(SlicesRandom, SharedPairCheckAgreesWithAGridOfEveryPair) {
  std::size_t shared = 0;
  for (std::uint64_t seed = 1; seed <= 1500; ++seed) {
    Rng rng(seed);
    QkvDocumentsPlan plan;
    plan.world_size = 2;
    PackedDocument doc;
    for (I k = draw(rng, 1, 4); k > 0; --k) doc.shards.push_back({draw(rng, 0, 1), draw(rng, 1, 6), draw(rng, 0, 1)});
    const I L = length_of(doc);
    for (I n = draw(rng, 1, 6); n > 0; --n) {
      const AttentionSlice s = random_slice(rng, L);
      bool any = false;
      for (I p = 0; p < L; ++p)
        for (I t = 0; t < L; ++t) any = any || slice_sees(s, p, t);
      if (any) doc.slices.push_back(s);
    }
    if (doc.slices.empty()) continue;
    bool clash = false;
    for (I p = 0; p < L; ++p)
      for (I t = 0; t < L; ++t) {
        int covering = 0;
        for (const AttentionSlice& s : doc.slices) covering += slice_sees(s, p, t) ? 1 : 0;
        clash = clash || covering > 1;
      }
    plan.documents = {PackedDocument{{{0, 1, 0}}}, doc};
    if (!clash) {
      ASSERT_NO_THROW((void)cpdispatch::plan_qkv(plan)) << "seed " << seed;
      continue;
    }
    ++shared;
    const std::string message = cptest::message_of<cpdispatch::invalid_input>([&] { (void)cpdispatch::plan_qkv(plan); });
    std::size_t d = 0, a = 0, b = 0;
    long long p = 0, t = 0;
    ASSERT_TRUE(read_shared(message, d, a, b, p, t)) << "seed " << seed << ": " << message;
    EXPECT_EQ(d, 1u);
    ASSERT_LT(a, b);
    ASSERT_LT(b, doc.slices.size());
    EXPECT_TRUE(slice_sees(doc.slices[a], p, t) && slice_sees(doc.slices[b], p, t)) << "seed " << seed << ": " << message;
  }
  EXPECT_GT(shared, 100u);
}

}  // namespace
