// Load-balanced planning (issue 7): planning time (Google Benchmark) and plan
// quality against two baselines on batches drawn from the real document-length
// samples, printed as the markdown table of benchmarks/RESULTS.md.
//
//   bin/bench_balance                                  # the whole grid
//   bin/bench_balance --benchmark_filter='W:64/tokens:64K'
//
// Grid: both samples x W in {8, 16, 64} x {16K, 64K, 128K} tokens per rank x
// C in {4, 8}, 20 seeded batches each (seeds 0..19). Bytes are weighed for a
// Llama-3-8B-like attention layer in bf16: 32 query heads and 8 key-value
// heads of dimension 128, so a query token is 8192 bytes and a key-value
// token (K and V) 4096 bytes. The samples are read from
// $CPDISPATCH_DOC_LENGTHS_DIR, else from the folder configured at build time.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/workload.hpp"

namespace {

using I = std::int64_t;
constexpr int kBatches = 20;
constexpr I kQueryBytes = 8192, kKvBytes = 4096;

struct Config {
  std::string sample;
  I world, tokens, C;
  std::string name() const {
    return "plan_balanced/" + sample + "/W:" + std::to_string(world) + "/tokens:" + std::to_string(tokens / 1024) + "K/C:" + std::to_string(C);
  }
};

/// What each plan achieves on one batch.
struct BatchQuality {
  double bound = 0;             // balance_lower_bound
  bool bound_by_cut = false;    // the costliest document's C-cut, not the mean, sets it
  double none = 0, greedy = 0, ours = 0;  // max rank cost / bound
  I greedy_bytes = 0, ours_bytes = 0;
  I ours_bytes_at_greedy = 0;   // ours, allowed greedy's largest rank cost
};

std::map<std::string, std::vector<std::vector<I>>> samples;           // name -> lengths (one entry)
std::map<std::string, std::vector<cpdispatch::BalanceProblem>> batches;  // config name -> batches
std::map<std::string, std::vector<BatchQuality>> quality;            // config name -> per batch

const std::vector<I>& sample(const std::string& name) {
  auto it = samples.find(name);
  if (it != samples.end()) return it->second.front();
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "bench_balance: cannot read %s (set CPDISPATCH_DOC_LENGTHS_DIR)\n", (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  return samples[name].emplace_back(nlohmann::json::parse(in).get<std::vector<I>>());
}

const std::vector<cpdispatch::BalanceProblem>& batches_of(const Config& c) {
  auto& out = batches[c.name()];
  if (!out.empty()) return out;
  for (int seed = 0; seed < kBatches; ++seed) {
    cpdispatch::BalanceProblem p;
    p.world_size = c.world;
    p.max_cp_degree = c.C;
    p.q_bytes = kQueryBytes;
    p.kv_bytes = kKvBytes;
    p.docs = cpdispatch::draw_workload(sample(c.sample), c.world, c.tokens, static_cast<std::uint64_t>(seed));
    out.push_back(std::move(p));
  }
  return out;
}

void measure_quality(const Config& c) {
  auto& q = quality[c.name()];
  if (!q.empty()) return;
  for (const auto& p : batches_of(c)) {
    BatchQuality b;
    b.bound = cpdispatch::balance_lower_bound(p);
    auto cost = [&](const cpdispatch::QkvPlan& plan) { return cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes); };
    const auto none = cost(cpdispatch::plan_unbalanced(p));
    b.bound_by_cut = b.bound > none.mean_attention() * (1 + 1e-12);
    const auto greedy = cost(cpdispatch::plan_greedy(p));
    const auto ours = cost(cpdispatch::plan_balanced(p));
    cpdispatch::BalanceOptions at_greedy;
    at_greedy.cost_limit = greedy.max_attention();
    const auto ours_loose = cost(cpdispatch::plan_balanced(p, at_greedy));
    b.none = static_cast<double>(none.max_attention()) / b.bound;
    b.greedy = static_cast<double>(greedy.max_attention()) / b.bound;
    b.ours = static_cast<double>(ours.max_attention()) / b.bound;
    b.greedy_bytes = greedy.bytes_moved;
    b.ours_bytes = ours.bytes_moved;
    b.ours_bytes_at_greedy = ours_loose.bytes_moved;
    q.push_back(b);
  }
}

void bm_plan_balanced(benchmark::State& state, Config c) {
  const auto& bs = batches_of(c);
  measure_quality(c);
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvPlan plan = cpdispatch::plan_balanced(bs[i++ % bs.size()]);
    benchmark::DoNotOptimize(plan);
  }
  I docs = 0;
  for (const auto& rank : bs.front().docs) docs += static_cast<I>(rank.size());
  state.counters["docs"] = static_cast<double>(docs);
}

/// Captures each benchmark's CPU and real time per plan for the table: the
/// median over --benchmark_repetitions when repeated.
class Reporter : public benchmark::ConsoleReporter {
 public:
  struct Times {
    double cpu_ms, real_ms;
  };
  std::map<std::string, Times> times;
  Reporter() : ConsoleReporter(OO_Tabular) {}  // no colour codes in the saved output
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      const bool median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
      if (!median && r.run_type != Run::RT_Iteration) continue;
      const double to_ms = 1e3 / benchmark::GetTimeUnitMultiplier(r.time_unit);
      times[r.run_name.function_name] = {r.GetAdjustedCPUTime() * to_ms, r.GetAdjustedRealTime() * to_ms};
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}
double most(const std::vector<double>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

std::string tokens_text(I t) { return std::to_string(t / 1024) + "K"; }

void print_table(const std::vector<Config>& configs, const Reporter& rep) {
  std::printf("\nPlan quality, %d batches per row (medians; `max` = worst batch). Imbalance = largest rank cost / lower bound.\n", kBatches);
  std::printf("bytes: Llama-3-8B-like layer, %lld B per query token, %lld B per key-value token.\n\n",
              static_cast<long long>(kQueryBytes), static_cast<long long>(kKvBytes));
  std::printf("| workload | W | tokens/rank | C | bound set by cut | imbalance none | greedy | ours (max) "
              "| bytes greedy | ours | ours/greedy (max) | ours/greedy at greedy's imbalance (max) | time ms CPU (real) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::string notes;
  for (const Config& c : configs) {
    auto it = quality.find(c.name());
    if (it == quality.end()) continue;
    std::vector<double> none, greedy, ours, gb, ob, ratio, ratio_at;
    int by_cut = 0, idle = 0;
    for (const BatchQuality& b : it->second) {
      none.push_back(b.none);
      greedy.push_back(b.greedy);
      ours.push_back(b.ours);
      gb.push_back(static_cast<double>(b.greedy_bytes));
      ob.push_back(static_cast<double>(b.ours_bytes));
      by_cut += b.bound_by_cut;
      if (b.greedy_bytes == 0) {  // no ratio: noted below the table
        ++idle;
        continue;
      }
      ratio.push_back(static_cast<double>(b.ours_bytes) / static_cast<double>(b.greedy_bytes));
      ratio_at.push_back(static_cast<double>(b.ours_bytes_at_greedy) / static_cast<double>(b.greedy_bytes));
    }
    const auto t = rep.times.find(c.name());
    char time[64] = "-";
    if (t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f (%.2f)", t->second.cpu_ms, t->second.real_ms);
    std::printf("| %s | %lld | %s | %lld | %d/%d | %.2f | %.3f | %.3f (%.3f) | %.1f MB | %.1f MB | %.2f (%.2f) | %.2f (%.2f) | %s |\n",
                c.sample.c_str(), static_cast<long long>(c.world), tokens_text(c.tokens).c_str(), static_cast<long long>(c.C), by_cut,
                kBatches, median(none), median(greedy), median(ours), most(ours), median(gb) / 1e6, median(ob) / 1e6, median(ratio),
                most(ratio), median(ratio_at), most(ratio_at), time);
    if (idle) {
      notes += "- " + c.sample + ", W = " + std::to_string(c.world) + ", " + tokens_text(c.tokens) + ", C = " + std::to_string(c.C) +
               ": greedy moved nothing in " + std::to_string(idle) + " batch(es) (the unbalanced plan was already within 10%); "
               "the ratios are over the other batches.\n";
    }
  }
  if (!notes.empty()) std::printf("\n%s", notes.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::vector<Config> configs;
  for (const char* s : {"prolong", "wlbllm"})
    for (I w : {8, 16, 64})
      for (I t : {16384, 65536, 131072})
        for (I c : {4, 8}) configs.push_back({s, w, t, c});
  for (const Config& c : configs) {
    benchmark::RegisterBenchmark(c.name().c_str(), bm_plan_balanced, c)->Unit(benchmark::kMillisecond);
  }
  Reporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  print_table(configs, rep);
  benchmark::Shutdown();
  return 0;
}
