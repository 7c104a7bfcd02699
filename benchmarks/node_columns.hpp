#pragma once
// The inter-node columns shared by bench_node, bench_dedup and bench_balance
// (docs/node-exchange.md): the KV tokens that cross between nodes in the flat
// (section 2), rank-level deduplicated (section 2c) and node-level exchanges,
// for a batch balanced without the topology ("blind"), with it ("aware",
// plan_balanced with a Topology) and laid out zig-zag, each with its balance
// (largest rank attention cost / balance_lower_bound); and the target check:
// node-level on the aware plan moves at most half the inter-node KV bytes of
// rank-level dedup on the blind plan, at equal balance.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/balance/baselines.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/balance/topology_balance.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "zigzag_plan.hpp"
#include "stats.hpp"

namespace node_columns {

using I = std::int64_t;

inline constexpr I kRanksPerNode = 8;
/// The batches of the inter-node columns: 32K tokens a rank, C = 8 (raised to
/// a document's span where one is wider), a Llama-3-8B-like layer in bf16
/// (8 KiB a query token, 4 KiB a key-value token: K and V).
inline constexpr I kTokensPerRank = 32 * 1024;
inline constexpr I kC = 8;
inline constexpr I kQueryBytes = 8192, kKvBytes = 4096;
/// Target: node-level (aware) <= this fraction of rank-level dedup (blind)...
inline constexpr double kTargetFraction = 0.5;
/// ...at equal balance: the aware plan's median bound ratio at most this, and
/// per batch at most the blind plan's plus kBalanceSlack.
inline constexpr double kBalanceLimit = 1.03, kBalanceSlack = 0.01;
/// Zig-zag on a batch cuts every document into 2W chunks; past this W its
/// KV metadata ([W][shards][copies up to 2W]) outgrows a small machine.
inline constexpr I kZigzagMaxWorld = 64;

/// A document-length sample of data/ ($CPDISPATCH_DOC_LENGTHS_DIR overrides).
inline std::vector<I> read_sample(const std::string& name, const char* program) {
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "%s: cannot read %s (set CPDISPATCH_DOC_LENGTHS_DIR)\n", program, (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  return nlohmann::json::parse(in).get<std::vector<I>>();
}


/// One packed batch of `lengths` (draw_workload with `seed`).
inline cpdispatch::BalanceProblem draw_problem(const std::vector<I>& lengths, I W, I tokens_per_rank, I C, std::uint64_t seed) {
  cpdispatch::BalanceProblem p;
  p.world_size = W;
  p.max_cp_degree = C;
  p.documents = cpdispatch::draw_workload(lengths, W, tokens_per_rank, seed);
  return p;
}

/// The batch of the inter-node columns: bytes of the layer, C raised to the widest span.
inline cpdispatch::BalanceProblem column_problem(const std::vector<I>& lengths, I W, std::uint64_t seed) {
  cpdispatch::BalanceProblem p = draw_problem(lengths, W, kTokensPerRank, kC, seed);
  p.q_bytes = kQueryBytes;
  p.kv_bytes = kKvBytes;
  p.max_cp_degree = std::max(kC, static_cast<I>(cpdispatch::widest_span(p.documents)));
  return p;
}

/// Balanced without the topology, or (`aware`) with it.
inline cpdispatch::QkvDocumentsPlan balanced(const cpdispatch::BalanceProblem& p, bool aware) {
  if (!aware) return cpdispatch::plan_balanced(p);
  return cpdispatch::plan_balanced(p, {}, cpdispatch::Topology::uniform(p.world_size, kRanksPerNode));
}

/// KV tokens (and query tokens) that cross nodes in one plan's exchanges.
struct InterNode {
  cpdispatch::NodeTokenCounts kv;
  I q = 0;
  InterNode& operator+=(const InterNode& o) {
    kv.flat += o.kv.flat, kv.dedup += o.kv.dedup, kv.node_level += o.kv.node_level, kv.inside += o.kv.inside;
    q += o.q;
    return *this;
  }
};

inline InterNode inter_node(const cpdispatch::QkvMetadata& m, const cpdispatch::Topology& t) {
  return {cpdispatch::node_token_counts(m.kv_fwd, t), cpdispatch::inter_node_tokens(m.q_fwd, t)};
}

/// One plan of one batch: its inter-node tokens and its balance.
struct PlanColumns {
  InterNode tokens;
  double bound_ratio = 0;  ///< largest rank attention cost / balance_lower_bound
};

inline PlanColumns plan_columns(const cpdispatch::QkvDocumentsPlan& plan, double bound) {
  const cpdispatch::Topology t = cpdispatch::Topology::uniform(plan.world_size, kRanksPerNode);
  return {inter_node(cpdispatch::plan_qkv(plan), t), static_cast<double>(cpdispatch::plan_cost(plan).max_attention()) / bound};
}

/// One batch: blind, aware and (up to kZigzagMaxWorld) zig-zag.
struct BatchColumns {
  PlanColumns blind, aware;
  std::optional<PlanColumns> zigzag;
};

inline BatchColumns batch_columns(const cpdispatch::BalanceProblem& p) {
  const double bound = cpdispatch::balance_lower_bound(p);
  BatchColumns b{plan_columns(balanced(p, false), bound), plan_columns(balanced(p, true), bound), std::nullopt};
  if (p.world_size <= kZigzagMaxWorld) b.zigzag = plan_columns(cpdispatch::plan_zigzag(p), bound);
  return b;
}

using bench::median;

/// The batches of one row, summed (tokens) and their balance (median, worst).
struct RowColumns {
  int batches = 0;
  InterNode blind, aware, zigzag;
  bool has_zigzag = false;
  double blind_ratio = 0, aware_ratio = 0, zigzag_ratio = 0;  ///< median bound ratios
  double worst_excess = 0;  ///< the largest aware - blind bound ratio of a batch
  /// node-level (aware) / rank-level dedup (blind), over the summed bytes
  double target_ratio() const {
    return blind.kv.dedup ? static_cast<double>(aware.kv.node_level) / static_cast<double>(blind.kv.dedup) : 0.0;
  }
  bool equal_balance() const { return aware_ratio <= kBalanceLimit && worst_excess <= kBalanceSlack; }
  bool bytes_met() const { return target_ratio() <= kTargetFraction; }
  bool target_met() const { return bytes_met() && equal_balance(); }
};

inline RowColumns row_columns(const std::vector<BatchColumns>& batches) {
  RowColumns r;
  r.batches = static_cast<int>(batches.size());
  r.worst_excess = -1e300;
  std::vector<double> blind, aware, zigzag;
  for (const BatchColumns& b : batches) {
    r.blind += b.blind.tokens;
    r.aware += b.aware.tokens;
    blind.push_back(b.blind.bound_ratio);
    aware.push_back(b.aware.bound_ratio);
    r.worst_excess = std::max(r.worst_excess, b.aware.bound_ratio - b.blind.bound_ratio);
    if (b.zigzag) {
      r.has_zigzag = true;
      r.zigzag += b.zigzag->tokens;
      zigzag.push_back(b.zigzag->bound_ratio);
    }
  }
  r.blind_ratio = median(blind), r.aware_ratio = median(aware), r.zigzag_ratio = median(zigzag);
  return r;
}

/// The row of `lengths` at W over seeds 0..batches-1.
inline RowColumns measure_row(const std::vector<I>& lengths, I W, int batches) {
  std::vector<BatchColumns> out;
  for (int seed = 0; seed < batches; ++seed) out.push_back(batch_columns(column_problem(lengths, W, static_cast<std::uint64_t>(seed))));
  return row_columns(out);
}

}  // namespace node_columns
