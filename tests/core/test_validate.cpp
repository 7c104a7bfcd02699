// Metadata::validate() rejects hand-corrupted metadata, one test per
// invariant, and the message names the field and its indices. The starting
// point is always the worked QKV example of docs/plan-format.md (section 4.1), which validates.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

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
QkvMetadata spec() {
  cpdispatch::QkvPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{4, 2}, {1, 0}}, {{3}, {0}}};
  p.ranks[1].docs = {{{5, 1, 2}, {0, 1, 0}}};
  return cpdispatch::plan_qkv(p);
}

std::string rejection(const Metadata& m, const char* name) {
  return message_of<invalid_input>([&] { m.validate(name); });
}

TEST(CoreValidate, AcceptsTheSpecExample) {
  const auto m = spec();
  EXPECT_NO_THROW(m.q_fwd.validate("q_fwd"));
  EXPECT_NO_THROW(m.q_rev.validate("q_rev"));
  EXPECT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  EXPECT_NO_THROW(m.kv_rev.validate("kv_rev"));
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

TEST(CoreValidate, RejectsAnEntryWithoutADestination) {
  auto m = spec();
  m.q_rev.dst_rank(0, 3) = -1;
  m.q_rev.dst_offset(0, 3) = 0;
  EXPECT_THAT(rejection(m.q_rev, "q_rev"), AllOf(HasSubstr("q_rev.seq_len[0][3] = 2"), HasSubstr("no destination")));
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
