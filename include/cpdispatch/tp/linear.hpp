#pragma once
// Tensor-parallel linear layers.
//
// The names are those of the Python tensor-parallel module this library's
// layers follow (src.distributed.tensor_parallel: RowParallelLinear,
// ColumnParallelLinear, DistributedModelWrapper, init_tensor_parallel), and
// they are the REVERSE of Megatron-LM's:
//
// | this library | splits                                  | forward communication              | Megatron-LM equivalent                    |
// |-------------------------|-----------------------------------------|------------------------------------|-------------------------------------------|
// | RowParallelLinear       | out_features (rows of the weight [out, in]) | none; output is this rank's out_features / world_size slice | ColumnParallelLinear(gather_output=False) |
// | ColumnParallelLinear    | in_features (columns of the weight)     | one all-reduce (sum) of the output | RowParallelLinear(input_is_parallel=True) |
//
// Both layers keep the weight as nn.Linear does, [out_features, in_features]
// row-major, and compute y = x W^T + b on row-major inputs [tokens, features]
// (the Python module's B x L flattened into tokens).
//
//   RowParallelLinear     weight [out_local, in], bias [out_local]   (out_local = out / world_size)
//     forward:  y_local = x W_local^T + b_local                      no communication
//     backward: dx = all_reduce_sum(dy_local W_local)                one all-reduce of tokens x in
//               dW_local += dy_local^T x,  db_local += sum(dy_local)
//   ColumnParallelLinear  weight [out, in_local], bias [out] (full)  (in_local = in / world_size)
//     forward:  y = all_reduce_sum(x_local W_local^T) + b            one all-reduce of tokens x out;
//                                                                    the bias is added once, after it
//     backward: dx_local = dy W_local                                no communication
//               dW_local += dy^T x_local,  db += sum(dy)
//
// Rank r holds rows (RowParallel) or columns (ColumnParallel)
// [r * n / world_size, (r + 1) * n / world_size) of the full weight.
//
// Building a layer is collective: every rank gathers every rank's
// (kind, world_size, rank, in_features, out_features, bias, dtype) with one
// all_gather and all of them raise the same error when they disagree (no
// rank is left waiting). Gradients accumulate until zero_grad(), so
// gradient accumulation over micro-batches is just several backward calls.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/tp/collectives.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::tp {

/// The Python module's constructor arguments besides in/out_features.
struct LinearOptions {
  bool bias = true;
  /// The Python module's world_size: 0 takes the transport's; otherwise it must equal
  /// the transport's world size on every rank ("world_size must match across
  /// all ranks").
  int world_size = 0;
  /// The Python module's rank: -1 takes the transport's; otherwise it must equal it.
  int rank = -1;
  /// Check shapes and world size across ranks with one all_gather when the
  /// layer is built. Turn off only where every rank is known to agree.
  bool check_across_ranks = true;
  /// Seed of the default initialisation (the full weight is a function of
  /// seed and element index, so every rank draws its slice of the same
  /// matrix): uniform in [-1/sqrt(in_features), 1/sqrt(in_features)), as
  /// torch.nn.Linear.
  std::uint64_t seed = 0;
};

/// A parameter and its gradient, in the backend's memory space.
template <class T>
struct Parameter {
  std::string name;
  T* value;
  T* grad;
  std::size_t count;
};

namespace detail {

// ---- shared arithmetic (also used by the unsharded reference model) --------

/// y[tokens, out] = x[tokens, in] W[out, in]^T (+ bias[out]).
template <class G, class T>
void linear_forward(G& g, const T* x, std::size_t tokens, std::size_t in, std::size_t out, const T* w, const T* bias,
                    T* y) {
  g.gemm(gemm::Transpose::no, gemm::Transpose::yes, tokens, out, in, T(1), x, in, w, in, T(0), y, out);
  if (bias != nullptr) g.add_bias(y, bias, tokens, out);
}

/// dx[tokens, in] = dy[tokens, out] W[out, in].
template <class G, class T>
void linear_backward_input(G& g, const T* dy, std::size_t tokens, std::size_t in, std::size_t out, const T* w, T* dx) {
  g.gemm(gemm::Transpose::no, gemm::Transpose::no, tokens, in, out, T(1), dy, out, w, in, T(0), dx, in);
}

/// grad_w[out, in] += dy^T x; grad_b[out] += sum over tokens of dy.
template <class G, class T>
void linear_backward_params(G& g, const T* x, const T* dy, std::size_t tokens, std::size_t in, std::size_t out,
                            T* grad_w, T* grad_b) {
  g.gemm(gemm::Transpose::yes, gemm::Transpose::no, out, in, tokens, T(1), dy, out, x, in, T(1), grad_w, in);
  if (grad_b != nullptr) g.sum_rows(dy, tokens, out, grad_b, true);
}

/// Element `index` of initialisation stream `stream` (0 weight, 1 bias):
/// uniform in [-bound, bound), a pure function so each rank draws its slice.
template <class T>
T init_value(std::uint64_t seed, std::uint64_t stream, std::uint64_t index, double bound) noexcept {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull + index + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
  return static_cast<T>((2.0 * u - 1.0) * bound);
}

/// Tokens of a host tensor [tokens, features] or [B, L, features], checking the feature count.
template <class T>
std::size_t tokens_of(const Tensor<T>& x, std::size_t features, const char* who, const char* what) {
  if (x.dim() != 2 && x.dim() != 3) {
    cpdispatch::detail::fail(who, ": ", what, " must be [tokens, features] or [B, L, features], got a ", x.dim(),
                             "-D tensor");
  }
  const std::size_t got = x.size(x.dim() - 1);
  if (got != features) {
    cpdispatch::detail::fail(who, ": ", what, " has ", got, " features in its last dimension, expected ", features);
  }
  return features == 0 ? 0 : x.numel() / features;
}

/// A host tensor shaped as `like` with its last dimension replaced.
template <class T>
Tensor<T> shaped_like(const Tensor<T>& like, std::size_t last) {
  std::vector<std::size_t> shape = like.shape();
  shape.back() = last;
  return Tensor<T>(shape);
}

/// A linear layer's weight, bias and their gradients in the backend's memory,
/// and the updates made to them. Shared by the sharded layers (buffers hold
/// this rank's slice) and the wrapper's replicated layer (the full tensors).
template <class G, class T>
struct LinearParameters {
  using buffer_type = typename G::template buffer<T>;

  LinearParameters() = default;
  LinearParameters(bool with_bias, std::size_t weight_count, std::size_t bias_count)
      : has_bias(with_bias), weight(weight_count), bias(bias_count), grad_weight(weight_count),
        grad_bias(bias_count) {}

  void zero_grad(G& g) {
    g.fill(grad_weight.data(), T(0), grad_weight.size());
    if (has_bias) g.fill(grad_bias.data(), T(0), grad_bias.size());
  }

  /// Plain SGD: parameter -= lr * gradient (gradients are left as they are).
  void sgd_step(G& g, T lr) {
    g.axpy(-lr, grad_weight.data(), weight.data(), weight.size());
    if (has_bias) g.axpy(-lr, grad_bias.data(), bias.data(), bias.size());
  }

  /// "weight" and, with a bias, "bias", with their gradients.
  std::vector<Parameter<T>> list() {
    std::vector<Parameter<T>> p{{"weight", weight.data(), grad_weight.data(), weight.size()}};
    if (has_bias) p.push_back({"bias", bias.data(), grad_bias.data(), bias.size()});
    return p;
  }

  bool has_bias = false;
  buffer_type weight{};
  buffer_type bias{};
  buffer_type grad_weight{};
  buffer_type grad_bias{};
};

enum class Split { out_features, in_features };

/// What each rank says about a layer it builds; gathered to check agreement.
struct LayerRecord {
  std::int64_t split, declared_world_size, declared_rank, transport_rank, in_features, out_features, bias, dtype_bytes,
      local_error;
  static constexpr std::size_t fields = 9;

  std::array<std::int64_t, fields> to_array() const noexcept {
    return {split,        declared_world_size, declared_rank, transport_rank, in_features,
            out_features, bias,                dtype_bytes,   local_error};
  }
  static LayerRecord from(const std::int64_t* v) noexcept {
    return {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
  }
};

/// Parameters, gradients, the collective construction check and the host-tensor
/// forward/backward of both layers. Layer is the derived layer (CRTP): the
/// host-tensor calls run its pointer-level forward/backward.
template <class Layer, class Tr, class G, class T, Split S>
class ShardedLinear {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  CPDISPATCH_CHECK_GEMM_BACKEND(G, T);
  static_assert(G::memory_space == Tr::memory_space,
                "cpdispatch: the GEMM backend and the transport must work on the same memory space (host or device)");

 public:
  using value_type = T;
  using transport_type = Tr;
  using gemm_type = G;
  using buffer_type = typename G::template buffer<T>;
  static constexpr const char* layer_name =
      S == Split::out_features ? "RowParallelLinear" : "ColumnParallelLinear";

  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return out_; }
  int world_size() const noexcept { return world_size_; }
  int rank() const noexcept { return rank_; }
  bool has_bias() const noexcept { return params_.has_bias; }
  ElementType dtype() const noexcept { return element_type_of<T>(); }
  Tr& transport() const noexcept { return *transport_; }
  G& gemm() const noexcept { return *gemm_; }

  /// This rank's weight: [out_local, in] (RowParallel) or [out, in_local] (ColumnParallel).
  const buffer_type& weight() const noexcept { return params_.weight; }
  buffer_type& weight() noexcept { return params_.weight; }
  /// [out_local] (RowParallel) or [out] (ColumnParallel); empty without bias.
  const buffer_type& bias() const noexcept { return params_.bias; }
  buffer_type& bias() noexcept { return params_.bias; }
  const buffer_type& grad_weight() const noexcept { return params_.grad_weight; }
  buffer_type& grad_weight() noexcept { return params_.grad_weight; }
  const buffer_type& grad_bias() const noexcept { return params_.grad_bias; }
  buffer_type& grad_bias() noexcept { return params_.grad_bias; }
  /// {rows, columns} of this rank's weight.
  std::pair<std::size_t, std::size_t> weight_shape() const noexcept { return {rows_, cols_}; }

  void zero_grad() { params_.zero_grad(*gemm_); }

  /// Plain SGD: parameter -= lr * gradient (gradients are left as they are).
  void sgd_step(T lr) { params_.sgd_step(*gemm_, lr); }

  /// This rank's parameters ("weight", "bias") with their gradients.
  std::vector<Parameter<T>> parameters() { return params_.list(); }

  // This rank's weight is [rows_, cols_], so every layer maps [..., cols_] to
  // [..., rows_]: [..., in] -> [..., out_local] (RowParallel),
  // [..., in_local] -> [..., out] (ColumnParallel).

  /// Host convenience: x [tokens, cols] or [B, L, cols] -> [..., rows].
  Tensor<T> forward(const Tensor<T>& x)
    requires(G::memory_space == MemorySpace::host)
  {
    const std::size_t tokens = tokens_of(x, cols_, forward_name, "the input");
    Tensor<T> y = shaped_like(x, rows_);
    layer().forward(x.data(), tokens, y.data());
    return y;
  }

  /// Host convenience: returns dx shaped as x (RowParallel: all-reduced over ranks).
  Tensor<T> backward(const Tensor<T>& x, const Tensor<T>& dy)
    requires(G::memory_space == MemorySpace::host)
  {
    const std::size_t tokens = tokens_of(x, cols_, backward_name, "the input");
    if (tokens_of(dy, rows_, backward_name, "the output gradient") != tokens) {
      cpdispatch::detail::fail(backward_name, ": the output gradient has ", dy.numel() / rows_, " tokens, the input ",
                               tokens);
    }
    Tensor<T> dx = shaped_like(x, cols_);
    layer().backward(x.data(), dy.data(), tokens, dx.data());
    return dx;
  }

  /// The full (unsharded) weight [out, in] on every rank: collective (all_gather).
  Tensor<T> gather_weight() const
    requires(Tr::memory_space == MemorySpace::host)
  {
    std::vector<T> gathered(static_cast<std::size_t>(world_size_) * weight().size());
    all_gather(*transport_, weight().data(), gathered.data(), weight().size());
    Tensor<T> full({out_, in_});
    if constexpr (S == Split::out_features) {
      std::copy(gathered.begin(), gathered.end(), full.data());
    } else {
      const std::size_t in_local = cols_;
      for (int r = 0; r < world_size_; ++r) {
        for (std::size_t o = 0; o < out_; ++o) {
          const T* src = gathered.data() + static_cast<std::size_t>(r) * weight().size() + o * in_local;
          std::copy(src, src + in_local, full.data() + o * in_ + static_cast<std::size_t>(r) * in_local);
        }
      }
    }
    return full;
  }

  /// The full bias [out] on every rank (collective for RowParallel); empty without bias.
  std::vector<T> gather_bias() const
    requires(Tr::memory_space == MemorySpace::host)
  {
    if (!has_bias()) return {};
    if constexpr (S == Split::out_features) {
      std::vector<T> full(out_);
      all_gather(*transport_, bias().data(), full.data(), bias().size());
      return full;
    } else {
      return std::vector<T>(bias().data(), bias().data() + bias().size());
    }
  }

 protected:
  /// from_full == false: default initialisation from options.seed.
  ShardedLinear(Tr& transport, G& gemm, std::size_t in, std::size_t out, const LinearOptions& options, bool from_full,
                const T* full_weight, std::size_t full_weight_size, const T* full_bias, std::size_t full_bias_size)
      : transport_(&transport), gemm_(&gemm), in_(in), out_(out) {
    std::string local_error;
    if (from_full) {
      if (full_weight_size != in * out) {
        local_error = cpdispatch::detail::concat(layer_name, "::from_full: the weight has ", full_weight_size,
                                                 " elements, expected out_features x in_features = ", out, " x ", in,
                                                 " = ", in * out);
      } else if (options.bias && full_bias_size != out) {
        local_error = cpdispatch::detail::concat(layer_name, "::from_full: the bias has ", full_bias_size,
                                                 " elements, expected out_features = ", out);
      } else if (!options.bias && full_bias_size != 0) {
        local_error = cpdispatch::detail::concat(layer_name, "::from_full: a bias of ", full_bias_size,
                                                 " elements was given but options.bias is false");
      }
    }
    check(options, local_error);

    const std::size_t w = static_cast<std::size_t>(world_size_);
    const std::size_t r = static_cast<std::size_t>(rank_);
    rows_ = S == Split::out_features ? out_ / w : out_;
    cols_ = S == Split::out_features ? in_ : in_ / w;
    const std::size_t bias_count = S == Split::out_features ? rows_ : out_;
    const std::size_t row0 = S == Split::out_features ? r * rows_ : 0;
    const std::size_t col0 = S == Split::out_features ? 0 : r * cols_;

    std::vector<T> host_w(rows_ * cols_);
    std::vector<T> host_b(options.bias ? bias_count : 0);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_));
    for (std::size_t i = 0; i < rows_; ++i) {
      for (std::size_t j = 0; j < cols_; ++j) {
        const std::size_t full_index = (row0 + i) * in_ + col0 + j;
        host_w[i * cols_ + j] = from_full ? full_weight[full_index]
                                                       : init_value<T>(options.seed, 0, full_index, bound);
      }
    }
    const std::size_t bias0 = S == Split::out_features ? row0 : 0;
    for (std::size_t i = 0; i < host_b.size(); ++i) {
      host_b[i] = from_full ? full_bias[bias0 + i] : init_value<T>(options.seed, 1, bias0 + i, bound);
    }
    params_ = LinearParameters<G, T>(options.bias, host_w.size(), host_b.size());
    gemm_->upload(host_w.data(), params_.weight.data(), host_w.size());
    if (!host_b.empty()) gemm_->upload(host_b.data(), params_.bias.data(), host_b.size());
    zero_grad();
  }

  std::size_t rows_ = 0;  // of this rank's weight
  std::size_t cols_ = 0;

 private:
  // Whole literals, not layer_name + suffix: tokens_of takes a C string and a
  // forward call should build none.
  static constexpr const char* forward_name =
      S == Split::out_features ? "RowParallelLinear::forward" : "ColumnParallelLinear::forward";
  static constexpr const char* backward_name =
      S == Split::out_features ? "RowParallelLinear::backward" : "ColumnParallelLinear::backward";

  Layer& layer() noexcept { return static_cast<Layer&>(*this); }

  /// Every rank gathers every rank's record and raises the same error.
  void check(const LinearOptions& options, const std::string& local_error) {
    const int transport_world = transport_->world_size();
    const int transport_rank = transport_->rank();
    const LayerRecord mine{S == Split::out_features ? 0 : 1,
                           options.world_size == 0 ? transport_world : options.world_size,
                           options.rank < 0 ? transport_rank : options.rank,
                           transport_rank,
                           static_cast<std::int64_t>(in_),
                           static_cast<std::int64_t>(out_),
                           options.bias ? 1 : 0,
                           static_cast<std::int64_t>(sizeof(T)),
                           local_error.empty() ? 0 : 1};
    const std::vector<LayerRecord> all = gather_records(mine, options.check_across_ranks);
    // Without the gather, the one record is this rank's own.
    const auto rank_of = [&](std::size_t i) { return options.check_across_ranks ? static_cast<int>(i) : transport_rank; };
    if (!local_error.empty()) cpdispatch::detail::fail(local_error);
    check_ranks_agree(all, rank_of, transport_world);
    check_features(transport_world);
    world_size_ = transport_world;
    rank_ = transport_rank;
  }

  /// Every rank's record (all_gather over the transport), or only this rank's.
  std::vector<LayerRecord> gather_records(const LayerRecord& mine, bool across_ranks) {
    if (!across_ranks) return {mine};
    const auto send = mine.to_array();
    const auto world = static_cast<std::size_t>(transport_->world_size());
    std::vector<std::int64_t> recv(world * LayerRecord::fields);
    all_gather(*transport_, send.data(), recv.data(), LayerRecord::fields);
    std::vector<LayerRecord> all;
    for (std::size_t r = 0; r < world; ++r) all.push_back(LayerRecord::from(recv.data() + r * LayerRecord::fields));
    return all;
  }

  /// No rank failed locally; world size, rank and layer agree across the records.
  template <class RankOf>
  static void check_ranks_agree(const std::vector<LayerRecord>& all, const RankOf& rank_of, int transport_world) {
    using cpdispatch::detail::fail;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (all[i].local_error != 0) {
        fail(layer_name, ": rank ", rank_of(i), " could not build its shard (its own error names the cause)");
      }
    }
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (all[i].declared_world_size != all[0].declared_world_size) {
        fail("world_size must match across all ranks: ", layer_name, " on rank ", rank_of(0), " has world_size ",
             all[0].declared_world_size, ", on rank ", rank_of(i), " world_size ", all[i].declared_world_size,
             " (the transport has ", transport_world, " ranks)");
      }
    }
    if (all[0].declared_world_size != transport_world) {
      fail("world_size must match across all ranks: ", layer_name, " was built with world_size ",
           all[0].declared_world_size, " but the transport has ", transport_world, " ranks");
    }
    for (const LayerRecord& r : all) {
      if (r.declared_rank != r.transport_rank) {
        fail(layer_name, ": rank ", r.transport_rank, " was built with rank = ", r.declared_rank,
             " but its transport is rank ", r.transport_rank);
      }
    }
    check_same_layer(all, rank_of);
  }

  template <class RankOf>
  static void check_same_layer(const std::vector<LayerRecord>& all, const RankOf& rank_of) {
    const auto describe = [](const LayerRecord& r) {
      return cpdispatch::detail::concat(r.split == 0 ? "RowParallelLinear" : "ColumnParallelLinear", "(in_features ",
                                        r.in_features, ", out_features ", r.out_features, ", bias ",
                                        r.bias != 0 ? "on" : "off", ", ", r.dtype_bytes == 4 ? "float32" : "float64", ")");
    };
    const LayerRecord& a = all[0];
    for (std::size_t i = 0; i < all.size(); ++i) {
      const LayerRecord& b = all[i];
      if (a.split != b.split || a.in_features != b.in_features || a.out_features != b.out_features ||
          a.bias != b.bias || a.dtype_bytes != b.dtype_bytes) {
        cpdispatch::detail::fail(layer_name, ": the layer must be the same on all ranks: rank ", rank_of(0), " builds ",
                                 describe(a), ", rank ", rank_of(i), " builds ", describe(b));
      }
    }
  }

  /// Positive features, the split one divisible by the world size.
  void check_features(int transport_world) const {
    using cpdispatch::detail::fail;
    if (in_ == 0 || out_ == 0) {
      fail(layer_name, ": in_features and out_features must be positive (in_features ", in_, ", out_features ", out_,
           ")");
    }
    const std::size_t w = static_cast<std::size_t>(transport_world);
    if constexpr (S == Split::out_features) {
      if (out_ % w != 0) {
        fail("out_features must be divisible by world_size: ", layer_name, " has out_features ", out_,
             " and world_size ", w, " (", out_, " % ", w, " = ", out_ % w, ")");
      }
    } else {
      if (in_ % w != 0) {
        fail("in_features must be divisible by world_size: ", layer_name, " has in_features ", in_,
             " and world_size ", w, " (", in_, " % ", w, " = ", in_ % w, ")");
      }
    }
  }

  Tr* transport_;
  G* gemm_;
  std::size_t in_;
  std::size_t out_;
  int world_size_ = 1;
  int rank_ = 0;
  LinearParameters<G, T> params_{};
};

}  // namespace detail

/// Splits out_features: rank r computes output features [r*out_local, (r+1)*out_local)
/// with no communication (Megatron-LM's ColumnParallelLinear(gather_output=False)).
template <class Tr, class G, class T = float>
class RowParallelLinear
    : public detail::ShardedLinear<RowParallelLinear<Tr, G, T>, Tr, G, T, detail::Split::out_features> {
  using Base = detail::ShardedLinear<RowParallelLinear<Tr, G, T>, Tr, G, T, detail::Split::out_features>;

 public:
  /// Default-initialised layer (see LinearOptions::seed). Collective.
  RowParallelLinear(Tr& transport, G& gemm, std::size_t in_features, std::size_t out_features,
                    LinearOptions options = {})
      : Base(transport, gemm, in_features, out_features, options, false, nullptr, 0, nullptr, 0) {}

  /// This rank's slice of the full weight [out, in] (and bias [out], empty
  /// when options.bias is false), both on the host. Collective.
  static RowParallelLinear from_full(Tr& transport, G& gemm, std::size_t in_features, std::size_t out_features,
                                     std::span<const T> weight, std::span<const T> bias, LinearOptions options = {}) {
    return RowParallelLinear(transport, gemm, in_features, out_features, options, weight, bias);
  }

  /// out_features / world_size.
  std::size_t out_features_local() const noexcept { return this->rows_; }
  /// First output feature of this rank.
  std::size_t out_features_begin() const noexcept { return static_cast<std::size_t>(this->rank()) * this->rows_; }

  /// y[tokens, out_local] = x[tokens, in] W_local^T + b_local. No communication.
  void forward(const T* x, std::size_t tokens, T* y) {
    detail::linear_forward(this->gemm(), x, tokens, this->in_features(), this->rows_, this->weight().data(),
                           this->has_bias() ? this->bias().data() : nullptr, y);
  }

  /// Accumulates the weight and bias gradients from the layer's input x and
  /// dy = dL/dy_local; writes dx[tokens, in] = dL/dx summed over ranks (one
  /// all-reduce), or skips it (and the all-reduce) when dx is null.
  void backward(const T* x, const T* dy, std::size_t tokens, T* dx) {
    detail::linear_backward_params(this->gemm(), x, dy, tokens, this->in_features(), this->rows_,
                                   this->grad_weight().data(), this->has_bias() ? this->grad_bias().data() : nullptr);
    if (dx == nullptr) return;
    detail::linear_backward_input(this->gemm(), dy, tokens, this->in_features(), this->rows_, this->weight().data(),
                                  dx);
    all_reduce_sum(this->transport(), dx, tokens * this->in_features());
  }

  /// The host-tensor overloads: x [tokens, in] or [B, L, in] -> [..., out_local];
  /// backward returns dx (all-reduced) shaped as x.
  using Base::backward;
  using Base::forward;

 private:
  RowParallelLinear(Tr& transport, G& gemm, std::size_t in, std::size_t out, const LinearOptions& options,
                    std::span<const T> weight, std::span<const T> bias)
      : Base(transport, gemm, in, out, options, true, weight.data(), weight.size(), bias.data(), bias.size()) {}
};

/// Splits in_features: rank r holds input features [r*in_local, (r+1)*in_local)
/// and the forward pass sums the partial outputs with one all-reduce
/// (Megatron-LM's RowParallelLinear(input_is_parallel=True)).
template <class Tr, class G, class T = float>
class ColumnParallelLinear
    : public detail::ShardedLinear<ColumnParallelLinear<Tr, G, T>, Tr, G, T, detail::Split::in_features> {
  using Base = detail::ShardedLinear<ColumnParallelLinear<Tr, G, T>, Tr, G, T, detail::Split::in_features>;

 public:
  /// Default-initialised layer (see LinearOptions::seed). Collective.
  ColumnParallelLinear(Tr& transport, G& gemm, std::size_t in_features, std::size_t out_features,
                       LinearOptions options = {})
      : Base(transport, gemm, in_features, out_features, options, false, nullptr, 0, nullptr, 0) {}

  /// This rank's columns of the full weight [out, in] and the full bias [out]
  /// (empty when options.bias is false), both on the host. Collective.
  static ColumnParallelLinear from_full(Tr& transport, G& gemm, std::size_t in_features, std::size_t out_features,
                                        std::span<const T> weight, std::span<const T> bias,
                                        LinearOptions options = {}) {
    return ColumnParallelLinear(transport, gemm, in_features, out_features, options, weight, bias);
  }

  /// in_features / world_size.
  std::size_t in_features_local() const noexcept { return this->cols_; }
  /// First input feature of this rank.
  std::size_t in_features_begin() const noexcept { return static_cast<std::size_t>(this->rank()) * this->cols_; }

  /// y[tokens, out] = sum over ranks of x_local[tokens, in_local] W_local^T, plus the bias
  /// (added once, after the all-reduce). One all-reduce of tokens x out_features elements.
  void forward(const T* x_local, std::size_t tokens, T* y) {
    detail::linear_forward(this->gemm(), x_local, tokens, this->cols_, this->out_features(), this->weight().data(),
                           static_cast<const T*>(nullptr), y);
    all_reduce_sum(this->transport(), y, tokens * this->out_features());
    if (this->has_bias()) this->gemm().add_bias(y, this->bias().data(), tokens, this->out_features());
  }

  /// Accumulates the gradients from the layer's input x_local and dy = dL/dy
  /// (the same on every rank); writes dx_local[tokens, in_local] (no
  /// communication), or skips it when dx_local is null.
  void backward(const T* x_local, const T* dy, std::size_t tokens, T* dx_local) {
    detail::linear_backward_params(this->gemm(), x_local, dy, tokens, this->cols_, this->out_features(),
                                   this->grad_weight().data(), this->has_bias() ? this->grad_bias().data() : nullptr);
    if (dx_local == nullptr) return;
    detail::linear_backward_input(this->gemm(), dy, tokens, this->cols_, this->out_features(), this->weight().data(),
                                  dx_local);
  }

  /// The host-tensor overloads: x_local [tokens, in_local] or [B, L, in_local] -> [..., out];
  /// backward returns dx_local shaped as x_local.
  using Base::backward;
  using Base::forward;

 private:
  ColumnParallelLinear(Tr& transport, G& gemm, std::size_t in, std::size_t out, const LinearOptions& options,
                       std::span<const T> weight, std::span<const T> bias)
      : Base(transport, gemm, in, out, options, true, weight.data(), weight.size(), bias.data(), bias.size()) {}
};

}  // namespace cpdispatch::tp
