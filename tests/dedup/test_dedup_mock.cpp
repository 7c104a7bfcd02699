// KvWireDispatcher on a strict mock transport, one rank at a time (the mock
// plays the other ranks): forward is exactly ONE all_to_all_v carrying the
// wire counts, reverse_combine (and reverse_combine_in_place) exactly ONE
// with the mirror counts, and the bytes and results match the global
// reference. Bad input reaches no transport call and writes nothing.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "dedup_cases.hpp"

namespace {

using cpdispatch::ElementType;
using cpdispatch::KvWireDispatcher;
using cpdispatch::Metadata;
using cpdispatch::testing::MockTransport;
using ::testing::_;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::InSequence;
using ::testing::StrictMock;
using Counts = std::span<const std::size_t>;
using V = std::vector<std::int32_t>;

constexpr std::size_t te = 2;  // int32 elements per token
constexpr std::size_t tb = te * sizeof(std::int32_t);

/// Global reference of one plan: every rank's buffers, int32 elements.
struct Reference {
  std::vector<V> mlp, wire, attention, dattn, wire_grad, grad;
};

Reference reference_of(const cpdispatch::QkvMetadata& meta, const cpdispatch::KvWireMetadata& w) {
  const auto W = static_cast<std::size_t>(meta.kv_fwd.world_size);
  Reference ref;
  ref.mlp.resize(W);
  ref.dattn.resize(W);
  ref.grad.resize(W);
  ref.wire_grad.resize(W);
  for (std::size_t r = 0; r < W; ++r) {
    ref.mlp[r].resize(static_cast<std::size_t>(meta.kv_fwd.send_tokens(static_cast<std::int64_t>(r))) * te);
    for (std::size_t i = 0; i < ref.mlp[r].size(); ++i) ref.mlp[r][i] = static_cast<std::int32_t>(100 * r + i + 1);
    ref.dattn[r].resize(static_cast<std::size_t>(meta.kv_fwd.num_recv_tokens(r, W)) * te);
    for (std::size_t i = 0; i < ref.dattn[r].size(); ++i) ref.dattn[r][i] = static_cast<std::int32_t>(7 * i + 3 * r + 1);
  }
  cpdispatch::simulate(w.fwd, ref.mlp, ref.wire, te);
  cpdispatch::simulate(meta.kv_fwd, ref.mlp, ref.attention, te);
  std::vector<V> replica;
  cpdispatch::simulate(meta.kv_rev, ref.dattn, replica, te);
  for (std::size_t r = 0; r < W; ++r) {
    ref.grad[r].resize(ref.mlp[r].size());
    cpdispatch::combine_copies<std::int32_t>(meta.kv_rev, static_cast<std::int64_t>(r), replica[r], ref.grad[r], te);
    const auto& fan = w.fan[r];  // the fan-in, written out
    ref.wire_grad[r].assign(static_cast<std::size_t>(fan.wire_tokens) * te, 0);
    for (std::size_t e = 0; e < fan.num_entries(); ++e)
      for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i)
        for (std::size_t x = 0; x < static_cast<std::size_t>(fan.seq_len[e]) * te; ++x)
          ref.wire_grad[r][static_cast<std::size_t>(fan.wire_offset[e]) * te + x] += ref.dattn[r][static_cast<std::size_t>(fan.attn_offset[i]) * te + x];
  }
  return ref;
}

/// The wire entries of `owner`'s wire buffer that come from `peer`: one run,
/// since the wire arrives in order of source rank.
V segment(const Metadata& wire_fwd, const V& buf, std::size_t owner, std::size_t peer) {
  std::size_t at = 0;
  for (std::size_t s = 0; s < peer; ++s) at += static_cast<std::size_t>(wire_fwd.num_recv_tokens(owner, s)) * te;
  const auto n = static_cast<std::size_t>(wire_fwd.num_recv_tokens(owner, peer)) * te;
  return V(buf.begin() + static_cast<std::ptrdiff_t>(at), buf.begin() + static_cast<std::ptrdiff_t>(at + n));
}

/// One exchange as seen by rank `me`: checks what it sends to each peer,
/// delivers what each peer sends it.
template <class Sent, class Delivered>
auto exchange_of(std::size_t me, Sent sent, Delivered delivered) {
  return [=](const void* send, Counts sc, Counts sd, void* recv, Counts rc, Counts rd) {
    for (std::size_t p = 0; p < sc.size(); ++p) {
      if (p == me) continue;
      V out(sc[p] / sizeof(std::int32_t));
      if (sc[p] > 0) std::memcpy(out.data(), static_cast<const std::byte*>(send) + sd[p], sc[p]);
      EXPECT_EQ(out, sent(p)) << me << " -> " << p;
      const V in = delivered(p);
      ASSERT_EQ(in.size() * sizeof(std::int32_t), rc[p]);
      if (!in.empty()) std::memcpy(static_cast<std::byte*>(recv) + rd[p], in.data(), rc[p]);
    }
  };
}

std::vector<std::size_t> counts(const Metadata& wire_fwd, std::size_t me, bool sending) {
  const auto W = static_cast<std::size_t>(wire_fwd.world_size);
  std::vector<std::size_t> c(W, 0);
  for (std::size_t p = 0; p < W; ++p) {
    if (p != me) c[p] = static_cast<std::size_t>(sending ? wire_fwd.num_recv_tokens(p, me) : wire_fwd.num_recv_tokens(me, p)) * tb;
  }
  return c;
}

std::span<std::byte> bytes(V& v) { return std::as_writable_bytes(std::span<std::int32_t>(v)); }
std::span<const std::byte> cbytes(const V& v) { return std::as_bytes(std::span<const std::int32_t>(v)); }

TEST(DedupMock, ForwardAndBackwardAreOneWireExchangeEach) {
  cpdispatch::Rng rng(9);
  std::vector<cpdispatch::QkvPlan> plans = {dedup_test::zigzag_plan(2, 2, 8), dedup_test::zigzag_plan(4, 1, 16)};
  for (int i = 0; i < 6; ++i) plans.push_back(dedup_test::random_plan(rng, 2 + i % 3, true));
  for (const auto& plan : plans) {
    const auto meta = cpdispatch::plan_qkv(plan);
    const auto w = cpdispatch::plan_kv_wire(meta);
    const Reference ref = reference_of(meta, w);
    const auto W = static_cast<std::size_t>(plan.world_size);
    for (std::size_t me = 0; me < W; ++me) {
      SCOPED_TRACE("W = " + std::to_string(W) + ", rank " + std::to_string(me));
      StrictMock<MockTransport> t(static_cast<int>(me), static_cast<int>(W));
      KvWireDispatcher<MockTransport> d(t, w, tb);
      const auto send = counts(w.fwd, me, true), recv = counts(w.fwd, me, false);
      {
        InSequence in_order;
        EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(send), _, _, ElementsAreArray(recv), _))
            .WillOnce(exchange_of(me, [&](std::size_t p) { return segment(w.fwd, ref.wire[p], p, me); },
                                  [&](std::size_t p) { return segment(w.fwd, ref.wire[me], me, p); }));
        EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(recv), _, _, ElementsAreArray(send), _))  // the mirror image, twice
            .Times(2)
            .WillRepeatedly(exchange_of(me, [&](std::size_t p) { return segment(w.fwd, ref.wire_grad[me], me, p); },
                                        [&](std::size_t p) { return segment(w.fwd, ref.wire_grad[p], p, me); }));
      }
      V attention(ref.attention[me].size(), -1), wire(ref.wire[me].size()), replica(d.required_bytes().replica_bytes / 4), grad(ref.grad[me].size());
      d.forward(cbytes(ref.mlp[me]), bytes(attention));
      EXPECT_EQ(attention, ref.attention[me]);
      d.reverse_combine(cbytes(ref.dattn[me]), bytes(wire), bytes(replica), bytes(grad), ElementType::int32);
      EXPECT_EQ(grad, ref.grad[me]);
      V consumed = ref.dattn[me], grad_in_place(grad.size());
      d.reverse_combine_in_place(bytes(consumed), bytes(replica), bytes(grad_in_place), ElementType::int32);
      EXPECT_EQ(grad_in_place, ref.grad[me]);
    }
  }
}

// ---- bad input: no transport call (StrictMock), nothing written -------------

struct BadInput : ::testing::Test {
  cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(dedup_test::zigzag_plan(2, 1, 8));
  cpdispatch::KvWireMetadata w = cpdispatch::plan_kv_wire(meta);
  StrictMock<MockTransport> t{0, 2};
};

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception: ") + e.what();
  }
  return "no exception";
}

TEST_F(BadInput, ShortBuffersNameTheBufferAndSizesAndWriteNothing) {
  KvWireDispatcher<MockTransport> d(t, w, tb);
  const auto& s = d.required_bytes();
  ASSERT_GT(s.wire_bytes, 0u);
  V short_mlp(s.mlp_bytes / 4 - 1, 1), attention(s.attention_bytes / 4, -9);
  EXPECT_THAT(message_of<cpdispatch::capacity_error>([&] { d.forward(cbytes(short_mlp), bytes(attention)); }),
              HasSubstr("KvWireDispatcher::forward (rank 0 of 2): mlp holds " + std::to_string(s.mlp_bytes - 4) +
                        " bytes, the plan needs " + std::to_string(s.mlp_bytes)));
  EXPECT_EQ(attention, V(attention.size(), -9));
  V mlp(s.mlp_bytes / 4, 1), short_attention(s.attention_bytes / 4 - 1, -9);
  EXPECT_THAT(message_of<cpdispatch::capacity_error>([&] { d.forward(cbytes(mlp), bytes(short_attention)); }),
              HasSubstr("attention holds " + std::to_string(s.attention_bytes - 4) + " bytes, the plan needs " + std::to_string(s.attention_bytes)));
  EXPECT_EQ(short_attention, V(short_attention.size(), -9));

  V wire(s.wire_bytes / 4, -9), short_wire(s.wire_bytes / 4 - 1, -9), replica(s.replica_bytes / 4, -9), grad(s.mlp_bytes / 4, -9);
  EXPECT_THAT(message_of<cpdispatch::capacity_error>(
                  [&] { d.reverse_combine(cbytes(attention), bytes(short_wire), bytes(replica), bytes(grad), ElementType::int32); }),
              HasSubstr("KvWireDispatcher::reverse_combine (rank 0 of 2): wire holds " + std::to_string(s.wire_bytes - 4) +
                        " bytes, the plan needs " + std::to_string(s.wire_bytes)));
  V short_replica(s.replica_bytes / 4 - 1, -9);
  EXPECT_THAT(message_of<cpdispatch::capacity_error>(
                  [&] { d.reverse_combine(cbytes(attention), bytes(wire), bytes(short_replica), bytes(grad), ElementType::int32); }),
              HasSubstr("replica holds " + std::to_string(s.replica_bytes - 4)));
  EXPECT_EQ(wire, V(wire.size(), -9)) << "the fan-in ran before the checks";
  EXPECT_EQ(short_wire, V(short_wire.size(), -9));
  EXPECT_EQ(grad, V(grad.size(), -9));
  EXPECT_EQ(short_replica, V(short_replica.size(), -9));
}

TEST_F(BadInput, ElementTypesTheFanInCannotSumAreRefused) {
  KvWireDispatcher<MockTransport> d(t, w, 6);  // 6-byte tokens: no whole int32 / float64
  const auto& s = d.required_bytes();
  std::vector<std::int64_t> buf(s.attention_bytes + s.wire_bytes + s.replica_bytes + s.mlp_bytes, 0);
  auto* base = reinterpret_cast<std::byte*>(buf.data());
  std::span<std::byte> attention(base, s.attention_bytes), wire(base + s.attention_bytes, s.wire_bytes);
  std::span<std::byte> replica(base + 8 * ((s.attention_bytes + s.wire_bytes) / 8 + 1), s.replica_bytes);
  std::span<std::byte> grad(base + 8 * ((s.attention_bytes + s.wire_bytes + s.replica_bytes) / 8 + 2), s.mlp_bytes);
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { d.reverse_combine(attention, wire, replica, grad, ElementType::float64); }),
              HasSubstr("token_bytes = 6 is not a multiple of the 8-byte float64 element"));
  KvWireDispatcher<MockTransport> d4(t, w, 8);
  EXPECT_THAT(message_of<cpdispatch::invalid_input>(
                  [&] { d4.reverse_combine(attention, wire.subspan(1), replica, grad, ElementType::float32); }),
              HasSubstr("wire is not aligned to 4 bytes for float32"));
}

TEST_F(BadInput, OverlappingBuffersAreRefused) {
  KvWireDispatcher<MockTransport> d(t, w, tb);
  const auto& s = d.required_bytes();
  V both((s.attention_bytes + s.mlp_bytes) / 4);
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { d.forward(cbytes(both), bytes(both)); }), HasSubstr("mlp and attention overlap"));
  V grads((s.attention_bytes + s.wire_bytes) / 4), replica(s.replica_bytes / 4), grad(s.mlp_bytes / 4);
  EXPECT_THAT(message_of<cpdispatch::invalid_input>(
                  [&] { d.reverse_combine(cbytes(grads), bytes(grads), bytes(replica), bytes(grad), ElementType::int32); }),
              HasSubstr("attention_grad and wire overlap"));
}

TEST_F(BadInput, AFanListThatDoesNotBelongToTheWireIsRefused) {
  cpdispatch::RankKvWire slice = w.get_slice(0);
  slice.fan.attn_offset[0] = slice.fan.attention_tokens;
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { KvWireDispatcher<MockTransport> d(t, slice, tb); }),
              HasSubstr("KvWireDispatcher (rank 0 of 2): fan.attn_offset[0] = " + std::to_string(slice.fan.attention_tokens)));
  slice = w.get_slice(0);
  slice.fan = w.fan[1];
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { KvWireDispatcher<MockTransport> d(t, slice, tb); }),
              HasSubstr("kv_wire_rev"));
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { KvWireDispatcher<MockTransport> d(t, w.get_slice(1), tb); }),
              HasSubstr("is the slice of rank 1 but the transport is rank 0"));
}

}  // namespace
