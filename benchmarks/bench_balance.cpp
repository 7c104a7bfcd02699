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
// $CPDISPATCH_DOC_LENGTHS_DIR, else from the project's data/ folder.
//
// A second table compares, per row, the plan balanced for the deduplicated
// KV exchange (BalanceOptions::dedup) with the plan balanced without it:
// both plans' key-value tokens on the wire when run deduplicated (counted by
// plan_kv_wire, docs/plan-format.md section 2c), their ratio, and both
// imbalances. plan_balanced_dedup/... times planning with the option.
//
// A third table balances the C = 16 rows under each attention mask (causal,
// a sliding window of 4096 tokens, full; docs/plan-format.md section 2d):
// imbalance against the mask's own lower bound, and the key-value bytes the
// mask sends, next to the zig-zag baseline's under the same mask.
// plan_balanced_mask/<mask>/... times planning under the mask.
//
// A fourth table gives the inter-node columns (benchmarks/node_columns.hpp,
// docs/node-exchange.md), 8 ranks a node, W = 16, 64, 256, 32K tokens a rank,
// C = 8 (or a document's span), 8 batches a row: the key-value bytes that
// cross nodes in the flat, rank-level dedup and node-level exchanges of the
// plan balanced without the topology (blind), with it (aware: plan_balanced
// with a Topology) and zig-zag (W <= 64), each plan's balance, and the target
// check (aware node-level <= half of blind dedup, at equal balance).
// plan_balanced_topology/... times planning with the topology.
//
// A fifth table balances batches whose documents are all shared-prefix ones
// (docs/plan-format.md section 2e: a prompt of a third, 8 responses, each
// seeing the prompt and itself causally): both samples, W in {8, 16, 64},
// 16K, 32K, 64K and 128K tokens per rank, C = 16, imbalance against the
// slices' own lower bound next to the same batch under the causal mask
// (target: median over the grid within 1.03). plan_balanced_slices/...
// times planning with the slices:
//
//   bin/bench_balance --benchmark_filter='plan_balanced_slices/'
//
// A sixth table plans the C = 16 rows on the invariant mode's grid
// (BalanceOptions::grid = 64, docs/invariant-attention.md): the balancer's
// lower bound with the grid over the bound without it (target: within
// 1.005 on a row's median), each plan's largest rank cost over the bound
// without the grid, and bytes moved, grid over no grid.
// plan_balanced_grid/... times planning on the grid:
//
//   bin/bench_balance --benchmark_filter='plan_balanced_grid/'

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

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "node_columns.hpp"
#include "shared_prefix.hpp"
#include "stats.hpp"

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
  // Balanced for the deduplicated exchange, against ours (balanced without).
  double dedup = 0;                // max rank cost / bound
  I ours_wire_kv = 0, dedup_wire_kv = 0;  // KV tokens on the wire, both run deduplicated
  I ours_wire = 0, dedup_wire = 0;        // bytes on the wire (queries + deduplicated KV)
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

/// KV tokens the deduplicated exchange of a plan sends between ranks.
I wire_kv_tokens(const cpdispatch::QkvDocumentsPlan& plan) {
  return cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(cpdispatch::plan_qkv(plan)).fwd);
}

void measure_dedup(const cpdispatch::BalanceProblem& p, const cpdispatch::QkvDocumentsPlan& ours, BatchQuality& b) {
  cpdispatch::BalanceOptions with;
  with.dedup = true;
  const cpdispatch::QkvDocumentsPlan dedup = cpdispatch::plan_balanced(p, with);
  const auto ours_cost = cpdispatch::plan_cost(ours, p.q_bytes, p.kv_bytes);
  const auto dedup_cost = cpdispatch::plan_cost(dedup, p.q_bytes, p.kv_bytes);
  b.dedup = static_cast<double>(dedup_cost.max_attention()) / b.bound;
  b.ours_wire_kv = wire_kv_tokens(ours);
  b.dedup_wire_kv = wire_kv_tokens(dedup);
  b.ours_wire = ours_cost.query_bytes + p.kv_bytes * b.ours_wire_kv;
  b.dedup_wire = dedup_cost.query_bytes + p.kv_bytes * b.dedup_wire_kv;
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
    const cpdispatch::QkvDocumentsPlan ours_plan = cpdispatch::plan_balanced(p);
    const auto ours = cost(ours_plan);
    b.none = static_cast<double>(none.max_attention()) / b.bound;
    b.greedy = static_cast<double>(greedy.max_attention()) / b.bound;
    b.zigzag = static_cast<double>(zigzag.max_attention()) / b.bound;
    b.ours = static_cast<double>(ours.max_attention()) / b.bound;
    b.greedy_bytes = greedy.bytes_moved;
    b.zigzag_bytes = zigzag.bytes_moved;
    b.ours_bytes = ours.bytes_moved;
    measure_dedup(p, ours_plan, b);
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

void bm_plan_balanced_dedup(benchmark::State& state, Config c) {
  const auto& bs = batches_of(c);
  cpdispatch::BalanceOptions with;
  with.dedup = true;
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(bs[i++ % bs.size()], with);
    benchmark::DoNotOptimize(plan);
  }
}

const cpdispatch::AttentionMask kMasks[] = {cpdispatch::AttentionMask::causal(), cpdispatch::AttentionMask::sliding_window(4096),
                                            cpdispatch::AttentionMask::full()};

/// One batch under one mask: balanced and zig-zag, each against the bound.
struct MaskQuality {
  double ours = 0, zigzag = 0;  // max rank cost / bound
  I ours_kv = 0, zigzag_kv = 0;  // key-value bytes sent
};
std::map<std::string, std::vector<MaskQuality>> mask_quality;  // mask_name -> per batch

std::string mask_name(const Config& c, const cpdispatch::AttentionMask& m) {
  return "plan_balanced_mask/" + to_string(m) + c.name().substr(std::string("plan_balanced").size());
}

cpdispatch::BalanceProblem with_mask(cpdispatch::BalanceProblem p, const cpdispatch::AttentionMask& m) {
  p.mask = m;
  return p;
}

void measure_mask(const Config& c, const cpdispatch::AttentionMask& m) {
  auto& q = mask_quality[mask_name(c, m)];
  if (!q.empty()) return;
  for (const auto& batch : batches_of(c)) {
    const cpdispatch::BalanceProblem p = with_mask(batch, m);
    const double bound = cpdispatch::balance_lower_bound(p);
    const auto ours = cpdispatch::plan_cost(cpdispatch::plan_balanced(p), p.q_bytes, p.kv_bytes);
    const auto zigzag = cpdispatch::plan_cost(cpdispatch::plan_zigzag(p), p.q_bytes, p.kv_bytes);
    q.push_back({static_cast<double>(ours.max_attention()) / bound, static_cast<double>(zigzag.max_attention()) / bound, ours.kv_bytes,
                 zigzag.kv_bytes});
  }
}

void bm_plan_balanced_mask(benchmark::State& state, Config c, cpdispatch::AttentionMask m) {
  const auto& bs = batches_of(c);
  measure_mask(c, m);
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(with_mask(bs[i++ % bs.size()], m));
    benchmark::DoNotOptimize(plan);
  }
}

/// One batch made of shared-prefix documents, balanced, and the same batch
/// causal: each largest rank cost over its own lower bound.
struct SliceQuality {
  double slices = 0, causal = 0;
};
std::map<std::string, std::vector<SliceQuality>> slice_quality;  // slice_name -> per batch
constexpr I kSliceTokens[] = {16384, 32768, 65536, 131072};
constexpr I kResponses = 8;

std::string slice_name(const Config& c) { return "plan_balanced_slices" + c.name().substr(std::string("plan_balanced").size()); }

/// Every document of `p` made a shared-prefix one.
cpdispatch::BalanceProblem with_shared_prefix(cpdispatch::BalanceProblem p) {
  for (cpdispatch::BalanceDocument& doc : p.documents) {
    I length = 0;
    for (const auto& piece : doc.pieces) length += piece.len;
    doc.slices = bench::shared_prefix_slices(length, kResponses);
  }
  return p;
}

double imbalance(const cpdispatch::BalanceProblem& p) {
  const auto cost = cpdispatch::plan_cost(cpdispatch::plan_balanced(p), p.q_bytes, p.kv_bytes);
  return static_cast<double>(cost.max_attention()) / cpdispatch::balance_lower_bound(p);
}

void measure_slices(const Config& c) {
  auto& q = slice_quality[slice_name(c)];
  if (!q.empty()) return;
  for (const auto& batch : batches_of(c)) q.push_back({imbalance(with_shared_prefix(batch)), imbalance(batch)});
}

void bm_plan_balanced_slices(benchmark::State& state, Config c) {
  std::vector<cpdispatch::BalanceProblem> bs;
  for (const auto& batch : batches_of(c)) bs.push_back(with_shared_prefix(batch));
  measure_slices(c);
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(bs[i++ % bs.size()]);
    benchmark::DoNotOptimize(plan);
  }
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

using bench::median;
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

double ratio(I a, I b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 1.0; }

/// Balanced for dedup vs balanced without, both run with the deduplicated exchange.
void print_dedup_table(const std::vector<Config>& configs, const Reporter& rep) {
  std::printf("\nBalanced for the deduplicated KV exchange (dedup) vs balanced without (ours), both run deduplicated, %d batches per row.\n"
              "KV: key-value tokens on the wire (plan_kv_wire), summed over the batches; ratio = dedup / ours (per batch: min, median).\n"
              "wire bytes: queries + deduplicated key-values. Imbalance = largest rank cost / lower bound (median, max).\n\n",
              kBatches);
  std::printf("| workload | W | tokens/rank | C | imbalance ours | imbalance dedup | KV Mtok ours | KV Mtok dedup | KV ratio (min, median) "
              "| wire bytes ratio | batches fewer | time ms CPU ours / dedup |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : configs) {
    auto it = quality.find(c.name());
    if (it == quality.end()) continue;
    std::vector<double> ours, dedup, kv_ratio;
    I ours_kv = 0, dedup_kv = 0, ours_wire = 0, dedup_wire = 0;
    int fewer = 0;
    for (const BatchQuality& b : it->second) {
      ours.push_back(b.ours);
      dedup.push_back(b.dedup);
      kv_ratio.push_back(ratio(b.dedup_wire_kv, b.ours_wire_kv));
      ours_kv += b.ours_wire_kv;
      dedup_kv += b.dedup_wire_kv;
      ours_wire += b.ours_wire;
      dedup_wire += b.dedup_wire;
      fewer += b.dedup_wire < b.ours_wire;
    }
    char time[64] = "-";
    const auto t = rep.times.find(c.name()), td = rep.times.find("plan_balanced_dedup" + c.name().substr(std::string("plan_balanced").size()));
    if (t != rep.times.end() && td != rep.times.end()) std::snprintf(time, sizeof time, "%.2f / %.2f", t->second.cpu_ms, td->second.cpu_ms);
    std::printf("| %s | %lld | %s | %lld | %.4f (%.4f) | %.4f (%.4f) | %.3f | %.3f | %.3f (%.3f, %.3f) | %.4f | %d/%d | %s |\n", c.sample.c_str(),
                static_cast<long long>(c.world), tokens_text(c.tokens).c_str(), static_cast<long long>(c.C), median(ours), most(ours),
                median(dedup), most(dedup), static_cast<double>(ours_kv) / 1e6, static_cast<double>(dedup_kv) / 1e6, ratio(dedup_kv, ours_kv),
                kv_ratio.empty() ? 1.0 : *std::min_element(kv_ratio.begin(), kv_ratio.end()), median(kv_ratio), ratio(dedup_wire, ours_wire),
                fewer, kBatches, time);
  }
}

/// Per mask: imbalance of ours and zig-zag, and the key-value bytes each sends.
void print_mask_table(const std::vector<Config>& configs, const Reporter& rep) {
  std::printf("\nBalancing under each attention mask, %d batches per row (C = 16 rows). Imbalance = largest rank cost / the mask's lower\n"
              "bound (median, max); KV GB: key-value bytes the mask sends (median), ours and zig-zag under the same mask.\n\n",
              kBatches);
  std::printf("| workload | W | tokens/rank | mask | ours (max) | zig-zag (max) | KV GB ours | KV GB zig-zag | time ms CPU |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : configs) {
    for (const cpdispatch::AttentionMask& m : kMasks) {
      auto it = mask_quality.find(mask_name(c, m));
      if (it == mask_quality.end()) continue;
      std::vector<double> ours, zigzag, ok, zk;
      for (const MaskQuality& b : it->second) {
        ours.push_back(b.ours);
        zigzag.push_back(b.zigzag);
        ok.push_back(static_cast<double>(b.ours_kv));
        zk.push_back(static_cast<double>(b.zigzag_kv));
      }
      char time[32] = "-";
      if (const auto t = rep.times.find(mask_name(c, m)); t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f", t->second.cpu_ms);
      std::printf("| %s | %lld | %s | %s | %.3f (%.3f) | %.3f (%.3f) | %.2f | %.2f | %s |\n", c.sample.c_str(), static_cast<long long>(c.world),
                  tokens_text(c.tokens).c_str(), to_string(m).c_str(), median(ours), most(ours), median(zigzag), most(zigzag), median(ok) / 1e9,
                  median(zk) / 1e9, time);
    }
  }
}

/// Shared-prefix batches: imbalance per row, and the median over every batch measured.
void print_slice_table(const std::vector<Config>& configs, const Reporter& rep) {
  std::printf("\nBalancing shared-prefix batches (prompt a third, %lld responses), %d batches per row, C = 16. Imbalance = largest rank\n"
              "cost / lower bound (median, max), with the slices and for the same batch causal.\n\n",
              static_cast<long long>(kResponses), kBatches);
  std::printf("| workload | W | tokens/rank | shared-prefix (max) | causal (max) | time ms CPU |\n");
  std::printf("|---|---|---|---|---|---|\n");
  std::vector<double> all;
  for (const Config& c : configs) {
    const auto it = slice_quality.find(slice_name(c));
    if (it == slice_quality.end()) continue;
    std::vector<double> slices, causal;
    for (const SliceQuality& b : it->second) {
      slices.push_back(b.slices);
      causal.push_back(b.causal);
    }
    all.insert(all.end(), slices.begin(), slices.end());
    char time[32] = "-";
    if (const auto t = rep.times.find(slice_name(c)); t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f", t->second.cpu_ms);
    std::printf("| %s | %lld | %s | %.4f (%.4f) | %.4f (%.4f) | %s |\n", c.sample.c_str(), static_cast<long long>(c.world), tokens_text(c.tokens).c_str(),
                median(slices), most(slices), median(causal), most(causal), time);
  }
  if (!all.empty()) std::printf("\nMedian over the %zu batches measured: %.4f (target: within 1.03).\n", all.size(), median(all));
}

/// One batch planned on the grid and without it.
struct GridQuality {
  double bound = 0;       // the lower bound with the grid / without it
  double on = 0, off = 0;  // largest rank cost / the bound without the grid
  double bytes = 0;       // bytes moved, grid / no grid
};
std::map<std::string, std::vector<GridQuality>> grid_quality;  // grid_name -> per batch
constexpr I kGrid = 64;

std::string grid_name(const Config& c) { return "plan_balanced_grid" + c.name().substr(std::string("plan_balanced").size()); }

cpdispatch::BalanceOptions on_the_grid() {
  cpdispatch::BalanceOptions o;
  o.grid = kGrid;
  return o;
}

void measure_grid(const Config& c) {
  auto& q = grid_quality[grid_name(c)];
  if (!q.empty()) return;
  for (const auto& p : batches_of(c)) {
    const double bound = cpdispatch::balance_lower_bound(p);
    const auto on = cpdispatch::plan_cost(cpdispatch::plan_balanced(p, on_the_grid()), p.q_bytes, p.kv_bytes);
    const auto off = cpdispatch::plan_cost(cpdispatch::plan_balanced(p), p.q_bytes, p.kv_bytes);
    q.push_back({cpdispatch::balance_lower_bound(p, on_the_grid()) / bound, static_cast<double>(on.max_attention()) / bound,
                 static_cast<double>(off.max_attention()) / bound, static_cast<double>(on.bytes_moved) / static_cast<double>(off.bytes_moved)});
  }
}

void bm_plan_balanced_grid(benchmark::State& state, Config c) {
  const auto& bs = batches_of(c);
  measure_grid(c);
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(bs[i++ % bs.size()], on_the_grid());
    benchmark::DoNotOptimize(plan);
  }
}

void print_grid_table(const std::vector<Config>& configs, const Reporter& rep) {
  std::printf("\nPlanning on the grid of %lld tokens, %d batches per row (C = 16 rows). Bound: the balancer's lower bound with the grid /\n"
              "without it (median, max; target: median within 1.005). Cost: largest rank cost / the bound without the grid (median),\n"
              "on the grid and off it. Bytes: bytes moved, grid / no grid (median, range).\n\n",
              static_cast<long long>(kGrid), kBatches);
  std::printf("| workload | W | tokens/rank | bound (max) | cost on the grid | cost off it | bytes (range) | time ms CPU |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : configs) {
    const auto it = grid_quality.find(grid_name(c));
    if (it == grid_quality.end()) continue;
    std::vector<double> bound, on, off, bytes;
    for (const GridQuality& b : it->second) {
      bound.push_back(b.bound);
      on.push_back(b.on);
      off.push_back(b.off);
      bytes.push_back(b.bytes);
    }
    char time[32] = "-";
    if (const auto t = rep.times.find(grid_name(c)); t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f", t->second.cpu_ms);
    std::printf("| %s | %lld | %s | %.4f (%.4f) | %.4f | %.4f | %.3f (%.3f-%.3f) | %s |\n", c.sample.c_str(), static_cast<long long>(c.world),
                tokens_text(c.tokens).c_str(), median(bound), most(bound), median(on), median(off), median(bytes),
                *std::min_element(bytes.begin(), bytes.end()), most(bytes), time);
  }
}

constexpr int kNodeBatches = 8;
constexpr I kNodeWorlds[] = {16, 64, 256};
std::map<std::string, node_columns::RowColumns> node_rows;  // name -> row

std::string node_name(const std::string& sample_name, I W) { return "plan_balanced_topology/" + sample_name + "/W:" + std::to_string(W); }

void bm_plan_balanced_topology(benchmark::State& state, std::string sample_name, I W) {
  const std::string name = node_name(sample_name, W);
  if (!node_rows.count(name)) node_rows[name] = node_columns::measure_row(sample(sample_name), W, kNodeBatches);
  std::vector<cpdispatch::BalanceProblem> bs;
  for (int seed = 0; seed < kNodeBatches; ++seed) bs.push_back(node_columns::column_problem(sample(sample_name), W, static_cast<std::uint64_t>(seed)));
  std::size_t i = 0;
  for (auto _ : state) {
    cpdispatch::QkvDocumentsPlan plan = node_columns::balanced(bs[i++ % bs.size()], true);
    benchmark::DoNotOptimize(plan);
  }
}

/// One plan's inter-node KV GB a batch: flat | dedup | node-level.
std::string node_cells(const node_columns::InterNode& sum, int batches) {
  const double gb = static_cast<double>(node_columns::kKvBytes) / 1e9 / batches;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f | %.3f | %.3f", static_cast<double>(sum.kv.flat) * gb, static_cast<double>(sum.kv.dedup) * gb,
                static_cast<double>(sum.kv.node_level) * gb);
  return buf;
}

std::string target_text(const node_columns::RowColumns& r) {
  if (r.target_met()) return "met";
  std::string why;
  if (!r.bytes_met()) why += "bytes";
  if (!r.equal_balance()) why += why.empty() ? "balance" : " and balance";
  return "not met (" + why + ")";
}

/// Inter-node KV bytes of the blind, aware and zig-zag plans, and the target check.
void print_node_table(const Reporter& rep) {
  std::printf("\nInter-node key-value bytes, %lld ranks a node, %d batches a row (32K tokens a rank, C = 8 or a document's span,\n"
              "%lld B a key-value token). GB a batch (mean) crossing nodes in the flat (section 2), rank-level dedup (2c) and node-level\n"
              "exchanges: blind = plan_balanced without the topology, aware = with it, zig-zag for reference (W <= 64).\n"
              "Balance = largest rank attention cost / lower bound (median; zig-zag ignores C, so it can go under the C-cut bound).\n"
              "Target: aware node-level <= %.2f x blind dedup, aware balance median <= %.2f and per batch <= blind + %.2f.\n\n",
              static_cast<long long>(node_columns::kRanksPerNode), kNodeBatches, static_cast<long long>(node_columns::kKvBytes),
              node_columns::kTargetFraction, node_columns::kBalanceLimit, node_columns::kBalanceSlack);
  std::printf("| workload | W | blind flat | blind dedup | blind node | aware flat | aware dedup | aware node | zig-zag flat | zig-zag dedup "
              "| zig-zag node | balance blind / aware / zig-zag | aware - blind (worst batch) | aware node / blind dedup | target | time ms CPU |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const char* s : {"prolong", "wlbllm"}) {
    for (I W : kNodeWorlds) {
      const auto it = node_rows.find(node_name(s, W));
      if (it == node_rows.end()) continue;
      const node_columns::RowColumns& r = it->second;
      char time[32] = "-";
      if (const auto t = rep.times.find(it->first); t != rep.times.end()) std::snprintf(time, sizeof time, "%.2f", t->second.cpu_ms);
      char zig[32] = "-";
      if (r.has_zigzag) std::snprintf(zig, sizeof zig, "%.4f", r.zigzag_ratio);
      std::printf("| %s | %lld | %s | %s | %s | %.4f / %.4f / %s | %+.4f | %.3f | %s | %s |\n", s, static_cast<long long>(W),
                  node_cells(r.blind, r.batches).c_str(), node_cells(r.aware, r.batches).c_str(),
                  r.has_zigzag ? node_cells(r.zigzag, r.batches).c_str() : "- | - | -", r.blind_ratio, r.aware_ratio, zig, r.worst_excess,
                  r.target_ratio(), target_text(r).c_str(), time);
    }
  }
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
    const std::string dedup = "plan_balanced_dedup" + c.name().substr(std::string("plan_balanced").size());
    benchmark::RegisterBenchmark(dedup.c_str(), bm_plan_balanced_dedup, c)->Unit(benchmark::kMillisecond);
    if (c.C != 16) continue;
    for (const cpdispatch::AttentionMask& m : kMasks) {
      benchmark::RegisterBenchmark(mask_name(c, m).c_str(), bm_plan_balanced_mask, c, m)->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark(grid_name(c).c_str(), bm_plan_balanced_grid, c)->Unit(benchmark::kMillisecond);
  }
  std::vector<Config> slice_configs;
  for (const char* s : {"prolong", "wlbllm"})
    for (I w : {8, 16, 64})
      for (I t : kSliceTokens) slice_configs.push_back({s, w, t, 16});
  for (const Config& c : slice_configs) benchmark::RegisterBenchmark(slice_name(c).c_str(), bm_plan_balanced_slices, c)->Unit(benchmark::kMillisecond);
  for (const char* s : {"prolong", "wlbllm"})
    for (I W : kNodeWorlds)
      benchmark::RegisterBenchmark(node_name(s, W).c_str(), bm_plan_balanced_topology, std::string(s), W)->Unit(benchmark::kMillisecond);
  Reporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  print_table(configs, rep);
  print_dedup_table(configs, rep);
  print_mask_table(configs, rep);
  print_node_table(rep);
  print_slice_table(slice_configs, rep);
  print_grid_table(configs, rep);
  benchmark::Shutdown();
  return 0;
}
