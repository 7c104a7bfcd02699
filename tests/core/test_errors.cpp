// Every class of bad input to the planner core: the exception type (invalid_input or
// capacity_error, both cpdispatch::error) and a message naming the culprit.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"

namespace {

using cpdispatch::capacity_error;
using cpdispatch::ConstBytes;
using cpdispatch::invalid_input;
using cpdispatch::make_tensor;
using cpdispatch::MutableBytes;
using cpdispatch::plan_qkv;
using cpdispatch::plan_query;
using cpdispatch::QkvPlan;
using cpdispatch::Tensor;
using cptest::I;
using cptest::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;
using cptest::M2;
using cptest::M3;
using cptest::t2;
using cptest::t3;

TEST(CoreErrors, ExceptionHierarchy) {
  static_assert(std::is_base_of_v<std::runtime_error, cpdispatch::error>);
  static_assert(std::is_base_of_v<cpdispatch::error, invalid_input>);
  static_assert(std::is_base_of_v<invalid_input, capacity_error>);
  static_assert(std::is_base_of_v<cpdispatch::error, cpdispatch::backend_error>);
  static_assert(!std::is_base_of_v<invalid_input, cpdispatch::backend_error>);
  const cpdispatch::backend_error b("nccl failed", 7);
  EXPECT_EQ(b.code(), 7);
  EXPECT_STREQ(b.what(), "nccl failed");
  // one catch clause for everything the library throws
  bool caught = false;
  try {
    (void)plan_query(t2({{-1}}), t2({{0}}));
  } catch (const cpdispatch::error&) {
    caught = true;
  }
  EXPECT_TRUE(caught);
}

// ------------------------------------------------------------------ plan_query

TEST(CoreErrors, PlanQueryShapeMismatches) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(Tensor<I>({2, 3, 1}, 1), Tensor<I>({2, 3}, 0)); }),
              HasSubstr("plan_query: seq_len has 3 dimensions"));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(Tensor<I>({2, 3}, 1), Tensor<I>({2}, 0)); }),
              HasSubstr("plan_query: dispatch has 1 dimensions"));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(Tensor<I>({2, 3}, 1), Tensor<I>({2, 2}, 0)); }),
              AllOf(HasSubstr("dispatch has shape [2, 2]"), HasSubstr("seq_len has [2, 3]")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(Tensor<I>({2, 3}, 1), Tensor<I>({3, 3, 2}, 0)); }),
              AllOf(HasSubstr("dispatch has shape [3, 3, 2]"), HasSubstr("seq_len has [2, 3]")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(Tensor<I>({0, 3}, 1), Tensor<I>({0, 3}, 0)); }),
              HasSubstr("world_size must be at least 1"));
}

TEST(CoreErrors, PlanQueryDestinationOutsideTheWorld) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2}, {4, 1}}), t2({{0, 1}, {2, 0}})); }),
              AllOf(HasSubstr("dispatch[1][0] = 2"), HasSubstr("outside [0, 2)")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2}, {4, 1}}), t2({{0, -2}, {1, 0}})); }),
              AllOf(HasSubstr("dispatch[0][1] = -2"), HasSubstr("outside [0, 2)")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2}, {4, 1}}), t3({{{0, -1}, {1, 5}}, {{0, 1}, {1, -1}}})); }),
              AllOf(HasSubstr("dispatch[0][1][1] = 5"), HasSubstr("outside [0, 2)")));
}

TEST(CoreErrors, PlanQueryNegativeLength) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, -3}, {4, 1}}), t2({{0, 1}, {1, 0}})); }),
              AllOf(HasSubstr("seq_len[0][1] = -3"), HasSubstr("negative")));
}

TEST(CoreErrors, PlanQueryShardWithoutDestination) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2}, {4, 1}}), t2({{0, 1}, {-1, 0}})); }),
              AllOf(HasSubstr("seq_len[1][0] = 4"), HasSubstr("dispatch[1][0] has no destination")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2}, {4, 1}}), t3({{{0, -1}, {1, 1}}, {{0, 1}, {-1, -1}}})); }),
              AllOf(HasSubstr("seq_len[1][1] = 1"), HasSubstr("dispatch[1][1] has no destination")));
}

TEST(CoreErrors, PlanQueryPaddingWithADestination) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 2, 0}, {4, 0, 0}}), t2({{0, 1, 1}, {1, -1, -1}})); }),
              AllOf(HasSubstr("dispatch[0][2] = 1"), HasSubstr("seq_len[0][2] = 0")));
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 0}, {4, 1}}), t3({{{0, -1}, {-1, 0}}, {{0, 1}, {1, -1}}})); }),
              AllOf(HasSubstr("dispatch[0][1][1] = 0"), HasSubstr("seq_len[0][1] = 0")));
}

TEST(CoreErrors, PlanQueryPaddingInTheMiddleOfARow) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)plan_query(t2({{3, 0, 2}, {4, 1, 1}}), t2({{0, -1, 1}, {1, 0, 0}})); }),
              AllOf(HasSubstr("seq_len[0][2] = 2"), HasSubstr("follows a padding shard")));
}

// -------------------------------------------------------------------- plan_qkv

QkvPlan good_plan() {
  QkvPlan p;
  p.world_size = 2;
  p.ranks.resize(2);
  p.ranks[0].docs = {{{4, 2}, {1, 0}}, {{3}, {0}}};
  p.ranks[1].docs = {{{5, 1, 2}, {0, 1, 0}}};
  return p;
}

TEST(CoreErrors, PlanQkvWorldSize) {
  for (I w : {0, -1}) {
    auto p = good_plan();
    p.world_size = w;
    EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }),
                AllOf(HasSubstr("world_size = " + std::to_string(w)), HasSubstr("must be at least 1")));
  }
}

TEST(CoreErrors, PlanQkvRanksCountIsNotWorldSize) {
  auto p = good_plan();
  p.world_size = 3;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks has 2 entries"), HasSubstr("world_size = 3")));
  p = good_plan();
  p.ranks.pop_back();
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks has 1 entries"), HasSubstr("world_size = 2")));
}

TEST(CoreErrors, PlanQkvEmptyDocument) {
  auto p = good_plan();
  p.ranks[1].docs.push_back({{}, {}});
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks[1].docs[1].shard_len is empty")));
}

TEST(CoreErrors, PlanQkvDstAndShardLenLengthsDiffer) {
  auto p = good_plan();
  p.ranks[0].docs[0].dst.pop_back();
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }),
              AllOf(HasSubstr("ranks[0].docs[0].dst has 1 entries"), HasSubstr("shard_len has 2")));
}

TEST(CoreErrors, PlanQkvNonPositiveLength) {
  auto p = good_plan();
  p.ranks[1].docs[0].shard_len[2] = -2;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks[1].docs[0].shard_len[2] = -2"), HasSubstr("positive")));
  p = good_plan();
  p.ranks[0].docs[1].shard_len[0] = 0;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks[0].docs[1].shard_len[0] = 0"), HasSubstr("positive")));
}

TEST(CoreErrors, PlanQkvDestinationOutsideTheWorld) {
  auto p = good_plan();
  p.ranks[1].docs[0].dst[1] = 2;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks[1].docs[0].dst[1] = 2"), HasSubstr("outside [0, 2)")));
  p = good_plan();
  p.ranks[0].docs[0].dst[0] = -1;  // a QKV shard always has a destination
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("ranks[0].docs[0].dst[0] = -1"), HasSubstr("outside [0, 2)")));
}

TEST(CoreErrors, PlanQkvMaxCpDegreeTooSmall) {
  auto p = good_plan();
  p.max_cp_degree = 2;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }),
              AllOf(HasSubstr("max_cp_degree = 2"), HasSubstr("3 shards of ranks[1].docs[0]")));
  p.max_cp_degree = 0;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), AllOf(HasSubstr("max_cp_degree = 0"), HasSubstr("at least 1")));
  p.max_cp_degree = 3;  // exactly the largest shard count is fine
  EXPECT_NO_THROW((void)plan_qkv(p));
}

// Not an error: ranks (or the whole world) without documents.
TEST(CoreErrors, PlanQkvWithoutDocumentsIsFine) {
  QkvPlan p;
  p.world_size = 3;
  p.ranks.resize(3);
  cpdispatch::QkvMetadata m;
  ASSERT_NO_THROW(m = plan_qkv(p));
  for (const auto* md : {&m.q_fwd, &m.q_rev, &m.kv_fwd, &m.kv_rev}) {
    EXPECT_NO_THROW(md->validate());
    for (I r = 0; r < 3; ++r) EXPECT_EQ(md->output_tokens(r), 0);
  }
  EXPECT_EQ(m.attn.cu_seqlens_q, (M2{{0}, {0}, {0}}));
  EXPECT_EQ(m.attn.max_seqlen_kv, (std::vector<I>{0, 0, 0}));
  p.ranks[1].docs = {{{2}, {0}}};  // one document, two empty ranks
  ASSERT_NO_THROW(m = plan_qkv(p));
  EXPECT_EQ(m.attn.seqlens_q, (M2{{2}, {}, {}}));
  EXPECT_EQ(m.attn.max_seqlen_q, (std::vector<I>{2, 0, 0}));
}

// Lengths come from users: sums that overflow 64 bits are errors, not UB.
TEST(CoreErrors, TokenCountsThatOverflow) {
  const I big = I{1} << 62;
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_query(t2({{big, big}}), t2({{0, 0}})); }),
              AllOf(HasSubstr("plan_query"), HasSubstr("overflows 64 bits")));
  // [C][T_r] replica buffer of 4 copies x 2^62 tokens
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_query(t2({{big}}), t3({{{0, 0, 0, 0}}})); }),
              AllOf(HasSubstr("rank 0"), HasSubstr("replica buffer"), HasSubstr("overflows 64 bits")));
  QkvPlan p;
  p.world_size = 1;
  p.ranks.resize(1);
  p.ranks[0].docs = {{{big, big}, {0, 0}}};
  EXPECT_THAT(message_of<invalid_input>([&] { (void)plan_qkv(p); }), HasSubstr("overflows 64 bits"));
}

// -------------------------------------------------------------------- simulate

struct Buffers {
  std::vector<std::vector<float>> in, out;
  std::vector<ConstBytes> in_b;
  std::vector<MutableBytes> out_b;
  Buffers(const cpdispatch::Metadata& m, std::size_t elems, std::ptrdiff_t out_delta, std::ptrdiff_t in_delta = 0) {
    for (I r = 0; r < m.world_size; ++r) {
      in.emplace_back(static_cast<std::size_t>(static_cast<std::ptrdiff_t>(static_cast<std::size_t>(m.send_tokens(r)) * elems) + (r == 1 ? in_delta : 0)), 1.0f);
      out.emplace_back(static_cast<std::size_t>(static_cast<std::ptrdiff_t>(static_cast<std::size_t>(m.output_tokens(r)) * elems) + (r == 1 ? out_delta : 0)), 0.0f);
    }
    for (auto& v : in) in_b.push_back(std::as_bytes(std::span<const float>(v)));
    for (auto& v : out) out_b.push_back(std::as_writable_bytes(std::span<float>(v)));
  }
  void run(const cpdispatch::Metadata& m, std::size_t elems) { cpdispatch::simulate(m, std::span<const ConstBytes>(in_b), std::span<const MutableBytes>(out_b), elems * sizeof(float)); }
};

TEST(CoreErrors, SimulateOutputBufferTooSmall) {
  const auto m = plan_qkv(good_plan());
  {
    Buffers b(m.q_fwd, 2, 0);
    EXPECT_NO_THROW(b.run(m.q_fwd, 2));  // exactly enough
  }
  {
    Buffers b(m.q_fwd, 2, -1);  // rank 1 receives 5 tokens x 8 bytes, given 36
    EXPECT_THAT(message_of<capacity_error>([&] { b.run(m.q_fwd, 2); }),
                AllOf(HasSubstr("outputs[1] holds 36 bytes"), HasSubstr("needs 40")));
  }
  {
    Buffers b(m.kv_rev, 1, -1);  // rank 1's replica buffer: 3 copies x 8 tokens x 4 bytes
    EXPECT_THAT(message_of<capacity_error>([&] { b.run(m.kv_rev, 1); }),
                AllOf(HasSubstr("outputs[1] holds 92 bytes"), HasSubstr("needs 96")));
  }
}

TEST(CoreErrors, SimulateInputBufferTooSmall) {
  const auto m = plan_qkv(good_plan());
  Buffers b(m.kv_fwd, 1, 0, -1);
  EXPECT_THAT(message_of<capacity_error>([&] { b.run(m.kv_fwd, 1); }), AllOf(HasSubstr("inputs[1] holds 28 bytes"), HasSubstr("reads 32")));
}

TEST(CoreErrors, SimulateBufferCountsAndTokenWidth) {
  const auto m = plan_qkv(good_plan());
  Buffers b(m.q_fwd, 1, 0);
  b.in_b.pop_back();
  EXPECT_THAT(message_of<invalid_input>([&] { b.run(m.q_fwd, 1); }), AllOf(HasSubstr("inputs has 1 buffers"), HasSubstr("world_size is 2")));
  Buffers c(m.q_fwd, 1, 0);
  c.out_b.push_back({});
  EXPECT_THAT(message_of<invalid_input>([&] { c.run(m.q_fwd, 1); }), AllOf(HasSubstr("outputs has 3 buffers"), HasSubstr("world_size is 2")));
  Buffers d(m.q_fwd, 1, 0);
  EXPECT_THAT(message_of<invalid_input>([&] { d.run(m.q_fwd, 0); }), HasSubstr("token_bytes must be positive"));
}

TEST(CoreErrors, SimulateRejectsMalformedMetadata) {
  auto m = plan_qkv(good_plan());
  m.q_fwd.num_seqs = Tensor<I>({3}, 0);
  Buffers b(plan_qkv(good_plan()).q_fwd, 1, 0);
  EXPECT_THAT(message_of<invalid_input>([&] { b.run(m.q_fwd, 1); }), HasSubstr("num_seqs has shape [3]"));
  m = plan_qkv(good_plan());
  m.q_fwd.dst_offset(1, 2) = 11;  // 2 tokens at 11 of rank 0's 12
  EXPECT_THAT(message_of<invalid_input>([&] { b.run(m.q_fwd, 1); }), AllOf(HasSubstr("dst_offset[1][2] = 11"), HasSubstr("rank 0")));
}

// -------------------------------------------------------------- combine_copies

TEST(CoreErrors, CombineBufferTooSmall) {
  const auto m = plan_qkv(good_plan());
  const auto s = m.kv_rev.get_slice(1);  // T = 8 tokens, C = 3 copies
  std::vector<float> replica(3 * 8 * 2), grad(8 * 2);
  EXPECT_NO_THROW(cpdispatch::combine_copies<float>(s, replica, grad, 2));
  std::vector<float> small_replica(3 * 8 * 2 - 1), small_grad(8 * 2 - 1);
  EXPECT_THAT(message_of<capacity_error>([&] { cpdispatch::combine_copies<float>(s, small_replica, grad, 2); }),
              AllOf(HasSubstr("replica holds 47 elements"), HasSubstr("needs 48")));
  EXPECT_THAT(message_of<capacity_error>([&] { cpdispatch::combine_copies<float>(s, replica, small_grad, 2); }),
              AllOf(HasSubstr("grad holds 15 elements"), HasSubstr("needs 16")));
  // the byte-level and global-view entry points check the same
  EXPECT_THAT(message_of<capacity_error>([&] {
                cpdispatch::combine_copies(s, std::as_bytes(std::span<const float>(small_replica)), std::as_writable_bytes(std::span<float>(grad)),
                                           8, cpdispatch::ElementType::float32);
              }),
              HasSubstr("replica holds 47 elements"));
  EXPECT_THAT(message_of<capacity_error>([&] { cpdispatch::combine_copies<float>(m.kv_rev, 1, replica, small_grad, 2); }),
              HasSubstr("grad holds 15 elements"));
}

TEST(CoreErrors, CombineOddTokenWidthForTheElementType) {
  const auto s = plan_qkv(good_plan()).kv_rev.get_slice(0);
  alignas(8) std::byte replica[512] = {}, grad[512] = {};
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies(s, ConstBytes(replica), MutableBytes(grad), 3, cpdispatch::ElementType::float16); }),
              AllOf(HasSubstr("token_bytes = 3"), HasSubstr("2-byte float16")));
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies(s, ConstBytes(replica), MutableBytes(grad), 6, cpdispatch::ElementType::float32); }),
              AllOf(HasSubstr("token_bytes = 6"), HasSubstr("4-byte float32")));
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies(s, ConstBytes(replica), MutableBytes(grad), 4, cpdispatch::ElementType::float64); }),
              AllOf(HasSubstr("token_bytes = 4"), HasSubstr("8-byte float64")));
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies(s, ConstBytes(replica), MutableBytes(grad), 0, cpdispatch::ElementType::bfloat16); }),
              AllOf(HasSubstr("token_bytes = 0"), HasSubstr("bfloat16")));
  EXPECT_THAT(message_of<invalid_input>([&] {
                cpdispatch::combine_copies(s, ConstBytes(replica + 1, 300), MutableBytes(grad), 4, cpdispatch::ElementType::float32);
              }),
              HasSubstr("aligned to 4 bytes"));
  EXPECT_NO_THROW(cpdispatch::combine_copies(s, ConstBytes(replica), MutableBytes(grad), 4, cpdispatch::ElementType::float16));
}

TEST(CoreErrors, CombineNeedsReverseKvMetadata) {
  const auto m = plan_qkv(good_plan());
  std::vector<float> replica(100), grad(100);
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies<float>(m.q_rev.get_slice(0), replica, grad, 1); }),
              HasSubstr("not reverse KV metadata"));
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies<float>(m.kv_rev.get_slice(0), replica, grad, 0); }),
              HasSubstr("token_elems must be positive"));
  EXPECT_THAT(message_of<invalid_input>([&] { cpdispatch::combine_copies<float>(m.kv_rev, 2, replica, grad, 1); }),
              AllOf(HasSubstr("rank 2"), HasSubstr("outside [0, 2)")));
}

// ---------------------------------------------------------------- small types

TEST(CoreErrors, TensorAndSliceArguments) {
  EXPECT_THAT(message_of<invalid_input>([] { (void)make_tensor<I>(M2{{1, 2}, {3}}); }), HasSubstr("row 1 has 1 entries"));
  EXPECT_THAT(message_of<invalid_input>([] { (void)Tensor<I>(std::vector<std::size_t>{1, 2, 3, 4}); }), HasSubstr("4 dimensions"));
  const Tensor<I> t({2, 3});
  EXPECT_THAT(message_of<invalid_input>([&] { (void)t.at(1, 3); }), AllOf(HasSubstr("index 3 on axis 1"), HasSubstr("[0, 3)")));
  EXPECT_THAT(message_of<invalid_input>([&] { (void)t.at(1); }), HasSubstr("1 indices given for a 2-D tensor"));
  EXPECT_EQ(t.at(1, 2), 0);
  const auto m = plan_qkv(good_plan());
  EXPECT_THAT(message_of<invalid_input>([&] { (void)m.q_fwd.get_slice(-1); }), HasSubstr("get_slice: rank -1"));
}

}  // namespace
