#pragma once
// The unsharded reference model (Sequential of Linear layers and element-wise
// activations) and DistributedModelWrapper (named as in the Python tensor-parallel module the
// layers follow, tp/linear.hpp), which shards it.
//
// Pairing: the wrapper walks the stack and pairs each linear layer with the
// next linear layer after it, provided only element-wise activations sit
// between them (a stack of this type has nothing else). The first of a pair
// becomes a RowParallelLinear (out_features split, no communication), the
// activations in between run on the local slice (they are element-wise), and
// the second becomes a ColumnParallelLinear (in_features split, one all-reduce
// of tokens x out_features). So each pair costs ONE all-reduce in forward and
// ONE in backward (the RowParallelLinear's input gradient), and every pair's
// output is complete and identical on all ranks.
//
// A linear layer left without a partner (the last one of an odd count) stays
// REPLICATED: every rank holds the full weight and computes the full output,
// with no communication (and identical gradients on every rank). Hence the
// wrapper's output is the unsharded model's for any stack, on every rank.
//
// world_size 1 runs the same operations as the unsharded model (collectives
// of one rank make no transport call), so with the same GEMM backend the
// results are bitwise identical.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/tp/collectives.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/tp/linear.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::tp {

/// An unsharded linear layer (torch.nn.Linear): weight [out, in], bias [out]
/// or empty, and their gradients. Host memory.
template <class T = float>
struct Linear {
  std::size_t in_features = 0;
  std::size_t out_features = 0;
  std::vector<T> weight;
  std::vector<T> bias;
  std::vector<T> grad_weight;
  std::vector<T> grad_bias;

  /// The layers' default initialisation (LinearOptions::seed): a
  /// RowParallelLinear/ColumnParallelLinear built with the same seed holds
  /// this weight's slice.
  static Linear make(std::size_t in_features, std::size_t out_features, bool bias = true, std::uint64_t seed = 0) {
    Linear l;
    l.in_features = in_features;
    l.out_features = out_features;
    l.weight.resize(in_features * out_features);
    l.bias.resize(bias ? out_features : 0);
    const double bound = in_features == 0 ? 0.0 : 1.0 / std::sqrt(static_cast<double>(in_features));
    for (std::size_t i = 0; i < l.weight.size(); ++i) l.weight[i] = detail::init_value<T>(seed, 0, i, bound);
    for (std::size_t i = 0; i < l.bias.size(); ++i) l.bias[i] = detail::init_value<T>(seed, 1, i, bound);
    l.grad_weight.assign(l.weight.size(), T(0));
    l.grad_bias.assign(l.bias.size(), T(0));
    return l;
  }

  /// From given values (weight [out, in] row-major; bias [out] or empty).
  static Linear from(std::size_t in_features, std::size_t out_features, std::vector<T> weight, std::vector<T> bias) {
    if (weight.size() != in_features * out_features) {
      cpdispatch::detail::fail("Linear: the weight has ", weight.size(), " elements, expected ", out_features, " x ",
                               in_features);
    }
    if (!bias.empty() && bias.size() != out_features) {
      cpdispatch::detail::fail("Linear: the bias has ", bias.size(), " elements, expected ", out_features);
    }
    Linear l;
    l.in_features = in_features;
    l.out_features = out_features;
    l.weight = std::move(weight);
    l.bias = std::move(bias);
    l.grad_weight.assign(l.weight.size(), T(0));
    l.grad_bias.assign(l.bias.size(), T(0));
    return l;
  }

  bool has_bias() const noexcept { return !bias.empty(); }
};

/// One entry of a Sequential: a linear layer or an element-wise activation.
template <class T = float>
using Layer = std::variant<Linear<T>, gemm::Activation>;

/// The unsharded reference model: a stack of Linear layers and activations
/// (torch.nn.Sequential), on a host GEMM backend. Layers are named by their
/// index, "0", "1", ..., as in PyTorch.
template <class T = float, class G = gemm::ReferenceGemm>
class Sequential {
  CPDISPATCH_CHECK_GEMM_BACKEND(G, T);
  static_assert(G::memory_space == MemorySpace::host, "cpdispatch: Sequential runs on a host GEMM backend");

 public:
  using value_type = T;

  Sequential() = default;
  explicit Sequential(G gemm) : gemm_(std::move(gemm)) {}

  /// Appends a linear layer; its in_features must match the previous out_features.
  Sequential& add(Linear<T> linear) {
    if (linear.in_features == 0 || linear.out_features == 0) {
      cpdispatch::detail::fail("Sequential: layer ", layers_.size(), " has in_features ", linear.in_features,
                               " and out_features ", linear.out_features, "; both must be positive");
    }
    if (const Linear<T>* prev = last_linear(); prev != nullptr && prev->out_features != linear.in_features) {
      cpdispatch::detail::fail("Sequential: layer ", layers_.size(), " has in_features ", linear.in_features,
                               " but the previous linear layer has out_features ", prev->out_features);
    }
    layers_.emplace_back(std::move(linear));
    return *this;
  }
  Sequential& add(gemm::Activation activation) {
    layers_.emplace_back(activation);
    return *this;
  }
  Sequential& linear(std::size_t in_features, std::size_t out_features, bool bias = true, std::uint64_t seed = 0) {
    return add(Linear<T>::make(in_features, out_features, bias, seed));
  }
  Sequential& relu() { return add(gemm::Activation::relu); }
  Sequential& gelu() { return add(gemm::Activation::gelu); }
  Sequential& tanh() { return add(gemm::Activation::tanh); }

  std::size_t size() const noexcept { return layers_.size(); }
  const std::vector<Layer<T>>& layers() const noexcept { return layers_; }
  std::vector<Layer<T>>& layers() noexcept { return layers_; }
  static std::string layer_name(std::size_t index) { return std::to_string(index); }

  /// Features of the first linear layer's input and the last one's output.
  std::size_t in_features() const noexcept {
    for (const auto& l : layers_) {
      if (const auto* lin = std::get_if<Linear<T>>(&l)) return lin->in_features;
    }
    return 0;
  }
  std::size_t out_features() const noexcept {
    const Linear<T>* l = last_linear();
    return l == nullptr ? 0 : l->out_features;
  }

  /// x [tokens, in] or [B, L, in] -> [..., out]; keeps what backward needs.
  Tensor<T> forward(const Tensor<T>& x) {
    if (last_linear() == nullptr) cpdispatch::detail::fail("Sequential::forward: the model has no linear layer");
    tokens_ = detail::tokens_of(x, in_features(), "Sequential::forward", "the input");
    saved_.resize(layers_.size() + 1);
    saved_[0].assign(x.data(), x.data() + x.numel());
    std::size_t width = in_features();
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const std::vector<T>& in = saved_[i];
      std::vector<T>& out = saved_[i + 1];
      if (const auto* lin = std::get_if<Linear<T>>(&layers_[i])) {
        out.resize(tokens_ * lin->out_features);
        detail::linear_forward(gemm_, in.data(), tokens_, lin->in_features, lin->out_features, lin->weight.data(),
                               lin->has_bias() ? lin->bias.data() : nullptr, out.data());
        width = lin->out_features;
      } else {
        out.resize(in.size());
        gemm_.activation_forward(std::get<gemm::Activation>(layers_[i]), in.data(), out.data(), in.size());
      }
    }
    Tensor<T> y = detail::shaped_like(x, width);
    std::copy(saved_.back().begin(), saved_.back().end(), y.data());
    forward_shape_ = x.shape();
    return y;
  }

  /// dy shaped as the last output -> dx shaped as the last input; accumulates gradients.
  Tensor<T> backward(const Tensor<T>& dy) {
    if (saved_.empty()) cpdispatch::detail::fail("Sequential::backward: call forward first");
    if (detail::tokens_of(dy, out_features(), "Sequential::backward", "the output gradient") != tokens_) {
      cpdispatch::detail::fail("Sequential::backward: the output gradient has ", dy.numel() / out_features(),
                               " tokens, the last forward had ", tokens_);
    }
    std::vector<T> g(dy.data(), dy.data() + dy.numel());
    std::vector<T> next;
    for (std::size_t i = layers_.size(); i-- > 0;) {
      const std::vector<T>& in = saved_[i];
      if (auto* lin = std::get_if<Linear<T>>(&layers_[i])) {
        detail::linear_backward_params(gemm_, in.data(), g.data(), tokens_, lin->in_features, lin->out_features,
                                       lin->grad_weight.data(), lin->has_bias() ? lin->grad_bias.data() : nullptr);
        next.resize(tokens_ * lin->in_features);
        detail::linear_backward_input(gemm_, g.data(), tokens_, lin->in_features, lin->out_features,
                                      lin->weight.data(), next.data());
      } else {
        next.resize(g.size());
        gemm_.activation_backward(std::get<gemm::Activation>(layers_[i]), in.data(), g.data(), next.data(), g.size());
      }
      std::swap(g, next);
    }
    std::vector<std::size_t> shape = forward_shape_;
    Tensor<T> dx(shape);
    std::copy(g.begin(), g.end(), dx.data());
    return dx;
  }

  void zero_grad() {
    for (auto& l : layers_) {
      if (auto* lin = std::get_if<Linear<T>>(&l)) {
        std::fill(lin->grad_weight.begin(), lin->grad_weight.end(), T(0));
        std::fill(lin->grad_bias.begin(), lin->grad_bias.end(), T(0));
      }
    }
  }

  /// Plain SGD over every parameter.
  void sgd_step(T lr) {
    for (auto& p : parameters()) gemm_.axpy(-lr, p.grad, p.value, p.count);
  }

  /// "0.weight", "0.bias", "2.weight", ... with their gradients.
  std::vector<Parameter<T>> parameters() {
    std::vector<Parameter<T>> p;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      if (auto* lin = std::get_if<Linear<T>>(&layers_[i])) {
        p.push_back({layer_name(i) + ".weight", lin->weight.data(), lin->grad_weight.data(), lin->weight.size()});
        if (lin->has_bias()) {
          p.push_back({layer_name(i) + ".bias", lin->bias.data(), lin->grad_bias.data(), lin->bias.size()});
        }
      }
    }
    return p;
  }

  G& gemm() noexcept { return gemm_; }

 private:
  const Linear<T>* last_linear() const noexcept {
    for (std::size_t i = layers_.size(); i-- > 0;) {
      if (const auto* lin = std::get_if<Linear<T>>(&layers_[i])) return lin;
    }
    return nullptr;
  }

  G gemm_{};
  std::vector<Layer<T>> layers_;
  std::vector<std::vector<T>> saved_;
  std::size_t tokens_ = 0;
  std::vector<std::size_t> forward_shape_;
};

/// mean((y - target)^2) over all elements; writes dL/dy into grad when given.
template <class T>
T mse_loss(const Tensor<T>& y, const Tensor<T>& target, Tensor<T>* grad = nullptr) {
  if (y.numel() != target.numel()) {
    cpdispatch::detail::fail("mse_loss: the output has ", y.numel(), " elements, the target ", target.numel());
  }
  const std::size_t n = y.numel();
  double sum = 0;
  if (grad != nullptr && grad->shape() != y.shape()) *grad = Tensor<T>(y.shape());
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(y.data()[i]) - static_cast<double>(target.data()[i]);
    sum += d * d;
    if (grad != nullptr) grad->data()[i] = static_cast<T>(2.0 * d / static_cast<double>(n));
  }
  return n == 0 ? T(0) : static_cast<T>(sum / static_cast<double>(n));
}

/// A linear layer every rank holds in full (a wrapper's unpaired layer).
template <class G, class T>
class ReplicatedLinear {
 public:
  using buffer_type = typename G::template buffer<T>;

  ReplicatedLinear(G& gemm, const Linear<T>& full)
      : gemm_(&gemm), in_(full.in_features), out_(full.out_features),
        params_(full.has_bias(), full.weight.size(), full.bias.size()) {
    gemm.upload(full.weight.data(), params_.weight.data(), full.weight.size());
    if (params_.has_bias) gemm.upload(full.bias.data(), params_.bias.data(), full.bias.size());
    zero_grad();
  }

  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return out_; }
  bool has_bias() const noexcept { return params_.has_bias; }
  const buffer_type& weight() const noexcept { return params_.weight; }
  const buffer_type& bias() const noexcept { return params_.bias; }
  const buffer_type& grad_weight() const noexcept { return params_.grad_weight; }
  const buffer_type& grad_bias() const noexcept { return params_.grad_bias; }

  void forward(const T* x, std::size_t tokens, T* y) {
    detail::linear_forward(*gemm_, x, tokens, in_, out_, params_.weight.data(),
                           params_.has_bias ? params_.bias.data() : nullptr, y);
  }
  void backward(const T* x, const T* dy, std::size_t tokens, T* dx) {
    detail::linear_backward_params(*gemm_, x, dy, tokens, in_, out_, params_.grad_weight.data(),
                                   params_.has_bias ? params_.grad_bias.data() : nullptr);
    if (dx != nullptr) detail::linear_backward_input(*gemm_, dy, tokens, in_, out_, params_.weight.data(), dx);
  }
  void zero_grad() { params_.zero_grad(*gemm_); }
  void sgd_step(T lr) { params_.sgd_step(*gemm_, lr); }
  std::vector<Parameter<T>> parameters() { return params_.list(); }

 private:
  G* gemm_;
  std::size_t in_;
  std::size_t out_;
  detail::LinearParameters<G, T> params_;
};

/// What the wrapper made of each layer of the model.
enum class Placement { row_parallel, column_parallel, replicated, activation };

constexpr const char* placement_name(Placement p) noexcept {
  switch (p) {
    case Placement::row_parallel: return "RowParallelLinear";
    case Placement::column_parallel: return "ColumnParallelLinear";
    case Placement::replicated: return "replicated Linear";
    case Placement::activation: return "activation";
  }
  return "?";
}

/// The Python wrapper's arguments besides the model.
struct WrapperOptions {
  int world_size = 0;  ///< 0: the transport's (see LinearOptions::world_size)
  int rank = -1;       ///< -1: the transport's
  bool check_across_ranks = true;
};

/// DistributedModelWrapper, as in the Python tensor-parallel module: shards a Sequential over the
/// transport's ranks (see the top of this header for the pairing rule).
/// Building it is collective (each sharded layer checks its shape across
/// ranks); so are forward and backward.
template <class Tr, class G, class T = float>
class DistributedModelWrapper {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  CPDISPATCH_CHECK_GEMM_BACKEND(G, T);

 public:
  using value_type = T;
  using buffer_type = typename G::template buffer<T>;
  using Row = RowParallelLinear<Tr, G, T>;
  using Column = ColumnParallelLinear<Tr, G, T>;
  using Replicated = ReplicatedLinear<G, T>;
  /// One stage of the parallel model, in the order of the original layers.
  using Stage = std::variant<Row, Column, Replicated, gemm::Activation>;

  template <class H>
  DistributedModelWrapper(const Sequential<T, H>& model, Tr& transport, G& gemm, WrapperOptions options = {})
      : transport_(&transport), gemm_(&gemm) {
    const auto& layers = model.layers();
    if (layers.empty()) cpdispatch::detail::fail("DistributedModelWrapper: the model has no layers");
    placements_ = plan(layers);
    LinearOptions lo;
    lo.world_size = options.world_size;
    lo.rank = options.rank;
    lo.check_across_ranks = options.check_across_ranks;
    stages_.reserve(layers.size());
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (placements_[i] == Placement::activation) {
        stages_.emplace_back(std::get<gemm::Activation>(layers[i]));
        continue;
      }
      const Linear<T>& lin = std::get<Linear<T>>(layers[i]);
      lo.bias = lin.has_bias();
      if (placements_[i] == Placement::row_parallel) {
        stages_.emplace_back(std::in_place_type<Row>, Row::from_full(transport, gemm, lin.in_features,
                                                                     lin.out_features, lin.weight, lin.bias, lo));
        parallelized_.push_back(Sequential<T, H>::layer_name(i));
      } else if (placements_[i] == Placement::column_parallel) {
        stages_.emplace_back(std::in_place_type<Column>, Column::from_full(transport, gemm, lin.in_features,
                                                                           lin.out_features, lin.weight, lin.bias, lo));
        parallelized_.push_back(Sequential<T, H>::layer_name(i));
      } else {
        stages_.emplace_back(std::in_place_type<Replicated>, gemm, lin);
      }
    }
    if (options.world_size != 0 && options.world_size != transport.world_size()) {
      // Only reachable without a sharded layer (those check it collectively).
      cpdispatch::detail::fail("world_size must match across all ranks: DistributedModelWrapper was built with "
                               "world_size ",
                               options.world_size, " but the transport has ", transport.world_size(), " ranks");
    }
    saved_.resize(stages_.size() + 1);
    widths_.resize(stages_.size() + 1);
    widths_[0] = model.in_features();
    for (std::size_t i = 0; i < stages_.size(); ++i) widths_[i + 1] = output_width(i, widths_[i]);
  }

  /// The Python wrapper's wrapper.world_size / wrapper.rank.
  int world_size() const noexcept { return transport_->world_size(); }
  int rank() const noexcept { return transport_->rank(); }
  /// The Python wrapper's wrapper.parallelized_layers: names of the layers that were sharded.
  const std::vector<std::string>& parallelized_layers() const noexcept { return parallelized_; }
  /// What became of each layer of the original model.
  const std::vector<Placement>& placements() const noexcept { return placements_; }
  /// The parallel model (the Python wrapper's wrapper.base_model), stage i for layer i.
  const std::vector<Stage>& stages() const noexcept { return stages_; }
  std::vector<Stage>& stages() noexcept { return stages_; }
  std::size_t in_features() const noexcept { return widths_.front(); }
  std::size_t out_features() const noexcept { return widths_.back(); }

  /// One line per layer: "0 Linear(8 -> 16): RowParallelLinear, out_features 4 per rank".
  std::string describe() const {
    std::string s;
    for (std::size_t i = 0; i < stages_.size(); ++i) {
      s += std::to_string(i) + " ";
      std::visit(
          [&](const auto& st) {
            using S = std::decay_t<decltype(st)>;
            if constexpr (std::is_same_v<S, gemm::Activation>) {
              s += gemm::activation_name(st);
            } else if constexpr (std::is_same_v<S, Row>) {
              s += cpdispatch::detail::concat("Linear(", st.in_features(), " -> ", st.out_features(),
                                              "): RowParallelLinear, out_features ", st.out_features_local(),
                                              " per rank");
            } else if constexpr (std::is_same_v<S, Column>) {
              s += cpdispatch::detail::concat("Linear(", st.in_features(), " -> ", st.out_features(),
                                              "): ColumnParallelLinear, in_features ", st.in_features_local(),
                                              " per rank, one all-reduce");
            } else {
              s += cpdispatch::detail::concat("Linear(", st.in_features(), " -> ", st.out_features(),
                                              "): replicated (no partner)");
            }
          },
          stages_[i]);
      s += '\n';
    }
    return s;
  }

  /// y[tokens, out] = the unsharded model's output, on every rank (x and y in
  /// the backend's memory space; x is the full input, the same on every rank).
  void forward(const T* x, std::size_t tokens, T* y) {
    tokens_ = tokens;
    ensure(saved_[0], tokens * widths_[0]);
    gemm_->copy(x, saved_[0].data(), tokens * widths_[0]);
    for (std::size_t i = 0; i < stages_.size(); ++i) {
      ensure(saved_[i + 1], tokens * widths_[i + 1]);
      const T* in = saved_[i].data();
      T* out = saved_[i + 1].data();
      std::visit(
          [&](auto& st) {
            using S = std::decay_t<decltype(st)>;
            if constexpr (std::is_same_v<S, gemm::Activation>) {
              gemm_->activation_forward(st, in, out, tokens * widths_[i]);
            } else {
              st.forward(in, tokens, out);
            }
          },
          stages_[i]);
    }
    gemm_->copy(saved_.back().data(), y, tokens * widths_.back());
    have_forward_ = true;
  }

  /// dy[tokens, out] (the same on every rank) -> dx[tokens, in] (the same on
  /// every rank; pass null to skip it, which also skips the first layer's
  /// input-gradient all-reduce). Accumulates every parameter's gradient.
  void backward(const T* dy, T* dx) {
    if (!have_forward_) cpdispatch::detail::fail("DistributedModelWrapper::backward: call forward first");
    const std::size_t tokens = tokens_;
    ensure(grad_a_, tokens * widths_.back());
    gemm_->copy(dy, grad_a_.data(), tokens * widths_.back());
    for (std::size_t i = stages_.size(); i-- > 0;) {
      const bool want_dx = i > 0 || dx != nullptr;
      ensure(grad_b_, tokens * widths_[i]);
      const T* in = saved_[i].data();
      const T* g = grad_a_.data();
      T* next = want_dx ? grad_b_.data() : nullptr;
      std::visit(
          [&](auto& st) {
            using S = std::decay_t<decltype(st)>;
            if constexpr (std::is_same_v<S, gemm::Activation>) {
              if (next != nullptr) gemm_->activation_backward(st, in, g, next, tokens * widths_[i]);
            } else {
              st.backward(in, g, tokens, next);
            }
          },
          stages_[i]);
      std::swap(grad_a_, grad_b_);
    }
    if (dx != nullptr) gemm_->copy(grad_a_.data(), dx, tokens * widths_[0]);
  }

  /// Host convenience: x [tokens, in] or [B, L, in] -> [..., out].
  Tensor<T> forward(const Tensor<T>& x)
    requires(G::memory_space == MemorySpace::host)
  {
    const std::size_t tokens = detail::tokens_of(x, widths_[0], "DistributedModelWrapper::forward", "the input");
    Tensor<T> y = detail::shaped_like(x, widths_.back());
    forward(x.data(), tokens, y.data());
    input_shape_ = x.shape();
    return y;
  }

  /// Host convenience: dy shaped as the output -> dx shaped as the input.
  Tensor<T> backward(const Tensor<T>& dy)
    requires(G::memory_space == MemorySpace::host)
  {
    if (!have_forward_) cpdispatch::detail::fail("DistributedModelWrapper::backward: call forward first");
    if (detail::tokens_of(dy, widths_.back(), "DistributedModelWrapper::backward", "the output gradient") !=
        tokens_) {
      cpdispatch::detail::fail("DistributedModelWrapper::backward: the output gradient has ",
                               dy.numel() / widths_.back(), " tokens, the last forward had ", tokens_);
    }
    std::vector<std::size_t> shape = input_shape_.empty() ? std::vector<std::size_t>{tokens_, widths_[0]} : input_shape_;
    Tensor<T> dx(shape);
    backward(dy.data(), dx.data());
    return dx;
  }

  void zero_grad() {
    for (auto& st : stages_) {
      std::visit(
          [](auto& s) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(s)>, gemm::Activation>) s.zero_grad();
          },
          st);
    }
  }

  void sgd_step(T lr) {
    for (auto& st : stages_) {
      std::visit(
          [lr](auto& s) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(s)>, gemm::Activation>) s.sgd_step(lr);
          },
          st);
    }
  }

  /// This rank's parameters, named as in the original model ("0.weight", ...).
  std::vector<Parameter<T>> parameters() {
    std::vector<Parameter<T>> all;
    for (std::size_t i = 0; i < stages_.size(); ++i) {
      std::visit(
          [&](auto& s) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(s)>, gemm::Activation>) {
              for (auto& p : s.parameters()) {
                p.name = std::to_string(i) + "." + p.name;
                all.push_back(std::move(p));
              }
            }
          },
          stages_[i]);
    }
    return all;
  }

  /// The unsharded model with this wrapper's current weights (and gradients),
  /// on every rank. Collective (all_gather per sharded layer).
  Sequential<T> gather_model() const
    requires(G::memory_space == MemorySpace::host && Tr::memory_space == MemorySpace::host)
  {
    Sequential<T> model;
    for (const auto& st : stages_) {
      std::visit(
          [&](const auto& s) {
            using S = std::decay_t<decltype(s)>;
            if constexpr (std::is_same_v<S, gemm::Activation>) {
              model.add(s);
            } else if constexpr (std::is_same_v<S, Replicated>) {
              Linear<T> l = Linear<T>::from(s.in_features(), s.out_features(), s.weight(), s.bias());
              l.grad_weight = s.grad_weight();
              l.grad_bias = s.grad_bias();
              model.add(std::move(l));
            } else {
              const Tensor<T> w = s.gather_weight();
              Linear<T> l = Linear<T>::from(s.in_features(), s.out_features(), w.values(), s.gather_bias());
              l.grad_weight = gather_grad_weight(s);
              l.grad_bias = gather_grad_bias(s);
              model.add(std::move(l));
            }
          },
          st);
    }
    return model;
  }

 private:
  template <class L>
  std::vector<T> gather_grad_weight(const L& s) const {
    // The gradient has the weight's layout: gather it like the weight.
    L copy = s;
    copy.weight() = s.grad_weight();
    return copy.gather_weight().values();
  }
  template <class L>
  std::vector<T> gather_grad_bias(const L& s) const {
    L copy = s;
    copy.bias() = s.grad_bias();
    return copy.gather_bias();
  }

  template <class Layers>
  static std::vector<Placement> plan(const Layers& layers) {
    std::vector<Placement> p(layers.size(), Placement::activation);
    std::size_t pending = layers.size();  // an unpaired linear layer, or none
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (std::holds_alternative<gemm::Activation>(layers[i])) continue;
      if (pending < layers.size()) {
        p[pending] = Placement::row_parallel;
        p[i] = Placement::column_parallel;
        pending = layers.size();
      } else {
        pending = i;
      }
    }
    if (pending < layers.size()) p[pending] = Placement::replicated;
    return p;
  }

  std::size_t output_width(std::size_t i, std::size_t in) const {
    return std::visit(
        [in](const auto& s) -> std::size_t {
          using S = std::decay_t<decltype(s)>;
          if constexpr (std::is_same_v<S, gemm::Activation>) {
            return in;
          } else if constexpr (std::is_same_v<S, Row>) {
            return s.out_features_local();
          } else {
            return s.out_features();
          }
        },
        stages_[i]);
  }

  void ensure(buffer_type& b, std::size_t n) {
    if (b.size() < n) b = buffer_type(n);
  }

  Tr* transport_;
  G* gemm_;
  std::vector<Placement> placements_;
  std::vector<Stage> stages_;
  std::vector<std::string> parallelized_;
  std::vector<std::size_t> widths_;  // widths_[i]: local feature count entering stage i
  std::vector<buffer_type> saved_;   // saved_[i]: the input of stage i (kept for backward)
  buffer_type grad_a_{};
  buffer_type grad_b_{};
  std::size_t tokens_ = 0;
  bool have_forward_ = false;
  std::vector<std::size_t> input_shape_;
};

}  // namespace cpdispatch::tp
