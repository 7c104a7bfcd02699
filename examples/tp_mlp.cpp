// tp_mlp: the seed's quick start and training loop in C++, on the in-process
// transport (ranks are threads).
//
//   bin/tp_mlp [--world-size 4] [--tokens 64] [--hidden 32] [--steps 5]
//
// Builds an unsharded MLP (hidden -> 4 hidden -> hidden, ReLU), shards it
// with DistributedModelWrapper on every rank, checks that the sharded
// forward equals the unsharded one, then trains both for a few SGD steps
// and checks that they end with the same weights. Exits 1 on a mismatch.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/tp/tensor_parallel.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::Tensor;

namespace {

struct Args {
  int world_size = 4;
  std::size_t tokens = 64;
  std::size_t hidden = 32;
  int steps = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--help" || s == "-h" || i + 1 >= argc) {
      std::printf("usage: tp_mlp [--world-size N] [--tokens N] [--hidden N] [--steps N]\n");
      std::exit(s == "--help" || s == "-h" ? 0 : 2);
    }
    const long v = std::atol(argv[++i]);
    if (v < 1) {
      std::fprintf(stderr, "tp_mlp: %s = %ld must be at least 1\n", s.c_str(), v);
      std::exit(2);
    }
    if (s == "--world-size") a.world_size = static_cast<int>(v);
    else if (s == "--tokens") a.tokens = static_cast<std::size_t>(v);
    else if (s == "--hidden") a.hidden = static_cast<std::size_t>(v);
    else if (s == "--steps") a.steps = static_cast<int>(v);
    else {
      std::fprintf(stderr, "tp_mlp: unknown option %s\n", s.c_str());
      std::exit(2);
    }
  }
  return a;
}

/// Deterministic inputs: the same on every rank.
Tensor<float> data(std::size_t tokens, std::size_t features, int salt) {
  Tensor<float> t({tokens, features});
  for (std::size_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<float>(((i * 2654435761u + static_cast<std::size_t>(salt) * 97u) % 1000) / 500.0 - 1.0);
  }
  return t;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    if (!(d <= diff)) diff = d;  // a NaN sticks (std::max would drop it)
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return ref == 0 ? diff : diff / ref;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const std::size_t H = args.hidden;

  // The unsharded model (the seed's nn.Sequential(Linear, ReLU, Linear)).
  tp::Sequential<float, cpdispatch::gemm::CblasGemm> model;
  model.linear(H, 4 * H, true, 1).relu().linear(4 * H, H, true, 2);

  cpdispatch::SimWorld world(args.world_size);
  std::mutex print;
  bool ok = true;
  try {
    world.run([&](cpdispatch::SimTransport& t) {
      const auto config = tp::init_tensor_parallel("sim", t);
      cpdispatch::gemm::CblasGemm gemm;  // one BLAS thread per rank
      tp::DistributedModelWrapper parallel(model, t, gemm);
      auto reference = model;  // each rank's unsharded copy, to compare with

      if (config.rank == 0) {
        std::printf("world_size %d, parallelized_layers:", config.world_size);
        for (const auto& name : parallel.parallelized_layers()) std::printf(" %s", name.c_str());
        std::printf("\n%s", parallel.describe().c_str());
      }

      // Forward: the sharded model's output is the unsharded one's.
      const Tensor<float> x = data(args.tokens, H, 0);
      const double forward_diff = max_rel_diff(parallel.forward(x).values(), reference.forward(x).values());

      // The seed's training loop: zero_grad, forward, loss, backward, step.
      float loss = 0;
      for (int step = 0; step < args.steps; ++step) {
        const Tensor<float> batch = data(args.tokens, H, step + 1);
        const Tensor<float> target = data(args.tokens, H, 100 + step);
        parallel.zero_grad();
        reference.zero_grad();
        Tensor<float> dy, dy_ref;
        loss = tp::mse_loss(parallel.forward(batch), target, &dy);
        tp::mse_loss(reference.forward(batch), target, &dy_ref);
        parallel.backward(dy);
        reference.backward(dy_ref);
        parallel.sgd_step(0.1f);
        reference.sgd_step(0.1f);
      }
      const auto trained = parallel.gather_model();
      double weight_diff = 0;
      for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
        const double d = max_rel_diff(std::get<tp::Linear<float>>(trained.layers()[i]).weight,
                                      std::get<tp::Linear<float>>(reference.layers()[i]).weight);
        if (!(d <= weight_diff)) weight_diff = d;
      }
      const std::lock_guard<std::mutex> lock(print);
      std::printf("rank %d: forward max rel diff %.2e, loss after %d steps %.6f, weights max rel diff %.2e\n",
                  config.rank, forward_diff, args.steps, static_cast<double>(loss), weight_diff);
      if (!(forward_diff <= 1e-5 && weight_diff <= 1e-5)) ok = false;  // a NaN is a mismatch
    });
  } catch (const cpdispatch::error& e) {
    std::fprintf(stderr, "tp_mlp: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "OK: the sharded model matches the unsharded one" : "MISMATCH");
  return ok ? 0 : 1;
}
