// plan_qkv throughput: world sizes 8 .. 4096, 16 documents per rank, each
// cut into 1, 2, 4 or 8 shards (create_qkv_dispatch, max_cp_degree 8).
//
// Counters: `entries` (dispatch entries of one plan: query entries + KV
// copies) and `entries/s` (entries planned per second). Target (issue 2):
// W = 1024 under 50 ms. Results: benchmarks/RESULTS.md.

#include <cstdint>

#include <benchmark/benchmark.h>

#include "cpdispatch/plan/generate.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace {

constexpr std::int64_t kDocsPerRank = 16;
constexpr std::int64_t kTokensPerRank = 16384;  // token counts do not change the planner's work
constexpr std::int64_t kMaxCpDegree = 8;
constexpr std::uint64_t kSeed = 2026;

// Query entries (one per shard) plus KV copies (n - k for KV shard k of an
// n-shard document): everything the planner places.
std::int64_t dispatch_entries(const cpdispatch::QkvPlan& plan) {
  std::int64_t entries = 0;
  for (const auto& rank : plan.ranks)
    for (const auto& doc : rank.docs) {
      const auto n = static_cast<std::int64_t>(doc.shard_len.size());
      entries += n + n * (n + 1) / 2;
    }
  return entries;
}

void BM_PlanQkv(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan =
      cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  for (auto _ : state) {
    cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    benchmark::DoNotOptimize(meta);
    benchmark::ClobberMemory();
  }
  const auto entries = static_cast<double>(dispatch_entries(plan));
  state.counters["entries"] = benchmark::Counter(entries);
  state.counters["entries/s"] = benchmark::Counter(entries, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_PlanQkv)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);

}  // namespace
