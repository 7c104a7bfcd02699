// Forward latency of DistributedModelWrapper on the in-process transport
// (SimWorld: ranks are threads) against the unsharded Sequential.
//
// Model: a 4-layer MLP, hidden -> 4 hidden -> hidden, twice, GELU (two
// RowParallel/ColumnParallel pairs: two all-reduces of tokens x hidden per
// forward). CBLAS with one BLAS thread per rank (thread), float32.
//
// Each benchmark iteration is one SimWorld::run in which every rank runs
// `kInner` forwards; the reported time (manual time) is rank 0's time per
// forward between two barriers, so thread start-up is not counted.
//   bin/bench_tp_forward --benchmark_filter=...
// Args: {tokens, hidden, world size}; world size 0 = the unsharded model.

#include <benchmark/benchmark.h>

#include <chrono>
#include <vector>

#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/tp/tensor_parallel.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace tp = cpdispatch::tp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kInner = 5;

tp::Sequential<float, cpdispatch::gemm::CblasGemm> make_model(std::size_t hidden) {
  tp::Sequential<float, cpdispatch::gemm::CblasGemm> m;
  m.linear(hidden, 4 * hidden, true, 1)
      .gelu()
      .linear(4 * hidden, hidden, true, 2)
      .gelu()
      .linear(hidden, 4 * hidden, true, 3)
      .gelu()
      .linear(4 * hidden, hidden, true, 4);
  return m;
}

void BM_TpForward(benchmark::State& state) {
  const auto tokens = static_cast<std::size_t>(state.range(0));
  const auto hidden = static_cast<std::size_t>(state.range(1));
  const int world = static_cast<int>(state.range(2));
  cpdispatch::gemm::CblasGemm::set_blas_threads(1);
  auto model = make_model(hidden);
  const cpdispatch::Tensor<float> x({tokens, hidden}, 0.5f);

  if (world == 0) {  // the unsharded model on this thread
    (void)model.forward(x);
    for (auto _ : state) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kInner; ++i) benchmark::DoNotOptimize(model.forward(x));
      state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count() / kInner);
    }
  } else {
    cpdispatch::SimWorld sim(world);
    for (auto _ : state) {
      double seconds = 0;
      sim.run([&](cpdispatch::SimTransport& t) {
        cpdispatch::gemm::CblasGemm gemm;
        tp::DistributedModelWrapper wrapper(model, t, gemm, {.check_across_ranks = false});
        std::vector<float> y(tokens * hidden);
        wrapper.forward(x.data(), tokens, y.data());  // warm-up: buffers
        t.barrier();
        const auto t0 = Clock::now();
        for (int i = 0; i < kInner; ++i) wrapper.forward(x.data(), tokens, y.data());
        t.barrier();
        if (t.rank() == 0) seconds = std::chrono::duration<double>(Clock::now() - t0).count() / kInner;
      });
      state.SetIterationTime(seconds);
    }
  }
  state.counters["ranks"] = world;
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * 4 * static_cast<double>(tokens * hidden * 4 * hidden), benchmark::Counter::kIsIterationInvariantRate);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (auto [tokens, hidden] : {std::pair{128, 256}, std::pair{256, 512}}) {
    for (int world : {0, 1, 2, 4}) b->Args({tokens, hidden, world});
  }
  b->ArgNames({"tokens", "hidden", "ranks"})->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
}

}  // namespace

BENCHMARK(BM_TpForward)->Apply(shapes);
