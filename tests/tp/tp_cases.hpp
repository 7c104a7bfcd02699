#pragma once
// Per-rank test bodies shared by the sim tests (run on every rank thread of a
// SimWorld) and the MPI tests (run on every process under mpiexec). Each rank
// computes the unsharded reference itself (everything is deterministic) and
// checks its own share against it, so no result has to be collected.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpdispatch/tp/tensor_parallel.hpp"
#include "tp_test_util.hpp"

namespace tp_cases {

namespace tp = cpdispatch::tp;
using cpdispatch::Tensor;

using tp_test::HostGemm;

template <class T>
constexpr double tol = tp_test::tolerance<T>();

/// The stacks the multi-rank tests shard; widths of split layers divide by 1..4.
template <class T>
tp::Sequential<T> stack(const std::string& name) {
  tp::Sequential<T> m;
  if (name == "mlp2") {
    m.linear(10, 24, true, 1).relu().linear(24, 6, true, 2);
  } else if (name == "mlp4") {  // 4 linear layers: 2 pairs, 2 all-reduces per pass
    m.linear(10, 24, true, 1).gelu().linear(24, 12, true, 2).relu().linear(12, 36, true, 3).gelu().linear(36, 6, true,
                                                                                                           4);
  } else if (name == "odd3") {  // the third linear layer has no partner: replicated
    m.linear(6, 12, true, 1).relu().linear(12, 4, false, 2).tanh().linear(4, 5, true, 3);
  } else if (name == "back_to_back") {  // a pair with no activation between
    m.linear(6, 12, true, 1).linear(12, 4, true, 2).relu();
  }
  return m;
}

/// RowParallelLinear (out_features split): output slice, all-reduced input
/// gradient and gradient slices equal the unsharded layer's.
template <class T, class Tr>
void row_layer_matches_unsharded(Tr& t) {
  const std::size_t in = 7, out = 12, tokens = 10;
  HostGemm gemm;
  const auto full = tp::Linear<T>::make(in, out, true, 5);
  auto layer = tp::RowParallelLinear<Tr, HostGemm, T>::from_full(t, gemm, in, out, full.weight, full.bias);
  tp::Sequential<T> reference;
  reference.add(full);
  const auto x = tp_test::random_tensor<T>({2, 5, in}, 1);
  const auto dy_full = tp_test::random_tensor<T>({2, 5, out}, 2);
  const Tensor<T> y_ref = reference.forward(x);
  const Tensor<T> dx_ref = reference.backward(dy_full);
  const auto& ref = std::get<tp::Linear<T>>(reference.layers()[0]);

  const std::size_t local = layer.out_features_local(), c0 = layer.out_features_begin();
  ASSERT_EQ(local, out / static_cast<std::size_t>(t.world_size()));
  const Tensor<T> y = layer.forward(x);
  ASSERT_EQ(y.shape(), (std::vector<std::size_t>{2, 5, local}));
  EXPECT_LT(tp_test::rel_error(y, tp_test::columns(y_ref, c0, local)), tol<T>) << "rank " << t.rank();

  const Tensor<T> dy = tp_test::columns(dy_full, c0, local);
  const Tensor<T> dx = layer.backward(Tensor<T>(x), dy);
  EXPECT_LT(tp_test::rel_error(dx.data(), dx_ref.data(), tokens * in), tol<T>) << "rank " << t.rank();
  EXPECT_LT(tp_test::rel_error(layer.grad_weight().data(), ref.grad_weight.data() + c0 * in, local * in), tol<T>);
  EXPECT_LT(tp_test::rel_error(layer.grad_bias().data(), ref.grad_bias.data() + c0, local), tol<T>);
  // The gathered weight is the original.
  EXPECT_EQ(layer.gather_weight().values(), full.weight);
  EXPECT_EQ(layer.gather_bias(), full.bias);
}

/// ColumnParallelLinear (in_features split): full output after the
/// all-reduce, local input gradient and gradient slices.
template <class T, class Tr>
void column_layer_matches_unsharded(Tr& t) {
  const std::size_t in = 12, out = 5, tokens = 10;
  HostGemm gemm;
  const auto full = tp::Linear<T>::make(in, out, true, 6);
  auto layer = tp::ColumnParallelLinear<Tr, HostGemm, T>::from_full(t, gemm, in, out, full.weight, full.bias);
  tp::Sequential<T> reference;
  reference.add(full);
  const auto x = tp_test::random_tensor<T>({tokens, in}, 3);
  const auto dy = tp_test::random_tensor<T>({tokens, out}, 4);
  const Tensor<T> y_ref = reference.forward(x);
  const Tensor<T> dx_ref = reference.backward(dy);
  const auto& ref = std::get<tp::Linear<T>>(reference.layers()[0]);

  const std::size_t local = layer.in_features_local(), c0 = layer.in_features_begin();
  ASSERT_EQ(local, in / static_cast<std::size_t>(t.world_size()));
  const Tensor<T> x_local = tp_test::columns(x, c0, local);
  const Tensor<T> y = layer.forward(x_local);
  EXPECT_LT(tp_test::rel_error(y, y_ref), tol<T>) << "rank " << t.rank();
  const Tensor<T> dx = layer.backward(x_local, dy);
  EXPECT_LT(tp_test::rel_error(dx, tp_test::columns(dx_ref, c0, local)), tol<T>) << "rank " << t.rank();
  std::vector<T> grad_slice;
  for (std::size_t o = 0; o < out; ++o) {
    for (std::size_t i = 0; i < local; ++i) grad_slice.push_back(ref.grad_weight[o * in + c0 + i]);
  }
  EXPECT_LT(tp_test::rel_error(layer.grad_weight(), grad_slice), tol<T>);
  EXPECT_LT(tp_test::rel_error(layer.grad_bias(), ref.grad_bias), tol<T>);  // full bias, once
  EXPECT_EQ(layer.gather_weight().values(), full.weight);
}

/// The wrapper's forward output, input gradient and every parameter gradient
/// equal the unsharded model's, on every rank.
template <class T, class Tr>
void wrapper_matches_unsharded(Tr& t, const std::string& name) {
  SCOPED_TRACE(name + " on rank " + std::to_string(t.rank()));
  HostGemm gemm;
  auto reference = stack<T>(name);
  tp::DistributedModelWrapper<Tr, HostGemm, T> wrapper(reference, t, gemm);
  EXPECT_EQ(wrapper.world_size(), t.world_size());
  const auto x = tp_test::random_tensor<T>({2, 4, reference.in_features()}, 7);
  const Tensor<T> y = wrapper.forward(x);
  const Tensor<T> y_ref = reference.forward(x);
  ASSERT_EQ(y.shape(), y_ref.shape());
  EXPECT_LT(tp_test::rel_error(y, y_ref), tol<T>);
  const auto dy = tp_test::random_tensor<T>(y.shape(), 8);
  EXPECT_LT(tp_test::rel_error(wrapper.backward(dy), reference.backward(dy)), tol<T>);
  const auto gathered = wrapper.gather_model();
  for (std::size_t i = 0; i < reference.size(); ++i) {
    if (const auto* lin = std::get_if<tp::Linear<T>>(&reference.layers()[i])) {
      const auto& got = std::get<tp::Linear<T>>(gathered.layers()[i]);
      EXPECT_LT(tp_test::rel_error(got.grad_weight, lin->grad_weight), tol<T>) << "layer " << i;
      EXPECT_LT(tp_test::rel_error(got.grad_bias, lin->grad_bias), tol<T>) << "layer " << i;
    }
  }
}

/// The seed's training loop (zero_grad, forward, loss, backward, step) with
/// gradient accumulation over 2 micro-batches: after a few steps the sharded
/// model holds the unsharded model's weights.
template <class T, class Tr>
void training_matches_unsharded(Tr& t) {
  HostGemm gemm;
  auto reference = stack<T>("mlp2");
  tp::DistributedModelWrapper<Tr, HostGemm, T> wrapper(reference, t, gemm);
  const int steps = 4, accumulation = 2;
  const T lr = T(0.05);
  for (int step = 0; step < steps; ++step) {
    wrapper.zero_grad();
    reference.zero_grad();
    for (int micro = 0; micro < accumulation; ++micro) {
      const auto x = tp_test::random_tensor<T>({3, 4, 10}, 1000 + static_cast<std::uint64_t>(step * 10 + micro));
      const auto target = tp_test::random_tensor<T>({3, 4, 6}, 2000 + static_cast<std::uint64_t>(step * 10 + micro));
      Tensor<T> dy, dy_ref;
      const T loss = tp::mse_loss(wrapper.forward(x), target, &dy);
      const T loss_ref = tp::mse_loss(reference.forward(x), target, &dy_ref);
      EXPECT_NEAR(loss, loss_ref, 1e-5 * std::abs(loss_ref)) << "step " << step;
      for (auto& g : dy.flat()) g /= accumulation;
      for (auto& g : dy_ref.flat()) g /= accumulation;
      wrapper.backward(dy);
      reference.backward(dy_ref);
    }
    wrapper.sgd_step(lr);
    reference.sgd_step(lr);
  }
  const auto trained = wrapper.gather_model();
  for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
    const auto& got = std::get<tp::Linear<T>>(trained.layers()[i]);
    const auto& want = std::get<tp::Linear<T>>(reference.layers()[i]);
    EXPECT_LT(tp_test::rel_error(got.weight, want.weight), tol<T>) << "layer " << i << " rank " << t.rank();
    EXPECT_LT(tp_test::rel_error(got.bias, want.bias), tol<T>) << "layer " << i << " rank " << t.rank();
  }
}

using tp_test::error_of;

/// in_features not divisible by world_size is an error for the in-split
/// layer (on every rank, with the numbers); divisible is fine.
template <class Tr>
void divisibility(Tr& t) {
  HostGemm gemm;
  const std::size_t W = static_cast<std::size_t>(t.world_size());
  using Row = tp::RowParallelLinear<Tr, HostGemm>;
  using Column = tp::ColumnParallelLinear<Tr, HostGemm>;
  EXPECT_EQ(error_of([&] { Column(t, gemm, 3 * W, 5); }), "(no error)");
  EXPECT_EQ(error_of([&] { Row(t, gemm, 5, 3 * W); }), "(no error)");
  if (W == 1) return;
  const std::size_t bad = 3 * W + 1;
  EXPECT_EQ(error_of([&] { Column(t, gemm, bad, 5); }),
            cpdispatch::detail::concat("in_features must be divisible by world_size: ColumnParallelLinear has "
                                       "in_features ",
                                       bad, " and world_size ", W, " (", bad, " % ", W, " = 1)"));
  EXPECT_EQ(error_of([&] { Row(t, gemm, 5, bad); }),
            cpdispatch::detail::concat("out_features must be divisible by world_size: RowParallelLinear has "
                                       "out_features ",
                                       bad, " and world_size ", W, " (", bad, " % ", W, " = 1)"));
  // The transport still works after the (collective, agreed) errors.
  tp::synchronize_across_ranks(t);
}

/// The last rank declares another world_size: every rank raises the error.
template <class Tr>
void world_size_mismatch(Tr& t) {
  HostGemm gemm;
  const int W = t.world_size();
  const int declared = t.rank() == W - 1 ? W + 1 : W;
  EXPECT_EQ(error_of([&] { tp::RowParallelLinear(t, gemm, 8, 12, {.world_size = declared}); }),
            cpdispatch::detail::concat("world_size must match across all ranks: RowParallelLinear on rank 0 has "
                                       "world_size ",
                                       W, ", on rank ", W - 1, " world_size ", W + 1, " (the transport has ", W,
                                       " ranks)"));
  tp::synchronize_across_ranks(t);
}

/// The seed's utilities on a real transport.
template <class Tr>
void utilities(Tr& t, tp::Backend backend) {
  const auto config = tp::init_tensor_parallel(backend, t);
  EXPECT_EQ(config.world_size, t.world_size());
  EXPECT_EQ(config.rank, t.rank());
  EXPECT_EQ(tp::get_tensor_parallel_config(), config);
  const int W = t.world_size();
  std::vector<double> v{1.0 + t.rank(), 2.0};
  tp::all_reduce_sum(t, std::span<double>(v));
  EXPECT_EQ(v[0], W * (W + 1) / 2.0);
  EXPECT_EQ(v[1], 2.0 * W);
  Tensor<float> b({2, 2}, static_cast<float>(t.rank()));
  tp::broadcast_tensor(t, b, W - 1);
  EXPECT_EQ(b, Tensor<float>({2, 2}, static_cast<float>(W - 1)));
  tp::synchronize_across_ranks(t);
  tp::reset_tensor_parallel_config();
}

}  // namespace tp_cases
