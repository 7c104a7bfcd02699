#pragma once
// cpdispatch-plan's load-balancing parts: the `balance` subcommand's usage
// and report, and the --svg picture of a qkv plan in either form. Its input
// document is read by the library (cpdispatch/io/balance_json.hpp); I/O
// and option parsing stay in cpdispatch_plan.cpp.

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/io/json.hpp"
#include "cpdispatch/balance/topology_balance.hpp"
#include "cpdispatch/io/svg.hpp"

namespace cpdispatch_cli {

constexpr std::string_view balance_usage = R"(Usage: cpdispatch-plan balance [FILE|-] [--summary] [--svg FILE] [--compact] [--dedup]
                               [--head-parallel off|auto] [--heads-q H] [--heads-kv H] [--head-parallel-degree U]
                               [--grid G]

Reads a batch of documents and writes a load-balanced qkv plan (JSON, the
format cpdispatch-plan reads): documents are cut into at most C contiguous
shards and attended where the largest per-rank attention cost ((query, key)
pairs the mask lets through) is smallest, then where the fewest bytes move.

Input (FILE, or standard input when FILE is - or absent): a packed batch,
  {"world_size": W, "max_cp_degree": C,
   "documents": [{"pieces": [{"rank": r, "len": n}, ...]}, ...],
                                                  (every document's pieces in
                                                   causal order, each a run of
                                                   the document on its home rank)
      a document may add "slices": [{"q": [a, b], "k": [c, d], "type": "causal"}, ...]
                                                  (optional: its own mask, in its
                                                   positions; types full, causal,
                                                   inv_causal, bi_causal; the plan
                                                   carries them unchanged)
   "recv_capacity": [tokens, ...],                (optional: W entries, the most
                                                   KV tokens a rank may hold)
   "q_bytes": 1, "kv_bytes": 1,                   (optional: bytes per query and
                                                   per key-value token)
   "mask": {"type": "causal"},                    (optional: or {"type": "full"},
                                                   {"type": "sliding_window",
                                                   "window": w}; the plan carries it)
   "dedup": false,                                (optional: as --dedup)
   "ranks_per_node": 8,                           (optional, or "nodes": [node of each
                                                   rank]: balance for the topology, see
                                                   docs/node-exchange.md; --summary adds the
                                                   tokens that cross nodes; the plan keeps "nodes")
   "inter_node_ratio": 9,                         (optional, with a topology: weight of a byte
                                                   between nodes against one inside a node)
   "head_parallel": "off", "heads_q": H,          (optional: as the flags below)
   "heads_kv": H, "head_parallel_degree": U,
   "pair_weight": 0,                              (optional, with auto: what one (query, key)
                                                   pair of work weighs against one byte)
   "grid": 1}                                     (optional: as --grid)
  or, with "ranks": [{"docs": [length, ...]}, ...] (W entries, MLP-layout order)
  instead of "documents", the whole documents each rank holds.

Output: for "documents", a documents-form qkv plan (every document's shards
in causal order, {"rank": home, "len": n, "dst": attention rank}, and its
slices; a shard never crosses a piece boundary); for "ranks", a per-rank
qkv plan. With
dedup, the plan also carries "dedup": true, so that cpdispatch-plan writes
its deduplicated KV exchange.

Options:
  --summary    instead of the plan, its per-rank table and a line comparing
               it with the unbalanced plan and the lower bound (with dedup,
               also the KV tokens sent off-rank without and with it)
  --svg FILE   also write a picture of the plan to FILE: bytes sent between
               ranks, and attention cost per rank before and after
  --compact    JSON on one line instead of pretty-printed
  --dedup      count key-value bytes as the deduplicated exchange sends them
               (once per document and destination rank): the plan may put
               several shards of a document on one rank where that moves
               fewer bytes at no cost to balance
  --head-parallel off|auto
               auto: a document spanning ranks of one group of U consecutive
               ranks goes head-parallel (whole on every rank of its group, each
               attending 1/U of the heads) where its dispatch would move more
               bytes than its share of that exchange; the other documents are
               balanced around the 1/U of its work on each rank of the group.
               Causal batches without slices. off (the default): none is.
  --heads-q H  query heads (needed with auto)
  --heads-kv H key-value heads (default: --heads-q)
  --head-parallel-degree U
               the group size (default: world_size); U divides world_size and
               H, and divides the key-value heads or is a multiple of them
  --grid G     cut documents only at multiples of G tokens in the packed
               coordinate (rank 0's tokens, then rank 1's, ...), as the op's
               invariant mode needs (its default grid is 64); 1 (the default):
               anywhere. The input's own piece boundaries are not moved:
               --summary says whether they are on the grid
  -h, --help   this help

Exit status: 0 success, 2 invalid input or usage (one line on standard error),
1 other failures.
)";

/// "2.134 (max 47, mean 22)": a per-rank quantity's max/mean, for summaries.
inline std::string max_over_mean_text(std::int64_t max, double mean) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f (max %lld, mean %.6g)", mean > 0 ? static_cast<double>(max) / mean : 1.0,
                static_cast<long long>(max), mean);
  return buf;
}

/// Writes `text` to the file `path` (a failure is not invalid input: exit 1).
inline void write_file(const std::string& path, std::string_view text) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  const bool ok = out && std::fwrite(text.data(), 1, text.size(), out) == text.size();
  const int error = errno;
  if (out && std::fclose(out) != 0 && ok) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(errno));
  if (!ok) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(error));
}

/// The summary's line on head-parallel documents (none for a per-rank plan
/// or one without them): their work is split u ways, below the lower bound
/// of dispatched plans.
inline std::string head_parallel_note(const cpdispatch::QkvPlan&) { return {}; }
inline std::string head_parallel_note(const cpdispatch::QkvDocumentsPlan& plan) {
  const auto n = std::count_if(plan.documents.begin(), plan.documents.end(), [](const auto& d) { return d.head_parallel; });
  if (n == 0) return {};
  return "head-parallel: " + std::to_string(n) + " document" + (n == 1 ? "" : "s") + " in groups of " +
         std::to_string(cpdispatch::detail::head_parallel_degree(plan)) + " ranks, the attention cost above counting 1/u of each on each rank of its group\n";
}

/// The summary's line on the grid (none without one): whether every cut of
/// the plan is on it, else the first cut off it, the input's own (a piece
/// boundary) first.
template <class PlanForm>
std::string grid_note(const cpdispatch::BalanceProblem& problem, const PlanForm& plan, std::int64_t grid) {
  if (grid == 1) return {};
  std::optional<cpdispatch::GridCut> off = cpdispatch::first_off_grid(problem, grid);
  const char* whose = "the input's own";
  if (!off) off = cpdispatch::first_off_grid(plan, grid), whose = "the plan's";
  std::string out = "grid: " + std::to_string(grid) + " tokens; ";
  if (!off) return out + "every cut of the plan is on it\n";
  return out + "a cut off it, " + whose + ": documents[" + std::to_string(off->document) + "] at offset " + std::to_string(off->offset) +
         " (packed position " + std::to_string(off->packed) + ")\n";
}

/// The `balance --summary` line: the plan against the unbalanced one and the
/// bound (for plans balanced with `options`: on its grid).
template <class PlanForm>
std::string balance_report(const cpdispatch::BalanceProblem& problem, const cpdispatch::BalanceOptions& options, const PlanForm& plan,
                           const cpdispatch::PlanLimits& limits) {
  const auto after = cpdispatch::plan_cost(plan, problem.q_bytes, problem.kv_bytes, limits);
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(problem, limits), problem.q_bytes, problem.kv_bytes, limits);
  const double bound = cpdispatch::balance_lower_bound(problem, options);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "balance: largest attention cost %lld, %.3f x the lower bound %.6g (before balancing %lld, %.3f x); "
                "bytes moved %lld (%lld query, %lld key-value)\n",
                static_cast<long long>(after.max_attention()), bound > 0 ? static_cast<double>(after.max_attention()) / bound : 1.0,
                bound, static_cast<long long>(before.max_attention()),
                bound > 0 ? static_cast<double>(before.max_attention()) / bound : 1.0, static_cast<long long>(after.bytes_moved),
                static_cast<long long>(after.query_bytes), static_cast<long long>(after.kv_bytes));
  return buf + head_parallel_note(plan) + grid_note(problem, plan, options.grid);
}

/// The SVG picture of a qkv plan (either form); the bars show the
/// unbalanced plan of the same documents too when it differs.
template <class PlanForm>
std::string plan_picture(const PlanForm& plan, std::int64_t q_bytes, std::int64_t kv_bytes, const cpdispatch::PlanLimits& limits) {
  const cpdispatch::BalanceProblem docs = cpdispatch::balance_problem_of(plan, q_bytes, kv_bytes);
  const auto after = cpdispatch::plan_cost(plan, q_bytes, kv_bytes, limits);
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(docs, limits), q_bytes, kv_bytes, limits);
  std::string title = "cpdispatch plan: " + std::to_string(plan.world_size) + " ranks";
  if (plan.max_cp_degree) title += ", at most " + std::to_string(*plan.max_cp_degree) + " shards per document";
  return cpdispatch::plan_svg(after, before.attention == after.attention ? nullptr : &before, title);
}

}  // namespace cpdispatch_cli
