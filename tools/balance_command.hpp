#pragma once
// cpdispatch-plan's load-balancing parts (issue 7): the `balance`
// subcommand's input document and report, and the --svg picture of a qkv
// plan. I/O and option parsing stay in cpdispatch_plan.cpp.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/json.hpp"
#include "cpdispatch/plan/svg.hpp"

namespace cpdispatch_cli {

constexpr std::string_view balance_usage = R"(Usage: cpdispatch-plan balance [FILE|-] [--summary] [--svg FILE] [--compact]

Reads the documents each rank holds and writes a load-balanced qkv plan (JSON,
the format cpdispatch-plan reads): documents are cut into at most C
contiguous shards and attended where the largest per-rank causal attention
cost (token pairs) is smallest, then where the fewest bytes move.

Input (FILE, or standard input when FILE is - or absent):
  {"world_size": W, "max_cp_degree": C,
   "ranks": [{"docs": [length, ...]}, ...],      (W entries, MLP-layout order)
   "recv_capacity": [tokens, ...],                (optional: W entries, the most
                                                   KV tokens a rank may hold)
   "q_bytes": 1, "kv_bytes": 1}                   (optional: bytes per query and
                                                   per key-value token)

Options:
  --summary    instead of the plan, its per-rank table (as cpdispatch-plan
               --summary) and a line comparing it with the unbalanced plan
               and the lower bound
  --svg FILE   also write a picture of the plan to FILE: bytes sent between
               ranks, and attention cost per rank before and after
  --compact    JSON on one line instead of pretty-printed
  -h, --help   this help

Exit status: 0 success, 2 invalid input or usage (one line on standard error),
1 other failures.
)";

/// The balance subcommand's input document (see balance_usage).
inline cpdispatch::BalanceProblem balance_problem_from_json(const nlohmann::json& j) {
  using namespace cpdispatch::detail;
  const auto root = JsonPath::root("input");
  read_object(j, root);
  check_keys(j, root, "a balance input", {"world_size", "max_cp_degree", "ranks", "recv_capacity", "q_bytes", "kv_bytes"});
  cpdispatch::BalanceProblem p;
  p.world_size = read_world_size(j, root, true);
  const auto W = static_cast<std::size_t>(p.world_size);
  auto at_least = [&](std::string_view key, std::int64_t min, bool required, std::int64_t fallback) {
    const nlohmann::json* v = member(j, root, key, required);
    if (!v) return fallback;
    const JsonPath path = root / key;
    const std::int64_t x = read_int(*v, path);
    if (x < min) fail_at(path, " = ", x, " must be at least ", min);
    return x;
  };
  p.max_cp_degree = at_least("max_cp_degree", 1, true, 1);
  p.q_bytes = at_least("q_bytes", 0, false, 1);
  p.kv_bytes = at_least("kv_bytes", 0, false, 1);
  const JsonPath ranks_path = root / "ranks";
  const nlohmann::json& ranks = read_array(*member(j, root, "ranks", true), ranks_path);
  if (ranks.size() != W) fail_at(ranks_path, " has ", entries(ranks.size()), ", but world_size = ", W);
  for (std::size_t r = 0; r < W; ++r) {
    const JsonPath rank_path = ranks_path[r];
    const nlohmann::json& rank = read_object(ranks[r], rank_path);
    check_keys(rank, rank_path, "a rank", {"docs"});
    const JsonPath docs_path = rank_path / "docs";
    p.docs.push_back(read_int_vector(*member(rank, rank_path, "docs", true), docs_path));
    for (std::size_t i = 0; i < p.docs.back().size(); ++i)
      if (p.docs.back()[i] < 1) fail_at(docs_path[i], " = ", p.docs.back()[i], " must be a positive length");
  }
  if (const nlohmann::json* cap = member(j, root, "recv_capacity", false)) {
    const JsonPath path = root / "recv_capacity";
    p.recv_capacity = read_int_vector(*cap, path);
    if (p.recv_capacity.size() != W) fail_at(path, " has ", entries(p.recv_capacity.size()), ", but world_size = ", W);
    for (std::size_t r = 0; r < W; ++r)
      if (p.recv_capacity[r] < 0) fail_at(path[r], " = ", p.recv_capacity[r], " must not be negative");
  }
  return p;
}

/// "2.134 (max 47, mean 22)": a per-rank quantity's max/mean, for summaries.
inline std::string max_over_mean_text(std::int64_t max, double mean) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f (max %lld, mean %.6g)", mean > 0 ? static_cast<double>(max) / mean : 1.0,
                static_cast<long long>(max), mean);
  return buf;
}

/// The `balance --summary` line: the plan against the unbalanced one and the bound.
inline std::string balance_report(const cpdispatch::BalanceProblem& problem, const cpdispatch::QkvPlan& plan) {
  const auto after = cpdispatch::plan_cost(plan, problem.q_bytes, problem.kv_bytes);
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(problem), problem.q_bytes, problem.kv_bytes);
  const double bound = cpdispatch::balance_lower_bound(problem);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "balance: largest attention cost %lld, %.3f x the lower bound %.6g (before balancing %lld, %.3f x); "
                "bytes moved %lld (%lld query, %lld key-value)\n",
                static_cast<long long>(after.max_attention()), bound > 0 ? static_cast<double>(after.max_attention()) / bound : 1.0,
                bound, static_cast<long long>(before.max_attention()),
                bound > 0 ? static_cast<double>(before.max_attention()) / bound : 1.0, static_cast<long long>(after.bytes_moved),
                static_cast<long long>(after.query_bytes), static_cast<long long>(after.kv_bytes));
  return buf;
}

/// The SVG picture of a qkv plan; the bars show the unbalanced plan of the
/// same documents too when it differs.
inline std::string plan_picture(const cpdispatch::QkvPlan& plan, std::int64_t q_bytes, std::int64_t kv_bytes) {
  const cpdispatch::BalanceProblem docs = cpdispatch::balance_problem_of(plan, q_bytes, kv_bytes);
  const auto after = cpdispatch::plan_cost(plan, q_bytes, kv_bytes);
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(docs), q_bytes, kv_bytes);
  std::string title = "cpdispatch plan: " + std::to_string(plan.world_size) + " ranks";
  if (plan.max_cp_degree) title += ", at most " + std::to_string(*plan.max_cp_degree) + " shards per document";
  return cpdispatch::plan_svg(after, before.attention == after.attention ? nullptr : &before, title);
}

/// Writes `text` to the file `path` (a failure is not invalid input: exit 1).
inline void write_file(const std::string& path, std::string_view text) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  const bool ok = out && std::fwrite(text.data(), 1, text.size(), out) == text.size();
  const int error = errno;
  if (out && std::fclose(out) != 0 && ok) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(errno));
  if (!ok) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(error));
}

}  // namespace cpdispatch_cli
