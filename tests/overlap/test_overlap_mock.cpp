// Call sequences of the overlapped GEMM, checked with the gMock transport and
// a gMock GEMM backend: which transport calls each method makes, in which
// order, and how they interleave with the GEMM calls (gMock's .After checks
// the order across the two threads). Also every error, with its message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "cpdispatch/overlap/overlap.hpp"
#include "cpdispatch/testing/mock_transport.hpp"

namespace ov = cpdispatch::overlap;
using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using cpdispatch::Request;
using cpdispatch::testing::MockTransport;
using ov::CommOverlapMethod;
using ov::CommOverlapType;
using ov::HelperThread;
using cpdispatch::gemm::Transpose;
using testing::_;
using testing::Expectation;
using testing::HasSubstr;
using testing::InSequence;
using testing::Return;
using testing::Sequence;
using testing::StrictMock;

namespace {

/// A GEMM backend whose gemm is a mock (the element-wise kernels are the host ones).
struct MockGemm : cpdispatch::gemm::HostKernels {
  MOCK_METHOD(void, gemm,
              (Transpose ta, Transpose tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
               std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc));
};
static_assert(cpdispatch::gemm::GemmBackend<MockGemm, float>);

int mod(int x, int m) { return ((x % m) + m) % m; }

// Slow mock actions widen the window in which a missing synchronisation would
// show: a GEMM step that did not wait for its shard runs while the receive's
// wait still sleeps, and gMock reports the unsatisfied .After. A loaded
// machine can only hide such a bug, never fail a correct implementation.
auto slow_wait() {
  return [](Request) { std::this_thread::sleep_for(std::chrono::milliseconds(10)); };
}
auto slow_gemm() {
  return [](auto&&...) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); };
}

/// Runs `f` and returns the cpdispatch::invalid_input message it throws ("" and a failure when none).
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  ADD_FAILURE() << "no cpdispatch::invalid_input was thrown";
  return "";
}

class OverlapMock : public testing::TestWithParam<HelperThread> {
 protected:
  ov::CommOverlapOptions options(int num_splits = 1) const {
    ov::CommOverlapOptions o;
    o.num_splits = num_splits;
    o.helper_thread = GetParam();
    o.tag = 42;
    return o;
  }
};

INSTANTIATE_TEST_SUITE_P(HelperThreads, OverlapMock, testing::Values(HelperThread::communication, HelperThread::gemm),
                         [](const testing::TestParamInfo<HelperThread>& info) {
                           return info.param == HelperThread::communication ? "CommOnHelper" : "GemmOnHelper";
                         });

}  // namespace

TEST_P(OverlapMock, RingExchangeAllGatherSendsNextReceivesPreviousEachStepInterleavedWithTheGemms) {
  const int tp = 4, rank = 1;
  const std::size_t ml = 3, k = 5, n = 2, bytes = ml * k * sizeof(float);
  StrictMock<MockTransport> t(rank, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {tp * ml, k}, ElementType::float32, tp,
                               options());
  std::vector<float> shard(ml * k, 2.5f), b(k * n), d(tp * ml * n);
  float* gathered = buffer.view<float>().data();
  auto slot = [&](int p) { return gathered + static_cast<std::size_t>(p) * ml * k; };

  Sequence transport_order, gemm_order;
  std::vector<Expectation> received;
  for (int i = 0; i + 1 < tp; ++i) {  // tp - 1 steps: receive from rank - 1, send to rank + 1
    EXPECT_CALL(t, irecv(slot(mod(rank - i - 1, tp)), bytes, mod(rank - 1, tp), 42))
        .InSequence(transport_order)
        .WillOnce(Return(Request{200u + static_cast<unsigned>(i)}));
    EXPECT_CALL(t, isend(slot(mod(rank - i, tp)), bytes, mod(rank + 1, tp), 42))
        .InSequence(transport_order)
        .WillOnce(Return(Request{100u + static_cast<unsigned>(i)}));
    received.push_back(
        EXPECT_CALL(t, wait(Request{200u + static_cast<unsigned>(i)})).InSequence(transport_order).WillOnce(slow_wait()));
    EXPECT_CALL(t, wait(Request{100u + static_cast<unsigned>(i)})).InSequence(transport_order);
  }
  for (int i = 0; i < tp; ++i) {  // step i multiplies shard (rank - i) mod tp, the local one first
    const int c = mod(rank - i, tp);
    auto& step = EXPECT_CALL(gemm, gemm(Transpose::no, Transpose::no, ml, n, k, 1.0f, slot(c), k, b.data(), n, 0.0f,
                                        d.data() + static_cast<std::size_t>(c) * ml * n, n))
                     .InSequence(gemm_order);
    if (i > 0) step.After(received[static_cast<std::size_t>(i - 1)]);  // only once its shard has arrived
  }
  ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(shard.data(), ml, k), Transpose::no,
                ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::matrix_view(d.data(), tp * ml, n));
  // The local shard went to its own slot before anything was sent.
  EXPECT_EQ(std::vector<float>(slot(rank), slot(rank) + ml * k), shard);
}

TEST_P(OverlapMock, PipelineIssuesOneReduceScatterPerChunkInChunkOrderAfterThatChunksGemms) {
  const int tp = 2, rank = 0, splits = 3;
  const std::size_t h = 2, m = tp * splits * h, block = m / tp, k = 3, n = 4;
  StrictMock<MockTransport> t(rank, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {m, n}, ElementType::float32, tp,
                               options(splits));
  std::vector<float> a(k * m), b(n * k), rs(block * n);  // A stored k x m (transa), B stored n x k (transb)
  float* out = buffer.view<float>().data();

  Sequence gemm_order, rs_order;
  for (int i = 0; i < splits; ++i) {
    const auto ui = static_cast<std::size_t>(i);
    testing::ExpectationSet chunk;
    for (std::size_t p = 0; p < tp; ++p) {  // rows [p*block + i*h, +h) of op(A) = columns of A
      chunk += EXPECT_CALL(gemm, gemm(Transpose::yes, Transpose::yes, h, n, k, 1.0f, a.data() + p * block + ui * h, m,
                                      b.data(), k, 0.0f, out + (ui * tp + p) * h * n, n))
                   .InSequence(gemm_order)
                   .WillOnce(slow_gemm());
    }
    EXPECT_CALL(t, reduce_scatter(out + ui * tp * h * n, rs.data() + ui * h * n, h * n, ElementType::float32, ReduceOp::sum))
        .InSequence(rs_order)
        .After(chunk);
  }
  ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), k, m), Transpose::yes,
                ov::matrix_view<const float>(b.data(), n, k), Transpose::yes, ov::MatrixView<float>{},
                ov::matrix_view(rs.data(), block, n));
}

TEST_P(OverlapMock, RingExchangeReduceScatterSendsEachPartialOnceComputedOwnPartialLast) {
  const int tp = 3, rank = 0;
  const std::size_t block = 2, m = tp * block, k = 3, n = 2, bytes = block * n * sizeof(float);
  StrictMock<MockTransport> t(rank, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {m, n}, ElementType::float32, tp,
                               options());
  std::vector<float> a(m * k), b(k * n), rs(block * n);
  float* partial = buffer.view<float>().data();
  float* staged = buffer.staging<float>().data();
  ASSERT_EQ(buffer.staging<float>().size(), (tp - 1) * block * n);

  Sequence gemm_order, transport_order;
  for (int s = 0; s < tp; ++s) {  // peers rank+1, rank+2, ..., then the rank itself
    const int p = s + 1 < tp ? mod(rank + s + 1, tp) : rank;
    const auto up = static_cast<std::size_t>(p);
    Expectation computed = EXPECT_CALL(gemm, gemm(Transpose::no, Transpose::no, block, n, k, 1.0f, a.data() + up * block * k,
                                                  k, b.data(), n, 0.0f, partial + up * block * n, n))
                               .InSequence(gemm_order)
                               .WillOnce(slow_gemm());
    if (s + 1 == tp) break;
    const auto us = static_cast<std::size_t>(s);
    EXPECT_CALL(t, irecv(staged + us * block * n, bytes, mod(rank - s - 1, tp), 42))
        .InSequence(transport_order)
        .WillOnce(Return(Request{10u + us}));
    EXPECT_CALL(t, isend(partial + up * block * n, bytes, p, 42))
        .InSequence(transport_order)
        .After(computed)
        .WillOnce(Return(Request{20u + us}));
    EXPECT_CALL(t, wait(Request{10u + us})).InSequence(transport_order);
    EXPECT_CALL(t, wait(Request{20u + us})).InSequence(transport_order);
  }
  ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), m, k), Transpose::no,
                ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::MatrixView<float>{},
                ov::matrix_view(rs.data(), block, n));
}

TEST_P(OverlapMock, BulkIssuesExactlyOneCollective) {
  const int tp = 4, rank = 2;
  const std::size_t rows = 8, cols = 3, m = 5, k = 2, n = 6;
  StrictMock<MockTransport> t(rank, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::BULK, {rows, cols}, ElementType::float32, tp, options());
  std::vector<float> a(m * k), b(k * n), d(m * n), rs(rows / tp * cols);
  EXPECT_CALL(t, reduce_scatter(buffer.data(), rs.data(), rows / tp * cols, ElementType::float32, ReduceOp::sum)).Times(1);
  EXPECT_CALL(gemm, gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, d.data(), n)).Times(1);
  ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), m, k), Transpose::no,
                ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::matrix_view(d.data(), m, n),
                ov::matrix_view(rs.data(), rows / tp, cols));
}

// One helper thread per buffer, reused by every call: the side on the helper
// runs on the same kernel thread each time (thread ids, unlike std::thread::id,
// are not reused soon after a thread ends), never on the caller's.
TEST_P(OverlapMock, EveryCallOfABufferRunsOnTheSameHelperThread) {
  const int tp = 2, rank = 0;
  const std::size_t rows = 4, cols = 3, m = 2, k = 2, n = 2;
  StrictMock<MockTransport> t(rank, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::BULK, {rows, cols}, ElementType::float32, tp, options());
  std::vector<float> a(m * k), b(k * n), d(m * n), rs(rows / tp * cols);
  std::vector<long> helper_tids;
  const bool comm_on_helper = GetParam() == HelperThread::communication;
  auto record = [&] { helper_tids.push_back(static_cast<long>(::syscall(SYS_gettid))); };
  EXPECT_CALL(t, reduce_scatter(_, _, _, _, _)).Times(3).WillRepeatedly([&](auto&&...) { if (comm_on_helper) record(); });
  EXPECT_CALL(gemm, gemm(_, _, _, _, _, _, _, _, _, _, _, _, _)).Times(3).WillRepeatedly([&](auto&&...) {
    if (!comm_on_helper) record();
  });
  for (int call = 0; call < 3; ++call) {
    ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), m, k), Transpose::no,
                  ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::matrix_view(d.data(), m, n),
                  ov::matrix_view(rs.data(), rows / tp, cols));
  }
  ASSERT_EQ(helper_tids.size(), 3u);
  EXPECT_EQ(helper_tids[0], helper_tids[1]);
  EXPECT_EQ(helper_tids[1], helper_tids[2]);
  EXPECT_NE(helper_tids[0], static_cast<long>(::syscall(SYS_gettid)));
}

TEST(OverlapMockNone, NoneIssuesNoCollective) {
  StrictMock<MockTransport> t(1, 4);  // no expectation: any transport call fails the test
  StrictMock<MockGemm> gemm;
  ov::CommOverlapRegistry registry;
  std::vector<float> a(3 * 2), b(3 * 4), d(2 * 4);  // A stored 3 x 2 (transa): op(A) is 2 x 3
  EXPECT_CALL(gemm, gemm(Transpose::yes, Transpose::no, 2u, 4u, 3u, 1.0f, a.data(), 2u, b.data(), 4u, 0.0f, d.data(), 4u))
      .Times(2);
  ov::comm_gemm(t, gemm, ov::matrix_view<const float>(a.data(), 3, 2), Transpose::yes,
                ov::matrix_view<const float>(b.data(), 3, 4), Transpose::no, ov::matrix_view(d.data(), 2, 4));
  // By id: NONE NONE does not look the id up.
  ov::comm_gemm(t, gemm, registry, CommOverlapType::NONE, CommOverlapMethod::NONE, 12345,
                ov::matrix_view<const float>(a.data(), 3, 2), Transpose::yes, ov::matrix_view<const float>(b.data(), 3, 4),
                Transpose::no, ov::matrix_view(d.data(), 2, 4));
}

// ---- failures during the call --------------------------------------------------

TEST_P(OverlapMock, AFailingReduceScatterIsRethrownAfterTheGemmSideStops) {
  const int tp = 2;
  const std::size_t m = 8, k = 2, n = 2;
  StrictMock<MockTransport> t(0, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {m, n}, ElementType::float32, tp, options(2));
  std::vector<float> a(m * k), b(k * n), rs(m / tp * n);
  EXPECT_CALL(t, reduce_scatter(_, _, _, _, _)).WillOnce(testing::Throw(cpdispatch::backend_error("link down", 7)));
  EXPECT_CALL(gemm, gemm(_, _, _, _, _, _, _, _, _, _, _, _, _)).Times(testing::Between(2, 4));  // chunk 1, maybe chunk 2
  try {
    ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), m, k), Transpose::no,
                  ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::MatrixView<float>{},
                  ov::matrix_view(rs.data(), m / tp, n));
    ADD_FAILURE() << "no exception";
  } catch (const cpdispatch::backend_error& e) {
    EXPECT_EQ(e.code(), 7);
    EXPECT_STREQ(e.what(), "link down");
  }
}

TEST_P(OverlapMock, AFailingReceiveStopsTheRingBeforeTheShardIsUsed) {
  const int tp = 3;
  const std::size_t ml = 2, k = 2, n = 2;
  StrictMock<MockTransport> t(0, tp);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapBuffer buffer(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {tp * ml, k}, ElementType::float32, tp,
                               options());
  std::vector<float> shard(ml * k), b(k * n), d(tp * ml * n);
  EXPECT_CALL(t, irecv(_, _, 2, 42)).WillOnce(testing::Throw(cpdispatch::backend_error("peer gone", 3)));
  EXPECT_CALL(gemm, gemm(_, _, _, _, _, _, _, _, _, _, _, _, _)).Times(testing::AtMost(1));  // the local shard only
  EXPECT_THROW(ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(shard.data(), ml, k), Transpose::no,
                             ov::matrix_view<const float>(b.data(), k, n), Transpose::no, ov::matrix_view(d.data(), tp * ml, n)),
               cpdispatch::backend_error);
}

// ---- errors: raised before any transport call (StrictMock: none expected) -------

TEST(OverlapErrors, UnsupportedCombinationsHaveTheSeedsMessages) {
  EXPECT_THAT(message_of([] { ov::CommOverlapBuffer(CommOverlapType::AG, CommOverlapMethod::BULK, {4, 4}, ElementType::float32, 2); }),
              HasSubstr("AllGather with bulk overlap not supported (comm_type AG, method BULK; AG takes RING_EXCHANGE)"));
  EXPECT_THAT(
      message_of([] { ov::CommOverlapBuffer(CommOverlapType::AG, CommOverlapMethod::PIPELINE, {4, 4}, ElementType::float32, 2); }),
      HasSubstr("pipeline overlap is only supported for ReduceScatter (comm_type AG, method PIPELINE"));
  EXPECT_THAT(
      message_of([] { ov::CommOverlapBuffer(CommOverlapType::NONE, CommOverlapMethod::PIPELINE, {4, 4}, ElementType::float32, 2); }),
      HasSubstr("Invalid collective type: method PIPELINE overlaps a collective, expected RS or AG, got NONE"));
  EXPECT_THAT(
      message_of([] { ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::NONE, {4, 4}, ElementType::float32, 2); }),
      HasSubstr("Invalid collective type: method NONE runs a plain GEMM, so the collective type must be NONE, got RS"));
  EXPECT_THAT(
      message_of([] { ov::CommOverlapBuffer(CommOverlapType::NONE, CommOverlapMethod::NONE, {4, 4}, ElementType::float32, 2); }),
      HasSubstr("Invalid collective type: method NONE runs a plain GEMM and needs no buffer (expected RS or AG, got NONE)"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(static_cast<CommOverlapType>(7), CommOverlapMethod::BULK, {4, 4}, ElementType::float32, 2);
              }),
              HasSubstr("Invalid collective type: expected NONE, RS or AG, got CommOverlapType(7)"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(CommOverlapType::RS, static_cast<CommOverlapMethod>(9), {4, 4}, ElementType::float32, 2);
              }),
              HasSubstr("invalid overlap method: expected NONE, BULK, PIPELINE or RING_EXCHANGE, got CommOverlapMethod(9)"));
}

TEST(OverlapErrors, ScalingModesOtherThanNoScalingAreNotSupported) {
  for (auto mode : {ov::ScalingMode::DELAYED_TENSOR_SCALING, ov::ScalingMode::CURRENT_TENSOR_SCALING,
                    ov::ScalingMode::MXFP8_1D_SCALING}) {
    ov::CommOverlapOptions o;
    o.scaling_mode = mode;
    EXPECT_THAT(message_of([&] {
                  ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 4}, ElementType::float32, 2, o);
                }),
                HasSubstr("scaling mode " + ov::to_string(mode) + " is not supported (expected NO_SCALING)"));
  }
}

TEST(OverlapErrors, AtomicGemmRequiresTheCudaBackend) {
  StrictMock<MockTransport> t(0, 2);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapOptions o;
  o.atomic_gemm = true;
  o.num_splits = 2;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {4, 2}, ElementType::float32, 2, o);
  EXPECT_TRUE(buffer.atomic_gemm());
  std::vector<float> a(4 * 2), b(2 * 2), rs(2 * 2);
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), 4, 2), Transpose::no,
                              ov::matrix_view<const float>(b.data(), 2, 2), Transpose::no, ov::MatrixView<float>{},
                              ov::matrix_view(rs.data(), 2, 2));
              }),
              HasSubstr("atomic GEMM requires the CUDA backend (the buffer has atomic_gemm = true, expected false"));
}

TEST(OverlapErrors, BufferSizeIsIncorrect) {
  StrictMock<MockTransport> t(0, 2);
  StrictMock<MockGemm> gemm;
  std::vector<float> a(6 * 5), b(5 * 4), d(12 * 4), rs(3 * 4);
  // AG: 2 shards of op(A) = 6 x 5 need a 12 x 5 buffer.
  ov::CommOverlapBuffer ag(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {10, 5}, ElementType::float32, 2);
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, ag, ov::matrix_view<const float>(a.data(), 6, 5), Transpose::no,
                              ov::matrix_view<const float>(b.data(), 5, 4), Transpose::no, ov::matrix_view(d.data(), 12, 4));
              }),
              HasSubstr("Buffer size is incorrect: AG RING_EXCHANGE puts the all-gathered op(A) (tp_size shards of op(A)) in the "
                        "buffer: expected 12 x 5 = 60 elements, got 10 x 5 = 50 elements"));
  // RS RING_EXCHANGE: the 6 x 4 GEMM output must be the buffer's shape, not only its size.
  ov::CommOverlapBuffer rs_buffer(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {4, 6}, ElementType::float32, 2);
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, rs_buffer, ov::matrix_view<const float>(a.data(), 6, 5), Transpose::no,
                              ov::matrix_view<const float>(b.data(), 5, 4), Transpose::no, ov::MatrixView<float>{},
                              ov::matrix_view(rs.data(), 3, 4));
              }),
              HasSubstr("Buffer size is incorrect: RS RING_EXCHANGE puts the GEMM output op(A) x op(B) in the buffer: expected "
                        "6 x 4 = 24 elements, got 4 x 6 = 24 elements"));
  // Filling a buffer with the wrong number of elements.
  ov::CommOverlapBuffer bulk(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 6}, ElementType::float32, 2);
  std::vector<float> fill(23);
  EXPECT_THAT(message_of([&] { bulk.copy_into(std::span<const float>(fill)); }),
              HasSubstr("Buffer size is incorrect: expected 24 elements (4 x 6), got 23"));
}

TEST(OverlapErrors, ShapesTypesAndTpSize) {
  StrictMock<MockTransport> t(0, 2);
  StrictMock<MockGemm> gemm;
  std::vector<float> a(4 * 3), b(3 * 2), rs(2 * 2), d(4 * 2);
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {4, 2}, ElementType::float32, 2);
  auto call = [&](ov::CommOverlapBuffer& buf, ov::MatrixView<const float> av, ov::MatrixView<const float> bv,
                  ov::MatrixView<float> dv, ov::MatrixView<float> rv) {
    return message_of([&] { ov::comm_gemm(t, gemm, buf, av, Transpose::no, bv, Transpose::no, dv, rv); });
  };
  const auto A = ov::matrix_view<const float>(a.data(), 4, 3);
  const auto B = ov::matrix_view<const float>(b.data(), 3, 2);
  const auto RS = ov::matrix_view(rs.data(), 2, 2);
  EXPECT_THAT(call(buffer, A, ov::matrix_view<const float>(b.data(), 2, 3), {}, RS),
              HasSubstr("op(A) is 4 x 3 and op(B) is 2 x 3: the inner dimensions must agree (expected op(B) with 3 rows, got 2)"));
  EXPECT_THAT(call(buffer, A, B, ov::matrix_view(d.data(), 4, 2), RS),
              HasSubstr("D is not used by RS RING_EXCHANGE (the GEMM output is the buffer), expected an empty view ({}), got 4 x 2"));
  EXPECT_THAT(call(buffer, A, B, {}, ov::matrix_view(rs.data(), 1, 4)),
              HasSubstr("rs_output is 1 x 4, expected 2 x 2"));
  EXPECT_THAT(call(buffer, A, B, {}, ov::MatrixView<float>{nullptr, 2, 2}), HasSubstr("rs_output is null (2 x 2 expected)"));
  EXPECT_THAT(call(buffer, A, B, {}, ov::matrix_view(buffer.view<float>().data() + 2, 2, 2)),
              HasSubstr("rs_output and the buffer overlap in memory"));
  // The buffer's tp_size must be the transport's world size.
  StrictMock<MockTransport> four(0, 4);
  EXPECT_THAT(message_of([&] { ov::comm_gemm(four, gemm, buffer, A, Transpose::no, B, Transpose::no, {}, RS); }),
              HasSubstr("the buffer's tp_size = 2 does not match the transport's world_size() = 4"));
  // dtype: a float64 buffer with a float GEMM.
  ov::CommOverlapBuffer doubles(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {4, 2}, ElementType::float64, 2);
  EXPECT_THAT(call(doubles, A, B, {}, RS),
              HasSubstr("CommOverlapBuffer::comm_gemm: the buffer's dtype is float64, the element type asked for is float32"));
  // AG: rs_output is not used.
  ov::CommOverlapBuffer ag(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {8, 3}, ElementType::float32, 2);
  std::vector<float> dag(8 * 2);
  EXPECT_THAT(call(ag, A, B, ov::matrix_view(dag.data(), 8, 2), RS),
              HasSubstr("rs_output is not used by AG RING_EXCHANGE, expected an empty view ({}), got 2 x 2"));
}

TEST(OverlapErrors, BufferCreationValidatesShapeDtypeAndSizes) {
  const std::vector<std::size_t> three_d{2, 2, 2};
  EXPECT_THAT(message_of([&] {
                ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, three_d, ElementType::float32, 2);
              }),
              HasSubstr("buffer_shape has 3 dimensions, expected 2 (rows, cols)"));
  EXPECT_THAT(message_of([] { ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 0}, ElementType::float32, 2); }),
              HasSubstr("buffer_shape [4, 0] has an empty dimension"));
  EXPECT_THAT(message_of([] { ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 4}, ElementType::float32, 0); }),
              HasSubstr("tp_size = 0 must be at least 1"));
  EXPECT_THAT(message_of([] { ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 4}, ElementType::bfloat16, 2); }),
              HasSubstr("dtype bfloat16 is not supported (expected float32 or float64"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {4, 4}, ElementType::float32, 2,
                                      ov::CommOverlapOptions{.num_splits = 0});
              }),
              HasSubstr("num_splits = 0 must be at least 1 for PIPELINE"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {12, 4}, ElementType::float32, 2,
                                      ov::CommOverlapOptions{.num_splits = 4});
              }),
              HasSubstr("buffer_shape[0] = 12 is not divisible by tp_size * num_splits = 2 * 4 = 8"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {10, 4}, ElementType::float32, 4);
              }),
              HasSubstr("buffer_shape[0] = 10 is not divisible by tp_size = 4 (AG RING_EXCHANGE splits the rows into one block per rank)"));
  EXPECT_THAT(message_of([] {
                ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::BULK, {SIZE_MAX / 2, 4}, ElementType::float32, 1);
              }),
              HasSubstr("more elements than memory can address"));
}

TEST(OverlapErrors, IdsOfDestroyedOrUnknownBuffersAreRejected) {
  StrictMock<MockTransport> t(0, 1);
  StrictMock<MockGemm> gemm;
  ov::CommOverlapRegistry registry;
  EXPECT_THAT(message_of([&] { registry.get(1); }), HasSubstr("buffer id 1 is unknown (ids issued so far: none)"));
  const auto first = registry.create(CommOverlapType::RS, CommOverlapMethod::BULK, {2, 2}, ElementType::float32, 1);
  const auto second = registry.create(CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, {2, 2}, ElementType::float32, 1);
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 2);
  EXPECT_EQ(registry.size(), 2u);
  registry.destroy(first);
  EXPECT_THAT(message_of([&] { registry.destroy(first); }), HasSubstr("buffer id 1 was destroyed (1 buffers live)"));
  EXPECT_THAT(message_of([&] { registry.get(99); }), HasSubstr("buffer id 99 is unknown (ids issued so far: 1 to 2)"));
  EXPECT_THAT(message_of([&] { registry.get(-1); }), HasSubstr("buffer id -1 is unknown"));
  // A call with the wrong type or method for the id.
  std::vector<float> a(2 * 2), b(2 * 2), d(2 * 2), rs(2 * 2);
  const auto A = ov::matrix_view<const float>(a.data(), 2, 2);
  const auto B = ov::matrix_view<const float>(b.data(), 2, 2);
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, registry, CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, second, A, Transpose::no,
                              B, Transpose::no, {}, ov::matrix_view(rs.data(), 2, 2));
              }),
              HasSubstr("Invalid collective type: buffer id 2 was created for AG RING_EXCHANGE, the call asks for RS RING_EXCHANGE"));
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, registry, CommOverlapType::AG, CommOverlapMethod::BULK, second, A, Transpose::no, B,
                              Transpose::no, ov::matrix_view(d.data(), 2, 2));
              }),
              HasSubstr("AllGather with bulk overlap not supported"));
  // After destroy_all, every id issued before is rejected, by get and by the GEMM.
  registry.destroy_all();
  EXPECT_EQ(registry.size(), 0u);
  for (auto id : {first, second}) {
    EXPECT_FALSE(registry.contains(id));
    EXPECT_THAT(message_of([&] { registry.get(id); }), HasSubstr("was destroyed"));
  }
  EXPECT_THAT(message_of([&] {
                ov::comm_gemm(t, gemm, registry, CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, second, A, Transpose::no,
                              B, Transpose::no, ov::matrix_view(d.data(), 2, 2));
              }),
              HasSubstr("buffer id 2 was destroyed"));
  // New ids never reuse old ones.
  EXPECT_EQ(registry.create(CommOverlapType::RS, CommOverlapMethod::BULK, {2, 2}, ElementType::float32, 1), 3);
}

TEST(OverlapErrors, TheProcessWideIdApi) {
  const auto id = ov::create_comm_overlap_buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {8, 2}, ElementType::float64, 2);
  const auto other = ov::create_comm_overlap_buffer(CommOverlapType::RS, CommOverlapMethod::BULK, {8, 2}, ElementType::float32, 2);
  EXPECT_EQ(ov::default_comm_overlap_registry().get(id)->dtype(), ElementType::float64);
  {  // the GEMM by id, through the process-wide registry
    StrictMock<MockTransport> t(1, 2);
    StrictMock<MockGemm> gemm;
    std::vector<float> a(3 * 2), b(2 * 5), d(3 * 5), rs(4 * 2);
    const void* filled = ov::default_comm_overlap_registry().get(other)->data();
    EXPECT_CALL(t, reduce_scatter(filled, rs.data(), 8u, ElementType::float32, ReduceOp::sum)).Times(1);
    EXPECT_CALL(gemm, gemm(Transpose::no, Transpose::no, 3u, 5u, 2u, 1.0f, a.data(), 2u, b.data(), 5u, 0.0f, d.data(), 5u));
    ov::comm_gemm(t, gemm, CommOverlapType::RS, CommOverlapMethod::BULK, other, ov::matrix_view<const float>(a.data(), 3, 2),
                  Transpose::no, ov::matrix_view<const float>(b.data(), 2, 5), Transpose::no, ov::matrix_view(d.data(), 3, 5),
                  ov::matrix_view(rs.data(), 4, 2));
  }
  ov::destroy_comm_overlap_buffer(id);
  EXPECT_THAT(message_of([&] { ov::destroy_comm_overlap_buffer(id); }), HasSubstr("was destroyed"));
  EXPECT_TRUE(ov::default_comm_overlap_registry().contains(other));
  ov::destroy_all_comm_overlap_buffers();
  EXPECT_THAT(message_of([&] { ov::destroy_comm_overlap_buffer(other); }), HasSubstr("was destroyed"));
}

TEST(OverlapErrors, ABufferDestroyedDuringACallLivesUntilTheCallReturns) {
  ov::CommOverlapRegistry registry;
  const auto id = registry.create(CommOverlapType::RS, CommOverlapMethod::BULK, {2, 2}, ElementType::float32, 1);
  auto held = registry.get(id);
  registry.destroy(id);
  EXPECT_EQ(held->size(), 4u);  // still valid: shared ownership
  EXPECT_EQ(held.use_count(), 1);
}
