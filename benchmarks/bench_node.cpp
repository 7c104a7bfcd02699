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
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/plan/topology_balance.hpp"
#include "cpdispatch/plan/workload.hpp"

namespace {

using I = std::int64_t;

constexpr I kRanksPerNode = 8;
constexpr I kTokensPerRank = 32 * 1024;
constexpr I kC = 8;
constexpr int kBatches = 2;

cpdispatch::QkvPlan zigzag(I W, I doc_len) {
  cpdispatch::QkvPlan plan;
  plan.world_size = W;
  plan.ranks.resize(static_cast<std::size_t>(W));
  for (auto& rank : plan.ranks) {
    cpdispatch::Document d;
    for (I i = 0; i < 2 * W; ++i) {
      d.shard_len.push_back(doc_len / (2 * W));
      d.dst.push_back(std::min(i, 2 * W - 1 - i));
    }
    rank.docs.push_back(d);
  }
  return plan;
}

std::vector<I> sample(const std::string& name) {
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "bench_node: cannot read %s (set CPDISPATCH_DOC_LENGTHS_DIR)\n", (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

std::vector<cpdispatch::QkvMetadata> plans_of(const std::string& kind, I W, bool placed, double& worst_ratio) {
  if (kind == "zigzag") return {cpdispatch::plan_qkv(zigzag(W, 2 * W * 64))};
  const std::vector<I> lengths = sample(kind);
  std::vector<cpdispatch::QkvMetadata> plans;
  for (int seed = 0; seed < kBatches; ++seed) {
    cpdispatch::BalanceProblem p;
    p.world_size = W;
    p.max_cp_degree = kC;
    p.documents = cpdispatch::draw_workload(lengths, W, kTokensPerRank, static_cast<std::uint64_t>(seed));
    const cpdispatch::QkvDocumentsPlan plan =
        placed ? cpdispatch::plan_balanced(p, {}, cpdispatch::Topology::uniform(W, kRanksPerNode)) : cpdispatch::plan_balanced(p);
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
  cpdispatch::NodeTokenCounts sum;
  I q = 0;
  for (const auto& m : metas) {
    const cpdispatch::NodeTokenCounts c = cpdispatch::node_token_counts(m.kv_fwd, topology);
    sum.flat += c.flat;
    sum.dedup += c.dedup;
    sum.node_level += c.node_level;
    sum.inside += c.inside;
    q += cpdispatch::inter_node_tokens(m.q_fwd, topology);
  }
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

