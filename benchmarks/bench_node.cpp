// The node-level KV exchange (docs/node-exchange.md) against the flat
// (section 2) and rank-level deduplicated (section 2c) exchanges: the KV
// tokens that cross between nodes, 8 ranks a node.
//
// BM_InterNodeTokens: counters `flat`, `dedup`, `node_level` (KV tokens that
// cross nodes, summed over the batches), `node_over_dedup` = node_level /
// dedup, `inside` (the node-level exchange's tokens between ranks of one
// node), `q_inter_node` (query tokens that cross nodes), `max_over_mean`
// (the worst batch's attention balance). Benchmark time: one plan_node_wire.
// `topology` 1: balanced by plan_balanced with the topology (relabelled
// attention ranks, shards moved into their home's node). Plans:
//   zigzag:   each rank's document cut into 2W chunks, chunk i attended on
//             rank min(i, 2W-1-i) (Megatron-LM / TransformerEngine causal balancing);
//   prolong, wlbllm: packed batches drawn from the samples in data/
//             (draw_workload, 32K tokens a rank, seeds 0..1), balanced by
//             plan_balanced (C = 8) without knowledge of the topology.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "node_columns.hpp"

namespace {

using I = std::int64_t;
using node_columns::kRanksPerNode;

constexpr I kTokensPerRank = 32 * 1024;
constexpr I kC = 8;
constexpr int kBatches = 2;

std::vector<cpdispatch::QkvMetadata> plans_of(const std::string& kind, I W, bool placed, double& worst_ratio) {
  if (kind == "zigzag") return {cpdispatch::plan_qkv(bench::zigzag_plan(W, 1, 2 * W * 64))};
  const std::vector<I> lengths = node_columns::read_sample(kind, "bench_node");
  std::vector<cpdispatch::QkvMetadata> plans;
  for (int seed = 0; seed < kBatches; ++seed) {
    const cpdispatch::QkvDocumentsPlan plan =
        node_columns::balanced(node_columns::draw_problem(lengths, W, kTokensPerRank, kC, static_cast<std::uint64_t>(seed)), placed);
    worst_ratio = std::max(worst_ratio, cpdispatch::plan_cost(plan).max_over_mean());
    plans.push_back(cpdispatch::plan_qkv(plan));
  }
  return plans;
}

void BM_InterNodeTokens(benchmark::State& state, std::string kind) {
  const I W = state.range(0);
  const bool placed = state.range(1) != 0;
  const cpdispatch::Topology topology = cpdispatch::Topology::uniform(W, kRanksPerNode);
  double worst_ratio = 0;
  const std::vector<cpdispatch::QkvMetadata> metas = plans_of(kind, W, placed, worst_ratio);
  node_columns::InterNode all;
  for (const auto& m : metas) all += node_columns::inter_node(m, topology);
  const cpdispatch::NodeTokenCounts& sum = all.kv;
  const I q = all.q;
  std::size_t i = 0;
  for (auto _ : state) {
    auto w = cpdispatch::plan_node_wire(metas[i++ % metas.size()].kv_fwd, topology);
    benchmark::DoNotOptimize(w);
  }
  state.counters["flat"] = static_cast<double>(sum.flat);
  state.counters["dedup"] = static_cast<double>(sum.dedup);
  state.counters["node_level"] = static_cast<double>(sum.node_level);
  state.counters["node_over_dedup"] = sum.dedup ? static_cast<double>(sum.node_level) / static_cast<double>(sum.dedup) : 1.0;
  state.counters["inside"] = static_cast<double>(sum.inside);
  state.counters["q_inter_node"] = static_cast<double>(q);
  state.counters["max_over_mean"] = worst_ratio;
}

BENCHMARK_CAPTURE(BM_InterNodeTokens, zigzag, std::string("zigzag"))->ArgNames({"W", "topology"})->ArgsProduct({{16, 64, 256}, {0}})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_InterNodeTokens, prolong, std::string("prolong"))->ArgNames({"W", "topology"})->ArgsProduct({{16, 64, 256}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_InterNodeTokens, wlbllm, std::string("wlbllm"))->ArgNames({"W", "topology"})->ArgsProduct({{16, 64, 256}, {0, 1}})->Unit(benchmark::kMillisecond);

}  // namespace

