// DistributedModelWrapper and the reference Sequential without a real
// multi-rank transport: pairing, world size 1 == the unsharded model
// (bitwise), call counts on one rank of a pretend world.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpdispatch/tp/tensor_parallel.hpp"
#include "cpdispatch/transports/single_rank.hpp"
#include "loopback_transport.hpp"
#include "tp_test_util.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::Tensor;
using testing::ElementsAre;
using testing::HasSubstr;
using tp::Placement;
using tp_test::error_of;
using tp_test::LoopbackTransport;

namespace {

using tp_test::HostGemm;


/// The model stacks of the tests, by name.
template <class T, class G>
tp::Sequential<T, G> stack(const std::string& name) {
  tp::Sequential<T, G> m;
  if (name == "mlp2") {
    m.linear(8, 16, true, 1).relu().linear(16, 8, true, 2);
  } else if (name == "mlp4") {
    m.linear(8, 16, true, 1).gelu().linear(16, 12, true, 2).relu().linear(12, 24, true, 3).gelu().linear(24, 6, true,
                                                                                                          4);
  } else if (name == "odd3") {
    m.linear(6, 8, true, 1).relu().linear(8, 4, false, 2).tanh().linear(4, 5, true, 3);
  } else if (name == "single") {
    m.linear(6, 4, true, 1);
  } else if (name == "back_to_back") {
    m.linear(6, 12, true, 1).linear(12, 4, true, 2).relu();
  }
  return m;
}

}  // namespace

TEST(TpWrapper, PairsEachLinearLayerWithTheNextOne) {
  cpdispatch::SingleRankTransport one;
  HostGemm gemm;
  {
    tp::DistributedModelWrapper w(stack<float, HostGemm>("mlp4"), one, gemm);
    EXPECT_THAT(w.placements(), ElementsAre(Placement::row_parallel, Placement::activation, Placement::column_parallel,
                                            Placement::activation, Placement::row_parallel, Placement::activation,
                                            Placement::column_parallel));
    EXPECT_THAT(w.parallelized_layers(), ElementsAre("0", "2", "4", "6"));
    EXPECT_EQ(w.world_size(), 1);
    EXPECT_EQ(w.rank(), 0);
    EXPECT_EQ(w.in_features(), 8u);
    EXPECT_EQ(w.out_features(), 6u);
    EXPECT_THAT(w.describe(), HasSubstr("0 Linear(8 -> 16): RowParallelLinear, out_features 16 per rank\n1 GELU\n"));
  }
  {
    tp::DistributedModelWrapper w(stack<float, HostGemm>("odd3"), one, gemm);
    EXPECT_THAT(w.placements(), ElementsAre(Placement::row_parallel, Placement::activation, Placement::column_parallel,
                                            Placement::activation, Placement::replicated));
    EXPECT_THAT(w.parallelized_layers(), ElementsAre("0", "2"));
    EXPECT_THAT(w.describe(), HasSubstr("4 Linear(4 -> 5): replicated (no partner)"));
  }
  {
    tp::DistributedModelWrapper w(stack<float, HostGemm>("back_to_back"), one, gemm);
    EXPECT_THAT(w.placements(),
                ElementsAre(Placement::row_parallel, Placement::column_parallel, Placement::activation));
  }
  {
    tp::DistributedModelWrapper w(stack<float, HostGemm>("single"), one, gemm);
    EXPECT_THAT(w.placements(), ElementsAre(Placement::replicated));
    EXPECT_TRUE(w.parallelized_layers().empty());
  }
}

/// world_size 1: the same operations as the unsharded model, so the same bits.
template <class T>
void check_world_size_one_is_exact(const std::string& name) {
  SCOPED_TRACE(name);
  cpdispatch::SingleRankTransport one;
  HostGemm gemm;
  auto reference = stack<T, HostGemm>(name);
  tp::DistributedModelWrapper<cpdispatch::SingleRankTransport, HostGemm, T> wrapper(reference, one, gemm);
  const auto x = tp_test::random_tensor<T>({2, 5, reference.in_features()}, 42);
  for (int step = 0; step < 3; ++step) {
    const Tensor<T> y = wrapper.forward(x);
    EXPECT_EQ(y, reference.forward(x));
    EXPECT_EQ(y.shape(), (std::vector<std::size_t>{2, 5, reference.out_features()}));
    const auto target = tp_test::random_tensor<T>(y.shape(), 100 + step);
    Tensor<T> dy;
    tp::mse_loss(y, target, &dy);
    EXPECT_EQ(wrapper.backward(dy), reference.backward(dy));
    wrapper.sgd_step(T(0.1));
    reference.sgd_step(T(0.1));
    wrapper.zero_grad();
    reference.zero_grad();
  }
  const auto gathered = wrapper.gather_model();
  ASSERT_EQ(gathered.size(), reference.size());
  for (std::size_t i = 0; i < reference.size(); ++i) {
    if (const auto* lin = std::get_if<tp::Linear<T>>(&reference.layers()[i])) {
      const auto& got = std::get<tp::Linear<T>>(gathered.layers()[i]);
      EXPECT_EQ(got.weight, lin->weight) << "layer " << i;
      EXPECT_EQ(got.bias, lin->bias) << "layer " << i;
    }
  }
}

TEST(TpWrapper, WorldSizeOneIsExactlyTheOriginal) {
  for (const char* name : {"mlp2", "mlp4", "odd3", "single", "back_to_back"}) {
    check_world_size_one_is_exact<float>(name);
    check_world_size_one_is_exact<double>(name);
  }
}

TEST(TpWrapper, CommunicationCountsOnOneRankOfTwo) {
  // Rank 0 of a pretend 2-rank world: every transport call is counted.
  LoopbackTransport t(0, 2);
  cpdispatch::gemm::ReferenceGemm gemm;
  tp::DistributedModelWrapper w(stack<float, cpdispatch::gemm::ReferenceGemm>("mlp4"), t, gemm);
  EXPECT_EQ(t.count("all_gather"), 4u);  // one shape check per sharded layer
  t.calls.clear();
  const std::size_t tokens = 3;
  std::vector<float> x(tokens * 8, 0.25f), y(tokens * 6);
  w.forward(x.data(), tokens, y.data());
  ASSERT_EQ(t.calls.size(), 2u);  // one all-reduce per pair
  EXPECT_EQ(t.calls[0].op, "all_reduce");
  EXPECT_EQ(t.calls[0].count, tokens * 12);  // the first pair's output
  EXPECT_EQ(t.calls[1].count, tokens * 6);
  t.calls.clear();
  std::vector<float> dy(tokens * 6, 1.0f), dx(tokens * 8);
  w.backward(dy.data(), dx.data());
  ASSERT_EQ(t.calls.size(), 2u);  // each RowParallelLinear's input gradient
  EXPECT_EQ(t.calls[0].count, tokens * 12);
  EXPECT_EQ(t.calls[1].count, tokens * 8);
  t.calls.clear();
  w.backward(dy.data(), nullptr);  // no model input gradient: the first layer skips its all-reduce
  EXPECT_EQ(t.calls.size(), 1u);
}

TEST(TpWrapper, Errors) {
  cpdispatch::SingleRankTransport one;
  cpdispatch::gemm::ReferenceGemm gemm;
  EXPECT_EQ(error_of([&] { tp::DistributedModelWrapper(tp::Sequential<float>(), one, gemm); }),
            "DistributedModelWrapper: the model has no layers");
  LoopbackTransport four(0, 4);
  tp::Sequential<float> m;
  m.linear(8, 10).relu().linear(10, 8);
  EXPECT_EQ(error_of([&] { tp::DistributedModelWrapper(m, four, gemm); }),
            "out_features must be divisible by world_size: RowParallelLinear has out_features 10 and world_size 4 "
            "(10 % 4 = 2)");
  EXPECT_EQ(error_of([&] { tp::DistributedModelWrapper(m, one, gemm, {.world_size = 4}); }),
            "world_size must match across all ranks: RowParallelLinear was built with world_size 4 but the transport "
            "has 1 ranks");
  tp::DistributedModelWrapper w(m, one, gemm);
  EXPECT_EQ(error_of([&] { w.backward(Tensor<float>({2, 8})); }),
            "DistributedModelWrapper::backward: call forward first");
  EXPECT_THAT(error_of([&] { w.forward(Tensor<float>({2, 9})); }),
              HasSubstr("the input has 9 features in its last dimension, expected 8"));
}

TEST(TpSequential, ShapeErrors) {
  tp::Sequential<float> m;
  m.linear(4, 6);
  EXPECT_EQ(error_of([&] { m.linear(5, 2); }),
            "Sequential: layer 1 has in_features 5 but the previous linear layer has out_features 6");
  EXPECT_EQ(error_of([&] { tp::Sequential<float>().relu().forward(Tensor<float>({1, 1})); }),
            "Sequential::forward: the model has no linear layer");
}

TEST(TpSequential, BackwardMatchesFiniteDifferences) {
  auto m = stack<double, cpdispatch::gemm::ReferenceGemm>("odd3");
  const auto x = tp_test::random_tensor<double>({3, 6}, 9);
  const auto target = tp_test::random_tensor<double>({3, 5}, 10);
  Tensor<double> dy;
  tp::mse_loss(m.forward(x), target, &dy);
  m.backward(dy);
  auto params = m.parameters();
  ASSERT_EQ(params.size(), 5u);  // 0.weight 0.bias 2.weight 4.weight 4.bias
  EXPECT_EQ(params[2].name, "2.weight");
  for (auto& p : params) {
    for (std::size_t i = 0; i < p.count; i += 3) {
      const double saved = p.value[i], h = 1e-6;
      p.value[i] = saved + h;
      const double hi = tp::mse_loss(m.forward(x), target);
      p.value[i] = saved - h;
      const double lo = tp::mse_loss(m.forward(x), target);
      p.value[i] = saved;
      EXPECT_NEAR(p.grad[i], (hi - lo) / (2 * h), 1e-7) << p.name << "[" << i << "]";
    }
  }
}
