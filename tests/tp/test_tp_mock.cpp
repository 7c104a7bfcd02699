// Call sequences checked with the gMock transports: which collectives the
// layers and the wrapper make, with which counts, and none besides.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "tp_cases.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using cpdispatch::testing::MockTransport;
using cpdispatch::testing::RecordingTransport;
using testing::_;
using testing::InSequence;
using testing::StrictMock;

namespace {

using Gemm = cpdispatch::gemm::ReferenceGemm;

/// The construction check's all_gather, answered as if every rank agreed.
void expect_shape_checks(StrictMock<MockTransport>& t, int times) {
  EXPECT_CALL(t, all_gather(_, _, 9u, ElementType::int64))
      .Times(times)
      .WillRepeatedly([&t](const void* send, void* recv, std::size_t count, ElementType type) {
        const std::size_t bytes = count * cpdispatch::element_size(type);
        for (int r = 0; r < t.world_size(); ++r) {
          std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes, send, bytes);
        }
      });
}

}  // namespace

TEST(TpMock, RowParallelForwardMakesNoTransportCall) {
  StrictMock<MockTransport> t(1, 4);
  Gemm gemm;
  expect_shape_checks(t, 1);
  tp::RowParallelLinear layer(t, gemm, 6, 8);
  testing::Mock::VerifyAndClearExpectations(&t);
  std::vector<float> x(3 * 6, 1.0f), y(3 * 2);
  layer.forward(x.data(), 3, y.data());  // StrictMock: any call fails the test
}

TEST(TpMock, ColumnParallelForwardMakesOneAllReduceOfTokensTimesOutFeatures) {
  StrictMock<MockTransport> t(0, 2);
  Gemm gemm;
  expect_shape_checks(t, 1);
  tp::ColumnParallelLinear layer(t, gemm, 6, 5);
  testing::Mock::VerifyAndClearExpectations(&t);
  const std::size_t tokens = 7;
  std::vector<float> x(tokens * 3, 1.0f), y(tokens * 5);
  EXPECT_CALL(t, all_reduce(y.data(), tokens * 5, ElementType::float32, ReduceOp::sum)).Times(1);
  layer.forward(x.data(), tokens, y.data());
}

TEST(TpMock, BackwardCommunication) {
  StrictMock<MockTransport> t(0, 2);
  Gemm gemm;
  expect_shape_checks(t, 2);
  tp::RowParallelLinear<StrictMock<MockTransport>, Gemm, double> row(t, gemm, 6, 8);
  tp::ColumnParallelLinear<StrictMock<MockTransport>, Gemm, double> col(t, gemm, 8, 5);
  testing::Mock::VerifyAndClearExpectations(&t);
  const std::size_t tokens = 3;
  std::vector<double> x(tokens * 6, 1.0), h(tokens * 4, 1.0), dy(tokens * 5, 1.0), dh(tokens * 4), dx(tokens * 6);
  col.backward(h.data(), dy.data(), tokens, dh.data());  // the in-split layer: local
  EXPECT_CALL(t, all_reduce(dx.data(), tokens * 6, ElementType::float64, ReduceOp::sum)).Times(1);
  row.backward(x.data(), dh.data(), tokens, dx.data());  // the out-split layer: all-reduce of dx
}

TEST(TpMock, WrapperOfFourLinearLayers) {
  StrictMock<MockTransport> t(0, 2);
  Gemm gemm;
  const auto model = tp_cases::stack<float>("mlp4");  // 10 -> 24 -> 12 -> 36 -> 6
  expect_shape_checks(t, 4);
  tp::DistributedModelWrapper wrapper(model, t, gemm);
  testing::Mock::VerifyAndClearExpectations(&t);
  const std::size_t tokens = 5;
  std::vector<float> x(tokens * 10, 0.5f), y(tokens * 6);
  {
    InSequence forward;  // one all-reduce per (RowParallel, ColumnParallel) pair
    EXPECT_CALL(t, all_reduce(_, tokens * 12, ElementType::float32, ReduceOp::sum));
    EXPECT_CALL(t, all_reduce(_, tokens * 6, ElementType::float32, ReduceOp::sum));
  }
  wrapper.forward(x.data(), tokens, y.data());
  testing::Mock::VerifyAndClearExpectations(&t);
  std::vector<float> dy(tokens * 6, 1.0f), dx(tokens * 10);
  {
    InSequence backward;  // each RowParallelLinear's input gradient, last pair first
    EXPECT_CALL(t, all_reduce(_, tokens * 12, ElementType::float32, ReduceOp::sum));
    EXPECT_CALL(t, all_reduce(_, tokens * 10, ElementType::float32, ReduceOp::sum));
  }
  wrapper.backward(dy.data(), dx.data());
}

TEST(TpMock, WrapperOnSimRecordsTwoAllReducesPerPassAndComputesTheModel) {
  cpdispatch::SimWorld world(2, cpdispatch::SimOptions{std::chrono::seconds(60)});
  const auto model = tp_cases::stack<float>("mlp4");
  world.run([&](cpdispatch::SimTransport& sim) {
    testing::NiceMock<RecordingTransport<cpdispatch::SimTransport>> t(sim);
    Gemm gemm;
    tp::DistributedModelWrapper wrapper(model, t, gemm);
    const auto x = tp_test::random_tensor<float>({4, 10}, 3);
    EXPECT_CALL(t, all_reduce(_, _, ElementType::float32, ReduceOp::sum)).Times(2);
    const auto y = wrapper.forward(x);
    testing::Mock::VerifyAndClearExpectations(&t);
    auto reference = model;
    EXPECT_LT(tp_test::rel_error(y, reference.forward(x)), 1e-5);
    EXPECT_CALL(t, all_reduce(_, _, ElementType::float32, ReduceOp::sum)).Times(2);
    wrapper.backward(y);
  });
}
