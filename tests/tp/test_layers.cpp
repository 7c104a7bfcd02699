// The tensor-parallel layers without a real multi-rank transport: world size
// 1 (SingleRankTransport) and one rank of a pretend world (LoopbackTransport)
// for shards, call counts and the construction errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/tp/tensor_parallel.hpp"
#include "cpdispatch/transports/single_rank.hpp"
#include "loopback_transport.hpp"
#include "tp_test_util.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::Tensor;
using testing::HasSubstr;
using tp_test::error_of;
using tp_test::LoopbackTransport;

namespace {

using tp_test::HostGemm;

template <class T>
class TpLayersTyped : public testing::Test {};
using ElementTypes = testing::Types<float, double>;
TYPED_TEST_SUITE(TpLayersTyped, ElementTypes);

}  // namespace

// ---- world size 1 ------------------------------------------------------------

TYPED_TEST(TpLayersTyped, WorldSizeOneRowLayerIsALinearLayer) {
  using T = TypeParam;
  cpdispatch::SingleRankTransport one;
  HostGemm gemm;
  tp::RowParallelLinear<cpdispatch::SingleRankTransport, HostGemm, T> layer(one, gemm, 6, 4, {.seed = 7});
  EXPECT_EQ(layer.in_features(), 6u);
  EXPECT_EQ(layer.out_features(), 4u);
  EXPECT_EQ(layer.out_features_local(), 4u);
  EXPECT_EQ(layer.world_size(), 1);
  EXPECT_EQ(layer.rank(), 0);
  EXPECT_EQ(layer.dtype(), (std::is_same_v<T, float> ? cpdispatch::ElementType::float32 : cpdispatch::ElementType::float64));
  EXPECT_EQ(layer.weight_shape(), (std::pair<std::size_t, std::size_t>(4, 6)));
  EXPECT_EQ(layer.bias().size(), 4u);

  const auto full = tp::Linear<T>::make(6, 4, true, 7);
  EXPECT_EQ(layer.weight(), full.weight);
  EXPECT_EQ(layer.bias(), full.bias);

  tp::Sequential<T, HostGemm> reference;
  reference.add(full);
  const auto x = tp_test::random_tensor<T>({2, 3, 6}, 1);  // [B, L, in]
  const Tensor<T> y = layer.forward(x);
  EXPECT_EQ(y.shape(), (std::vector<std::size_t>{2, 3, 4}));
  EXPECT_EQ(y, reference.forward(x));  // bitwise: the same operations

  const auto dy = tp_test::random_tensor<T>({2, 3, 4}, 2);
  const Tensor<T> dx = layer.backward(x, dy);
  EXPECT_EQ(dx, reference.backward(dy));
  const auto& ref = std::get<tp::Linear<T>>(reference.layers()[0]);
  EXPECT_EQ(layer.grad_weight(), ref.grad_weight);
  EXPECT_EQ(layer.grad_bias(), ref.grad_bias);
}

TYPED_TEST(TpLayersTyped, WorldSizeOneColumnLayerIsALinearLayer) {
  using T = TypeParam;
  cpdispatch::SingleRankTransport one;
  HostGemm gemm;
  const auto full = tp::Linear<T>::make(5, 3, true, 11);
  auto layer = tp::ColumnParallelLinear<cpdispatch::SingleRankTransport, HostGemm, T>::from_full(one, gemm, 5, 3, full.weight,
                                                                                          full.bias);
  EXPECT_EQ(layer.in_features_local(), 5u);
  EXPECT_EQ(layer.weight_shape(), (std::pair<std::size_t, std::size_t>(3, 5)));
  tp::Sequential<T, HostGemm> reference;
  reference.add(full);
  const auto x = tp_test::random_tensor<T>({4, 5}, 3);
  EXPECT_EQ(layer.forward(x), reference.forward(x));
  const auto dy = tp_test::random_tensor<T>({4, 3}, 4);
  EXPECT_EQ(layer.backward(x, dy), reference.backward(dy));
  const auto& ref = std::get<tp::Linear<T>>(reference.layers()[0]);
  EXPECT_EQ(layer.grad_weight(), ref.grad_weight);
  EXPECT_EQ(layer.grad_bias(), ref.grad_bias);
}

TEST(TpLayers, GradientsAccumulateUntilZeroGrad) {
  cpdispatch::SingleRankTransport one;
  cpdispatch::gemm::ReferenceGemm gemm;
  tp::RowParallelLinear layer(one, gemm, 3, 2);
  const auto x = tp_test::random_tensor<float>({4, 3}, 5);
  const auto dy = tp_test::random_tensor<float>({4, 2}, 6);
  layer.backward(x, dy);
  const std::vector<float> once = layer.grad_weight();
  layer.backward(x, dy);
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_FLOAT_EQ(layer.grad_weight()[i], 2 * once[i]);
  layer.zero_grad();
  for (float g : layer.grad_weight()) EXPECT_EQ(g, 0.0f);
  for (float g : layer.grad_bias()) EXPECT_EQ(g, 0.0f);
}

TEST(TpLayers, NoBias) {
  cpdispatch::SingleRankTransport one;
  cpdispatch::gemm::ReferenceGemm gemm;
  tp::ColumnParallelLinear layer(one, gemm, 3, 2, {.bias = false});
  EXPECT_FALSE(layer.has_bias());
  EXPECT_TRUE(layer.bias().empty());
  EXPECT_EQ(layer.parameters().size(), 1u);
  const auto x = tp_test::random_tensor<float>({1, 3}, 5);
  tp::Sequential<float> reference;
  reference.add(tp::Linear<float>::from(3, 2, layer.weight(), {}));
  EXPECT_EQ(layer.forward(x), reference.forward(x));
}

TEST(TpLayers, InputShapeErrors) {
  cpdispatch::SingleRankTransport one;
  cpdispatch::gemm::ReferenceGemm gemm;
  tp::RowParallelLinear layer(one, gemm, 4, 2);
  EXPECT_EQ(error_of([&] { layer.forward(Tensor<float>({3, 5})); }),
            "RowParallelLinear::forward: the input has 5 features in its last dimension, expected 4");
  EXPECT_THAT(error_of([&] { layer.forward(Tensor<float>({3})); }), HasSubstr("must be [tokens, features]"));
  EXPECT_THAT(error_of([&] { layer.backward(Tensor<float>({3, 4}), Tensor<float>({2, 2})); }),
              HasSubstr("the output gradient has 2 tokens, the input 3"));
}

TEST(TpLayers, FromFullChecksSizes) {
  cpdispatch::SingleRankTransport one;
  cpdispatch::gemm::ReferenceGemm gemm;
  using Row = tp::RowParallelLinear<cpdispatch::SingleRankTransport, cpdispatch::gemm::ReferenceGemm>;
  const std::vector<float> w(11), b(2);
  EXPECT_EQ(error_of([&] { Row::from_full(one, gemm, 4, 3, w, b); }),
            "RowParallelLinear::from_full: the weight has 11 elements, expected out_features x in_features = 3 x 4 "
            "= 12");
  const std::vector<float> w12(12);
  EXPECT_EQ(error_of([&] { Row::from_full(one, gemm, 4, 3, w12, b); }),
            "RowParallelLinear::from_full: the bias has 2 elements, expected out_features = 3");
  EXPECT_EQ(error_of([&] { Row::from_full(one, gemm, 4, 3, w12, b, {.bias = false}); }),
            "RowParallelLinear::from_full: a bias of 2 elements was given but options.bias is false");
  EXPECT_THAT(error_of([&] { Row(one, gemm, 0, 3); }), HasSubstr("in_features and out_features must be positive"));
}

// ---- one rank of a pretend world (LoopbackTransport) --------------------------

TEST(TpLayers, RankTakesItsSliceOfTheFullWeight) {
  const auto full = tp::Linear<float>::make(6, 8, true, 3);
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(1, 4);  // rank 1 of 4
  tp::RowParallelLinear row(t, gemm, 6, 8, {.seed = 3});
  EXPECT_EQ(t.count("all_gather"), 1u);  // the construction check
  EXPECT_EQ(t.calls[0].count, 9u);
  EXPECT_EQ(row.out_features_local(), 2u);
  EXPECT_EQ(row.out_features_begin(), 2u);
  EXPECT_EQ(row.weight(), std::vector<float>(full.weight.begin() + 2 * 6, full.weight.begin() + 4 * 6));
  EXPECT_EQ(row.bias(), std::vector<float>(full.bias.begin() + 2, full.bias.begin() + 4));

  tp::ColumnParallelLinear col(t, gemm, 8, 6, {.seed = 5});
  const auto full2 = tp::Linear<float>::make(8, 6, true, 5);
  EXPECT_EQ(col.in_features_local(), 2u);
  EXPECT_EQ(col.in_features_begin(), 2u);
  ASSERT_EQ(col.weight().size(), 12u);
  for (std::size_t o = 0; o < 6; ++o) {
    for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(col.weight()[o * 2 + i], full2.weight[o * 8 + 2 + i]);
  }
  EXPECT_EQ(col.bias(), full2.bias);  // the full bias, added once after the reduction
}

TEST(TpLayers, CommunicationOfEachPass) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 2);
  tp::RowParallelLinear row(t, gemm, 6, 8);
  tp::ColumnParallelLinear col(t, gemm, 8, 5);
  t.calls.clear();
  const std::size_t tokens = 3;
  std::vector<float> x(tokens * 6, 0.5f), h(tokens * 4), y(tokens * 5), dy(tokens * 5, 1.0f), dh(tokens * 4),
      dx(tokens * 6);
  row.forward(x.data(), tokens, h.data());
  EXPECT_TRUE(t.calls.empty()) << "RowParallelLinear::forward must not communicate";
  col.forward(h.data(), tokens, y.data());
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].op, "all_reduce");
  EXPECT_EQ(t.calls[0].count, tokens * 5);  // tokens x out_features
  t.calls.clear();
  col.backward(h.data(), dy.data(), tokens, dh.data());
  EXPECT_TRUE(t.calls.empty()) << "ColumnParallelLinear::backward must not communicate";
  row.backward(x.data(), dh.data(), tokens, dx.data());
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].op, "all_reduce");
  EXPECT_EQ(t.calls[0].count, tokens * 6);  // tokens x in_features
  t.calls.clear();
  row.backward(x.data(), dh.data(), tokens, nullptr);  // no input gradient, no all-reduce
  EXPECT_TRUE(t.calls.empty());
}

TEST(TpLayers, ColumnLayerAddsTheBiasOnceAfterTheReduction) {
  // Loopback's all-reduce multiplies by world_size (every rank holds the same
  // partial): the bias must not be multiplied.
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 2);
  const std::vector<float> w{1, 0, 0, 1};  // [2, 2]; rank 0 holds column 0
  const std::vector<float> b{10, 20};
  auto col = tp::ColumnParallelLinear<LoopbackTransport, cpdispatch::gemm::ReferenceGemm>::from_full(t, gemm, 2, 2, w, b);
  std::vector<float> x{3}, y(2);
  col.forward(x.data(), 1, y.data());
  EXPECT_EQ(y, (std::vector<float>{2 * 3 + 10, 0 + 20}));
}

// ---- construction errors, as the seed names them -----------------------------

TEST(TpLayerErrors, OutFeaturesMustBeDivisibleByWorldSize) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 4);
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 8, 10); }),
            "out_features must be divisible by world_size: RowParallelLinear has out_features 10 and world_size 4 "
            "(10 % 4 = 2)");
  EXPECT_EQ(error_of([&] { tp::ColumnParallelLinear(t, gemm, 10, 8); }),
            "in_features must be divisible by world_size: ColumnParallelLinear has in_features 10 and world_size 4 "
            "(10 % 4 = 2)");
  // Divisible: fine, whatever the other dimension.
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 10, 8); }), "(no error)");
  EXPECT_EQ(error_of([&] { tp::ColumnParallelLinear(t, gemm, 8, 10); }), "(no error)");
}

TEST(TpLayerErrors, WorldSizeMustMatchTheTransport) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 4);
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 8, 8, {.world_size = 2}); }),
            "world_size must match across all ranks: RowParallelLinear was built with world_size 2 but the transport "
            "has 4 ranks");
}

TEST(TpLayerErrors, WorldSizeMustMatchAcrossAllRanks) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 4);
  t.edit_peer = [](int r, char* block, std::size_t) {
    if (r == 3) {
      const std::int64_t two = 2;
      std::memcpy(block + 1 * sizeof(std::int64_t), &two, sizeof two);  // declared world_size
    }
  };
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 8, 8, {.world_size = 4}); }),
            "world_size must match across all ranks: RowParallelLinear on rank 0 has world_size 4, on rank 3 "
            "world_size 2 (the transport has 4 ranks)");
}

TEST(TpLayerErrors, ShapesMustMatchAcrossAllRanks) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 2);
  t.edit_peer = [](int, char* block, std::size_t) {
    const std::int64_t twelve = 12;
    std::memcpy(block + 5 * sizeof(std::int64_t), &twelve, sizeof twelve);  // out_features
  };
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 8, 16); }),
            "RowParallelLinear: the layer must be the same on all ranks: rank 0 builds RowParallelLinear(in_features "
            "8, out_features 16, bias on, float32), rank 1 builds RowParallelLinear(in_features 8, out_features 12, "
            "bias on, float32)");
}

TEST(TpLayerErrors, ARankThatCannotBuildItsShardFailsEveryRank) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 3);
  t.edit_peer = [](int r, char* block, std::size_t) {
    if (r == 2) {
      const std::int64_t one = 1;
      std::memcpy(block + 8 * sizeof(std::int64_t), &one, sizeof one);  // local error
    }
  };
  EXPECT_EQ(error_of([&] { tp::ColumnParallelLinear(t, gemm, 6, 6); }),
            "ColumnParallelLinear: rank 2 could not build its shard (its own error names the cause)");
}

TEST(TpLayerErrors, RankMustMatchTheTransport) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(1, 2);
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 4, 4, {.rank = 0}); }),
            "RowParallelLinear: rank 1 was built with rank = 0 but its transport is rank 1");
}

TEST(TpLayerErrors, ChecksCanBeLocalOnly) {
  cpdispatch::gemm::ReferenceGemm gemm;
  LoopbackTransport t(0, 2);
  tp::RowParallelLinear row(t, gemm, 4, 4, {.check_across_ranks = false});
  EXPECT_EQ(t.count("all_gather"), 0u);
  EXPECT_THAT(error_of([&] { tp::RowParallelLinear(t, gemm, 4, 5, {.check_across_ranks = false}); }),
              HasSubstr("out_features must be divisible by world_size"));
}
