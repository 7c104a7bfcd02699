// Slices (docs/plan-format.md, section 2e): the worked example number for
// number, each validation error with the document and slice it names, a KV
// shard nobody needs (no copies, gradient 0, through dedup, the node-level
// wire and the simulation) and a query shard that needs nothing.

#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "helpers.hpp"
#include "rank_share.hpp"

namespace {

using namespace cptest;
using cpdispatch::AttentionEntry;
using cpdispatch::AttentionSlice;
using cpdispatch::Band;
using cpdispatch::invalid_input;
using cpdispatch::PackedDocument;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::SliceType;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr I open_lo = Band::unbounded_lo, open_hi = Band::unbounded_hi;

AttentionSlice slice(I qa, I qb, I ka, I kb, SliceType type) { return {qa, qb, ka, kb, type}; }

/// Section 2e's example: a shared-prefix document (prompt 3, responses 2 and
/// 3) in shards of 3, 2, 3 (homes 0, 0, 1; destinations 1, 0, 1), and a plain
/// causal document of two 2-token shards on rank 1 attending on ranks 1 and 0.
QkvDocumentsPlan example() {
  QkvDocumentsPlan p;
  p.world_size = 2;
  PackedDocument prompt{{{0, 3, 1}, {0, 2, 0}, {1, 3, 1}}};
  prompt.slices = {slice(0, 3, 0, 3, SliceType::causal), slice(3, 5, 0, 3, SliceType::full), slice(3, 5, 3, 5, SliceType::causal),
                   slice(5, 8, 0, 3, SliceType::full), slice(5, 8, 5, 8, SliceType::causal)};
  p.documents = {prompt, PackedDocument{{{1, 2, 1}, {1, 2, 0}}}};
  return p;
}

/// [q0, q1, k0, k1, lo, hi] as the spec writes an entry (open ends as the band's markers).
AttentionEntry entry(I q0, I q1, I k0, I k1, I lo, I hi) {
  AttentionEntry e;
  e.q_start = q0;
  e.q_len = q1 - q0;
  e.kv_start = k0;
  e.kv_len = k1 - k0;
  e.band = {lo, hi};
  return e;
}

std::string plan_error(const QkvDocumentsPlan& plan, const cpdispatch::PlanLimits& limits = {}) {
  return message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv(plan, limits); });
}

TEST(Slices, WorkedExampleNeededSets) {
  // Document 0: shards at 0, 3, 5 of 3, 2, 3 tokens.
  cpdispatch::detail::SliceNeeds needs;
  const std::vector<I> start{0, 3, 5}, len{3, 2, 3};
  needs.compute(example().documents[0].slices, start.data(), len.data(), 3);
  EXPECT_EQ(needs.need_begin, (std::vector<std::size_t>{0, 1, 3, 5}));
  EXPECT_EQ(needs.needs, (std::vector<std::size_t>{0, 0, 1, 0, 2}));  // {0}, {0, 1}, {0, 2}
  EXPECT_EQ(needs.columns, (std::vector<I>{0, 0, 3, 0, 3}));
  EXPECT_EQ(needs.user_begin, (std::vector<std::size_t>{0, 3, 4, 5}));
  EXPECT_EQ(needs.users, (std::vector<std::size_t>{0, 1, 2, 1, 2}));
  EXPECT_EQ(needs.most_users(), (std::pair<std::size_t, std::size_t>{3, 0}));
}

TEST(Slices, WorkedExampleMetadata) {
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(example());
  EXPECT_EQ(m.kv_fwd.num_copies(), 3u);  // C = 3: the prompt's shard has three users
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, 1}, {0, -1, -1}, {-1, -1, -1}}, {{1, -1, -1}, {1, 0, -1}, {0, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 0, 3}, {3, 0, 0}, {0, 0, 0}}, {{6, 0, 0}, {9, 5, 0}, {7, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{5, 4, 9}, {6, 5, 11}}));
  EXPECT_EQ(m.kv_fwd.num_seqs, t1({2, 3}));
  EXPECT_EQ(m.kv_rev.dst_rank, t2({{0, 0, 1, 1}, {0, 0, 1, 1}}));
  EXPECT_EQ(m.kv_rev.dst_offset, t2({{5, 3, 10, 5}, {0, 10, 0, 3}}));
  EXPECT_EQ(m.kv_rev.seq_len, t2({{3, 2, 2, 2}, {3, 3, 3, 2}}));
  EXPECT_EQ(m.kv_rev.num_recv_tokens, t2({{5, 6, 11}, {4, 5, 9}}));
  EXPECT_EQ(m.kv_rev.num_seqs, t1({4, 4}));
  EXPECT_EQ(*m.kv_rev.seq_recv_mask, t3({{{1, 1, 1}, {1, 0, 0}, {0, 0, 0}}, {{1, 0, 0}, {1, 1, 0}, {1, 0, 0}}}));
  EXPECT_EQ(m.attn.seqlens_q, (std::vector<std::vector<I>>{{2, 2}, {3, 3, 2}}));
  EXPECT_EQ(m.attn.seqlens_kv, (std::vector<std::vector<I>>{{5, 4}, {3, 6, 2}}));
  EXPECT_EQ(m.attn.mask, cpdispatch::AttentionMask::causal());  // the plan's default, recorded
  const std::vector<std::vector<std::vector<AttentionEntry>>> entries = {
      {{entry(0, 2, 0, 3, open_lo, open_hi), entry(0, 2, 3, 5, open_lo, 3)}, {entry(0, 2, 0, 4, open_lo, 2)}},
      {{entry(0, 3, 0, 3, open_lo, 0)}, {entry(0, 3, 0, 3, open_lo, open_hi), entry(0, 3, 3, 6, open_lo, 3)}, {entry(0, 2, 0, 2, open_lo, 0)}}};
  EXPECT_EQ(m.attn.entries, entries);
}

TEST(Slices, OneRanksLayoutOfTheGlobalPlanCarriesItsEntries) {
  const QkvDocumentsPlan p = example();
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(p);
  for (I r = 0; r < 2; ++r) {
    const cpdispatch::RankAttentionLayout mine = cpdispatch::attention_of(m.attn, r);
    EXPECT_EQ(mine.entries, m.attn.entries[static_cast<std::size_t>(r)]) << "rank " << r;
    EXPECT_EQ(mine.entries, cpdispatch::plan_qkv_for_rank(p, r).attn.entries) << "rank " << r;
  }
}

TEST(Slices, PlainDocumentsKeepTheirMaskAsOneEntryEach) {
  QkvDocumentsPlan p = example();
  for (const auto& [mask, band] : {std::pair{cpdispatch::AttentionMask::causal(), Band{open_lo, 2}},
                                   std::pair{cpdispatch::AttentionMask::full(), Band{}},
                                   std::pair{cpdispatch::AttentionMask::sliding_window(2), Band{1, 2}}}) {
    p.mask = mask;
    const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(p);
    // Document 1's second shard attends on rank 0 after document 0's: lq = 2, lk = 4 (2 under a window of 2: its own shard).
    const I lk = m.attn.seqlens_kv[0][1];
    ASSERT_EQ(m.attn.entries[0][1].size(), 1u) << to_string(mask);
    EXPECT_EQ(m.attn.entries[0][1][0], entry(0, 2, 0, lk, band.lo, band.bounded_above() ? lk - 2 : open_hi)) << to_string(mask);
    EXPECT_EQ(m.attn.mask, mask);
  }
}

TEST(Slices, PlanWithoutSlicesHasNoEntries) {
  QkvDocumentsPlan p = example();
  p.documents[0].slices.clear();
  cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(p);
  EXPECT_TRUE(m.attn.entries.empty());
  EXPECT_TRUE(cpdispatch::plan_qkv_for_rank(p, 0).attn.entries.empty());
  // Planned into the same metadata after a plan with slices: none left over.
  cpdispatch::plan_qkv(example(), m);
  EXPECT_EQ(m.attn.entries.size(), 2u);
  cpdispatch::plan_qkv(p, m);
  EXPECT_TRUE(m.attn.entries.empty());
}

// ---------------------------------------------------------------- validation

TEST(SliceValidation, TypeOutsideTheFour) {
  QkvDocumentsPlan p = example();
  p.documents[0].slices[2].type = static_cast<SliceType>(7);
  EXPECT_THAT(plan_error(p), HasSubstr("documents[0].slices[2].type = 7 is not a slice type"));
}

TEST(SliceValidation, RectangleEmptyOrOutsideTheDocument) {
  const std::vector<std::pair<AttentionSlice, std::string>> cases = {
      {slice(3, 3, 0, 3, SliceType::full), "documents[0].slices[1].q = [3, 3] is empty or outside the document (0 <= q[0] < q[1] <= 8"},
      {slice(4, 3, 0, 3, SliceType::full), "documents[0].slices[1].q = [4, 3]"},
      {slice(-1, 3, 0, 3, SliceType::full), "documents[0].slices[1].q = [-1, 3]"},
      {slice(3, 9, 0, 3, SliceType::full), "documents[0].slices[1].q = [3, 9]"},
      {slice(3, 5, 2, 2, SliceType::full), "documents[0].slices[1].k = [2, 2] is empty or outside the document (0 <= k[0] < k[1] <= 8"},
      {slice(3, 5, 0, 9, SliceType::full), "documents[0].slices[1].k = [0, 9]"},
  };
  for (const auto& [bad, message] : cases) {
    QkvDocumentsPlan p = example();
    p.documents[0].slices[1] = bad;
    EXPECT_THAT(plan_error(p), HasSubstr(message));
  }
}

TEST(SliceValidation, SliceWithNoPairInsideItsBand) {
  QkvDocumentsPlan p = example();
  p.documents.push_back(PackedDocument{{{0, 4, 0}}});
  p.documents[2].slices = {slice(0, 1, 0, 1, SliceType::full), slice(0, 4, 0, 2, SliceType::bi_causal)};  // kb - ka < qb - qa
  EXPECT_THAT(plan_error(p), AllOf(HasSubstr("documents[2].slices[1] (bi_causal, q [0, 4], k [0, 2]) has no (query, key) pair"),
                                   HasSubstr("key - query in [0, -2]")));
}

TEST(SliceValidation, TwoSlicesSharingAPairAreBothNamed) {
  QkvDocumentsPlan p = example();
  p.documents[0].slices.push_back(slice(6, 7, 4, 6, SliceType::full));  // (6, 5) is also in slices[4]'s causal band
  EXPECT_THAT(plan_error(p), HasSubstr("documents[0].slices[4] and documents[0].slices[5] share the pair (query 6, key 5)"));
  // Overlapping rectangles whose bands are apart share nothing: causal below, inv_causal above the diagonal.
  QkvDocumentsPlan apart = example();
  apart.documents[1].slices = {slice(0, 4, 0, 4, SliceType::causal), slice(0, 3, 1, 4, SliceType::inv_causal)};
  EXPECT_NO_THROW((void)cpdispatch::plan_qkv(apart));
  apart.documents[1].slices[1] = slice(0, 3, 0, 4, SliceType::inv_causal);  // now from the diagonal on: shares (0, 0)
  EXPECT_THAT(plan_error(apart), HasSubstr("documents[1].slices[0] and documents[1].slices[1] share the pair (query 0, key 0)"));
}

TEST(SliceValidation, CopyDimensionBelowTheMostUsers) {
  QkvDocumentsPlan p = example();
  p.max_cp_degree = 2;
  EXPECT_THAT(plan_error(p), HasSubstr("documents[0].shards[0] is needed by 3 query shards (by the document's slices), more than max_cp_degree = 2"));
}

TEST(SliceValidation, WorkBeyondTheLimitsIsRefused) {
  QkvDocumentsPlan p;
  p.world_size = 1;
  p.documents = {PackedDocument{std::vector<cpdispatch::DocumentShard>(64, {0, 1, 0})}};
  // One query range, 64 key columns: 64 x 63 / 2 comparisons, and each slice meets all 64 query shards.
  for (I k = 0; k < 64; ++k) p.documents[0].slices.push_back(slice(0, 64, k, k + 1, SliceType::full));
  cpdispatch::PlanLimits small;
  small.max_bytes = 16 * 100;  // 100 comparisons
  EXPECT_THAT(plan_error(p, small), AllOf(HasSubstr("documents[0].slices: checking its 64 slices for shared pairs takes more than 100"),
                                          HasSubstr("PlanLimits::max_bytes / 16")));
  small.max_bytes = 16 * 4096;  // enough comparisons, too little memory for 4096 pieces
  EXPECT_THAT(plan_error(p, small), AllOf(HasSubstr("the slices of documents[0..0] (64 slices, 4096 (slice, query shard) pieces"),
                                          HasSubstr("PlanLimits::max_bytes")));
  EXPECT_NO_THROW((void)cpdispatch::plan_qkv(p));
}

TEST(SliceValidation, ExactEntryCountsDecideTheLimitNotTheirBound) {
  // One causal slice over 64 one-token shards: query shard i needs KV shards
  // 0 .. i, so 64 x 65 / 2 entries, fewer than the 64 x 64 its query and key
  // ranges could give.
  QkvDocumentsPlan p;
  p.world_size = 1;
  p.documents = {PackedDocument{std::vector<cpdispatch::DocumentShard>(64, {0, 1, 0})}};
  p.documents[0].slices = {slice(0, 64, 0, 64, SliceType::causal)};
  cpdispatch::PlanLimits limits;
  const auto bytes = [&](std::uint64_t entries) { return cpdispatch::footprint_bytes(cpdispatch::footprint::slice_tables(1, 64, entries), limits); };
  const std::uint64_t entries = 64 * 65 / 2;
  ASSERT_LT(bytes(entries), bytes(64 * 64));
  limits.max_bytes = bytes(entries);
  EXPECT_EQ(cpdispatch::detail::check_documents_plan(p, limits), 64u);
  limits.max_bytes -= 1;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::detail::check_documents_plan(p, limits); }),
              HasSubstr("the slices of documents[0..0] (1 slices, 64 (slice, query shard) pieces, " + std::to_string(entries) + " attention entries)"));
}

TEST(SliceValidation, CopyDimensionCountsUsersNotShards) {
  // Three shards each attending only itself (one user a KV shard), and three
  // under one causal slice (KV shard 0 has three users).
  PackedDocument diagonal{{{0, 1, 0}, {0, 1, 0}, {0, 1, 0}}};
  diagonal.slices = {slice(0, 1, 0, 1, SliceType::full), slice(1, 2, 1, 2, SliceType::full), slice(2, 3, 2, 3, SliceType::full)};
  PackedDocument causal{{{0, 1, 0}, {0, 1, 0}, {0, 1, 0}}};
  causal.slices = {slice(0, 3, 0, 3, SliceType::causal)};
  QkvDocumentsPlan p;
  p.world_size = 1;
  p.documents = {diagonal, diagonal};
  EXPECT_EQ(cpdispatch::detail::check_documents_plan(p), 1u);
  p.documents = {diagonal, causal};
  EXPECT_EQ(cpdispatch::detail::check_documents_plan(p), 3u);
  p.max_cp_degree = 2;
  EXPECT_THAT(plan_error(p), HasSubstr("documents[1].shards[0] is needed by 3 query shards (by the document's slices), more than max_cp_degree = 2"));
  p.max_cp_degree = 1;
  p.documents = {diagonal, diagonal};
  EXPECT_EQ(cpdispatch::detail::check_documents_plan(p), 1u);
}

TEST(SliceValidation, PerRankFormHasNoSlices) {
  QkvDocumentsPlan p = example();
  EXPECT_THAT(message_of<invalid_input>([&] { (void)cpdispatch::to_rank_plan(p); }),
              HasSubstr("to_rank_plan: documents[0] has slices (section 2e); only the documents form holds them"));
}

// ---------------------------------------------------------------- one rank's share

/// Five ranks: documents[0] (a causal slice, home 0) and documents[1] (a
/// shared prefix, home 1) attend on rank 2, documents[0] first, so rank 1's
/// KV copies there start after documents[0]'s KV group; documents[2] (a
/// causal slice) stays on rank 3 and documents[3] (no slices) on rank 4.
QkvDocumentsPlan groups_before_a_copy() {
  QkvDocumentsPlan p;
  p.world_size = 5;
  PackedDocument before{{{0, 3, 2}}}, shared{{{1, 2, 2}, {1, 2, 2}}}, apart{{{3, 2, 3}}};
  before.slices = {slice(0, 3, 0, 3, SliceType::causal)};
  shared.slices = {slice(0, 2, 0, 2, SliceType::causal), slice(2, 4, 0, 2, SliceType::full), slice(2, 4, 2, 4, SliceType::causal)};
  apart.slices = {slice(0, 2, 0, 2, SliceType::causal)};
  p.documents = {before, shared, apart, PackedDocument{{{4, 2, 4}}}};
  return p;
}

TEST(Slices, EachRankPlansTheNeededSetsItsShareReadsOnly) {
  QkvDocumentsPlan plan = groups_before_a_copy();
  const std::vector<std::vector<std::uint8_t>> wanted = {{1, 1, 0, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 0}};
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankPlanWorkspace workspace;
  for (I r = 0; r < plan.world_size; ++r) {
    cpdispatch::plan_qkv_for_rank(plan, r, mine, workspace);
    EXPECT_EQ(workspace.set_docs, wanted[static_cast<std::size_t>(r)]) << "rank " << r;
  }
  const cpdispatch::RankQkvMetadata rank1 = cpdispatch::plan_qkv_for_rank(plan, 1);
  EXPECT_EQ(rank1.kv_fwd.dst_offset[0], 3);  // after documents[0]'s group of 3 tokens at rank 2
  EXPECT_TRUE(cptest::every_rank_matches(plan));
  plan.dedup = true;  // the dedup slices read every document's users
  cpdispatch::plan_qkv_for_rank(plan, 1, mine, workspace);
  EXPECT_TRUE(workspace.set_docs.empty());
  EXPECT_TRUE(cptest::every_rank_matches(plan));
}

// ---------------------------------------------------------------- nothing needed

/// One document of 2 + 2 + 2 tokens on ranks 0, 0, 1 attending on 1, 0, 1:
/// shard 2 sees shard 0 only, shard 1 nothing, shard 0 itself, so KV shards
/// 1 and 2 are nobody's; and a plain 3-token document on rank 1 attending on 0.
QkvDocumentsPlan unneeded_shard() {
  QkvDocumentsPlan p;
  p.world_size = 2;
  p.documents = {PackedDocument{{{0, 2, 1}, {0, 2, 0}, {1, 2, 1}}}, PackedDocument{{{1, 3, 0}}}};
  p.documents[0].slices = {slice(0, 2, 0, 2, SliceType::causal), slice(4, 6, 0, 2, SliceType::full)};
  return p;
}

TEST(Slices, KvShardNobodyNeedsHasNoCopies) {
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(unneeded_shard());
  EXPECT_EQ(m.kv_fwd.num_copies(), 2u);
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 1}, {-1, -1}}, {{-1, -1}, {0, -1}}}));
  EXPECT_EQ(*m.kv_rev.seq_recv_mask, t3({{{1, 1}, {0, 0}}, {{0, 0}, {1, 0}}}));
  // Query shard 1 (rank 0's first arrival) needs nothing: an empty group and no entries.
  EXPECT_EQ(m.attn.seqlens_q[0], (std::vector<I>{2, 3}));
  EXPECT_EQ(m.attn.seqlens_kv[0], (std::vector<I>{0, 3}));
  EXPECT_TRUE(m.attn.entries[0][0].empty());
  EXPECT_EQ(m.attn.entries[1], (std::vector<std::vector<AttentionEntry>>{{entry(0, 2, 0, 2, open_lo, 0)}, {entry(0, 2, 0, 2, open_lo, open_hi)}}));
  EXPECT_EQ(m.attn.seqlens_kv[1], (std::vector<I>{2, 2}));
  // Nobody's shard stays home and nothing else depends on it.
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{0, 3, 3}, {4, 0, 4}}));
}

TEST(Slices, KvShardNobodyNeedsThroughDedupNodeWireAndSimulation) {
  const QkvDocumentsPlan plan = unneeded_shard();
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(m);
  EXPECT_EQ(wire.dispatch, t3({{{1, -1}, {-1, -1}}, {{-1, -1}, {0, -1}}}));  // shard 0's two copies to rank 1 travel once
  EXPECT_EQ(wire.fwd.num_recv_tokens, t2({{0, 3, 3}, {2, 0, 2}}));
  EXPECT_EQ(*wire.rev.seq_recv_mask, t3({{{1, 0}, {0, 0}}, {{0, 0}, {1, 0}}}));
  const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(m.kv_fwd, cpdispatch::Topology::uniform(2, 1));
  EXPECT_EQ(node.ranks[0].replica_mask, (std::vector<std::uint8_t>{1, 0, 0, 0}));  // shard 1 gets no gradient
  // Forward: every copy lands; backward: the unneeded shard's gradient is 0.
  const std::vector<std::vector<I>> keys = {{10, 11, 12, 13}, {14, 15, 30, 31, 32}};
  std::vector<std::vector<I>> attention, replica;
  cpdispatch::simulate(m.kv_fwd, keys, attention, 1);
  EXPECT_EQ(attention[0], (std::vector<I>{30, 31, 32}));
  EXPECT_EQ(attention[1], (std::vector<I>{10, 11, 10, 11}));
  for (auto& rank : attention) std::fill(rank.begin(), rank.end(), 1);
  cpdispatch::simulate(m.kv_rev, attention, replica, 1);
  std::vector<I> grad(4, -1);
  cpdispatch::combine_copies<I>(m.kv_rev.get_slice(0), replica[0], grad, 1);
  EXPECT_EQ(grad, (std::vector<I>{2, 2, 0, 0}));
  // Each rank's share says the same.
  for (I r = 0; r < 2; ++r) {
    const cpdispatch::RankKvWire mine = cpdispatch::plan_kv_wire_for_rank(plan, r);
    EXPECT_EQ(mine.fwd.dst_rank, wire.fwd.get_slice(r).dst_rank) << r;
    EXPECT_TRUE(mine.fan == wire.fan[static_cast<std::size_t>(r)]) << r;
  }
}

}  // namespace
