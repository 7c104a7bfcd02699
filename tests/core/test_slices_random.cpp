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
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "helpers.hpp"
#include "../common/same_slice.hpp"

namespace {

using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionSlice;
using cpdispatch::PackedDocument;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::SliceType;
using cptest::I;

using Rng = std::mt19937_64;

I draw(Rng& rng, I lo, I hi) { return std::uniform_int_distribution<I>(lo, hi)(rng); }

/// Whether slice s lets query p see key t: section 2e's table, written out here.
bool slice_sees(const AttentionSlice& s, I p, I t) {
  if (p < s.q_begin || p >= s.q_end || t < s.k_begin || t >= s.k_end) return false;
  switch (s.type) {
    case SliceType::full: return true;
    case SliceType::causal: return t - p <= s.k_end - s.q_end;
    case SliceType::inv_causal: return t - p >= s.k_begin - s.q_begin;
    case SliceType::bi_causal: return t - p >= s.k_begin - s.q_begin && t - p <= s.k_end - s.q_end;
  }
  return false;
}

/// Whether query p of `doc` sees key t: its slices, or else the plan's mask.
bool sees(const PackedDocument& doc, const AttentionMask& mask, I p, I t) {
  if (doc.slices.empty()) return mask.sees(p, t);
  for (const AttentionSlice& s : doc.slices) {
    if (slice_sees(s, p, t)) return true;
  }
  return false;
}

I length_of(const PackedDocument& doc) {
  I total = 0;
  for (const auto& s : doc.shards) total += s.len;
  return total;
}

/// [0, L) cut at random into runs of at least one position: their starts, then L.
std::vector<I> random_cuts(Rng& rng, I L) {
  std::vector<I> cuts{0};
  for (I p = 1; p < L; ++p) {
    if (draw(rng, 0, 2) == 0) cuts.push_back(p);
  }
  cuts.push_back(L);
  return cuts;
}

/// A prompt, then responses that each see the prompt and themselves.
std::vector<AttentionSlice> shared_prefix(Rng& rng, I L) {
  if (L == 1) return {{0, 1, 0, 1, SliceType::causal}};
  const I prompt = draw(rng, 1, L - 1);
  std::vector<AttentionSlice> out{{0, prompt, 0, prompt, SliceType::causal}};
  const std::vector<I> cuts = random_cuts(rng, L - prompt);
  for (std::size_t r = 0; r + 1 < cuts.size(); ++r) {
    const I a = prompt + cuts[r], b = prompt + cuts[r + 1];
    out.push_back({a, b, 0, prompt, SliceType::full});
    out.push_back({a, b, a, b, SliceType::causal});
  }
  return out;
}

/// Frames that see every earlier frame and themselves whole.
std::vector<AttentionSlice> block_causal(Rng& rng, I L) {
  std::vector<AttentionSlice> out;
  const std::vector<I> cuts = random_cuts(rng, L);
  for (std::size_t f = 0; f + 1 < cuts.size(); ++f) out.push_back({cuts[f], cuts[f + 1], 0, cuts[f + 1], SliceType::full});
  return out;
}

/// A bidirectional prefix, then causal text that sees the prefix.
std::vector<AttentionSlice> prefix_lm(Rng& rng, I L) {
  const I prefix = draw(rng, 1, L);
  std::vector<AttentionSlice> out{{0, prefix, 0, prefix, SliceType::full}};
  if (prefix == L) return out;
  out.push_back({prefix, L, 0, prefix, SliceType::full});
  out.push_back({prefix, L, prefix, L, SliceType::causal});
  return out;
}

AttentionSlice random_slice(Rng& rng, I L) {
  const I qa = draw(rng, 0, L - 1), qb = draw(rng, qa + 1, L), ka = draw(rng, 0, L - 1), kb = draw(rng, ka + 1, L);
  return {qa, qb, ka, kb, static_cast<SliceType>(draw(rng, 0, 3))};
}

/// Random slices of all four types, each kept only when it has a pair and
/// shares none with those kept before (checked on a grid of every pair).
std::vector<AttentionSlice> random_mix(Rng& rng, I L) {
  std::vector<AttentionSlice> out;
  std::vector<char> taken(static_cast<std::size_t>(L * L), 0);
  const I tries = draw(rng, 1, 8);
  for (I n = 0; n < tries; ++n) {
    const AttentionSlice s = random_slice(rng, L);
    bool any = false, clash = false;
    for (I p = 0; p < L; ++p)
      for (I t = 0; t < L; ++t)
        if (slice_sees(s, p, t)) {
          any = true;
          clash = clash || taken[static_cast<std::size_t>(p * L + t)];
        }
    if (!any || clash) continue;
    for (I p = 0; p < L; ++p)
      for (I t = 0; t < L; ++t)
        if (slice_sees(s, p, t)) taken[static_cast<std::size_t>(p * L + t)] = 1;
    out.push_back(s);
  }
  if (out.empty()) out.push_back({0, 1, 0, 1, SliceType::full});
  return out;
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
  for (I d = 0; d < documents; ++d) {
    PackedDocument doc;
    I home = draw(rng, 0, W - 1), dst = draw(rng, 0, W - 1);
    const I shards = draw(rng, 1, 5);
    for (I k = 0; k < shards; ++k) {
      if (k > 0 && draw(rng, 0, 2) == 0) home = (home + 1) % W;  // packed across ranks
      if (draw(rng, 0, 1) == 0) dst = draw(rng, 0, W - 1);
      doc.shards.push_back({home, draw(rng, 1, 8), dst});
    }
    const I L = length_of(doc);
    switch (draw(rng, 0, 4)) {
      case 1: doc.slices = shared_prefix(rng, L); break;
      case 2: doc.slices = block_causal(rng, L); break;
      case 3: doc.slices = prefix_lm(rng, L); break;
      case 4: doc.slices = random_mix(rng, L); break;
      default: break;  // the plan's mask
    }
    plan.documents.push_back(doc);
  }
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

::testing::AssertionResult same_attention(const cpdispatch::RankAttentionLayout& mine, const cpdispatch::AttentionLayout& a, std::size_t r) {
  if (mine.seqlens_q != a.seqlens_q[r] || mine.seqlens_kv != a.seqlens_kv[r] || mine.cu_seqlens_q != a.cu_seqlens_q[r] ||
      mine.cu_seqlens_kv != a.cu_seqlens_kv[r] || mine.max_seqlen_q != a.max_seqlen_q[r] || mine.max_seqlen_kv != a.max_seqlen_kv[r] ||
      mine.mask != a.mask) {
    return ::testing::AssertionFailure() << "attention layout differs";
  }
  if (mine.entries != (a.entries.empty() ? std::vector<std::vector<AttentionEntry>>{} : a.entries[r])) {
    return ::testing::AssertionFailure() << "entries differ";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult every_rank_matches(const QkvDocumentsPlan& plan) {
  const cpdispatch::QkvMetadata global = cpdispatch::plan_qkv(plan);
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(global);
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankPlanWorkspace workspace;  // reused across ranks, as a job reuses it across steps
  for (I r = 0; r < plan.world_size; ++r) {
    cpdispatch::plan_qkv_for_rank(plan, r, mine, workspace);
    const std::string at = "rank " + std::to_string(r) + ": ";
    for (auto [got, want, name] : {std::tuple{&mine.q_fwd, &global.q_fwd, "q_fwd"}, std::tuple{&mine.q_rev, &global.q_rev, "q_rev"},
                                   std::tuple{&mine.kv_fwd, &global.kv_fwd, "kv_fwd"}, std::tuple{&mine.kv_rev, &global.kv_rev, "kv_rev"}}) {
      auto same = cptest::same_slice(*got, want->get_slice(r), at + name);
      if (!same) return same;
    }
    auto attn = same_attention(mine.attn, global.attn, static_cast<std::size_t>(r));
    if (!attn) return attn << " at " << at;
    if (mine.kv_wire.has_value() != plan.dedup) return ::testing::AssertionFailure() << at << "kv_wire present = " << mine.kv_wire.has_value();
    if (!plan.dedup) continue;
    const cpdispatch::RankKvWire want = wire.get_slice(r);
    for (auto [got, w, name] : {std::tuple{&mine.kv_wire->fwd, &want.fwd, "kv_wire_fwd"}, std::tuple{&mine.kv_wire->rev, &want.rev, "kv_wire_rev"}}) {
      auto same = cptest::same_slice(*got, *w, at + name);
      if (!same) return same;
    }
    if (!(mine.kv_wire->fan == want.fan)) return ::testing::AssertionFailure() << at << "fan list differs";
  }
  return ::testing::AssertionSuccess();
}

TEST(SlicesRandom, EachRanksShareEqualsTheGlobalPlan) {
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed);
    ASSERT_TRUE(every_rank_matches(plan)) << "seed " << seed << " W " << plan.world_size << " dedup " << plan.dedup;
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
