// Head-parallel documents (docs/plan-format.md, section 2f): the worked
// example 4.7 number for number, the errors, and on random plans: the
// metadata validates, every rank of a group receives each head-parallel
// document whole at its place in the layout, tokens moved by the metadata
// alone (simulate) go there and back home, the dispatched documents are
// planned as if the head-parallel ones were not there, and each rank's
// share equals the global plan.
// verify_coverage and verify_coverage_for_rank pass every plan made here and
// name the seeded corruptions of section 4.7.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "rank_share.hpp"

namespace {

using cpdispatch::DocumentShard;
using cpdispatch::PackedDocument;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::QkvMetadata;
using ::testing::AllOf;
using ::testing::HasSubstr;
using I = std::int64_t;
using V = std::vector<I>;
using VV = std::vector<V>;

/// Section 4.7: W = 4, u = 2; document 0 (head-parallel) is 3 tokens on
/// rank 0 and 2 on rank 1; document 1 is dispatched (2 tokens on rank 1
/// attending on rank 2, 4 on rank 2 attending on rank 3); document 2 is 1
/// token on rank 3 attending on rank 0.
QkvDocumentsPlan example_4_7() {
  QkvDocumentsPlan plan;
  plan.world_size = 4;
  plan.head_parallel_degree = 2;
  PackedDocument hp{{{0, 3, -1}, {1, 2, -1}}};
  hp.head_parallel = true;
  plan.documents = {hp, {{{1, 2, 2}, {2, 4, 3}}}, {{{3, 1, 0}}}};
  return plan;
}

std::vector<I> flat(const cpdispatch::Tensor<I>& t) { return {t.flat().begin(), t.flat().end()}; }

/// Every rank's MLP layout, each token labelled 1000 * (document + 1) + its position in the document.
std::vector<V> labelled_tokens(const QkvDocumentsPlan& plan) {
  std::vector<V> tokens(static_cast<std::size_t>(plan.world_size));
  for (std::size_t d = 0; d < plan.documents.size(); ++d) {
    I at = 0;
    for (const DocumentShard& s : plan.documents[d].shards) {
      for (I i = 0; i < s.len; ++i) tokens[static_cast<std::size_t>(s.rank)].push_back(1000 * (static_cast<I>(d) + 1) + at + i);
      at += s.len;
    }
  }
  return tokens;
}

/// Moved by the metadata alone (simulate): hp_fwd gives each rank its
/// group's head-parallel documents whole, in hp_attn's order; hp_rev brings
/// every slab of them home, and q_fwd + q_rev bring exactly the other tokens home.
void expect_round_trip(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  const std::vector<V> mlp = labelled_tokens(plan);
  std::vector<V> layout, back, attended, returned;
  cpdispatch::simulate(m.hp_fwd, mlp, layout, 1);
  const auto u = static_cast<std::size_t>(m.hp_attn.degree);
  for (std::size_t r = 0; r < mlp.size(); ++r) {
    V want;
    for (const I d : m.hp_attn.documents[r]) {
      I length = 0;
      for (const DocumentShard& s : plan.documents[static_cast<std::size_t>(d)].shards) length += s.len;
      for (I i = 0; i < length; ++i) want.push_back(1000 * (d + 1) + i);
    }
    EXPECT_EQ(layout[r], want) << "rank " << r;
  }
  cpdispatch::simulate(m.hp_rev, layout, back, 1);
  cpdispatch::simulate(m.q_fwd, mlp, attended, 1);
  cpdispatch::simulate(m.q_rev, attended, returned, 1);
  for (std::size_t r = 0; r < mlp.size(); ++r) {
    ASSERT_EQ(back[r].size(), u * mlp[r].size());
    ASSERT_EQ(returned[r].size(), mlp[r].size());
    for (std::size_t i = 0; i < mlp[r].size(); ++i) {
      const bool hp = plan.documents[static_cast<std::size_t>(mlp[r][i] / 1000 - 1)].head_parallel;
      for (std::size_t c = 0; c < u; ++c) EXPECT_EQ(back[r][c * mlp[r].size() + i], hp ? mlp[r][i] : 0) << "rank " << r << " slab " << c;
      EXPECT_EQ(returned[r][i], hp ? 0 : mlp[r][i]) << "rank " << r << " token " << i;
    }
  }
}

TEST(HeadParallel, WorkedExample47) {
  const QkvMetadata m = cpdispatch::plan_qkv(example_4_7());
  // The MLP layout holds every shard; the head-parallel ones have no query destination.
  EXPECT_EQ(flat(m.q_fwd.dst_rank), (V{-1, -1, -1, 2, 3, -1, 0, -1}));
  EXPECT_EQ(flat(m.q_fwd.seq_len), (V{3, 0, 2, 2, 4, 0, 1, 0}));
  EXPECT_EQ(flat(m.q_rev.seq_recv_mask.value()), (V{0, 0, 0, 1, 1, 0, 1, 0}));  // the head-parallel shards do not come back
  EXPECT_EQ(flat(m.q_rev.recv_seq_lens.value()), (V{3, 0, 2, 2, 4, 0, 1, 0}));
  EXPECT_EQ(m.kv_fwd.num_copies(), 2u);  // C counts document 1 only
  EXPECT_EQ(flat(m.kv_fwd.dst_rank), (V{-1, -1, -1, -1, -1, -1, 2, 3, 3, -1, -1, -1, 0, -1, -1, -1}));
  EXPECT_EQ(flat(m.kv_rev.seq_recv_mask.value()), (V{0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(m.attn.seqlens_q, (VV{{1}, {}, {2}, {4}}));
  EXPECT_EQ(m.attn.seqlens_kv, (VV{{1}, {}, {2}, {6}}));

  EXPECT_EQ(flat(m.hp_fwd.dst_rank), (V{0, 1, -1, -1, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(flat(m.hp_fwd.dst_offset), (V{0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_fwd.num_recv_tokens), (V{3, 2, 0, 0, 5, 3, 2, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_fwd.num_seqs), (V{1, 2, 1, 1}));
  EXPECT_EQ(flat(m.hp_rev.dst_rank), (V{0, 1, 0, 1, -1, -1, -1, -1}));
  EXPECT_EQ(flat(m.hp_rev.dst_offset), (V{0, 0, 3, 4, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_rev.seq_len), (V{3, 2, 3, 2, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_rev.num_recv_tokens), (V{3, 3, 0, 0, 6, 2, 2, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_rev.num_seqs), (V{2, 2, 0, 0}));
  EXPECT_EQ(flat(m.hp_rev.seq_recv_mask.value()), (V{1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(flat(m.hp_rev.recv_seq_lens.value()), (V{3, 0, 2, 2, 4, 0, 1, 0}));

  EXPECT_EQ(m.hp_attn.degree, 2);
  EXPECT_EQ(m.hp_attn.documents, (VV{{0}, {0}, {}, {}}));
  EXPECT_EQ(m.hp_attn.seqlens, (VV{{5}, {5}, {}, {}}));
  EXPECT_EQ(m.hp_attn.cu_seqlens, (VV{{0, 5}, {0, 5}, {0}, {0}}));
  EXPECT_EQ(m.hp_attn.max_seqlen, (V{5, 5, 0, 0}));
  EXPECT_EQ(m.hp_attn.group_rank, (V{0, 1, 0, 1}));
  EXPECT_TRUE(m.hp_attn.entries.empty());
  for (const auto* meta : {&m.q_fwd, &m.q_rev, &m.kv_fwd, &m.kv_rev, &m.hp_fwd, &m.hp_rev}) EXPECT_NO_THROW(meta->validate());
  expect_round_trip(example_4_7(), m);
  EXPECT_NO_THROW(cpdispatch::verify_coverage(example_4_7(), m));
  for (I r = 0; r < 4; ++r) EXPECT_NO_THROW(cpdispatch::verify_coverage_for_rank(example_4_7(), r, cpdispatch::plan_qkv_for_rank(example_4_7(), r)));
}

std::string coverage_message(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  return cptest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::verify_coverage(plan, m); });
}

std::string coverage_rejection(const QkvMetadata& m) { return coverage_message(example_4_7(), m); }

std::string rank_coverage_rejection(I r, const cpdispatch::RankQkvMetadata& mine) {
  return cptest::message_of<cpdispatch::invalid_input>([&] { cpdispatch::verify_coverage_for_rank(example_4_7(), r, mine); });
}

/// Section 4.7 with one thing wrong at a time: each message names the
/// document, the rank and the field.
TEST(HeadParallel, CoverageNamesCorruptionsOfTheWorkedExample) {
  const QkvMetadata planned = cpdispatch::plan_qkv(example_4_7());
  QkvMetadata m = planned;
  m.hp_attn.documents[1].clear();  // rank 1 no longer holds document 0
  m.hp_attn.seqlens[1].clear();
  m.hp_attn.cu_seqlens[1] = {0};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("verify_coverage: hp_attn.documents[1] lacks documents[0], which is head-parallel on ranks [0, 2)"));
  m = planned;
  m.hp_attn.documents[2] = {0};  // rank 2 is in the other group
  m.hp_attn.seqlens[2] = {5};
  m.hp_attn.cu_seqlens[2] = {0, 5};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("hp_attn.documents[2][0] = 0, but documents[0] is head-parallel on ranks [0, 2), a group without rank 2"));
  m = planned;
  m.hp_attn.documents[0] = {0, 0};  // twice on rank 0
  m.hp_attn.seqlens[0] = {5, 5};
  m.hp_attn.cu_seqlens[0] = {0, 5, 10};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("hp_attn.documents[0][1] = 0 lists documents[0] a second time (also hp_attn.documents[0][0])"));
  m = planned;
  m.hp_attn.seqlens[0] = {4};
  m.hp_attn.cu_seqlens[0] = {0, 4};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("hp_attn.seqlens[0][0] = 4, but documents[0] has 5 tokens"));
  m = planned;
  m.hp_fwd.dst_offset(1, 0, 1) = 4;  // doc0.1 on rank 1 one row late
  EXPECT_THAT(coverage_rejection(m), HasSubstr("copy 1 of documents[0].shards[1] (hp_fwd.dst_offset[1][0][1]) lands at rank 1 head-parallel row 4, "
                                               "expected 3 (documents[0] starts at 0 there, the shard at 3 in it)"));
  m = planned;
  m.hp_fwd.dst_rank(1, 0, 1) = 0;  // doc0.1 twice to rank 0, never to rank 1
  EXPECT_THAT(coverage_rejection(m), HasSubstr("brings documents[0].shards[1] to rank 0 a second time"));
  m = planned;
  m.q_fwd.dst_rank(0, 0) = 1;
  EXPECT_THAT(coverage_rejection(m), HasSubstr("q_fwd[0][0] (documents[0].shards[0]) has dst_rank 1, but documents[0] is head-parallel"));
  m = planned;
  m.kv_fwd.dst_rank(0, 0, 0) = 2;
  EXPECT_THAT(coverage_rejection(m), HasSubstr("kv_fwd.dst_rank[0][0][0] (documents[0].shards[0]) = 2, but documents[0] is head-parallel"));
  m = planned;
  m.hp_attn.mask = cpdispatch::AttentionMask::full();  // the whole-document entry sees the future
  EXPECT_THAT(coverage_rejection(m), AllOf(HasSubstr("documents[0]: rank 0 head-parallel document 0 (hp_attn.documents[0][0]) whole-document entry "
                                                     "under hp_attn.mask attends"),
                                           HasSubstr("pairs the mask does not allow, e.g. query 0 key 1")));
  m = planned;
  m.hp_attn.entries = {{{{.q_start = 0, .q_len = 5, .kv_start = 0, .kv_len = 3, .band = {cpdispatch::Band::unbounded_lo, 0}}}}, {{}}, {}, {}};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("documents[0]: no entry attends 3 allowed pairs on rank 0 (hp_attn.documents[0][0])"));
  m = planned;
  m.hp_attn = {};
  EXPECT_THAT(coverage_rejection(m), HasSubstr("hp_attn.degree = 0, but head_parallel_degree = 2 makes groups of 2 ranks"));

  cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(example_4_7(), 1);
  mine.hp_rev.dst_offset[0] = 0;  // doc0.0 back to slab 0 of rank 0, which is rank 0's
  EXPECT_THAT(rank_coverage_rejection(1, mine), HasSubstr("verify_coverage_for_rank: hp_rev[1][0] (documents[0].shards[0]) returns to slab 0 of rank 0's "
                                                           "replica buffer, expected slab 1"));
  mine = cpdispatch::plan_qkv_for_rank(example_4_7(), 0);
  std::swap(mine.hp_rev.dst_rank[0], mine.hp_rev.dst_rank[1]);  // doc0.1's rows returned first
  std::swap(mine.hp_rev.dst_offset[0], mine.hp_rev.dst_offset[1]);
  std::swap(mine.hp_rev.seq_len[0], mine.hp_rev.seq_len[1]);
  EXPECT_THAT(rank_coverage_rejection(0, mine), HasSubstr("hp_rev[0][0] (documents[0].shards[1]) lands at rank 0 head-parallel row 0, expected 3"));
  mine = cpdispatch::plan_qkv_for_rank(example_4_7(), 1);
  mine.hp_attn.group_rank = 0;
  EXPECT_THAT(rank_coverage_rejection(1, mine), HasSubstr("hp_attn.group_rank[1] = 0, expected 1"));
  mine = cpdispatch::plan_qkv_for_rank(example_4_7(), 3);
  mine.hp_attn.documents = {0};
  mine.hp_attn.seqlens = {5};
  mine.hp_attn.cu_seqlens = {0, 5};
  EXPECT_THAT(rank_coverage_rejection(3, mine), HasSubstr("hp_attn.documents[3][0] = 0, but documents[0] is head-parallel on ranks [0, 2)"));
  mine = cpdispatch::plan_qkv_for_rank(example_4_7(), 1);
  mine.hp_rev.dst_rank.pop_back();  // doc0.1 never comes back from rank 1
  mine.hp_rev.dst_offset.pop_back();
  mine.hp_rev.seq_len.pop_back();
  EXPECT_THAT(rank_coverage_rejection(1, mine), HasSubstr("documents[0].shards[1] never reaches rank 1 (hp_rev)"));
}

TEST(HeadParallel, DispatchedDocumentsPlanAsWithoutTheHeadParallelOnes) {
  QkvDocumentsPlan plan = example_4_7();
  QkvDocumentsPlan rest = plan;
  rest.documents.erase(rest.documents.begin());
  rest.head_parallel_degree = 0;
  const QkvMetadata with = cpdispatch::plan_qkv(plan), without = cpdispatch::plan_qkv(rest);
  EXPECT_EQ(with.attn.seqlens_kv, without.attn.seqlens_kv);
  EXPECT_EQ(with.attn.cu_seqlens_q, without.attn.cu_seqlens_q);
  EXPECT_EQ(flat(with.kv_fwd.num_recv_tokens), flat(without.kv_fwd.num_recv_tokens));
  EXPECT_EQ(flat(with.q_fwd.num_recv_tokens), flat(without.q_fwd.num_recv_tokens));
  EXPECT_TRUE(without.hp_attn.empty());
  EXPECT_EQ(without.hp_fwd.world_size, 0);
}

TEST(HeadParallel, DestinationsOfAHeadParallelDocumentAreIgnored) {
  QkvDocumentsPlan plan = example_4_7(), other = plan;
  other.documents[0].shards[0].dst = 3;
  other.documents[0].shards[1].dst = 99;
  const QkvMetadata a = cpdispatch::plan_qkv(plan), b = cpdispatch::plan_qkv(other);
  EXPECT_EQ(flat(a.hp_fwd.dst_offset), flat(b.hp_fwd.dst_offset));
  EXPECT_EQ(flat(a.q_fwd.dst_rank), flat(b.q_fwd.dst_rank));
}

TEST(HeadParallel, DegreeZeroMeansTheWorld) {
  QkvDocumentsPlan plan = example_4_7();
  plan.head_parallel_degree = 0;
  const QkvMetadata m = cpdispatch::plan_qkv(plan);
  EXPECT_EQ(m.hp_attn.degree, 4);
  EXPECT_EQ(m.hp_fwd.num_copies(), 4u);
  EXPECT_EQ(m.hp_attn.seqlens, (VV{{5}, {5}, {5}, {5}}));
  EXPECT_EQ(m.hp_attn.group_rank, (V{0, 1, 2, 3}));
}

TEST(HeadParallel, Errors) {
  const auto message = [](const QkvDocumentsPlan& plan) {
    try {
      (void)cpdispatch::plan_qkv(plan);
    } catch (const cpdispatch::invalid_input& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const I u : {-1, 3, 5}) {
    QkvDocumentsPlan plan = example_4_7();
    plan.head_parallel_degree = u;
    EXPECT_THAT(message(plan), HasSubstr("head_parallel_degree = " + std::to_string(u))) << u;
  }
  QkvDocumentsPlan spans = example_4_7();
  spans.documents[0].shards[1].rank = 2;  // ranks 0 and 2: groups 0 and 1
  EXPECT_THAT(message(spans), HasSubstr("documents[0] is head-parallel but its shards live on ranks 0 (shards[0]) and 2 (shards[1])"));
  QkvDocumentsPlan dispatched = example_4_7();
  dispatched.documents[1].shards[0].dst = -1;  // a dispatched document still needs its destinations
  EXPECT_THAT(message(dispatched), HasSubstr("documents[1].shards[0].dst = -1"));
  QkvDocumentsPlan small_c = example_4_7();
  small_c.max_cp_degree = 1;  // document 1's two shards need C = 2; document 0 does not count
  EXPECT_THAT(message(small_c), HasSubstr("documents[1].shards has 2 shards"));
  EXPECT_THROW((void)cpdispatch::to_rank_plan(example_4_7()), cpdispatch::invalid_input);
}

TEST(HeadParallel, PlanLimitsCountTheHeadParallelMetadata) {
  // One head-parallel document over 64 ranks, nothing dispatched: its
  // [W][S][u] metadata is most of what planning allocates, so the last budget
  // that is refused (doubling up from 1 KiB) is refused for it.
  QkvDocumentsPlan plan;
  plan.world_size = 64;
  PackedDocument doc;
  doc.head_parallel = true;
  for (I r = 0; r < plan.world_size; ++r) doc.shards.push_back({r, 3, -1});
  plan.documents = {doc};
  std::string last_refusal;
  cpdispatch::PlanLimits limits;
  for (limits.max_bytes = 1024;; limits.max_bytes *= 2) {
    try {
      (void)cpdispatch::plan_qkv(plan, limits);
      break;
    } catch (const cpdispatch::invalid_input& e) {
      last_refusal = e.what();
    }
  }
  EXPECT_THAT(last_refusal, HasSubstr("the head-parallel exchange of world_size = 64, head_parallel_degree = 64"));
}

/// A random plan: W = 1..8, u a divisor of W, documents that span ranks
/// within a group (some head-parallel, some with slices) and others anywhere.
QkvDocumentsPlan random_plan(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto draw = [&](I lo, I hi) { return std::uniform_int_distribution<I>(lo, hi)(rng); };
  QkvDocumentsPlan plan;
  plan.world_size = draw(1, 8);
  const I W = plan.world_size;
  V divisors;
  for (I u = 1; u <= W; ++u)
    if (W % u == 0) divisors.push_back(u);
  plan.head_parallel_degree = draw(0, 1) == 0 ? 0 : divisors[static_cast<std::size_t>(draw(0, static_cast<I>(divisors.size()) - 1))];
  const I u = plan.head_parallel_degree == 0 ? W : plan.head_parallel_degree;
  if (seed % 3 == 1) plan.mask = cpdispatch::AttentionMask::sliding_window(draw(1, 6));
  const I documents = draw(1, 7);
  for (I d = 0; d < documents; ++d) {
    PackedDocument doc;
    doc.head_parallel = draw(0, 2) == 0;
    const I group = draw(0, W / u - 1), shards = draw(1, 4);
    I length = 0;
    for (I k = 0; k < shards; ++k) {
      const I home = doc.head_parallel ? group * u + draw(0, u - 1) : draw(0, W - 1);
      const I len = draw(1, 6);
      doc.shards.push_back({home, len, doc.head_parallel ? draw(-1, W + 2) : draw(0, W - 1)});
      length += len;
    }
    if (draw(0, 3) == 0 && length > 1) {  // a prefix seen by everything after it, causally inside each part
      const I cut = draw(1, length - 1);
      doc.slices = {{0, cut, 0, cut, cpdispatch::SliceType::causal},
                    {cut, length, 0, cut, cpdispatch::SliceType::full},
                    {cut, length, cut, length, cpdispatch::SliceType::causal}};
    }
    plan.documents.push_back(std::move(doc));
  }
  plan.dedup = seed % 2 == 0;
  return plan;
}

/// Each rank of a group holds every head-parallel document of it, whole, at
/// the place hp_attn gives: hp_fwd puts shard k of document d at
/// cu_seqlens[i] + (its offset in d) on every rank of the group.
void expect_whole_documents(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  const auto u = static_cast<std::size_t>(m.hp_attn.degree);
  std::vector<std::size_t> local(static_cast<std::size_t>(plan.world_size), 0);
  for (std::size_t d = 0; d < plan.documents.size(); ++d) {
    I at = 0;
    for (const DocumentShard& s : plan.documents[d].shards) {
      const auto r = static_cast<std::size_t>(s.rank), j = local[r]++;
      for (std::size_t c = 0; c < u; ++c) {
        if (!plan.documents[d].head_parallel) {
          EXPECT_EQ(m.hp_fwd.dst_rank(r, j, c), -1);
          continue;
        }
        const std::size_t dest = r / u * u + c;
        const auto& docs = m.hp_attn.documents[dest];
        const auto i = static_cast<std::size_t>(std::find(docs.begin(), docs.end(), static_cast<I>(d)) - docs.begin());
        ASSERT_LT(i, docs.size()) << "document " << d << " missing on rank " << dest;
        EXPECT_EQ(m.hp_fwd.dst_rank(r, j, c), static_cast<I>(dest));
        EXPECT_EQ(m.hp_fwd.dst_offset(r, j, c), m.hp_attn.cu_seqlens[dest][i] + at);
      }
      EXPECT_EQ(m.q_fwd.dst_rank(r, j), plan.documents[d].head_parallel ? -1 : s.dst);
      at += s.len;
    }
  }
}

/// The head-parallel part of rank r's share against the global plan.
::testing::AssertionResult same_head_parallel(const cpdispatch::RankQkvMetadata& mine, const QkvMetadata& global, std::size_t r) {
  const std::string at = "rank " + std::to_string(r) + ": ";
  auto fwd = cptest::same_slice(mine.hp_fwd, global.hp_fwd.get_slice(static_cast<I>(r)), at + "hp_fwd");
  if (!fwd) return fwd;
  auto rev = cptest::same_slice(mine.hp_rev, global.hp_rev.get_slice(static_cast<I>(r)), at + "hp_rev");
  if (!rev) return rev;
  const auto& a = global.hp_attn;
  const auto& b = mine.hp_attn;
  if (b.degree != a.degree || b.documents != a.documents[r] || b.seqlens != a.seqlens[r] || b.cu_seqlens != a.cu_seqlens[r] ||
      b.max_seqlen != a.max_seqlen[r] || b.group_rank != a.group_rank[r] || b.mask != a.mask ||
      b.entries != (a.entries.empty() ? std::vector<std::vector<cpdispatch::AttentionEntry>>{} : a.entries[r])) {
    return ::testing::AssertionFailure() << at << "hp_attn differs";
  }
  return ::testing::AssertionSuccess();
}

TEST(HeadParallel, RandomPlansValidateAndEveryRankMatchesTheGlobalPlan) {
  int with_head_parallel = 0;
  for (std::uint64_t seed = 0; seed < 300; ++seed) {
    const QkvDocumentsPlan plan = random_plan(seed);
    SCOPED_TRACE("seed " + std::to_string(seed));
    const QkvMetadata m = cpdispatch::plan_qkv(plan);
    for (const auto* meta : {&m.q_fwd, &m.q_rev, &m.kv_fwd, &m.kv_rev}) ASSERT_NO_THROW(meta->validate());
    ASSERT_NO_THROW(cpdispatch::verify_coverage(plan, m)) << coverage_message(plan, m);
    if (!cpdispatch::detail::has_head_parallel(plan)) {
      EXPECT_TRUE(m.hp_attn.empty());
      for (I r = 0; r < plan.world_size; ++r) ASSERT_NO_THROW(cpdispatch::verify_coverage_for_rank(plan, r, cpdispatch::plan_qkv_for_rank(plan, r)));
      continue;
    }
    ++with_head_parallel;
    ASSERT_NO_THROW(m.hp_fwd.validate("hp_fwd"));
    ASSERT_NO_THROW(m.hp_rev.validate("hp_rev"));
    expect_whole_documents(plan, m);
    expect_round_trip(plan, m);
    const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(m);
    cpdispatch::RankQkvMetadata mine;
    cpdispatch::RankPlanWorkspace workspace;
    for (I r = 0; r < plan.world_size; ++r) {
      cpdispatch::plan_qkv_for_rank(plan, r, mine, workspace);
      ASSERT_TRUE(cptest::rank_matches(plan, m, wire, mine, r));
      ASSERT_TRUE(same_head_parallel(mine, m, static_cast<std::size_t>(r)));
      ASSERT_NO_THROW(cpdispatch::verify_coverage_for_rank(plan, r, mine)) << "rank " << r;
      for (const auto* slice : {&mine.q_fwd, &mine.q_rev, &mine.hp_fwd, &mine.hp_rev}) ASSERT_NO_THROW(slice->validate());
    }
  }
  EXPECT_GT(with_head_parallel, 100);  // the draw exercises what it names
}

}  // namespace
