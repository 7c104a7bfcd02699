// Load-balanced planning of packed batches: planning time (Google Benchmark)
// and plan quality against three baselines on batches drawn from the real
// document-length samples and packed end to end over the ranks (long
// documents span ranks), printed as the markdown table of benchmarks/RESULTS.md.
//
//   bin/bench_balance                                  # the whole grid
//   bin/bench_balance --benchmark_filter='W:64/tokens:64K'
//
// Grid: both samples x W in {8, 16, 64} x {16K, 64K, 128K} tokens per rank x
// C in {8, 16, 32}, 20 seeded batches each (seeds 0..19). A batch with a
// document over more than C ranks cannot be planned with C shards (a shard
// never crosses a piece boundary): its C is raised to that span, and the
// table says in how many batches. Baselines: every shard at home (none), the
// greedy baseline, and per-document zig-zag (Megatron-LM / Transformer
// Engine: 2W chunks, chunk i on rank min(i, 2W-1-i); it ignores C). Bytes are weighed for a
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
  double bound = 0;                            // balance_lower_bound
  bool bound_by_cut = false;                   // a document's C-cut, not the mean, sets it
  bool raised = false;                         // C raised to the widest span
  double spanning = 0;                         // documents that span ranks
  double none = 0, greedy = 0, zigzag = 0, ours = 0;  // max rank cost / bound
  I greedy_bytes = 0, zigzag_bytes = 0, ours_bytes = 0;
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
    p.q_bytes = kQueryBytes;
    p.kv_bytes = kKvBytes;
    p.documents = cpdispatch::draw_workload(sample(c.sample), c.world, c.tokens, static_cast<std::uint64_t>(seed));
    p.max_cp_degree = std::max(c.C, static_cast<I>(cpdispatch::widest_span(p.documents)));
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
    b.raised = p.max_cp_degree > c.C;
    b.spanning = static_cast<double>(cpdispatch::spanning_documents(p.documents));
    auto cost = [&](const cpdispatch::QkvDocumentsPlan& plan) { return cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes); };
    const auto none = cost(cpdispatch::plan_unbalanced(p));
    b.bound_by_cut = b.bound > none.mean_attention() * (1 + 1e-12);
    const auto greedy = cost(cpdispatch::plan_greedy(p));
    const auto zigzag = cost(cpdispatch::plan_zigzag(p));
    const auto ours = cost(cpdispatch::plan_balanced(p));
    b.none = static_cast<double>(none.max_attention()) / b.bound;
    b.greedy = static_cast<double>(greedy.max_attention()) / b.bound;
    b.zigzag = static_cast<double>(zigzag.max_attention()) / b.bound;
    b.ours = static_cast<double>(ours.max_attention()) / b.bound;
    b.greedy_bytes = greedy.bytes_moved;
    b.zigzag_bytes = zigzag.bytes_moved;
    b.ours_bytes = ours.bytes_moved;
    q.push_back(b);
  }
}

void bm_plan_balanced(benchmark::State& state, Config c) {
  const auto& bs = batches_of(c);
  measure_quality(c);
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(bs[i++ % bs.size()]);
    benchmark::DoNotOptimize(plan);
  }
  state.counters["docs"] = static_cast<double>(bs.front().documents.size());
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
  std::printf("\nPlan quality, %d packed batches per row (medians; `max` = worst batch). Imbalance = largest rank cost / lower bound.\n",
              kBatches);
  std::printf("bytes: Llama-3-8B-like layer, %lld B per query token, %lld B per key-value token.\n\n",
              static_cast<long long>(kQueryBytes), static_cast<long long>(kKvBytes));
  std::printf("| workload | W | tokens/rank | C | spanning docs | bound set by cut | none | greedy | zig-zag (max) | ours (max) "
              "| GB moved greedy | zig-zag | ours | time ms CPU (real) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::string notes;
  for (const Config& c : configs) {
    auto it = quality.find(c.name());
    if (it == quality.end()) continue;
    std::vector<double> none, greedy, zigzag, ours, gb, zb, ob, spanning;
    int by_cut = 0, raised = 0;
    for (const BatchQuality& b : it->second) {
      none.push_back(b.none);
      greedy.push_back(b.greedy);
      zigzag.push_back(b.zigzag);
      ours.push_back(b.ours);
      gb.push_back(static_cast<double>(b.greedy_bytes));
      zb.push_back(static_cast<double>(b.zigzag_bytes));
      ob.push_back(static_cast<double>(b.ours_bytes));
      spanning.push_back(b.spanning);
      by_cut += b.bound_by_cut;
      raised += b.raised;
    }
    const auto t = rep.times.find(c.name());
    char time[64] = "-";
    if (t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f (%.2f)", t->second.cpu_ms, t->second.real_ms);
    std::printf("| %s | %lld | %s | %lld | %.0f | %d/%d | %.2f | %.3f | %.3f (%.3f) | %.3f (%.3f) | %.2f | %.2f | %.2f | %s |\n",
                c.sample.c_str(), static_cast<long long>(c.world), tokens_text(c.tokens).c_str(), static_cast<long long>(c.C),
                median(spanning), by_cut, kBatches, median(none), median(greedy), median(zigzag), most(zigzag), median(ours), most(ours),
                median(gb) / 1e9, median(zb) / 1e9, median(ob) / 1e9, time);
    if (raised) {
      notes += "- " + c.sample + ", W = " + std::to_string(c.world) + ", " + tokens_text(c.tokens) + ", C = " + std::to_string(c.C) + ": " +
               std::to_string(raised) + " batch(es) hold a document over more than C ranks; C was raised to its span there.\n";
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
        for (I c : {8, 16, 32}) configs.push_back({s, w, t, c});
  for (const Config& c : configs) {
    benchmark::RegisterBenchmark(c.name().c_str(), bm_plan_balanced, c)->Unit(benchmark::kMillisecond);
  }
  Reporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  print_table(configs, rep);
  benchmark::Shutdown();
  return 0;
}
