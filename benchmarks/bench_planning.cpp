// plan_qkv throughput: world sizes 8 .. 4096, 16 documents per rank, each
// cut into 1, 2, 4 or 8 shards (create_qkv_dispatch, max_cp_degree 8).
//
// Counters: `entries` (dispatch entries of one plan: query entries + KV
// copies) and `entries/s` (entries planned per second). Target: W = 1024
// under 50 ms. Results: benchmarks/RESULTS.md.
//
// The documents form (documents that may span ranks) is measured against the
// per-rank form of the same layout in the same run: BM_PlanQkvDocumentsForm
// plans to_documents() of BM_PlanQkv's plan (target: at most 1.2x), and
// BM_PlanQkvCrossRank a packed plan (16 shards per rank) whose long
// documents continue over consecutive ranks.
//
// Masks made of slices (docs/plan-format.md, section 2e): BM_PlanQkvForRankSlices
// plans one rank's share of the per-rank batch in documents form, every
// document causal or made a shared-prefix one (a prompt of a third, 8
// responses), side by side (target: shared-prefix at most 2x causal);
// BM_PlanQkvSlices plans the same batches globally (plan_qkv, kept output);
// BM_VerifyCoverageForRank checks one rank's share of the same plans with
// verify_coverage_for_rank (target: under 1 s at W = 16384).

#include <cstdint>
#include <ctime>

#include <benchmark/benchmark.h>

#include "cpdispatch/check/coverage.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "shared_prefix.hpp"

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

std::int64_t dispatch_entries(const cpdispatch::QkvDocumentsPlan& plan) {
  std::int64_t entries = 0;
  for (const auto& doc : plan.documents) {
    const auto n = static_cast<std::int64_t>(doc.shards.size());
    entries += n + n * (n + 1) / 2;
  }
  return entries;
}

template <class Plan>
void plan_and_count(benchmark::State& state, const Plan& plan) {
  for (auto _ : state) {
    cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    benchmark::DoNotOptimize(meta);
    benchmark::ClobberMemory();
  }
  const auto entries = static_cast<double>(dispatch_entries(plan));
  state.counters["entries"] = benchmark::Counter(entries);
  state.counters["entries/s"] = benchmark::Counter(entries, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_PlanQkvDocumentsForm(benchmark::State& state) {
  const cpdispatch::QkvPlan plan =
      cpdispatch::create_qkv_dispatch(state.range(0), kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  plan_and_count(state, cpdispatch::to_documents(plan));
}

/// A packed batch: documents of 1..8 shards laid end to end over the ranks
/// in order, so a document's shards sit on one or more consecutive ranks
/// (16 shards per rank on average), each attending on a random rank.
cpdispatch::QkvDocumentsPlan packed_plan(std::int64_t world) {
  cpdispatch::Rng rng(kSeed);
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = world;
  plan.max_cp_degree = kMaxCpDegree;
  const std::int64_t shards_per_rank = 16;
  std::int64_t placed = 0;
  while (placed < world * shards_per_rank) {
    cpdispatch::PackedDocument doc;
    const std::int64_t n = rng.between(1, kMaxCpDegree);
    for (std::int64_t k = 0; k < n && placed < world * shards_per_rank; ++k, ++placed) {
      doc.shards.push_back({placed / shards_per_rank, rng.between(1, 2048), rng.between(0, world - 1)});
    }
    plan.documents.push_back(std::move(doc));
  }
  return plan;
}

void BM_PlanQkvCrossRank(benchmark::State& state) { plan_and_count(state, packed_plan(state.range(0))); }

BENCHMARK(BM_PlanQkvDocumentsForm)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanQkvCrossRank)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

}  // namespace

namespace {

void BM_PlanQkvForRank(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  for (auto _ : state) {
    cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, world / 2);
    benchmark::DoNotOptimize(mine);
    benchmark::ClobberMemory();
  }
  const auto entries = static_cast<double>(dispatch_entries(plan));
  state.counters["entries"] = benchmark::Counter(entries);
  state.counters["entries/s"] = benchmark::Counter(entries, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_PlanQkvForRank)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond);

void count_entries(benchmark::State& state, double entries) {
  state.counters["entries"] = benchmark::Counter(entries);
  state.counters["entries/s"] = benchmark::Counter(entries, benchmark::Counter::kIsIterationInvariantRate);
}

/// Plans rank world / 2's share of `plan` every iteration into kept output
/// and workspace, as a training loop does; the last share.
template <class Plan>
cpdispatch::RankQkvMetadata plan_middle_rank(benchmark::State& state, const Plan& plan, std::int64_t world) {
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankPlanWorkspace workspace;
  for (auto _ : state) {
    cpdispatch::plan_qkv_for_rank(plan, world / 2, mine, workspace);
    benchmark::DoNotOptimize(mine);
    benchmark::ClobberMemory();
  }
  return mine;
}

/// Per-rank planning (reused storage) under each attention mask (mask 0:
/// causal, 1: full, 2: a window of 4096 tokens, 3: a window of 512): the
/// needed ranges change the KV copies, so "kv_entries" counts what each mask
/// places (the KV groups of every query shard).
void BM_PlanQkvForRankMask(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  const cpdispatch::AttentionMask masks[] = {cpdispatch::AttentionMask::causal(), cpdispatch::AttentionMask::full(),
                                             cpdispatch::AttentionMask::sliding_window(4096), cpdispatch::AttentionMask::sliding_window(512)};
  plan.mask = masks[state.range(1)];
  state.SetLabel(to_string(plan.mask));
  const cpdispatch::RankQkvMetadata mine = plan_middle_rank(state, plan, world);
  double kv_entries = 0;
  cpdispatch::detail::DocumentRanges need;
  for (const auto& rank : plan.ranks)
    for (const auto& doc : rank.docs) {
      need.compute(plan.mask, doc.shard_len.data(), doc.shard_len.size());
      for (std::size_t i = 0; i < doc.shard_len.size(); ++i) kv_entries += static_cast<double>(need.hi[i] - need.lo[i] + 1);
    }
  state.counters["kv_entries"] = benchmark::Counter(kv_entries);
  state.counters["kv_tokens_at_rank"] = benchmark::Counter(static_cast<double>(mine.kv_fwd.num_total_recv_tokens));
}

BENCHMARK(BM_PlanQkvForRankMask)->ArgNames({"W", "mask"})->ArgsProduct({{1024, 16384}, {0, 1, 2, 3}})->Unit(benchmark::kMillisecond);

/// Per-rank planning every step into the same output and workspace (the
/// storage-reusing overload), against BM_PlanQkvForRank's fresh result.
void BM_PlanQkvForRankReuse(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  plan_middle_rank(state, plan, world);
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

/// Per-rank planning of the same layout in documents form (a shard table
/// sorted by home rank instead of one pass over the ranks).
void BM_PlanQkvForRankDocumentsForm(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvDocumentsPlan plan =
      cpdispatch::to_documents(cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed));
  for (auto _ : state) {
    cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, world / 2);
    benchmark::DoNotOptimize(mine);
    benchmark::ClobberMemory();
  }
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

/// The documents form planned every step with a kept workspace (its shard
/// table rebuilt in place), against BM_PlanQkvForRankDocumentsForm.
void BM_PlanQkvForRankDocumentsFormReuse(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvDocumentsPlan plan =
      cpdispatch::to_documents(cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed));
  plan_middle_rank(state, plan, world);
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

/// Per-rank planning with the deduplicated exchange's slices in the same
/// pass (reused storage), against BM_PlanQkvForRankReuse without them.
void BM_PlanQkvForRankDedup(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankKvWire wire;
  cpdispatch::RankPlanWorkspace workspace;
  for (auto _ : state) {
    cpdispatch::plan_qkv_for_rank(plan, world / 2, mine, workspace, &wire);
    benchmark::DoNotOptimize(mine);
    benchmark::DoNotOptimize(wire);
    benchmark::ClobberMemory();
  }
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

/// The same slices from the global route: plan_qkv, plan_kv_wire, get_slice.
void BM_PlanKvWireGlobalSlice(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  for (auto _ : state) {
    cpdispatch::RankKvWire wire = cpdispatch::plan_kv_wire(cpdispatch::plan_qkv(plan)).get_slice(world / 2);
    benchmark::DoNotOptimize(wire);
    benchmark::ClobberMemory();
  }
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

BENCHMARK(BM_PlanQkvForRankReuse)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanQkvForRankDocumentsForm)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanQkvForRankDocumentsFormReuse)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanQkvForRankDedup)->ArgName("W")->Arg(8)->Arg(64)->Arg(1024)->Arg(16384)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanKvWireGlobalSlice)->ArgName("W")->Arg(8)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond);

/// Global planning every step into the same QkvMetadata (the storage-reusing
/// overload), against BM_PlanQkv's fresh metadata.
void BM_PlanQkvReuse(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  cpdispatch::QkvMetadata meta;
  for (auto _ : state) {
    cpdispatch::plan_qkv(plan, meta);
    benchmark::DoNotOptimize(meta);
    benchmark::ClobberMemory();
  }
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

/// The per-rank batch in documents form under the causal mask, every
/// document made a shared-prefix one (8 responses) when `shared_prefix`.
cpdispatch::QkvDocumentsPlan slice_batch(std::int64_t world, bool shared_prefix) {
  cpdispatch::QkvDocumentsPlan plan =
      cpdispatch::to_documents(cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed));
  for (cpdispatch::PackedDocument& doc : plan.documents) {
    std::int64_t length = 0;
    for (const cpdispatch::DocumentShard& s : doc.shards) length += s.len;
    if (shared_prefix) doc.slices = bench::shared_prefix_slices(length, 8);
  }
  return plan;
}

/// Attention entries of a rank's share (the implicit entry counts one).
double attention_entries(const cpdispatch::RankAttentionLayout& a) {
  if (a.entries.empty()) return static_cast<double>(a.seqlens_q.size());
  double n = 0;
  for (const auto& list : a.entries) n += static_cast<double>(list.size());
  return n;
}

/// Per-rank planning (kept output and workspace) of slice_batch: arg
/// `prefix` 0 causal, 1 shared-prefix.
void BM_PlanQkvForRankSlices(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvDocumentsPlan plan = slice_batch(world, state.range(1) != 0);
  state.SetLabel(state.range(1) != 0 ? "shared-prefix" : "causal");
  const cpdispatch::RankQkvMetadata mine = plan_middle_rank(state, plan, world);
  state.counters["attn_entries_at_rank"] = benchmark::Counter(attention_entries(mine.attn));
  state.counters["kv_tokens_at_rank"] = benchmark::Counter(static_cast<double>(mine.kv_fwd.num_total_recv_tokens));
}

/// verify_coverage_for_rank on rank W / 2's share of slice_batch (planned
/// once): arg `prefix` as above.
void BM_VerifyCoverageForRank(benchmark::State& state) {
  const std::int64_t world = state.range(0), rank = world / 2;
  const cpdispatch::QkvDocumentsPlan plan = slice_batch(world, state.range(1) != 0);
  state.SetLabel(state.range(1) != 0 ? "shared-prefix" : "causal");
  const cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, rank);
  for (auto _ : state) {
    cpdispatch::verify_coverage_for_rank(plan, rank, mine);
    benchmark::ClobberMemory();
  }
  state.counters["attn_entries_at_rank"] = benchmark::Counter(attention_entries(mine.attn));
}

/// Global planning (kept output) of slice_batch: arg `prefix` as above.
void BM_PlanQkvSlices(benchmark::State& state) {
  const std::int64_t world = state.range(0);
  const cpdispatch::QkvDocumentsPlan plan = slice_batch(world, state.range(1) != 0);
  state.SetLabel(state.range(1) != 0 ? "shared-prefix" : "causal");
  cpdispatch::QkvMetadata meta;
  for (auto _ : state) {
    cpdispatch::plan_qkv(plan, meta);
    benchmark::DoNotOptimize(meta);
    benchmark::ClobberMemory();
  }
}

BENCHMARK(BM_PlanQkvForRankSlices)->ArgNames({"W", "prefix"})->ArgsProduct({{1024, 16384}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanQkvSlices)->ArgNames({"W", "prefix"})->ArgsProduct({{1024}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_VerifyCoverageForRank)->ArgNames({"W", "prefix"})->ArgsProduct({{1024, 16384}, {0, 1}})->Unit(benchmark::kMillisecond);

BENCHMARK(BM_PlanQkvReuse)->ArgName("W")->Arg(8)->Arg(64)->Arg(512)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);

/// CPU seconds of this process so far (the phases below are timed in CPU
/// time: the machine is shared).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// plan_qkv's phases one by one, each a counter in ms of CPU per plan:
/// validate, shard table, queries (q_fwd and q_rev are written in one pass),
/// KV groups, kv_fwd, kv_rev (with its copy mask), attention layout. Arg
/// `reuse` 1 plans into the same QkvMetadata every time (steady state), 0
/// into a fresh one.
void BM_PlanQkvPhases(benchmark::State& state) {
  namespace d = cpdispatch::detail;
  const std::int64_t world = state.range(0);
  const bool reuse = state.range(1) != 0;
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(world, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed);
  const char* names[] = {"validate_ms", "shard_table_ms", "q_fwd+q_rev_ms", "kv_groups_ms", "kv_fwd_ms", "kv_rev_ms", "attn_ms"};
  double spent[7] = {};
  cpdispatch::QkvMetadata kept;
  for (auto _ : state) {
    cpdispatch::QkvMetadata fresh;
    cpdispatch::QkvMetadata& out = reuse ? kept : fresh;
    double at = cpu_seconds();
    auto lap = [&](int phase) {
      const double now = cpu_seconds();
      spent[phase] += now - at;
      at = now;
    };
    const std::size_t C = d::check_rank_plan(plan);
    lap(0);
    const d::ShardTable t = d::shard_table(plan, C);
    lap(1);
    const cpdispatch::Tensor<std::int64_t> seq_len = t.rank_major(t.len, 0);
    d::plan_query_into(seq_len, t.rank_major(t.dst, -1), out.q_fwd, out.q_rev);
    lap(2);
    const d::RowPrefix prefix = d::row_prefix(seq_len, t.C, "plan_qkv");
    const d::KvGroups groups = d::kv_groups(t);
    lap(3);
    d::kv_forward(t, groups, seq_len, out.q_fwd.num_seqs, out.kv_fwd);
    lap(4);
    d::kv_reverse(t, groups, prefix, seq_len, out.kv_rev);
    d::copy_mask(out.kv_fwd.dst_rank, out.kv_rev.seq_recv_mask);
    lap(5);
    d::attention_layout(t, groups, out.attn);
    lap(6);
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  for (int i = 0; i < 7; ++i) state.counters[names[i]] = benchmark::Counter(1e3 * spent[i] / static_cast<double>(state.iterations()));
  count_entries(state, static_cast<double>(dispatch_entries(plan)));
}

BENCHMARK(BM_PlanQkvPhases)->ArgNames({"W", "reuse"})->Args({1024, 0})->Args({1024, 1})->Args({4096, 0})->Args({4096, 1})->Unit(benchmark::kMillisecond);

}  // namespace
