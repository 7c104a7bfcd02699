// The deduplicated KV exchange (spec section 2c) against the section 2 one,
// side by side in one run.
//
// BM_WireTokens: KV tokens that cross between ranks, section 2 (`kv_tokens`)
// and deduplicated (`wire_tokens`), `ratio` = wire / kv, and the time of
// plan_kv_wire (the benchmark time; `plan_ms` is that of making and planning
// the plan, balancing included, for scale). Plans:
//   zigzag:   Megatron-LM / TransformerEngine causal load balancing: each
//             rank's document cut into 2W chunks, chunk i attended on rank
//             min(i, 2W-1-i) (two query shards of every document per rank);
//   prolong, wlbllm: balanced packed batches, documents drawn from the
//             samples in data/ (draw_workload, seeds
//             0..3, summed), planned by plan_balanced (C = 8).
// BM_SimFwdBwd: forward + backward of the KV tensor on the sim transport
// (ranks as threads), 4 KiB tokens, bfloat16 gradients, zig-zag plans (one
// document per rank of 1024 / 512 / 128 tokens at W = 8 / 16 / 64, so that
// each rank's attention layout is about 33 MiB):
// inside one SimWorld::run each rank alternates the section 2 path
// (Dispatcher forward + reverse_combine) and the deduplicated one
// (KvWireDispatcher forward + reverse_combine, and reverse_combine_in_place),
// each phase timed barrier to barrier (the slowest rank decides). Benchmark
// time: the deduplicated forward + backward; counters: each phase's mean
// (`*_ms`), `speedup` = plain / dedup (forward + reverse_combine) and
// `speedup_in_place` = plain / dedup (forward + reverse_combine_in_place),
// and the same from the CPU time the ranks' threads spent
// (CLOCK_THREAD_CPUTIME_ID, summed over ranks: the work itself, without the
// time a rank waits for a core or for the others; on a loaded machine the
// wall-clock ratios are noisy): `cpu_speedup`, `cpu_speedup_in_place`,
// `cpu_fwd_speedup`, `cpu_bwd_speedup`. `pieces` 1 is SimTransport (one
// all_to_all_pieces: receivers copy straight from the senders' buffers);
// 0 is SimPackingTransport (pack, all_to_all_v, unpack, as over MPI).
// BM_InterNodeKv: the inter-node columns (benchmarks/node_columns.hpp,
// docs/node-exchange.md), 8 ranks a node: key-value bytes that cross nodes
// (4 KiB a token; the mean of 4 batches, seeds 0..3, 32K tokens a rank,
// C = 8 or a document's span) in the flat, rank-level dedup and node-level
// exchanges, for the plan balanced without the topology (`blind_*`), with it
// (`aware_*`, plan_balanced with a Topology) and zig-zag (`zigzag_*`, W <= 64
// only: its KV metadata outgrows the machine beyond); each plan's balance
// (`*_balance`: largest rank attention cost / lower bound, median over the
// batches); `target` = aware node-level / blind dedup bytes and `target_met`
// (1 when target <= 0.5 and the aware plan's median balance <= 1.03 and per
// batch <= the blind plan's + 0.01). Benchmark time: place_on_topology.
// Results: benchmarks/RESULTS.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/balance/topology_balance.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "node_columns.hpp"

namespace {

using I = std::int64_t;
using Bytes = std::vector<std::byte>;
using clock_type = std::chrono::steady_clock;


const std::vector<I>& sample(const std::string& name) {
  static std::vector<std::pair<std::string, std::vector<I>>> cache;
  for (const auto& [n, v] : cache)
    if (n == name) return v;
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "bench_dedup: cannot read %s (set CPDISPATCH_DOC_LENGTHS_DIR)\n", (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  cache.emplace_back(name, nlohmann::json::parse(in).get<std::vector<I>>());
  return cache.back().second;
}

constexpr I kBalancedTokensPerRank = 32 * 1024;
constexpr I kBalancedC = 8;
constexpr int kBatches = 4;

/// The plans of one row, planned (both plan forms occur).
std::vector<cpdispatch::QkvMetadata> plans_of(const std::string& kind, I W) {
  if (kind == "zigzag") return {cpdispatch::plan_qkv(bench::zigzag_plan(W, 2, 2 * W * 64))};
  std::vector<cpdispatch::QkvMetadata> plans;
  for (int seed = 0; seed < kBatches; ++seed) {
    cpdispatch::BalanceProblem p;
    p.world_size = W;
    p.max_cp_degree = kBalancedC;
    p.documents = cpdispatch::draw_workload(sample(kind), W, kBalancedTokensPerRank, static_cast<std::uint64_t>(seed));
    plans.push_back(cpdispatch::plan_qkv(cpdispatch::plan_balanced(p)));
  }
  return plans;
}

void BM_WireTokens(benchmark::State& state, std::string kind) {
  const I W = state.range(0);
  const auto t0 = clock_type::now();
  const std::vector<cpdispatch::QkvMetadata> metas = plans_of(kind, W);
  const double qkv_s = std::chrono::duration<double>(clock_type::now() - t0).count();
  I kv = 0, wire = 0;
  for (const auto& m : metas) {
    kv += cpdispatch::off_rank_tokens(m.kv_fwd);
    wire += cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(m).fwd);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    auto w = cpdispatch::plan_kv_wire(metas[i++ % metas.size()]);
    benchmark::DoNotOptimize(w);
  }
  state.counters["kv_tokens"] = static_cast<double>(kv);
  state.counters["wire_tokens"] = static_cast<double>(wire);
  state.counters["ratio"] = static_cast<double>(wire) / static_cast<double>(kv);
  state.counters["plan_ms"] = qkv_s * 1e3 / static_cast<double>(metas.size());
}

constexpr int kRepsPerRun = 4;
constexpr std::size_t kTokenBytes = 4096;

/// One rank's buffers. The attention layout doubles as its gradient (the
/// forward fills every token with valid bfloat16 values; the in-place
/// backward's scribbles are overwritten by the next forward), which keeps
/// W = 64 within memory.
struct RankBuffers {
  Bytes mlp, attn, wire, replica, grad;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// The five timed phases, in the order they run.
enum Phase { plain_fwd, plain_bwd, dedup_fwd, dedup_bwd, dedup_bwd_in_place, phases };

/// One rank's interleaved runs; rank 0 adds its barrier-to-barrier times.
template <class T>
void run_rank(cpdispatch::SimTransport& sim, T& t, const cpdispatch::QkvMetadata& meta, const cpdispatch::KvWireMetadata& wire,
              RankBuffers& b, std::vector<double>& seconds, std::vector<double>& cpu) {
  cpdispatch::Dispatcher<T> plain(t, meta.kv_fwd, meta.kv_rev, kTokenBytes);
  cpdispatch::KvWireDispatcher<T> dedup(t, wire, kTokenBytes);
  const auto type = cpdispatch::ElementType::bfloat16;
  auto run = [&](int phase) {
    switch (phase) {
      case plain_fwd: plain.forward(b.mlp, b.attn); break;
      case plain_bwd: plain.reverse_combine(b.attn, b.replica, b.grad, type); break;
      case dedup_fwd: dedup.forward(b.mlp, b.attn); break;
      case dedup_bwd: dedup.reverse_combine(b.attn, b.wire, b.replica, b.grad, type); break;
      default: dedup.reverse_combine_in_place(b.attn, b.replica, b.grad, type); break;
    }
  };
  for (int p = 0; p < phases; ++p) run(p);  // warm-up: staging allocated, pages touched
  for (int i = 0; i < kRepsPerRun; ++i) {
    for (int p = 0; p < phases; ++p) {
      sim.barrier();
      const auto t0 = clock_type::now();
      const double c0 = thread_cpu_seconds();
      run(p);
      cpu[static_cast<std::size_t>(p)] += thread_cpu_seconds() - c0;
      sim.barrier();
      if (sim.rank() == 0) seconds[static_cast<std::size_t>(p)] += std::chrono::duration<double>(clock_type::now() - t0).count();
    }
  }
}

void BM_SimFwdBwd(benchmark::State& state) {
  const I W = state.range(0), tokens_per_rank = state.range(1);
  const bool pieces = state.range(2) != 0;
  const auto meta = cpdispatch::plan_qkv(bench::zigzag_plan(W, 1, tokens_per_rank));
  const auto wire = cpdispatch::plan_kv_wire(meta);
  std::vector<RankBuffers> buffers(static_cast<std::size_t>(W));
  for (I r = 0; r < W; ++r) {
    RankBuffers& b = buffers[static_cast<std::size_t>(r)];
    const auto& f = wire.fan[static_cast<std::size_t>(r)];
    b.mlp.assign(static_cast<std::size_t>(meta.kv_fwd.send_tokens(r)) * kTokenBytes, std::byte{1});
    b.attn.assign(static_cast<std::size_t>(f.attention_tokens) * kTokenBytes, std::byte{0});
    b.wire.assign(static_cast<std::size_t>(f.wire_tokens) * kTokenBytes, std::byte{0});
    b.replica.assign(static_cast<std::size_t>(meta.kv_rev.output_tokens(r)) * kTokenBytes, std::byte{0});
    b.grad.assign(b.mlp.size(), std::byte{0});
  }
  std::vector<double> total(phases, 0.0);
  std::vector<std::vector<double>> cpu(static_cast<std::size_t>(W), std::vector<double>(phases, 0.0));  // [rank][phase]
  cpdispatch::SimWorld world(static_cast<int>(W));
  for (auto _ : state) {
    std::vector<double> seconds(phases, 0.0);
    world.run([&](cpdispatch::SimTransport& sim) {
      RankBuffers& b = buffers[static_cast<std::size_t>(sim.rank())];
      if (pieces) {
        run_rank(sim, sim, meta, wire, b, seconds, cpu[static_cast<std::size_t>(sim.rank())]);
      } else {
        cpdispatch::SimPackingTransport packing(sim);
        run_rank(sim, packing, meta, wire, b, seconds, cpu[static_cast<std::size_t>(sim.rank())]);
      }
    });
    for (int p = 0; p < phases; ++p) total[static_cast<std::size_t>(p)] += seconds[static_cast<std::size_t>(p)];
    state.SetIterationTime((seconds[dedup_fwd] + seconds[dedup_bwd]) / kRepsPerRun);
  }
  const double ms = 1e3 / (static_cast<double>(state.iterations()) * kRepsPerRun);
  const char* names[] = {"plain_fwd_ms", "plain_bwd_ms", "dedup_fwd_ms", "dedup_bwd_ms", "inplace_bwd_ms"};
  for (int p = 0; p < phases; ++p) state.counters[names[p]] = total[static_cast<std::size_t>(p)] * ms;
  const double plain = total[plain_fwd] + total[plain_bwd];
  state.counters["speedup"] = plain / (total[dedup_fwd] + total[dedup_bwd]);
  state.counters["speedup_in_place"] = plain / (total[dedup_fwd] + total[dedup_bwd_in_place]);
  std::vector<double> busy(phases, 0.0);  // CPU seconds of all ranks per phase
  for (const auto& rank : cpu)
    for (int p = 0; p < phases; ++p) busy[static_cast<std::size_t>(p)] += rank[static_cast<std::size_t>(p)];
  const double plain_cpu = busy[plain_fwd] + busy[plain_bwd];
  state.counters["cpu_speedup"] = plain_cpu / (busy[dedup_fwd] + busy[dedup_bwd]);
  state.counters["cpu_speedup_in_place"] = plain_cpu / (busy[dedup_fwd] + busy[dedup_bwd_in_place]);
  state.counters["cpu_fwd_speedup"] = busy[plain_fwd] / busy[dedup_fwd];
  state.counters["cpu_bwd_speedup"] = busy[plain_bwd] / busy[dedup_bwd];
}

void put_plan(benchmark::State& state, const std::string& name, const node_columns::InterNode& sum, int batches, double balance) {
  const double bytes = static_cast<double>(node_columns::kKvBytes) / batches;
  state.counters[name + "_flat"] = static_cast<double>(sum.kv.flat) * bytes;
  state.counters[name + "_dedup"] = static_cast<double>(sum.kv.dedup) * bytes;
  state.counters[name + "_node"] = static_cast<double>(sum.kv.node_level) * bytes;
  state.counters[name + "_balance"] = balance;
}

/// Each row measured once (Google Benchmark may call a benchmark several times).
const node_columns::RowColumns& inter_node_row(const std::string& kind, I W) {
  static std::vector<std::pair<std::string, node_columns::RowColumns>> cache;
  const std::string key = kind + "/" + std::to_string(W);
  for (const auto& [k, row] : cache)
    if (k == key) return row;
  cache.emplace_back(key, node_columns::measure_row(sample(kind), W, kBatches));
  return cache.back().second;
}

void BM_InterNodeKv(benchmark::State& state, std::string kind) {
  const I W = state.range(0);
  const node_columns::RowColumns& row = inter_node_row(kind, W);
  const cpdispatch::BalanceProblem p = node_columns::column_problem(sample(kind), W, 0);
  const cpdispatch::QkvDocumentsPlan blind = cpdispatch::plan_balanced(p);
  const cpdispatch::Topology topology = cpdispatch::Topology::uniform(W, node_columns::kRanksPerNode);
  for (auto _ : state) {
    auto placed = cpdispatch::place_on_topology(blind, p, topology);
    benchmark::DoNotOptimize(placed);
  }
  put_plan(state, "blind", row.blind, row.batches, row.blind_ratio);
  put_plan(state, "aware", row.aware, row.batches, row.aware_ratio);
  if (row.has_zigzag) put_plan(state, "zigzag", row.zigzag, row.batches, row.zigzag_ratio);
  state.counters["target"] = row.target_ratio();
  state.counters["target_met"] = row.target_met() ? 1 : 0;
}

BENCHMARK_CAPTURE(BM_WireTokens, zigzag, std::string("zigzag"))->ArgName("W")->Arg(8)->Arg(16)->Arg(64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_WireTokens, prolong, std::string("prolong"))->ArgName("W")->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_WireTokens, wlbllm, std::string("wlbllm"))->ArgName("W")->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_InterNodeKv, prolong, std::string("prolong"))->ArgName("W")->Arg(16)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_InterNodeKv, wlbllm, std::string("wlbllm"))->ArgName("W")->Arg(16)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SimFwdBwd)
    ->ArgNames({"W", "tokens_per_rank", "pieces"})
    ->Args({8, 1024, 1})
    ->Args({16, 512, 1})
    ->Args({64, 128, 1})
    ->Args({8, 1024, 0})
    ->Args({16, 512, 0})
    ->Args({64, 128, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
