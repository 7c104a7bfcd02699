// The dispatcher's calls, checked on a strict mock transport, one rank at a
// time: the mock plays the rest of the world (it checks what this rank sends
// each peer and delivers what each peer would send), so every rank's whole
// behaviour is checked without running the others.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::testing::MockTransport;
using cptest::Bytes;
using ::testing::_;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::InSequence;
using ::testing::Invoke;
using ::testing::StrictMock;
using ::testing::Throw;
using Counts = std::span<const std::size_t>;

/// The rest of the world for rank `me`, in one exchange: checks the segment
/// sent to each peer against `expect_sent(peer)` and delivers `deliver(peer)`.
template <class ExpectSent, class Deliver>
auto world_of(int me, ExpectSent expect_sent, Deliver deliver) {
  return [=](const void* send, Counts sc, Counts sd, void* recv, Counts rc, Counts rd) {
    ASSERT_EQ(sc[static_cast<std::size_t>(me)], 0u) << "self traffic must not reach the transport";
    ASSERT_EQ(rc[static_cast<std::size_t>(me)], 0u) << "self traffic must not reach the transport";
    for (std::size_t p = 0; p < sc.size(); ++p) {
      if (static_cast<int>(p) == me) continue;
      const auto* s = static_cast<const std::byte*>(send) + sd[p];
      EXPECT_EQ(Bytes(s, s + sc[p]), expect_sent(static_cast<int>(p))) << "rank " << me << " -> " << p;
      const Bytes in = deliver(static_cast<int>(p));
      ASSERT_EQ(in.size(), rc[p]) << "rank " << p << " -> " << me;
      if (!in.empty()) std::memcpy(static_cast<std::byte*>(recv) + rd[p], in.data(), in.size());
    }
  };
}

struct Reference {
  std::vector<Bytes> mlp, attention, attention_in, replica;  // inputs and simulate() outputs
};

Reference reference_of(const cptest::PairCase& c, std::size_t tb, std::uint64_t salt) {
  const int W = static_cast<int>(c.fwd.world_size);
  Reference ref;
  ref.mlp = cptest::inputs_for(W, tb, salt, [&](int r) { return c.fwd.send_tokens(r); });
  ref.attention = cptest::simulate_bytes(c.fwd, ref.mlp, tb);
  ref.attention_in = cptest::inputs_for(W, tb, salt + 1, [&](int r) { return c.rev.send_tokens(r); });
  ref.replica = cptest::simulate_bytes(c.rev, ref.attention_in, tb);
  return ref;
}

class MockDispatch : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, MockDispatch, ::testing::Values(2, 3, 4, 8));

// One forward dispatch issues exactly one all_to_all_v whose byte counts are
// num_recv_tokens x token width (self: 0), then the reverse issues the mirror
// image; the data each peer gets and the output are exactly simulate()'s.
TEST_P(MockDispatch, ForwardAndReverseAreOneExchangeEachWithTheMetadataCounts) {
  const int W = GetParam();
  const std::size_t tb = 6;
  for (std::uint64_t seed : {1u, 2u}) {
    for (const auto& c : cptest::pair_cases(W, seed)) {
      SCOPED_TRACE(c.name + " seed " + std::to_string(seed));
      const Reference ref = reference_of(c, tb, seed);
      for (int r = 0; r < W; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        StrictMock<MockTransport> t(r, W);
        Dispatcher d(t, c.fwd, c.rev, tb);
        const auto& sizes = d.required_bytes();
        ASSERT_EQ(sizes.mlp_bytes, ref.mlp[static_cast<std::size_t>(r)].size());
        ASSERT_EQ(sizes.attention_bytes, ref.attention[static_cast<std::size_t>(r)].size());
        ASSERT_EQ(sizes.replica_bytes, ref.replica[static_cast<std::size_t>(r)].size());
        const auto send = cptest::forward_send_counts(c.fwd, r, tb);
        const auto recv = cptest::forward_recv_counts(c.fwd, r, tb);
        Bytes staging(sizes.staging_bytes);
        Bytes attention(sizes.attention_bytes, std::byte{0xA5});
        Bytes replica(sizes.replica_bytes, std::byte{0xA5});
        {
          InSequence in_order;
          EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(send), _, _, ElementsAreArray(recv), _))
              .WillOnce(Invoke(world_of(
                  r, [&](int p) { return cptest::entries_bytes(c.rev, p, r, ref.attention[static_cast<std::size_t>(p)], tb); },
                  [&](int p) { return cptest::entries_bytes(c.rev, r, p, ref.attention[static_cast<std::size_t>(r)], tb); })));
          EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(recv), _, _, ElementsAreArray(send), _))  // the mirror image
              .WillOnce(Invoke(world_of(
                  r, [&](int p) { return cptest::entries_bytes(c.rev, r, p, ref.attention_in[static_cast<std::size_t>(r)], tb); },
                  [&](int p) { return cptest::entries_bytes(c.rev, p, r, ref.attention_in[static_cast<std::size_t>(p)], tb); })));
        }
        d.forward(ref.mlp[static_cast<std::size_t>(r)], attention, staging);
        EXPECT_EQ(attention, ref.attention[static_cast<std::size_t>(r)]);
        d.reverse(ref.attention_in[static_cast<std::size_t>(r)], replica, staging);
        EXPECT_EQ(replica, ref.replica[static_cast<std::size_t>(r)]);
      }
    }
  }
}

// Plans from the planner: forward receives and reverse sends are contiguous
// per peer, so the transport works on the caller's buffers there.
TEST(MockDispatch, PlannerPlansReceiveForwardAndSendReverseInPlace) {
  const int W = 4;
  const std::size_t tb = 4;
  const auto qkv = cptest::random_qkv(W, 7);
  for (int r = 0; r < W; ++r) {
    StrictMock<MockTransport> t(r, W);
    Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, tb);
    Bytes mlp(d.required_bytes().mlp_bytes), attention(d.required_bytes().attention_bytes), replica(d.required_bytes().replica_bytes);
    InSequence in_order;
    EXPECT_CALL(t, all_to_all_v(_, _, _, static_cast<void*>(attention.data()), _, _));
    EXPECT_CALL(t, all_to_all_v(static_cast<const void*>(attention.data()), _, _, _, _, _));
    d.forward(mlp, attention);
    d.reverse(attention, replica);
  }
}

// The worked example of docs/plan-format.md, section 4: exact arguments, displacements included.
TEST(MockDispatch, WorkedExampleExactArguments) {
  cpdispatch::QkvPlan plan;
  plan.world_size = 2;
  plan.max_cp_degree = 3;
  plan.ranks = {{{{{4, 2}, {1, 0}}, {{3}, {0}}}}, {{{{5, 1, 2}, {0, 1, 0}}}}};
  const auto qkv = cpdispatch::plan_qkv(plan);
  const std::size_t tb = 2;
  // Rank 1's queries: shards of 5, 1, 2 tokens to ranks 0, 1, 0. It sends shards 0
  // and 2 (7 tokens) to rank 0, packed; it gets 4 tokens from rank 0 (q_fwd
  // dst_offset [1][1] = 4: rank 1's own shard sits after rank 0's).
  StrictMock<MockTransport> t(1, 2);
  Dispatcher d(t, qkv.q_fwd, qkv.q_rev, tb);
  EXPECT_EQ(d.required_bytes(), (cpdispatch::BufferSizes{16, 10, 16, 14}));
  Bytes mlp = cptest::pattern(16, 1), attention(10), staging(14), back(16);
  {
    InSequence in_order;
    EXPECT_CALL(t, all_to_all_v(static_cast<const void*>(staging.data()), ElementsAreArray({14, 0}), ElementsAreArray({0, 0}),
                                static_cast<void*>(attention.data()), ElementsAreArray({8, 0}), ElementsAreArray({0, 0})))
        .WillOnce(Invoke([&](const void* send, Counts, Counts, void* recv, Counts, Counts) {
          const auto* s = static_cast<const std::byte*>(send);
          EXPECT_EQ(Bytes(s, s + 10), Bytes(mlp.begin(), mlp.begin() + 10));  // shard 0
          EXPECT_EQ(Bytes(s + 10, s + 14), Bytes(mlp.begin() + 12, mlp.end()));  // shard 2
          std::memset(recv, 0x11, 8);                                             // rank 0's shard 0
        }));
    // Reverse: the attention buffer's first 8 bytes go back to rank 0 straight
    // from the buffer; 14 bytes come back from rank 0 into staging.
    EXPECT_CALL(t, all_to_all_v(static_cast<const void*>(attention.data()), ElementsAreArray({8, 0}), ElementsAreArray({0, 0}),
                                static_cast<void*>(staging.data()), ElementsAreArray({14, 0}), ElementsAreArray({0, 0})))
        .WillOnce(Invoke([&](const void*, Counts, Counts, void* recv, Counts, Counts) {
          std::memcpy(recv, mlp.data(), 10);
          std::memcpy(static_cast<std::byte*>(recv) + 10, mlp.data() + 12, 4);
        }));
  }
  d.forward(mlp, attention, staging);
  EXPECT_EQ(Bytes(attention.begin(), attention.begin() + 8), Bytes(8, std::byte{0x11}));
  EXPECT_EQ(Bytes(attention.begin() + 8, attention.end()), Bytes(mlp.begin() + 10, mlp.begin() + 12));  // its own shard 1
  d.reverse(attention, back, staging);
  EXPECT_EQ(back, mlp);
}

// KV backward: the exchange comes first and the combine uses what it brought.
TEST(MockDispatch, KvBackwardExchangesThenCombines) {
  const int W = 4;
  const std::size_t tb = 8;
  const auto qkv = cptest::random_qkv(W, 3);
  for (auto type : {ElementType::float32, ElementType::bfloat16, ElementType::float16, ElementType::float64}) {
    std::vector<Bytes> grads;
    for (int r = 0; r < W; ++r) grads.push_back(cptest::float_pattern(static_cast<std::size_t>(qkv.kv_rev.send_tokens(r)) * tb, 5 + static_cast<std::uint64_t>(r), type));
    const auto replicas = cptest::simulate_bytes(qkv.kv_rev, grads, tb, std::byte{0});
    for (int r = 0; r < W; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const auto u = static_cast<std::size_t>(r);
      Bytes expect_grad(static_cast<std::size_t>(qkv.kv_fwd.send_tokens(r)) * tb);
      cpdispatch::combine_copies(qkv.kv_rev.get_slice(r), replicas[u], expect_grad, tb, type);

      StrictMock<MockTransport> t(r, W);
      Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, tb);
      Bytes replica(d.required_bytes().replica_bytes, std::byte{0}), grad(d.required_bytes().mlp_bytes, std::byte{0x5A});
      const Bytes untouched = grad;
      InSequence in_order;
      EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(cptest::forward_recv_counts(qkv.kv_fwd, r, tb)), _, _,
                                  ElementsAreArray(cptest::forward_send_counts(qkv.kv_fwd, r, tb)), _))
          .WillOnce(Throw(cpdispatch::backend_error("link down", 3)))
          .WillOnce(Invoke(world_of(
              r, [&](int p) { return cptest::entries_bytes(qkv.kv_rev, r, p, grads[u], tb); },
              [&](int p) { return cptest::entries_bytes(qkv.kv_rev, p, r, grads[static_cast<std::size_t>(p)], tb); })));
      EXPECT_THROW(d.reverse_combine(grads[u], replica, grad, type), cpdispatch::backend_error);
      EXPECT_EQ(grad, untouched) << "no combine without its exchange";
      d.reverse_combine(grads[u], replica, grad, type);
      EXPECT_EQ(replica, replicas[u]);
      EXPECT_EQ(grad, expect_grad);
    }
  }
}

// A failing transport: the exception propagates with the dispatcher's
// context, keeps its kind and code, and the dispatcher works afterwards.
TEST(MockDispatch, TransportErrorsPropagateWithContextAndTheDispatcherStaysUsable) {
  const int W = 3;
  const std::size_t tb = 4;
  const auto qkv = cptest::random_qkv(W, 11);
  const cptest::PairCase c{"q", qkv.q_fwd, qkv.q_rev, false};
  const Reference ref = reference_of(c, tb, 9);
  const int r = 1;
  StrictMock<MockTransport> t(r, W);
  Dispatcher d(t, c.fwd, c.rev, tb);
  Bytes attention(d.required_bytes().attention_bytes, std::byte{0xA5});
  auto world = world_of(
      r, [&](int p) { return cptest::entries_bytes(c.rev, p, r, ref.attention[static_cast<std::size_t>(p)], tb); },
      [&](int p) { return cptest::entries_bytes(c.rev, r, p, ref.attention[static_cast<std::size_t>(r)], tb); });
  InSequence in_order;
  EXPECT_CALL(t, all_to_all_v).WillOnce(Throw(cpdispatch::backend_error("MPI_Alltoallv failed: MPI_ERR_TRUNCATE", 15)));
  EXPECT_CALL(t, all_to_all_v).WillOnce(Throw(std::runtime_error("not from our family")));
  EXPECT_CALL(t, all_to_all_v).WillOnce(Invoke(world));
  try {
    d.forward(ref.mlp[r], attention);
    ADD_FAILURE() << "no exception";
  } catch (const cpdispatch::backend_error& e) {
    EXPECT_EQ(e.code(), 15);
    EXPECT_STREQ(e.what(), "Dispatcher::forward (rank 1 of 3): all_to_all_v failed: MPI_Alltoallv failed: MPI_ERR_TRUNCATE");
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "the original is not nested";
    } catch (const cpdispatch::backend_error& original) {
      EXPECT_STREQ(original.what(), "MPI_Alltoallv failed: MPI_ERR_TRUNCATE");
    }
  }
  EXPECT_THAT(cptest::message_of<cpdispatch::error>([&] { d.forward(ref.mlp[r], attention); }),
              HasSubstr("Dispatcher::forward (rank 1 of 3): all_to_all_v failed: not from our family"));
  d.forward(ref.mlp[r], attention);
  EXPECT_EQ(attention, ref.attention[r]);
}

// One rank: everything is local; the transport is never called.
TEST(MockDispatch, OneRankNeverCallsTheTransport) {
  const auto qkv = cptest::random_qkv(1, 4);
  StrictMock<MockTransport> t(0, 1);
  for (const auto* pair : {&qkv.q_fwd, &qkv.kv_fwd}) {
    const auto& rev = pair == &qkv.q_fwd ? qkv.q_rev : qkv.kv_rev;
    Dispatcher d(t, *pair, rev, 3);
    const Bytes mlp = cptest::pattern(d.required_bytes().mlp_bytes, 1);
    Bytes attention(d.required_bytes().attention_bytes), replica(d.required_bytes().replica_bytes, std::byte{0});
    d.forward(mlp, attention);
    EXPECT_EQ(attention, cptest::simulate_bytes(*pair, {mlp}, 3)[0]);
    d.reverse(attention, replica);
    EXPECT_EQ(replica, cptest::simulate_bytes(rev, {attention}, 3, std::byte{0})[0]);
    EXPECT_EQ(d.required_bytes().staging_bytes, 0u);
  }
}

TEST(MockDispatch, ConstructionChecksTheSlicesAgainstTheTransport) {
  const auto qkv = cptest::random_qkv(4, 2);
  const auto other = cptest::random_qkv(4, 3);
  StrictMock<MockTransport> t(2, 4);
  using cpdispatch::invalid_input;
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, qkv.q_fwd.get_slice(1), qkv.q_rev.get_slice(2), 8); }),
              HasSubstr("Dispatcher (rank 2 of 4): fwd is the slice of rank 1 but the transport is rank 2"));
  StrictMock<MockTransport> wide(2, 5);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(wide, qkv.q_fwd, qkv.q_rev, 8); }),
              HasSubstr("fwd.world_size = 4 but the transport's world_size() = 5"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(wide, qkv.q_fwd.get_slice(2), qkv.q_rev.get_slice(2), 8); }),
              HasSubstr("Dispatcher (rank 2 of 5): fwd.world_size = 4 but the transport's world_size() = 5"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, qkv.q_fwd, qkv.q_rev, 0); }),
              HasSubstr("token_bytes must be positive"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, qkv.kv_rev, qkv.kv_fwd, 8); }),
              HasSubstr("fwd and rev swapped"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, qkv.q_fwd, other.q_rev, 8); }),
              HasSubstr("not slices of one plan"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, qkv.q_fwd, qkv.kv_rev, 8); }),
              HasSubstr("not slices of one plan"));
  auto bad = qkv.q_fwd.get_slice(2);
  bad.dst_rank[0] = 4;
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(t, bad, qkv.q_rev.get_slice(2), 8); }),
              HasSubstr("fwd.dst_rank[0] = 4 is outside [0, 4)"));
  StrictMock<MockTransport> stranger(7, 4);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { Dispatcher d(stranger, qkv.q_fwd.get_slice(2), qkv.q_rev.get_slice(2), 8); }),
              HasSubstr("rank() = 7 is outside [0, 4)"));
}

// The dispatcher checks a slice by the format's own per-rank rules
// (RankMetadata::validate), so the reverse-KV lengths and mask are checked
// too, worded as the global validation words them.
TEST(MockDispatch, SlicesAreCheckedByTheFormatsRules) {
  const auto qkv = cptest::random_qkv(4, 2);
  StrictMock<MockTransport> t(2, 4);
  using cpdispatch::invalid_input;
  const auto fwd = qkv.kv_fwd.get_slice(2);
  auto rev = qkv.kv_rev.get_slice(2);
  ASSERT_TRUE(rev.recv_seq_lens && !rev.recv_seq_lens->empty() && rev.mask_copies > 0);
  const auto message = [&](const cpdispatch::RankMetadata& r) {
    return cptest::message_of<invalid_input>([&] { Dispatcher d(t, fwd, r, 8); });
  };
  auto negative = rev;
  (*negative.recv_seq_lens)[0] = -3;
  EXPECT_THAT(message(negative), HasSubstr("Dispatcher (rank 2 of 4): rev.recv_seq_lens[0] = -3 is negative"));
  auto not_a_bit = rev;
  (*not_a_bit.seq_recv_mask)[0] = 2;
  EXPECT_THAT(message(not_a_bit), HasSubstr("Dispatcher (rank 2 of 4): rev.seq_recv_mask[0][0] = 2 is not 0 or 1"));
  auto total = rev;
  total.num_recv_tokens.back() += 1;
  EXPECT_THAT(message(total), HasSubstr("rev.num_recv_tokens[4] = " + std::to_string(total.num_recv_tokens.back()) +
                                        ", but the row sums to " + std::to_string(rev.num_recv_tokens.back())));
  // The same rule, the same words, on the slice alone.
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { negative.validate("kv_rev"); }),
              HasSubstr("kv_rev.recv_seq_lens[0] = -3 is negative"));
  EXPECT_NO_THROW(rev.validate("kv_rev"));
  EXPECT_NO_THROW(fwd.validate("kv_fwd"));
}

TEST(MockDispatch, BuffersAreCheckedBeforeAnyCommunication) {
  const int W = 4;
  const auto qkv = cptest::random_qkv(W, 5);
  StrictMock<MockTransport> t(0, W);  // no call expected: every check comes first
  Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, 8);
  const auto s = d.required_bytes();
  ASSERT_GT(s.staging_bytes, 0u);
  Bytes mlp(s.mlp_bytes), attention(s.attention_bytes), replica(s.replica_bytes), staging(s.staging_bytes), grad(s.mlp_bytes);
  using cpdispatch::capacity_error;
  const std::string tokens = " tokens x 8 bytes)";
  EXPECT_THAT(cptest::message_of<capacity_error>([&] { d.forward(std::span(mlp).first(s.mlp_bytes - 1), attention); }),
              HasSubstr("Dispatcher::forward (rank 0 of 4): mlp holds " + std::to_string(s.mlp_bytes - 1) + " bytes, the plan needs " +
                        std::to_string(s.mlp_bytes) + " (" + std::to_string(s.mlp_bytes / 8) + tokens));
  EXPECT_THAT(cptest::message_of<capacity_error>([&] { d.forward(mlp, std::span(attention).first(8)); }),
              HasSubstr("attention holds 8 bytes, the plan needs " + std::to_string(s.attention_bytes)));
  EXPECT_THAT(cptest::message_of<capacity_error>([&] { d.forward(mlp, attention, std::span(staging).first(1)); }),
              HasSubstr("staging holds 1 bytes, the plan needs "));
  EXPECT_THAT(cptest::message_of<capacity_error>([&] { d.reverse(attention, std::span(replica).first(0)); }),
              HasSubstr("Dispatcher::reverse (rank 0 of 4): replica holds 0 bytes, the plan needs " + std::to_string(s.replica_bytes)));
  EXPECT_THAT(cptest::message_of<capacity_error>([&] { d.reverse_combine(attention, replica, std::span(grad).first(8), ElementType::float32); }),
              HasSubstr("Dispatcher::reverse_combine (rank 0 of 4): grad holds 8 bytes, the plan needs " + std::to_string(s.mlp_bytes)));
  using cpdispatch::invalid_input;
  Bytes big(s.mlp_bytes + s.attention_bytes);
  const auto first = std::span(big).first(s.mlp_bytes);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { d.forward(first, std::span(big).subspan(s.mlp_bytes - 1)); }),
              HasSubstr("mlp and attention overlap"));
  EXPECT_CALL(t, all_to_all_v);
  d.forward(first, std::span(big).subspan(s.mlp_bytes));  // adjacent is fine
  ::testing::Mock::VerifyAndClearExpectations(&t);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { d.forward(mlp, attention, std::span(attention)); }),
              HasSubstr("staging and attention overlap"));
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { d.reverse_combine(attention, replica, replica, ElementType::float32); }),
              HasSubstr("grad and replica overlap"));
  // Only the buffers the combine reads or writes as elements must be aligned: the exchange copies bytes.
  Bytes loose(s.attention_bytes + s.staging_bytes + 2);
  const auto unaligned_grad = std::span(loose).subspan(1, s.attention_bytes);
  const auto unaligned_staging = std::span(loose).subspan(s.attention_bytes + 2, s.staging_bytes);
  EXPECT_CALL(t, all_to_all_v);
  EXPECT_NO_THROW(d.reverse_combine(unaligned_grad, replica, grad, ElementType::float32, unaligned_staging));
  ::testing::Mock::VerifyAndClearExpectations(&t);
  Bytes loose_replica(s.replica_bytes + 1);
  EXPECT_THAT(cptest::message_of<invalid_input>(
                  [&] { d.reverse_combine(attention, std::span(loose_replica).subspan(1, s.replica_bytes), grad, ElementType::float32); }),
              HasSubstr("replica is not aligned to 4 bytes for float32"));
  Dispatcher odd(t, qkv.kv_fwd, qkv.kv_rev, 6);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { odd.reverse_combine(attention, replica, grad, ElementType::float32); }),
              HasSubstr("token_bytes = 6 is not a multiple of the 4-byte float32 element"));
  Dispatcher q(t, qkv.q_fwd, qkv.q_rev, 8);
  EXPECT_THAT(cptest::message_of<invalid_input>([&] { q.reverse_combine(attention, replica, grad, ElementType::float32); }),
              HasSubstr("no seq_recv_mask"));
}

}  // namespace
