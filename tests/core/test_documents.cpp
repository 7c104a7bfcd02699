// Documents that span ranks (docs/plan-format.md, section 2b): the worked
// example of section 4.3 number for number, the per-rank form as its special case, the
// errors that name documents[i].shards[k], and large copy dimensions.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "helpers.hpp"

namespace {

using cpdispatch::DocumentShard;
using cpdispatch::invalid_input;
using cpdispatch::make_tensor;
using cpdispatch::PackedDocument;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::QkvMetadata;
using cpdispatch::Tensor;
using cptest::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;
using I = std::int64_t;
using cptest::M2;
using cptest::M3;
using cptest::t1;
using cptest::t2;
using cptest::t3;

// Section 2b's example: document 0 has 3 tokens on rank 0, then 2 + 4 on rank 1.
QkvDocumentsPlan section_2b_plan() {
  QkvDocumentsPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.documents = {PackedDocument{{{0, 3, 1}, {1, 2, 0}, {1, 4, 1}}}, PackedDocument{{{0, 5, 0}}}, PackedDocument{{{1, 1, 1}}}};
  return p;
}

void expect_section_2b(const QkvMetadata& m) {
  EXPECT_EQ(m.q_fwd.dst_rank, t2({{1, 0, -1}, {0, 1, 1}}));
  EXPECT_EQ(m.q_fwd.dst_offset, t2({{0, 0, 0}, {5, 3, 7}}));
  EXPECT_EQ(m.q_fwd.seq_len, t2({{3, 5, 0}, {2, 4, 1}}));
  EXPECT_EQ(m.q_fwd.num_recv_tokens, t2({{5, 2, 7}, {3, 5, 8}}));
  EXPECT_EQ(m.q_fwd.num_seqs, t1({2, 3}));
  EXPECT_EQ(m.q_fwd.num_total_recv_tokens, (std::vector<I>{7, 8}));
  EXPECT_EQ(m.q_rev.dst_rank, t2({{0, 1, -1}, {0, 1, 1}}));
  EXPECT_EQ(m.q_rev.dst_offset, t2({{3, 0, 0}, {0, 2, 6}}));
  EXPECT_EQ(m.q_rev.seq_len, t2({{5, 2, 0}, {3, 4, 1}}));
  EXPECT_EQ(m.q_rev.num_recv_tokens, t2({{5, 3, 8}, {2, 5, 7}}));
  EXPECT_EQ(m.q_rev.num_seqs, t1({2, 3}));
  EXPECT_EQ(m.kv_fwd.dst_rank, t3({{{1, 0, 1}, {0, -1, -1}, {-1, -1, -1}}, {{0, 1, -1}, {1, -1, -1}, {1, -1, -1}}}));
  EXPECT_EQ(m.kv_fwd.dst_offset, t3({{{0, 5, 3}, {0, 0, 0}, {0, 0, 0}}, {{8, 6, 0}, {8, 0, 0}, {12, 0, 0}}}));
  EXPECT_EQ(m.kv_fwd.seq_len, t2({{3, 5, 0}, {2, 4, 1}}));
  // Counts follow the bytes: rank 0 receives 3 tokens of doc0.0 from its home, rank 0.
  EXPECT_EQ(m.kv_fwd.num_recv_tokens, t2({{8, 2, 10}, {6, 7, 13}}));
  EXPECT_EQ(m.kv_fwd.num_seqs, t1({2, 3}));
  EXPECT_EQ(m.kv_fwd.num_total_recv_tokens, (std::vector<I>{10, 13}));
  EXPECT_EQ(m.kv_rev.dst_rank, t2({{0, 0, 1, -1, -1}, {0, 0, 1, 1, 1}}));
  EXPECT_EQ(m.kv_rev.dst_offset, t2({{3, 8, 0, 0, 0}, {0, 16, 7, 2, 6}}));
  EXPECT_EQ(m.kv_rev.seq_len, t2({{5, 3, 2, 0, 0}, {3, 3, 2, 4, 1}}));
  EXPECT_EQ(m.kv_rev.num_recv_tokens, t2({{8, 6, 14}, {2, 7, 9}}));
  EXPECT_EQ(m.kv_rev.num_seqs, t1({3, 5}));
  EXPECT_EQ(m.kv_rev.num_total_recv_tokens, (std::vector<I>{14, 9}));
  ASSERT_TRUE(m.kv_rev.seq_recv_mask.has_value());
  ASSERT_TRUE(m.kv_rev.recv_seq_lens.has_value());
  EXPECT_EQ(*m.kv_rev.seq_recv_mask, t3({{{1, 1, 1}, {1, 0, 0}, {0, 0, 0}}, {{1, 1, 0}, {1, 0, 0}, {1, 0, 0}}}));
  EXPECT_EQ(*m.kv_rev.recv_seq_lens, t2({{3, 5, 0}, {2, 4, 1}}));
  EXPECT_EQ(m.attn.seqlens_q, (M2{{5, 2}, {3, 4, 1}}));
  EXPECT_EQ(m.attn.seqlens_kv, (M2{{5, 5}, {3, 9, 1}}));
  EXPECT_EQ(m.attn.cu_seqlens_q, (M2{{0, 5, 7}, {0, 3, 7, 8}}));
  EXPECT_EQ(m.attn.cu_seqlens_kv, (M2{{0, 5, 10}, {0, 3, 12, 13}}));
  EXPECT_EQ(m.attn.max_seqlen_q, (std::vector<I>{5, 4}));
  EXPECT_EQ(m.attn.max_seqlen_kv, (std::vector<I>{5, 9}));
}

bool same_metadata(const cpdispatch::Metadata& a, const cpdispatch::Metadata& b) {
  return a.world_size == b.world_size && a.dst_rank == b.dst_rank && a.dst_offset == b.dst_offset && a.seq_len == b.seq_len &&
         a.num_recv_tokens == b.num_recv_tokens && a.num_seqs == b.num_seqs && a.num_total_recv_tokens == b.num_total_recv_tokens &&
         a.seq_recv_mask == b.seq_recv_mask && a.recv_seq_lens == b.recv_seq_lens;
}

::testing::AssertionResult same_qkv(const QkvMetadata& a, const QkvMetadata& b) {
  for (auto [x, y, name] : {std::tuple{&a.q_fwd, &b.q_fwd, "q_fwd"}, std::tuple{&a.q_rev, &b.q_rev, "q_rev"},
                            std::tuple{&a.kv_fwd, &b.kv_fwd, "kv_fwd"}, std::tuple{&a.kv_rev, &b.kv_rev, "kv_rev"}}) {
    if (!same_metadata(*x, *y)) return ::testing::AssertionFailure() << name << " differs";
  }
  const auto &p = a.attn, &q = b.attn;
  if (p.seqlens_q != q.seqlens_q || p.seqlens_kv != q.seqlens_kv || p.cu_seqlens_q != q.cu_seqlens_q ||
      p.cu_seqlens_kv != q.cu_seqlens_kv || p.max_seqlen_q != q.max_seqlen_q || p.max_seqlen_kv != q.max_seqlen_kv) {
    return ::testing::AssertionFailure() << "attn differs";
  }
  return ::testing::AssertionSuccess();
}

TEST(CoreDocuments, Section2bWorkedExample) { expect_section_2b(cpdispatch::plan_qkv(section_2b_plan())); }

TEST(CoreDocuments, Section2bWithDefaultCpDegreeIsTheSame) {
  auto p = section_2b_plan();
  p.max_cp_degree.reset();  // default: the most shards of a document, 3
  expect_section_2b(cpdispatch::plan_qkv(p));
}

// ---------------------------------------------------------- moving tokens

using Buffers = std::vector<std::vector<I>>;
constexpr I sentinel = -1;  // neither a token nor a slot: a place no copy wrote

/// Token t of document i, as a value a buffer slot can hold.
I token_id(std::size_t doc, I t) { return static_cast<I>(doc << 24) + t; }
/// Slot i of rank d's KV-group buffer, as a value (what kv_rev carries back).
I slot_id(std::size_t d, std::size_t i) { return static_cast<I>((d + 1) << 32) + static_cast<I>(i); }

/// What the exchanges of a causal documents plan must leave in each rank's
/// buffer, built from the plan alone (section 2b): the MLP layout (`home`),
/// the query attention layout (`q`), the KV groups (`kv`), and each home's
/// [C][T_r] replica buffer after kv_rev carries back the slot ids of the KV
/// groups (`kv_slots`): slab c of a KV shard holds the slots where its copy c
/// landed, and stays `sentinel` where that copy does not exist.
struct ExpectedBuffers {
  Buffers home, q, kv, kv_slots, replicas;
};

ExpectedBuffers expected_buffers(const QkvDocumentsPlan& p, std::size_t C) {
  const auto W = static_cast<std::size_t>(p.world_size);
  ExpectedBuffers e{Buffers(W), Buffers(W), Buffers(W), Buffers(W), Buffers(W)};
  const auto& docs = p.documents;
  struct At {
    std::size_t doc, shard;
  };
  std::vector<std::vector<At>> on(W);  // each home's shards in its MLP order: (document, shard)
  Buffers start(docs.size()), mlp(docs.size()), group(docs.size());  // [doc][shard]: in the document, P_r, KV group start
  for (std::size_t i = 0; i < docs.size(); ++i) {
    I at = 0;
    for (std::size_t k = 0; k < docs[i].shards.size(); ++k) {
      on[static_cast<std::size_t>(docs[i].shards[k].rank)].push_back({i, k});
      start[i].push_back(at);
      at += docs[i].shards[k].len;
    }
    mlp[i].resize(start[i].size());
    group[i].resize(start[i].size());
  }
  for (std::size_t r = 0; r < W; ++r)
    for (const auto [i, k] : on[r]) {
      mlp[i][k] = static_cast<I>(e.home[r].size());
      for (I t = 0; t < docs[i].shards[k].len; ++t) e.home[r].push_back(token_id(i, start[i][k] + t));
    }
  // Query shards arrive in global order over (home rank, local index); each
  // one's KV group is its document from the start through its own end.
  for (std::size_t r = 0; r < W; ++r)
    for (const auto [i, k] : on[r]) {
      const auto d = static_cast<std::size_t>(docs[i].shards[k].dst);
      const I end = start[i][k] + docs[i].shards[k].len;
      for (I t = start[i][k]; t < end; ++t) e.q[d].push_back(token_id(i, t));
      group[i][k] = static_cast<I>(e.kv[d].size());
      for (I t = 0; t < end; ++t) e.kv[d].push_back(token_id(i, t));
    }
  for (std::size_t d = 0; d < W; ++d)
    for (std::size_t x = 0; x < e.kv[d].size(); ++x) e.kv_slots[d].push_back(slot_id(d, x));
  // Copy c of KV shard k went to the group of query shard k + c, at the
  // shard's own place in it.
  for (std::size_t r = 0; r < W; ++r) {
    const std::size_t T = e.home[r].size();
    e.replicas[r].assign(C * T, sentinel);
    for (const auto [i, k] : on[r])
      for (std::size_t c = 0; k + c < docs[i].shards.size(); ++c) {
        const auto d = static_cast<std::size_t>(docs[i].shards[k + c].dst);
        for (I t = 0; t < docs[i].shards[k].len; ++t)
          e.replicas[r][c * T + static_cast<std::size_t>(mlp[i][k] + t)] = slot_id(d, static_cast<std::size_t>(group[i][k + c] + start[i][k] + t));
      }
  }
  return e;
}

/// Runs `m` on `in` into buffers the sizes of `like`'s, filled with `sentinel` first.
Buffers exchange(const cpdispatch::Metadata& m, const Buffers& in, const Buffers& like) {
  Buffers out;
  std::vector<cpdispatch::ConstBytes> src;
  std::vector<cpdispatch::MutableBytes> dst;
  for (const auto& b : like) out.emplace_back(b.size(), sentinel);
  for (const auto& b : in) src.push_back(std::as_bytes(std::span<const I>(b)));
  for (auto& b : out) dst.push_back(std::as_writable_bytes(std::span<I>(b)));
  cpdispatch::simulate(m, std::span<const cpdispatch::ConstBytes>(src), std::span<const cpdispatch::MutableBytes>(dst), sizeof(I));
  return out;
}

/// Equal buffers, or the first rank and slot where they differ.
::testing::AssertionResult same(const Buffers& got, const Buffers& want) {
  for (std::size_t r = 0; r < want.size(); ++r) {
    if (got[r].size() != want[r].size()) {
      return ::testing::AssertionFailure() << "rank " << r << " has " << got[r].size() << " tokens, expected " << want[r].size();
    }
    for (std::size_t i = 0; i < want[r].size(); ++i) {
      if (got[r][i] != want[r][i]) {
        return ::testing::AssertionFailure() << "rank " << r << " slot " << i << " holds " << got[r][i] << ", expected " << want[r][i];
      }
    }
  }
  return ::testing::AssertionSuccess();
}

/// The four exchanges of `m` move every token of the causal plan `p` where
/// the plan says: every slot of every buffer is compared with the plan's
/// own account, so a count, an offset, an order or a slab that is off shows.
void expect_exchanges_follow(const QkvDocumentsPlan& p, const QkvMetadata& m) {
  ASSERT_EQ(p.mask.type, cpdispatch::MaskType::causal);
  const ExpectedBuffers e = expected_buffers(p, m.kv_fwd.num_copies());
  const Buffers q = exchange(m.q_fwd, e.home, e.q);
  EXPECT_TRUE(same(q, e.q)) << "q_fwd";
  EXPECT_TRUE(same(exchange(m.q_rev, q, e.home), e.home)) << "q_rev after q_fwd";
  EXPECT_TRUE(same(exchange(m.kv_fwd, e.home, e.kv), e.kv)) << "kv_fwd";
  EXPECT_TRUE(same(exchange(m.kv_rev, e.kv_slots, e.replicas), e.replicas)) << "kv_rev";
}

TEST(CoreDocuments, Section2bMetadataValidatesAndMovesTokensAsPlanned) {
  const auto p = section_2b_plan();
  const auto m = cpdispatch::plan_qkv(p);
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
  expect_exchanges_follow(p, m);
}

TEST(CoreDocuments, PlanningLeavesThePlanUntouched) {
  const auto p = section_2b_plan();
  auto copy = p;
  (void)cpdispatch::plan_qkv(copy);
  EXPECT_EQ(copy.documents, p.documents);
  EXPECT_EQ(copy.max_cp_degree, p.max_cp_degree);
}

TEST(CoreDocuments, PerRankSection2ExampleAsDocumentsIsIdentical) {
  cpdispatch::QkvPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{4, 2}, {1, 0}}, {{3}, {0}}};
  p.ranks[1].docs = {{{5, 1, 2}, {0, 1, 0}}};
  const QkvDocumentsPlan d = cpdispatch::to_documents(p);
  ASSERT_EQ(d.documents.size(), 3u);
  EXPECT_EQ(d.documents[2], (PackedDocument{{{1, 5, 0}, {1, 1, 1}, {1, 2, 0}}}));
  EXPECT_TRUE(same_qkv(cpdispatch::plan_qkv(p), cpdispatch::plan_qkv(d)));
}

TEST(CoreDocuments, BothFormsAgreeOnRandomPerRankPlans) {
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const cpdispatch::QkvPlan p = cptest::to_plan(cptest::random_qkv_plan(seed, {16, 3, 6, 20}));
    ASSERT_TRUE(same_qkv(cpdispatch::plan_qkv(p), cpdispatch::plan_qkv(cpdispatch::to_documents(p))));
  }
}

// Documents that each keep one home, listed in any order, are the per-rank
// plan that lists each rank's documents in that same order.
TEST(CoreDocuments, SingleHomeDocumentsInAnyOrderMatchThePerRankForm) {
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 1 + static_cast<I>(seed % 9);
    o.num_documents = static_cast<I>(seed % 13);
    o.max_shards = 5;
    QkvDocumentsPlan d = cpdispatch::random_documents_plan(o, seed);
    cpdispatch::QkvPlan p;
    p.world_size = d.world_size;
    p.ranks.resize(static_cast<std::size_t>(d.world_size));
    for (PackedDocument& doc : d.documents) {
      cpdispatch::Document per_rank;
      for (DocumentShard& s : doc.shards) {
        s.rank = doc.shards[0].rank;
        per_rank.shard_len.push_back(s.len);
        per_rank.dst.push_back(s.dst);
      }
      p.ranks[static_cast<std::size_t>(doc.shards[0].rank)].docs.push_back(per_rank);
    }
    ASSERT_TRUE(same_qkv(cpdispatch::plan_qkv(p), cpdispatch::plan_qkv(d)));
  }
}

TEST(CoreDocuments, RandomCrossRankPlansValidateAndMoveTokensAsPlanned) {
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 1 + static_cast<I>(seed % 12);
    o.num_documents = static_cast<I>(seed % 17);
    o.max_shards = 8;
    const auto p = cpdispatch::random_documents_plan(o, seed);
    const auto m = cpdispatch::plan_qkv(p);
    ASSERT_NO_THROW(m.q_fwd.validate("q_fwd"));
    ASSERT_NO_THROW(m.q_rev.validate("q_rev"));
    ASSERT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
    ASSERT_NO_THROW(m.kv_rev.validate("kv_rev"));
    expect_exchanges_follow(p, m);
    if (HasFailure()) return;  // one failing seed says enough
  }
}

// ---------------------------------------------------------------- bad input

std::string error_of(const QkvDocumentsPlan& p) {
  return message_of<invalid_input>([&] { (void)cpdispatch::plan_qkv(p); });
}

TEST(CoreDocuments, WorldSizeMustBePositive) {
  auto p = section_2b_plan();
  p.world_size = 0;
  EXPECT_THAT(error_of(p), HasSubstr("world_size = 0 must be at least 1"));
}

TEST(CoreDocuments, EmptyDocumentIsNamed) {
  auto p = section_2b_plan();
  p.documents[1].shards.clear();
  EXPECT_THAT(error_of(p), HasSubstr("documents[1].shards is empty"));
}

TEST(CoreDocuments, HomeRankOutsideTheWorldIsNamed) {
  auto p = section_2b_plan();
  p.documents[0].shards[2].rank = 2;
  EXPECT_THAT(error_of(p), AllOf(HasSubstr("documents[0].shards[2].rank = 2"), HasSubstr("outside [0, 2)")));
  p.documents[0].shards[2].rank = -1;
  EXPECT_THAT(error_of(p), HasSubstr("documents[0].shards[2].rank = -1"));
}

TEST(CoreDocuments, NonPositiveLengthIsNamed) {
  auto p = section_2b_plan();
  p.documents[2].shards[0].len = 0;
  EXPECT_THAT(error_of(p), AllOf(HasSubstr("documents[2].shards[0].len = 0"), HasSubstr("positive")));
  p.documents[2].shards[0].len = -4;
  EXPECT_THAT(error_of(p), HasSubstr("documents[2].shards[0].len = -4"));
}

TEST(CoreDocuments, DestinationOutsideTheWorldIsNamed) {
  auto p = section_2b_plan();
  p.documents[0].shards[1].dst = 5;
  EXPECT_THAT(error_of(p), AllOf(HasSubstr("documents[0].shards[1].dst = 5"), HasSubstr("outside [0, 2)")));
  p.documents[0].shards[1].dst = -1;  // a query shard always attends somewhere
  EXPECT_THAT(error_of(p), HasSubstr("documents[0].shards[1].dst = -1"));
}

TEST(CoreDocuments, MoreShardsThanMaxCpDegreeIsNamed) {
  auto p = section_2b_plan();
  p.max_cp_degree = 2;
  EXPECT_THAT(error_of(p), AllOf(HasSubstr("documents[0].shards has 3 shards"), HasSubstr("max_cp_degree = 2")));
  p.max_cp_degree = 0;
  EXPECT_THAT(error_of(p), HasSubstr("max_cp_degree = 0 must be at least 1"));
}

TEST(CoreDocuments, ContextThatOverflowsIsAnError) {
  QkvDocumentsPlan p;
  p.world_size = 2;
  const I big = std::numeric_limits<I>::max() / 2 + 1;
  p.documents = {PackedDocument{{{0, big, 0}, {1, big, 1}, {1, 1, 1}}}};
  EXPECT_THAT(error_of(p), HasSubstr("overflows 64 bits"));
}

TEST(CoreDocuments, NoDocumentsAtAll) {
  QkvDocumentsPlan p;
  p.world_size = 3;
  const auto m = cpdispatch::plan_qkv(p);
  EXPECT_EQ(m.kv_fwd.dst_rank.shape(), (std::vector<std::size_t>{3, 0, 1}));
  EXPECT_EQ(m.attn.cu_seqlens_q, (M2{{0}, {0}, {0}}));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
}

// A 340K-token document over 64K-token ranks needs many shards; C = 256 plans
// (the dense copy axis is the only cost that grows with C).
TEST(CoreDocuments, LargeCopyDimension) {
  QkvDocumentsPlan p;
  p.world_size = 16;
  p.max_cp_degree = 256;
  PackedDocument doc;
  for (I k = 0; k < 256; ++k) doc.shards.push_back({k / 16, 3, (k * 7) % 16});
  p.documents = {doc, PackedDocument{{{15, 5, 0}}}};
  const auto m = cpdispatch::plan_qkv(p);
  EXPECT_EQ(m.kv_fwd.dst_rank.shape(), (std::vector<std::size_t>{16, 17, 256}));
  EXPECT_EQ(m.kv_fwd.dst_rank(0, 0, 255), (255 * 7) % 16);  // KV shard 0 reaches the last query shard
  EXPECT_EQ(m.kv_fwd.dst_rank(15, 15, 1), -1);             // the last shard has one copy
  EXPECT_EQ(m.attn.max_seqlen_kv[(255 * 7) % 16], 256 * 3);
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
  expect_exchanges_follow(p, m);
}

// ---------------------------------------------------------------- slices

// A slice handed to us (not one get_slice made) may hold any lengths: its
// token totals must be checked arithmetic, not signed overflow.
TEST(CoreDocuments, SliceTotalsThatOverflowAreErrors) {
  cpdispatch::RankMetadata s;
  s.world_size = 1;
  s.seq_len = {std::numeric_limits<I>::max(), 1};
  EXPECT_THAT(message_of<invalid_input>([&] { (void)s.send_tokens(); }), HasSubstr("overflows 64 bits"));
  s.recv_seq_lens = std::vector<I>{std::numeric_limits<I>::max(), 2};
  s.seq_recv_mask = std::vector<I>{1, 1};
  s.mask_copies = 1;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)s.output_tokens(); }), HasSubstr("overflows 64 bits"));
  s.recv_seq_lens = std::vector<I>{std::numeric_limits<I>::max() / 2, 1};
  s.mask_copies = 3;  // the [C][T] product overflows even where the sum does not
  EXPECT_THAT(message_of<invalid_input>([&] { (void)s.output_tokens(); }), HasSubstr("replica buffer"));
}

}  // namespace
