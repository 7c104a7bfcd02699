// Metadata::validate() rejects hand-corrupted metadata, one test per
// invariant, and the message names the field and its indices. The starting
// point is always the worked QKV example of docs/plan-format.md (section 4.1), which validates.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"

namespace {

using cpdispatch::invalid_input;
using cpdispatch::Metadata;
using cpdispatch::QkvMetadata;
using cpdispatch::Tensor;
using cptest::I;
using cptest::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;

// q_fwd  dst_rank [[1,0,0],[0,1,0]]  dst_offset [[0,0,2],[5,4,10]]  seq_len [[4,2,3],[5,1,2]]
// q_rev  dst_rank [[0,0,1,1],[0,1,-1,-1]]  dst_offset [[4,6,0,6],[0,5,0,0]]  seq_len [[2,3,5,2],[4,1,0,0]]
// kv_fwd dst_offset [[[0,0,0],[4,0,0],[6,0,0]],[[9,4,14],[9,19,0],[20,0,0]]]
// kv_rev dst_rank [[0,0,0,1,1,1,1],[0,1,1,-1,-1,-1,-1]]  dst_offset [[9,4,6,0,16,13,6],[0,8,5,0,0,0,0]]
cpdispatch::QkvPlan spec_plan() {
  cpdispatch::QkvPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{4, 2}, {1, 0}}, {{3}, {0}}};
  p.ranks[1].docs = {{{5, 1, 2}, {0, 1, 0}}};
  return p;
}

QkvMetadata spec() { return cpdispatch::plan_qkv(spec_plan()); }

std::string rejection(const Metadata& m, const char* name) {
  return message_of<invalid_input>([&] { m.validate(name); });
}

using Rows = std::vector<std::vector<I>>;

/// What a causal per-rank plan says each exchange must do, worked out from
/// its shards alone (docs/plan-format.md, section 2).
struct PlanAccount {
  std::vector<I> home;         // [r]: T_r, the tokens r holds
  std::vector<I> q_layout;     // [d]: query tokens d's attention layout holds
  std::vector<I> kv_layout;    // [d]: KV tokens d's KV groups hold
  Rows q_counts, kv_counts;    // [d][s]: tokens d receives from s, the total last
  Rows replica;                // [r][c * T_r + t]: 1 where copy c of the shard at t comes back
};

PlanAccount account(const cpdispatch::QkvPlan& p, std::size_t C) {
  const auto W = static_cast<std::size_t>(p.world_size);
  PlanAccount a{std::vector<I>(W), std::vector<I>(W), std::vector<I>(W), Rows(W, std::vector<I>(W + 1)),
                Rows(W, std::vector<I>(W + 1)), Rows(W)};
  for (std::size_t r = 0; r < W; ++r)
    for (const auto& doc : p.ranks[r].docs)
      for (I len : doc.shard_len) a.home[r] += len;
  for (std::size_t r = 0; r < W; ++r) {
    a.replica[r].assign(C * static_cast<std::size_t>(a.home[r]), 0);
    I at = 0;  // P_r(j)
    for (const auto& doc : p.ranks[r].docs) {
      const std::size_t n = doc.shard_len.size();
      I context = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const auto d = static_cast<std::size_t>(doc.dst[i]);
        const I len = doc.shard_len[i];
        for (auto* c : {&a.q_counts[d][r], &a.q_counts[d][W]}) *c += len;
        for (auto* c : {&a.kv_counts[d][r], &a.kv_counts[d][W]}) *c += context + len;  // KV shards 0..i
        a.q_layout[d] += len;
        a.kv_layout[d] += context + len;
        for (std::size_t c = 0; c < n - i; ++c)  // KV shard i serves query shards i .. n-1
          for (I t = 0; t < len; ++t) a.replica[r][c * static_cast<std::size_t>(a.home[r]) + static_cast<std::size_t>(at + t)] = 1;
        context += len;
        at += len;
      }
    }
  }
  return a;
}

Rows transposed(const Rows& counts) {
  const std::size_t W = counts.size();
  Rows t(W, std::vector<I>(W + 1));
  for (std::size_t d = 0; d < W; ++d)
    for (std::size_t s = 0; s < W; ++s) {
      t[s][d] = counts[d][s];
      t[s][W] += counts[d][s];
    }
  return t;
}

/// Where the copies of `m` land, by brute force: per destination, how many
/// copies write each slot of a buffer of `tokens[d]` tokens, and how many
/// tokens come from each source (the total last); a copy outside its
/// buffer is counted in `outside` instead.
struct Landing {
  Rows cover, counts;
  int outside = 0;
};

Landing land(const Metadata& m, const std::vector<I>& tokens) {
  const auto W = static_cast<std::size_t>(m.world_size);
  Landing l{Rows(W), Rows(W, std::vector<I>(W + 1)), 0};
  for (std::size_t d = 0; d < W; ++d) l.cover[d].assign(static_cast<std::size_t>(tokens[d]), 0);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < m.max_seqs(); ++j)
      for (std::size_t k = 0; k < m.num_copies(); ++k) {
        const I d = m.has_copies() ? m.dst_rank(r, j, k) : m.dst_rank(r, j);
        const I off = m.has_copies() ? m.dst_offset(r, j, k) : m.dst_offset(r, j);
        const I len = m.seq_len(r, j);
        if (d < 0) continue;
        const auto du = static_cast<std::size_t>(d);
        if (du >= W || off < 0 || len < 0 || off + len > tokens[du]) {
          ++l.outside;
          continue;
        }
        for (I t = off; t < off + len; ++t) ++l.cover[du][static_cast<std::size_t>(t)];
        l.counts[du][r] += len;
        l.counts[du][W] += len;
      }
  return l;
}

Rows rows_of(const Tensor<I>& t) {
  Rows rows(t.size(0));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i].assign(t.row(i).begin(), t.row(i).end());
  return rows;
}

Rows all_ones(const std::vector<I>& tokens) {
  Rows rows;
  for (I n : tokens) rows.emplace_back(static_cast<std::size_t>(n), 1);
  return rows;
}

// What validate() accepts here is valid by an account that does not use
// it: the plan's own token totals, and every receive buffer written exactly
// once (the replica buffers exactly where a copy comes back).
TEST(CoreValidate, AcceptsTheSpecExample) {
  const auto m = spec();
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));

  const PlanAccount a = account(spec_plan(), 3);
  ASSERT_EQ(a.home, (std::vector<I>{9, 8}));  // the plan's shards: 4 + 2 + 3 on rank 0, 5 + 1 + 2 on rank 1
  const auto check = [](const Metadata& md, const std::vector<I>& send, const std::vector<I>& out, const Rows& cover,
                         const Rows& counts) {
    const Landing l = land(md, out);
    EXPECT_EQ(l.outside, 0);
    EXPECT_EQ(l.cover, cover);
    EXPECT_EQ(l.counts, counts);
    EXPECT_EQ(rows_of(md.num_recv_tokens), counts);
    for (std::size_t r = 0; r < send.size(); ++r) {
      EXPECT_EQ(md.send_tokens(static_cast<I>(r)), send[r]) << "rank " << r;
      EXPECT_EQ(md.output_tokens(static_cast<I>(r)), out[r]) << "rank " << r;
    }
  };
  std::vector<I> replicas;
  for (I t : a.home) replicas.push_back(3 * t);
  {
    SCOPED_TRACE("q_fwd");
    check(m.q_fwd, a.home, a.q_layout, all_ones(a.q_layout), a.q_counts);
  }
  {
    SCOPED_TRACE("q_rev");
    check(m.q_rev, a.q_layout, a.home, all_ones(a.home), transposed(a.q_counts));
  }
  {
    SCOPED_TRACE("kv_fwd");
    check(m.kv_fwd, a.home, a.kv_layout, all_ones(a.kv_layout), a.kv_counts);
  }
  {
    SCOPED_TRACE("kv_rev");
    check(m.kv_rev, a.kv_layout, replicas, a.replica, transposed(a.kv_counts));
  }
}

// ---- overlap

TEST(CoreValidate, RejectsOverlappingRegions2D) {
  auto m = spec();
  m.q_fwd.dst_offset(0, 2) = 1;  // [1, 4) on rank 0 overlaps shard [0][1] at [0, 2)
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"),
              AllOf(HasSubstr("q_fwd.dst_offset[0][2] = 1"), HasSubstr("overlaps dst_offset[0][1] = 0"), HasSubstr("rank 0")));
}

TEST(CoreValidate, RejectsOverlappingRegions3D) {
  auto m = spec();
  m.kv_fwd.dst_offset(0, 0, 1) = 1;  // [1, 5) on rank 0 overlaps copy [0][1][0] at [4, 6)
  EXPECT_THAT(rejection(m.kv_fwd, "kv_fwd"),
              AllOf(HasSubstr("kv_fwd.dst_offset[0][1][0] = 4"), HasSubstr("overlaps dst_offset[0][0][1] = 1"), HasSubstr("rank 0")));
}

// ---- out of bounds

TEST(CoreValidate, RejectsARegionPastTheReceiveBuffer) {
  auto m = spec();
  m.q_fwd.dst_offset(1, 2) = 11;  // 2 tokens at 11 in rank 0's 12
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.dst_offset[1][2] = 11"), HasSubstr("12 tokens rank 0 receives")));
}

TEST(CoreValidate, RejectsARegionPastTheReplicaBuffer) {
  auto m = spec();
  m.kv_rev.dst_offset(0, 0) = 24;  // 4 tokens at 24 in rank 0's 3 x 9 replica buffer
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.dst_offset[0][0] = 24"), HasSubstr("27 tokens rank 0")));
}

TEST(CoreValidate, RejectsANegativeOffset) {
  auto m = spec();
  m.q_fwd.dst_offset(1, 1) = -4;
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.dst_offset[1][1] = -4"), HasSubstr("negative")));
}

// ---- conservation

TEST(CoreValidate, RejectsACountThatDoesNotMatchWhatIsSent) {
  auto m = spec();
  m.q_fwd.num_recv_tokens(0, 1) = 6;  // rank 1 sends 7 tokens to rank 0
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"),
              AllOf(HasSubstr("q_fwd.num_recv_tokens[0][1] = 6"), HasSubstr("rank 1 sends 7 tokens to rank 0")));
}

TEST(CoreValidate, RejectsARowTotalThatIsNotTheSum) {
  auto m = spec();
  m.kv_fwd.num_recv_tokens(1, 2) = 11;
  EXPECT_THAT(rejection(m.kv_fwd, "kv_fwd"), AllOf(HasSubstr("kv_fwd.num_recv_tokens[1][2] = 11"), HasSubstr("sums to 10")));
}

TEST(CoreValidate, RejectsAWrongNumTotalRecvTokens) {
  auto m = spec();
  m.q_rev.num_total_recv_tokens[1] = 9;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.num_total_recv_tokens[1] = 9"), HasSubstr("expected 8")));
}

// ---- padding

TEST(CoreValidate, RejectsPaddingWithADestination) {
  auto m = spec();
  m.q_rev.dst_rank(1, 2) = 0;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.dst_rank[1][2] = 0"), HasSubstr("seq_len[1][2] = 0")));
}

TEST(CoreValidate, RejectsPaddingWithAnOffset) {
  auto m = spec();
  m.q_rev.dst_offset(1, 3) = 7;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.dst_offset[1][3] = 7"), HasSubstr("no destination")));
  m = spec();
  m.kv_fwd.dst_offset(0, 1, 2) = 3;  // a copy that does not exist
  EXPECT_THAT(rejection(m.kv_fwd, "kv_fwd"), AllOf(HasSubstr("kv_fwd.dst_offset[0][1][2] = 3"), HasSubstr("no destination")));
}

TEST(CoreValidate, RejectsPaddingInTheMiddleOfARow) {
  auto m = spec();
  // rank 1's row [4, 1, 0, 0] becomes [4, 0, 1, 0]
  m.q_rev.seq_len(1, 1) = 0;
  m.q_rev.dst_rank(1, 1) = -1;
  m.q_rev.dst_offset(1, 1) = 0;
  m.q_rev.seq_len(1, 2) = 1;
  m.q_rev.dst_rank(1, 2) = 1;
  m.q_rev.dst_offset(1, 2) = 5;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.seq_len[1][2] = 1"), HasSubstr("follows a padding entry")));
}

TEST(CoreValidate, RejectsAWrongNumSeqs) {
  auto m = spec();
  m.q_rev.num_seqs(1) = 3;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.num_seqs[1] = 3"), HasSubstr("2 non-padding entries")));
  m = spec();
  m.q_rev.num_seqs(0) = 5;  // wider than the row
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.num_seqs[0] = 5"), HasSubstr("outside [0, 4]")));
}

// Section 2f: a head-parallel shard stays home in q_fwd (no destination);
// that is valid metadata, while the planner's own input still needs a
// destination for every query shard (test_errors.cpp).
TEST(CoreValidate, AcceptsAQueryShardThatStaysHome) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents.push_back({{{0, 2, 0}, {1, 2, 1}}, {}, true});
  plan.documents.push_back({{{0, 3, 1}}});
  const auto m = cpdispatch::plan_qkv(plan);
  ASSERT_EQ(m.q_fwd.dst_rank(0, 0), -1);  // the head-parallel shard on rank 0
  ASSERT_EQ(m.q_fwd.dst_rank(0, 1), 1);
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
  EXPECT_NO_THROW(m.hp_fwd.validate("hp_fwd"));
  EXPECT_NO_THROW(m.hp_rev.validate("hp_rev"));
}

// Section 2e: a KV shard that no query needs has no copy in kv_fwd; that is
// valid (it stays home).
TEST(CoreValidate, AcceptsAKeyValueShardThatNoQueryNeeds) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents.push_back({{{0, 2, 1}, {1, 2, 0}}, {{0, 4, 0, 2, cpdispatch::SliceType::full}}});
  const auto m = cpdispatch::plan_qkv(plan);
  ASSERT_EQ(m.kv_fwd.dst_rank(1, 0, 0), -1);  // shard 1's keys are seen by nobody
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
}

TEST(CoreValidate, RejectsANegativeLength) {
  auto m = spec();
  m.q_fwd.seq_len(1, 1) = -1;
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.seq_len[1][1] = -1"), HasSubstr("negative")));
}

TEST(CoreValidate, RejectsADestinationOutsideTheWorld) {
  auto m = spec();
  m.q_fwd.dst_rank(0, 1) = 2;
  EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.dst_rank[0][1] = 2"), HasSubstr("outside [0, 2)")));
  m = spec();
  m.kv_fwd.dst_rank(1, 2, 1) = -2;
  EXPECT_THAT(rejection(m.kv_fwd, "kv_fwd"), AllOf(HasSubstr("kv_fwd.dst_rank[1][2][1] = -2"), HasSubstr("outside [0, 2)")));
}

// ---- the reverse-KV mask

TEST(CoreValidate, RejectsAMaskValueOtherThan0Or1) {
  auto m = spec();
  (*m.kv_rev.seq_recv_mask)(1, 0, 2) = 2;
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.seq_recv_mask[1][0][2] = 2"), HasSubstr("not 0 or 1")));
}

TEST(CoreValidate, RejectsAMaskOnAPaddingShard) {
  cpdispatch::QkvPlan p;  // rank 0 holds one shard, rank 1 two: rank 0's mask row has padding
  p.world_size = 2;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{3}, {0}}};
  p.ranks[1].docs = {{{2, 2}, {0, 1}}};
  auto m = cpdispatch::plan_qkv(p);
  ASSERT_NO_THROW(m.kv_rev.validate("kv_rev"));
  (*m.kv_rev.seq_recv_mask)(0, 1, 0) = 1;
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.seq_recv_mask[0][1][0] = 1"), HasSubstr("recv_seq_lens[0][1] = 0")));
}

TEST(CoreValidate, RejectsAMaskThatMarksACopyThatDoesNotArrive) {
  auto m = spec();
  (*m.kv_rev.seq_recv_mask)(0, 0, 2) = 1;  // shard [0][0] has copies 0 and 1 only
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.seq_recv_mask marks 5 copies"), HasSubstr("rank 0"), HasSubstr("only 4 arrive")));
}

TEST(CoreValidate, RejectsACopyThatTheMaskDoesNotMark) {
  auto m = spec();
  (*m.kv_rev.seq_recv_mask)(0, 0, 1) = 0;  // copy 1 of shard [0][0] still comes back (kv_rev[0][0], offset 9)
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"),
              AllOf(HasSubstr("kv_rev.dst_offset[0][0] = 9"), HasSubstr("not a copy that seq_recv_mask marks on rank 0")));
}

TEST(CoreValidate, RejectsANegativeRecvSeqLen) {
  auto m = spec();
  (*m.kv_rev.recv_seq_lens)(1, 2) = -2;
  EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.recv_seq_lens[1][2] = -2"), HasSubstr("negative")));
}

// ---- shapes

TEST(CoreValidate, RejectsWrongShapes) {
  {
    auto m = spec();
    m.q_fwd.dst_offset = Tensor<I>({2, 2}, 0);
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.dst_offset has shape [2, 2]"), HasSubstr("dst_rank has [2, 3]")));
  }
  {
    auto m = spec();
    m.kv_fwd.dst_offset = Tensor<I>({2, 3}, 0);  // 2-D offsets for 3-D ranks
    EXPECT_THAT(rejection(m.kv_fwd, "kv_fwd"), AllOf(HasSubstr("kv_fwd.dst_offset has shape [2, 3]"), HasSubstr("dst_rank has [2, 3, 3]")));
  }
  {
    auto m = spec();
    m.q_fwd.seq_len = Tensor<I>({2, 4}, 0);
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.seq_len has shape [2, 4]"), HasSubstr("expected [2, 3]")));
  }
  {
    auto m = spec();
    m.q_fwd.num_recv_tokens = Tensor<I>({2, 2}, 0);
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.num_recv_tokens has shape [2, 2]"), HasSubstr("expected [2, 3]")));
  }
  {
    auto m = spec();
    m.q_fwd.num_seqs = Tensor<I>({3}, 0);
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.num_seqs has shape [3]"), HasSubstr("expected [2]")));
  }
  {
    auto m = spec();
    m.q_fwd.world_size = 3;
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.dst_rank has shape [2, 3]"), HasSubstr("3 rows")));
  }
  {
    auto m = spec();
    m.q_fwd.dst_rank = Tensor<I>({2}, 0);
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), HasSubstr("q_fwd.dst_rank has 1 dimensions"));
  }
  {
    auto m = spec();
    m.q_fwd.world_size = 0;
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), HasSubstr("q_fwd.world_size = 0 must be positive"));
  }
  {
    auto m = spec();
    m.q_fwd.num_total_recv_tokens.pop_back();
    EXPECT_THAT(rejection(m.q_fwd, "q_fwd"), AllOf(HasSubstr("q_fwd.num_total_recv_tokens has 1 entries"), HasSubstr("expected 2")));
  }
  {
    auto m = spec();
    m.kv_rev.recv_seq_lens.reset();
    EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), HasSubstr("kv_rev: seq_recv_mask and recv_seq_lens must be both present"));
  }
  {
    auto m = spec();
    m.kv_rev.recv_seq_lens = Tensor<I>({2, 2}, 1);
    EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), AllOf(HasSubstr("kv_rev.recv_seq_lens has shape [2, 2]"), HasSubstr("expected [2, 3]")));
  }
  {
    auto m = spec();
    m.kv_rev.seq_recv_mask = Tensor<I>({2, 3}, 0);
    EXPECT_THAT(rejection(m.kv_rev, "kv_rev"), HasSubstr("kv_rev.seq_recv_mask has shape [2, 3]"));
  }
}

// The default name prefixes messages when the caller gives none.
TEST(CoreValidate, DefaultNameIsMetadata) {
  auto m = spec();
  m.q_fwd.seq_len(0, 0) = -1;
  EXPECT_THAT(message_of<invalid_input>([&] { m.q_fwd.validate(); }), HasSubstr("metadata.seq_len[0][0] = -1"));
}

}  // namespace
