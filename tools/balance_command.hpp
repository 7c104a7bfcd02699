#pragma once
// cpdispatch-plan's load-balancing parts: the `balance` subcommand's input
// document (a packed batch, or documents per rank) and report, and the --svg
// picture of a qkv plan in either form. I/O and option parsing stay in
// cpdispatch_plan.cpp.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/json.hpp"
#include "cpdispatch/plan/topology_balance.hpp"
#include "cpdispatch/plan/svg.hpp"

namespace cpdispatch_cli {

constexpr std::string_view balance_usage = R"(Usage: cpdispatch-plan balance [FILE|-] [--summary] [--svg FILE] [--compact] [--dedup]

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
   "inter_node_ratio": 9}                         (optional, with a topology: weight of a byte
                                                   between nodes against one inside a node)
  or, with "ranks": [{"docs": [length, ...]}, ...] (W entries, MLP-layout order)
  instead of "documents", the whole documents each rank holds.

Output: for "documents", a documents-form qkv plan (every document's shards
in causal order, {"rank": home, "len": n, "dst": attention rank}; a shard
never crosses a piece boundary); for "ranks", a per-rank qkv plan. With
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
  -h, --help   this help

Exit status: 0 success, 2 invalid input or usage (one line on standard error),
1 other failures.
)";

/// `documents[i].pieces` of a balance input: objects {"rank", "len"}.
inline std::vector<std::vector<cpdispatch::DocumentPiece>> read_packed_documents(const nlohmann::json& j, const cpdispatch::detail::JsonPath& path,
                                                                                 std::int64_t world_size, std::int64_t max_cp_degree) {
  using namespace cpdispatch::detail;
  const nlohmann::json& docs = read_array(j, path);
  std::vector<std::vector<cpdispatch::DocumentPiece>> out(docs.size());
  for (std::size_t i = 0; i < docs.size(); ++i) {
    const JsonPath doc_path = path[i];
    check_keys(read_object(docs[i], doc_path), doc_path, "a document", {"pieces"});
    const JsonPath pieces_path = doc_path / "pieces";
    const nlohmann::json& pieces = read_array(*member(docs[i], doc_path, "pieces", true), pieces_path);
    if (pieces.empty()) fail_at(pieces_path, " is empty: a document has at least one piece");
    if (static_cast<std::int64_t>(pieces.size()) > max_cp_degree) {
      fail_at(pieces_path, " has ", entries(pieces.size()), ", but max_cp_degree = ", max_cp_degree,
              " (a shard never crosses a piece boundary, so the document needs at least ", pieces.size(), " shards)");
    }
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const JsonPath piece_path = pieces_path[k];
      check_keys(read_object(pieces[k], piece_path), piece_path, "a piece", {"rank", "len"});
      const JsonPath rank_path = piece_path / "rank", len_path = piece_path / "len";
      const std::int64_t rank = read_int(*member(pieces[k], piece_path, "rank", true), rank_path);
      const std::int64_t len = read_int(*member(pieces[k], piece_path, "len", true), len_path);
      if (rank < 0 || rank >= world_size) fail_at(rank_path, " = ", rank, " is outside [0, ", world_size, ")");
      if (len < 1) fail_at(len_path, " = ", len, " must be a positive length");
      out[i].push_back({rank, len});
    }
  }
  return out;
}

/// `ranks` of a balance input: W objects {"docs": [length, ...]}.
inline std::vector<std::vector<std::int64_t>> read_rank_documents(const nlohmann::json& j, const cpdispatch::detail::JsonPath& path,
                                                                  std::size_t W) {
  using namespace cpdispatch::detail;
  const nlohmann::json& ranks = read_array(j, path);
  if (ranks.size() != W) fail_at(path, " has ", entries(ranks.size()), ", but world_size = ", W);
  std::vector<std::vector<std::int64_t>> out;
  for (std::size_t r = 0; r < W; ++r) {
    const JsonPath rank_path = path[r];
    const nlohmann::json& rank = read_object(ranks[r], rank_path);
    check_keys(rank, rank_path, "a rank", {"docs"});
    const JsonPath docs_path = rank_path / "docs";
    out.push_back(read_int_vector(*member(rank, rank_path, "docs", true), docs_path));
    for (std::size_t i = 0; i < out.back().size(); ++i)
      if (out.back()[i] < 1) fail_at(docs_path[i], " = ", out.back()[i], " must be a positive length");
  }
  return out;
}

/// The balance subcommand's input document (see balance_usage).
inline cpdispatch::BalanceProblem balance_problem_from_json(const nlohmann::json& j) {
  using namespace cpdispatch::detail;
  const auto root = JsonPath::root("input");
  read_object(j, root);
  check_keys(j, root, "a balance input", {"world_size", "max_cp_degree", "documents", "ranks", "recv_capacity", "q_bytes", "kv_bytes", "dedup",
                                                "ranks_per_node", "nodes", "inter_node_ratio", "mask"});
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
  p.mask = read_plan_mask(j, root);
  const nlohmann::json* documents = member(j, root, "documents", false);
  const nlohmann::json* ranks = member(j, root, "ranks", false);
  if (documents && ranks) fail_at(root, ": both \"documents\" and \"ranks\" are given; a balance input has one of them");
  if (!documents && !ranks) fail_at(root, ": missing \"documents\" (a packed batch) or \"ranks\" (documents per rank)");
  if (documents) p.documents = read_packed_documents(*documents, root / "documents", p.world_size, p.max_cp_degree);
  else p.docs = read_rank_documents(*ranks, root / "ranks", W);
  if (const nlohmann::json* cap = member(j, root, "recv_capacity", false)) {
    const JsonPath path = root / "recv_capacity";
    p.recv_capacity = read_int_vector(*cap, path);
    if (p.recv_capacity.size() != W) fail_at(path, " has ", entries(p.recv_capacity.size()), ", but world_size = ", W);
    for (std::size_t r = 0; r < W; ++r)
      if (p.recv_capacity[r] < 0) fail_at(path[r], " = ", p.recv_capacity[r], " must not be negative");
  }
  return p;
}

/// The balance input's planning options: its optional "dedup" (true or false).
inline cpdispatch::BalanceOptions balance_options_from_json(const nlohmann::json& j) {
  using namespace cpdispatch::detail;
  const auto root = JsonPath::root("input");
  cpdispatch::BalanceOptions options;
  const nlohmann::json* dedup = member(read_object(j, root), root, "dedup", false);
  if (dedup && !dedup->is_boolean()) fail_at(root / "dedup", ": expected true or false, got ", describe(*dedup));
  options.dedup = dedup && dedup->get<bool>();
  return options;
}

/// The balance input's optional "inter_node_ratio" (a number > 0; default
/// the NVLink / InfiniBand ratio).
inline double inter_node_ratio_from_json(const nlohmann::json& j) {
  using namespace cpdispatch::detail;
  const auto root = JsonPath::root("input");
  const nlohmann::json* v = member(read_object(j, root), root, "inter_node_ratio", false);
  if (!v) return cpdispatch::default_inter_node_ratio;
  if (!v->is_number() || !(v->get<double>() > 0) || v->get<double>() > 1e12) {
    fail_at(root / "inter_node_ratio", ": expected a number in (0, 1e12], got ", describe(*v));
  }
  return v->get<double>();
}

/// The balanced plan's JSON; balanced for dedup, it asks for the deduplicated exchange.
inline nlohmann::json balanced_plan_json(const cpdispatch::Plan& plan, bool dedup) {
  nlohmann::json out = cpdispatch::plan_to_json(plan);
  if (dedup) out["dedup"] = true;
  return out;
}

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

/// The `balance --summary` line: the plan against the unbalanced one and the bound.
template <class PlanForm>
std::string balance_report(const cpdispatch::BalanceProblem& problem, const PlanForm& plan, const cpdispatch::PlanLimits& limits) {
  const auto after = cpdispatch::plan_cost(plan, problem.q_bytes, problem.kv_bytes, limits);
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(problem, limits), problem.q_bytes, problem.kv_bytes, limits);
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
