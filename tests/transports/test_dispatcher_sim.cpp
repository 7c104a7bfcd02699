// The dispatcher on the threaded sim transport gives byte-identical results to
// the global simulation (simulate() and combine_copies) for every rank, world
// sizes 1 to 16; the recording mock checks its calls while the data moves.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::SimOptions;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using cpdispatch::testing::RecordingTransport;
using cptest::Bytes;
using ::testing::_;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StrictMock;
using ::testing::Throw;

SimOptions guarded() { return SimOptions{std::chrono::milliseconds(60000)}; }

// The sim transport is a PieceTransport (one all_to_all_pieces per call, no
// staging); wrapped in the recording mock it is a plain Transport (pack, one
// all_to_all_v, unpack). Both paths run every case.
enum class Path { pieces, all_to_all_v };

struct SimDispatchParam {
  int world_size;
  Path path;
};

std::string name_of(const ::testing::TestParamInfo<SimDispatchParam>& info) {
  return "W" + std::to_string(info.param.world_size) + (info.param.path == Path::pieces ? "_pieces" : "_all_to_all_v");
}

/// Runs `body(dispatcher_transport)` on every rank of a world of W, through
/// the sim transport itself or through the recording mock around it.
template <class Body>
void run_on(int W, Path path, Body body) {
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    if (path == Path::pieces) {
      body(t);
    } else {
      ::testing::NiceMock<RecordingTransport<SimTransport>> recording(t);
      body(recording);
    }
  });
}

class SimDispatch : public ::testing::TestWithParam<SimDispatchParam> {};
INSTANTIATE_TEST_SUITE_P(Worlds, SimDispatch,
                         ::testing::ValuesIn([] {
                           std::vector<SimDispatchParam> params;
                           for (int W : {1, 2, 3, 4, 5, 8, 16})
                             for (Path p : {Path::pieces, Path::all_to_all_v}) params.push_back({W, p});
                           return params;
                         }()),
                         name_of);

TEST_P(SimDispatch, ByteIdenticalToTheGlobalSimulation) {
  const int W = GetParam().world_size;
  const auto U = static_cast<std::size_t>(W);
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    for (const auto& c : cptest::pair_cases(W, seed)) {
      for (std::size_t tb : {std::size_t{1}, std::size_t{12}}) {
        SCOPED_TRACE(c.name + " seed " + std::to_string(seed) + " token_bytes " + std::to_string(tb));
        const auto mlp = cptest::inputs_for(W, tb, seed, [&](int r) { return c.fwd.send_tokens(r); });
        const auto attention_in = cptest::inputs_for(W, tb, seed + 7, [&](int r) { return c.rev.send_tokens(r); });
        const auto expect_attention = cptest::simulate_bytes(c.fwd, mlp, tb);
        const auto expect_replica = cptest::simulate_bytes(c.rev, attention_in, tb);
        std::vector<Bytes> attention(U), replica(U), attention_staged(U), replica_staged(U);
        run_on(W, GetParam().path, [&](auto& t) {
          const auto r = static_cast<std::size_t>(t.rank());
          Dispatcher d(t, c.fwd, c.rev, tb);
          const auto& s = d.required_bytes();
          if (GetParam().path == Path::pieces) {
            EXPECT_EQ(s.staging_bytes, 0u);
          }
          attention[r].assign(s.attention_bytes, std::byte{0xA5});
          replica[r].assign(s.replica_bytes, std::byte{0xA5});
          d.forward(mlp[r], attention[r]);
          d.reverse(attention_in[r], replica[r]);
          // Again, with caller-owned staging (in a larger buffer).
          Bytes staging(s.staging_bytes + 5);
          attention_staged[r].assign(s.attention_bytes, std::byte{0xA5});
          replica_staged[r].assign(s.replica_bytes, std::byte{0xA5});
          d.forward(mlp[r], attention_staged[r], staging);
          d.reverse(attention_in[r], replica_staged[r], staging);
        });
        for (std::size_t r = 0; r < U; ++r) {
          EXPECT_EQ(attention[r], expect_attention[r]) << "forward, rank " << r;
          EXPECT_EQ(replica[r], expect_replica[r]) << "reverse, rank " << r;
          EXPECT_EQ(attention_staged[r], expect_attention[r]) << "forward with staging, rank " << r;
          EXPECT_EQ(replica_staged[r], expect_replica[r]) << "reverse with staging, rank " << r;
        }
      }
    }
  }
}

TEST_P(SimDispatch, KvBackwardCombineMatchesTheGlobalCombine) {
  const int W = GetParam().world_size;
  const auto U = static_cast<std::size_t>(W);
  const std::size_t tb = 16;
  for (std::uint64_t seed : {4u, 5u}) {
    for (const auto& c : cptest::pair_cases(W, seed)) {
      if (!c.kv) continue;
      for (auto type : {ElementType::float32, ElementType::float64, ElementType::bfloat16, ElementType::float16}) {
        SCOPED_TRACE(c.name + " seed " + std::to_string(seed) + " " + cpdispatch::element_name(type));
        std::vector<Bytes> grads;
        for (int r = 0; r < W; ++r) grads.push_back(cptest::float_pattern(static_cast<std::size_t>(c.rev.send_tokens(r)) * tb, seed + static_cast<std::uint64_t>(r), type));
        const auto expect_replica = cptest::simulate_bytes(c.rev, grads, tb, std::byte{0});
        std::vector<Bytes> expect_grad(U), replica(U), grad(U);
        for (std::size_t r = 0; r < U; ++r) {
          expect_grad[r].assign(static_cast<std::size_t>(c.fwd.send_tokens(static_cast<std::int64_t>(r))) * tb, std::byte{0});
          cpdispatch::combine_copies(c.rev.get_slice(static_cast<std::int64_t>(r)), expect_replica[r], expect_grad[r], tb, type);
        }
        run_on(W, GetParam().path, [&](auto& t) {
          const auto r = static_cast<std::size_t>(t.rank());
          Dispatcher d(t, c.fwd, c.rev, tb);
          replica[r].assign(d.required_bytes().replica_bytes, std::byte{0});
          grad[r].assign(d.required_bytes().mlp_bytes, std::byte{0x77});
          d.reverse_combine(grads[r], replica[r], grad[r], type);
        });
        for (std::size_t r = 0; r < U; ++r) {
          EXPECT_EQ(replica[r], expect_replica[r]) << "rank " << r;
          EXPECT_EQ(grad[r], expect_grad[r]) << "rank " << r;
        }
      }
    }
  }
}

// What the combine means: forward KV, every copy's gradient = 1 -> each
// shard's gradient is its number of copies.
TEST(SimDispatchSemantics, CombineSumsTheCopiesOfEachShard) {
  const int W = 4;
  const auto qkv = cptest::random_qkv(W, 9, 64, 4);
  const std::size_t elems = 3, tb = elems * sizeof(float);
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    Dispatcher kv(t, qkv.kv_fwd, qkv.kv_rev, tb);
    const auto& s = kv.required_bytes();
    std::vector<float> ones(s.attention_bytes / sizeof(float), 1.0f), replica(s.replica_bytes / sizeof(float)),
        grad(s.mlp_bytes / sizeof(float), -1.0f);
    kv.reverse_combine(std::as_bytes(std::span(ones)), std::as_writable_bytes(std::span(replica)), std::as_writable_bytes(std::span(grad)),
                       ElementType::float32);
    const auto slice = qkv.kv_fwd.get_slice(r);
    std::size_t at = 0;
    for (std::size_t g = 0; g < slice.seq_len.size(); ++g) {
      float copies = 0;
      for (std::size_t c = 0; c < slice.num_copies; ++c) copies += slice.dst_rank[g * slice.num_copies + c] >= 0 ? 1.0f : 0.0f;
      for (std::size_t i = 0; i < static_cast<std::size_t>(slice.seq_len[g]) * elems; ++i, ++at) ASSERT_EQ(grad[at], copies) << "rank " << r << " shard " << g;
    }
  });
}

// The recording mock: gMock checks the calls, the sim moves the data.
TEST(SimDispatchRecorded, OneAllToAllPerCallWithTheMetadataCounts) {
  const int W = 5;
  const std::size_t tb = 8;
  const auto qkv = cptest::random_qkv(W, 21);
  const auto mlp = cptest::inputs_for(W, tb, 3, [&](int r) { return qkv.q_fwd.send_tokens(r); });
  const auto expect = cptest::simulate_bytes(qkv.q_fwd, mlp, tb);
  SimWorld world(W, guarded());
  world.run([&](SimTransport& sim) {
    const int r = sim.rank();
    StrictMock<RecordingTransport<SimTransport>> t(sim);
    const auto send = cptest::forward_send_counts(qkv.q_fwd, r, tb), recv = cptest::forward_recv_counts(qkv.q_fwd, r, tb);
    ::testing::InSequence in_order;
    EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(send), _, _, ElementsAreArray(recv), _));
    EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(recv), _, _, ElementsAreArray(send), _));
    Dispatcher d(t, qkv.q_fwd, qkv.q_rev, tb);
    Bytes attention(d.required_bytes().attention_bytes), back(d.required_bytes().replica_bytes);
    d.forward(mlp[static_cast<std::size_t>(r)], attention);
    EXPECT_EQ(attention, expect[static_cast<std::size_t>(r)]);
    d.reverse(attention, back);
    EXPECT_EQ(back, mlp[static_cast<std::size_t>(r)]);  // forward then reverse is the identity for queries
  });
}

// Every rank's transport fails once: each rank sees the error with its
// context, then the same dispatchers complete the exchange.
TEST(SimDispatchRecorded, DispatchersStayUsableAfterATransportError) {
  const int W = 4;
  const std::size_t tb = 4;
  const auto qkv = cptest::random_qkv(W, 22);
  const auto mlp = cptest::inputs_for(W, tb, 4, [&](int r) { return qkv.kv_fwd.send_tokens(r); });
  const auto expect = cptest::simulate_bytes(qkv.kv_fwd, mlp, tb);
  SimWorld world(W, guarded());
  world.run([&](SimTransport& sim) {
    const int r = sim.rank();
    StrictMock<RecordingTransport<SimTransport>> t(sim);
    EXPECT_CALL(t, all_to_all_v).WillOnce(Throw(cpdispatch::backend_error("injected", 5))).WillRepeatedly(::testing::DoDefault());
    Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, tb);
    Bytes attention(d.required_bytes().attention_bytes, std::byte{0xA5});
    EXPECT_THAT(cptest::message_of<cpdispatch::backend_error>([&] { d.forward(mlp[static_cast<std::size_t>(r)], attention); }),
                HasSubstr("Dispatcher::forward (rank " + std::to_string(r) + " of 4): all_to_all_v failed: injected"));
    d.forward(mlp[static_cast<std::size_t>(r)], attention);
    EXPECT_EQ(attention, expect[static_cast<std::size_t>(r)]);
  });
}

// Failing ranks do not hang the others: a rank whose buffer is too small
// throws before its collective; the rest are released and run() names it.
TEST(SimDispatchFailure, ARankWithAShortBufferFailsTheWorldWithoutAHang) {
  const int W = 4;
  const auto qkv = cptest::random_qkv(W, 23);
  SimWorld world(W);  // no timeout: the release must not depend on one
  try {
    world.run([&](SimTransport& t) {
      Dispatcher d(t, qkv.q_fwd, qkv.q_rev, 4);
      Bytes mlp(d.required_bytes().mlp_bytes), attention(t.rank() == 2 ? 0 : d.required_bytes().attention_bytes);
      d.forward(mlp, attention);
    });
    ADD_FAILURE() << "run() did not throw";
  } catch (const cpdispatch::capacity_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("SimWorld rank 2 of 4: Dispatcher::forward (rank 2 of 4): attention holds 0 bytes"));
  }
}

}  // namespace
