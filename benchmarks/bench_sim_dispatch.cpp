// The Dispatcher on the sim transport (ranks as threads) for a realistic QKV
// plan, against a plain memcpy of the same bytes by the same threads,
// measured in the same run, iteration by iteration.
//
// The plan is bench_simulate's: 4096 tokens and 16 documents per rank, CP
// degrees 1, 2 or 4 (create_qkv_dispatch, seed 2026); world sizes 4 and 8.
// Two paths (argument `pieces`):
//   1: SimTransport itself, a PieceTransport: one all_to_all_pieces per call,
//      each receiver copies straight from the senders' buffers (no staging);
//   0: SimPackingTransport: the same world without all_to_all_pieces, so the
//      dispatcher packs, calls all_to_all_v and unpacks, as it does over MPI.
// Per iteration, inside one SimWorld::run (thread start and the dispatchers'
// construction and first call are outside the timed region), alternately:
//   forward:  q.forward + kv.forward (every KV copy), one exchange each;
//   backward: q.reverse + kv.reverse_combine (bfloat16 gradient, fp32 sum);
//   baseline: each rank memcpy's as many bytes as its attention layout holds
//             (Q and KV), between the buffers the dispatch uses;
// each timed from a barrier to a barrier (the slowest rank decides), so both
// share cache state and machine load.
//
// Counters: `bytes` (attention-layout bytes of all ranks, per iteration),
// `dispatch_GB/s`, `memcpy_GB/s` (10^9 bytes/s, wall clock), `ratio` =
// dispatch / memcpy throughput (wall clock), and `cpu_ratio` = the same from
// the CPU time the ranks' threads spent (CLOCK_THREAD_CPUTIME_ID, summed over
// ranks): the work itself, without the time a rank waits for a core or for
// the others at a meeting point (two per dispatch call here). On a loaded
// machine the two differ a lot. The benchmark time is the dispatch's (manual
// time, wall clock).
// Target: forward ratio of at least 0.7. Results: benchmarks/RESULTS.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <span>
#include <vector>

#include <benchmark/benchmark.h>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using Bytes = std::vector<std::byte>;
using clock_type = std::chrono::steady_clock;

constexpr std::int64_t kTokensPerRank = 4096;
constexpr std::int64_t kDocsPerRank = 16;
constexpr std::int64_t kMaxCpDegree = 4;
constexpr std::uint64_t kSeed = 2026;
constexpr int kRepsPerRun = 4;

enum class Direction { forward, backward };

/// Copies n bytes from `src` to `dst` in chunks that fit both (a rank may
/// receive more than it holds, or the other way round).
void copy_bytes(std::span<std::byte> dst, std::span<const std::byte> src, std::size_t n) {
  const std::size_t chunk = std::min(dst.size(), src.size());
  for (std::size_t done = 0; chunk && done < n; done += chunk) std::memcpy(dst.data(), src.data(), std::min(chunk, n - done));
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct RankBuffers {
  Bytes q_mlp, q_attn, q_back, kv_mlp, kv_attn, kv_replica, kv_grad;
};

struct Bench {
  Direction direction;
  std::size_t token_bytes;
  cpdispatch::QkvMetadata meta;
  std::vector<RankBuffers> buffers;
  double dispatch_s = 0, memcpy_s = 0;               // rank 0's sums for the current run
  std::vector<double> dispatch_cpu = {}, memcpy_cpu = {};  // per rank, over all runs

  /// One rank's run: warm-up, then kRepsPerRun timed dispatch / baseline pairs.
  /// `t` carries the dispatchers, `sim` the barriers.
  template <class T>
  void run_rank(cpdispatch::SimTransport& sim, T& t) {
    RankBuffers& b = buffers[static_cast<std::size_t>(sim.rank())];
    cpdispatch::Dispatcher q(t, meta.q_fwd, meta.q_rev, token_bytes);
    cpdispatch::Dispatcher kv(t, meta.kv_fwd, meta.kv_rev, token_bytes);
    auto dispatch = [&] {
      if (direction == Direction::forward) {
        q.forward(b.q_mlp, b.q_attn);
        kv.forward(b.kv_mlp, b.kv_attn);
      } else {
        q.reverse(b.q_attn, b.q_back);
        kv.reverse_combine(b.kv_attn, b.kv_replica, b.kv_grad, cpdispatch::ElementType::bfloat16);
      }
    };
    auto baseline = [&] {  // as many bytes as this rank's attention layout holds
      if (direction == Direction::forward) {
        copy_bytes(b.q_attn, b.q_mlp, b.q_attn.size());
        copy_bytes(b.kv_attn, b.kv_mlp, b.kv_attn.size());
      } else {
        copy_bytes(b.q_back, b.q_attn, b.q_attn.size());
        copy_bytes(b.kv_replica, b.kv_attn, b.kv_attn.size());
      }
    };
    dispatch();  // warm-up: staging allocated, pages touched
    baseline();
    for (int i = 0; i < kRepsPerRun; ++i) {
      sim.barrier();
      const auto t0 = clock_type::now();
      const double c0 = thread_cpu_seconds();
      dispatch();
      const double c1 = thread_cpu_seconds();
      sim.barrier();
      const auto t1 = clock_type::now();
      const double c2 = thread_cpu_seconds();
      baseline();
      const double c3 = thread_cpu_seconds();
      sim.barrier();
      const auto t2 = clock_type::now();
      dispatch_cpu[static_cast<std::size_t>(sim.rank())] += c1 - c0;
      memcpy_cpu[static_cast<std::size_t>(sim.rank())] += c3 - c2;
      if (sim.rank() == 0) {
        dispatch_s += std::chrono::duration<double>(t1 - t0).count();
        memcpy_s += std::chrono::duration<double>(t2 - t1).count();
      }
    }
  }
};

void run(benchmark::State& state, Direction direction) {
  const auto token_bytes = static_cast<std::size_t>(state.range(0));
  const int W = static_cast<int>(state.range(1));
  const bool pieces = state.range(2) != 0;
  Bench bench{direction, token_bytes,
              cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(W, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed)),
              std::vector<RankBuffers>(static_cast<std::size_t>(W))};
  bench.dispatch_cpu.assign(static_cast<std::size_t>(W), 0.0);
  bench.memcpy_cpu.assign(static_cast<std::size_t>(W), 0.0);
  const auto& meta = bench.meta;
  std::size_t bytes = 0;  // attention-layout bytes of all ranks
  for (int r = 0; r < W; ++r) {
    RankBuffers& b = bench.buffers[static_cast<std::size_t>(r)];
    auto tokens = [&](std::int64_t t) { return static_cast<std::size_t>(t) * token_bytes; };
    b.q_mlp.assign(tokens(meta.q_fwd.send_tokens(r)), std::byte{1});
    b.q_attn.assign(tokens(meta.q_fwd.output_tokens(r)), std::byte{2});
    b.q_back.assign(tokens(meta.q_rev.output_tokens(r)), std::byte{3});
    b.kv_mlp.assign(tokens(meta.kv_fwd.send_tokens(r)), std::byte{4});
    b.kv_attn.assign(tokens(meta.kv_fwd.output_tokens(r)), std::byte{0});  // zero: valid bfloat16 gradients
    b.kv_replica.assign(tokens(meta.kv_rev.output_tokens(r)), std::byte{0});
    b.kv_grad.assign(tokens(meta.kv_fwd.send_tokens(r)), std::byte{0});
    bytes += b.q_attn.size() + b.kv_attn.size();
  }

  double dispatch_s = 0, memcpy_s = 0;
  std::int64_t reps = 0;
  cpdispatch::SimWorld world(W);
  for (auto _ : state) {
    bench.dispatch_s = bench.memcpy_s = 0;
    world.run([&](cpdispatch::SimTransport& sim) {
      if (pieces) {
        bench.run_rank(sim, sim);
      } else {
        cpdispatch::SimPackingTransport packing(sim);
        bench.run_rank(sim, packing);
      }
    });
    dispatch_s += bench.dispatch_s;
    memcpy_s += bench.memcpy_s;
    reps += kRepsPerRun;
    state.SetIterationTime(bench.dispatch_s / kRepsPerRun);
  }
  const double total = static_cast<double>(bytes) * static_cast<double>(reps);
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(bytes) * static_cast<double>(state.iterations())));
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["dispatch_GB/s"] = total / dispatch_s / 1e9;
  state.counters["memcpy_GB/s"] = total / memcpy_s / 1e9;
  state.counters["ratio"] = memcpy_s / dispatch_s;
  double dispatch_cpu = 0, memcpy_cpu = 0;
  for (int r = 0; r < W; ++r) {
    dispatch_cpu += bench.dispatch_cpu[static_cast<std::size_t>(r)];
    memcpy_cpu += bench.memcpy_cpu[static_cast<std::size_t>(r)];
  }
  state.counters["cpu_ratio"] = memcpy_cpu / dispatch_cpu;
}

void BM_SimDispatchForward(benchmark::State& state) { run(state, Direction::forward); }
void BM_SimDispatchBackward(benchmark::State& state) { run(state, Direction::backward); }

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"token_bytes", "ranks", "pieces"});
  for (int pieces : {1, 0})
    for (int ranks : {4, 8})
      for (int token_bytes : {256, 1024, 4096, 8192}) b->Args({token_bytes, ranks, pieces});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_SimDispatchForward)->Apply(sizes);
BENCHMARK(BM_SimDispatchBackward)->Apply(sizes);

}  // namespace
