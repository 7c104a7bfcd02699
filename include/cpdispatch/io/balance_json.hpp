#pragma once
// JSON reading of a load-balancing input (the document `cpdispatch-plan
// balance` reads, docs/cli.md): a packed batch ("documents": every document's
// pieces on their home ranks, and its "slices" where it has its own mask,
// docs/plan-format.md section 2e) or the whole documents per rank ("ranks"),
// with C, receive capacities, bytes per token, the mask, "dedup" and the
// topology's "inter_node_ratio"; and the balanced plan's JSON. On
// nlohmann-json (target cpdispatch::json), like io/json.hpp: a malformed
// input throws invalid_input naming the JSON path of the offending value,
// e.g. `documents[0].pieces[1].len = 0 must be a positive length` (the
// document as a whole is `input`: `input: expected an object`).
// The topology itself ("ranks_per_node" or "nodes") is read by
// topology_from_json(input, world_size, "input").

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/plan/any_plan.hpp"
#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/io/json.hpp"
#include "cpdispatch/balance/topology_balance.hpp"

namespace cpdispatch {

namespace detail {

/// A slice's "q" or "k" range [begin, end] (at `path`): non-empty and
/// inside the document's `len` tokens. Planning checks the rest of a slice.
inline void check_slice_range(std::int64_t begin, std::int64_t end, const JsonPath& path, std::int64_t len) {
  if (begin >= end) fail_at(path, " = [", begin, ", ", end, "] is empty");
  if (begin < 0 || end > len) fail_at(path, " = [", begin, ", ", end, "] reaches outside the document (", len, " tokens)");
}

/// "slices" of a document of `len` tokens (section 2e): a non-empty list of
/// {"q": [qa, qb], "k": [ka, kb], "type": t}, read as a plan's are, each
/// rectangle inside the document.
inline std::vector<AttentionSlice> read_balance_slices(const json& j, const JsonPath& path, std::int64_t len) {
  const json& list = read_array(j, path);
  if (list.empty()) fail_at(path, ": an empty list; leave \"slices\" out for the mask (section 2e)");
  std::vector<AttentionSlice> out;
  for (std::size_t k = 0; k < list.size(); ++k) {
    const AttentionSlice& s = out.emplace_back(read_slice(list[k], path[k]));
    check_slice_range(s.q_begin, s.q_end, path[k] / "q", len);
    check_slice_range(s.k_begin, s.k_end, path[k] / "k", len);
  }
  return out;
}

/// `documents` of a balance input: every document's "pieces", objects
/// {"rank", "len"}, at most max_cp_degree of them (a shard never crosses a
/// piece boundary), and its optional "slices".
inline std::vector<BalanceDocument> read_packed_documents(const json& j, const JsonPath& path, std::int64_t world_size,
                                                          std::int64_t max_cp_degree) {
  const json& docs = read_array(j, path);
  std::vector<BalanceDocument> out(docs.size());
  for (std::size_t i = 0; i < docs.size(); ++i) {
    const JsonPath doc_path = path[i];
    check_keys(read_object(docs[i], doc_path), doc_path, "a document", {"pieces", "slices"});
    const JsonPath pieces_path = doc_path / "pieces";
    const json& pieces = read_array(*member(docs[i], doc_path, "pieces", true), pieces_path);
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
      out[i].pieces.push_back({rank, len});
    }
    if (const json* slices = member(docs[i], doc_path, "slices", false)) {
      std::int64_t doc_len = 0;
      for (const DocumentPiece& pc : out[i].pieces) doc_len = add_tokens(doc_len, pc.len, "balance input");
      out[i].slices = read_balance_slices(*slices, doc_path / "slices", doc_len);
    }
  }
  return out;
}


/// `ranks` of a balance input: W objects {"docs": [length, ...]}.
inline std::vector<std::vector<std::int64_t>> read_rank_documents(const json& j, const JsonPath& path, std::size_t W) {
  const json& ranks = read_array(j, path);
  if (ranks.size() != W) fail_at(path, " has ", entries(ranks.size()), ", but world_size = ", W);
  std::vector<std::vector<std::int64_t>> out;
  for (std::size_t r = 0; r < W; ++r) {
    const JsonPath rank_path = path[r];
    const json& rank = read_object(ranks[r], rank_path);
    check_keys(rank, rank_path, "a rank", {"docs"});
    const JsonPath docs_path = rank_path / "docs";
    out.push_back(read_int_vector(*member(rank, rank_path, "docs", true), docs_path));
    for (std::size_t i = 0; i < out.back().size(); ++i)
      if (out.back()[i] < 1) fail_at(docs_path[i], " = ", out.back()[i], " must be a positive length");
  }
  return out;
}

/// "recv_capacity" of a balance input: W tokens counts, none negative.
inline std::vector<std::int64_t> read_recv_capacity(const json& cap, const JsonPath& path, std::size_t W) {
  std::vector<std::int64_t> out = read_int_vector(cap, path);
  if (out.size() != W) fail_at(path, " has ", entries(out.size()), ", but world_size = ", W);
  for (std::size_t r = 0; r < W; ++r)
    if (out[r] < 0) fail_at(path[r], " = ", out[r], " must not be negative");
  return out;
}

}  // namespace detail

/// The BalanceProblem of a balance input:
/// world_size, max_cp_degree, either "documents" (a packed batch) or "ranks"
/// (documents per rank), and the optional recv_capacity, q_bytes, kv_bytes
/// and mask. Keys outside the format are rejected; "dedup", the topology and
/// "inter_node_ratio" are allowed and read by the functions below.
inline BalanceProblem balance_problem_from_json(const nlohmann::json& j) {
  using namespace detail;
  const auto root = JsonPath::root("input");
  read_object(j, root);
  check_keys(j, root, "a balance input", {"world_size", "max_cp_degree", "documents", "ranks", "recv_capacity", "q_bytes", "kv_bytes", "dedup",
                                          "ranks_per_node", "nodes", "inter_node_ratio", "mask", "head_parallel", "head_parallel_degree",
                                          "heads_q", "heads_kv", "pair_weight", "grid"});
  BalanceProblem p;
  p.world_size = read_int_at_least(j, root, "world_size", 1, true, 0);
  const auto W = static_cast<std::size_t>(p.world_size);
  p.max_cp_degree = read_int_at_least(j, root, "max_cp_degree", 1, true, 1);
  p.q_bytes = read_int_at_least(j, root, "q_bytes", 0, false, 1);
  p.kv_bytes = read_int_at_least(j, root, "kv_bytes", 0, false, 1);
  p.mask = read_plan_mask(j, root);
  const json* documents = member(j, root, "documents", false);
  const json* ranks = member(j, root, "ranks", false);
  if (documents && ranks) fail_at(root, ": both \"documents\" and \"ranks\" are given; a balance input has one of them");
  if (!documents && !ranks) fail_at(root, ": missing \"documents\" (a packed batch) or \"ranks\" (documents per rank)");
  if (documents) p.documents = read_packed_documents(*documents, root / "documents", p.world_size, p.max_cp_degree);
  else p.docs = read_rank_documents(*ranks, root / "ranks", W);
  if (const json* cap = member(j, root, "recv_capacity", false)) p.recv_capacity = read_recv_capacity(*cap, root / "recv_capacity", W);
  return p;
}

/// "off" or "auto" as a HeadParallel; `where` names the field or flag.
inline HeadParallel head_parallel_from_string(std::string_view text, std::string_view where) {
  if (text == "off") return HeadParallel::off;
  if (text == "auto") return HeadParallel::automatic;
  detail::fail(where, ": expected \"off\" or \"auto\", got \"", text, "\"");
}

/// A balance input's planning options: its optional "dedup" (true or false,
/// false when absent), head-parallel choice ("head_parallel": "off" or
/// "auto", "head_parallel_degree", "heads_q", "heads_kv", "pair_weight";
/// plan_balanced checks their values together) and "grid" (an integer in
/// [1, 2^40], 1 when absent: BalanceOptions::grid); the other options keep
/// their defaults.
inline BalanceOptions balance_options_from_json(const nlohmann::json& j) {
  using namespace detail;
  const auto root = JsonPath::root("input");
  BalanceOptions options;
  const json* dedup = member(read_object(j, root), root, "dedup", false);
  options.dedup = dedup && read_bool(*dedup, root / "dedup");
  if (const json* hp = member(j, root, "head_parallel", false)) {
    if (!hp->is_string()) fail_at(root / "head_parallel", ": expected \"off\" or \"auto\", got ", describe(*hp));
    options.head_parallel = head_parallel_from_string(hp->get<std::string>(), (root / "head_parallel").str());
  }
  options.head_parallel_degree = read_int_at_least(j, root, "head_parallel_degree", 0, false, 0);
  options.heads_q = read_int_at_least(j, root, "heads_q", 1, false, 0);
  options.heads_kv = read_int_at_least(j, root, "heads_kv", 0, false, 0);
  if (const json* w = member(j, root, "pair_weight", false)) {
    if (!w->is_number() || !(w->get<double>() >= 0) || w->get<double>() > 1e12) {
      fail_at(root / "pair_weight", ": expected a number in [0, 1e12], got ", describe(*w));
    }
    options.pair_weight = w->get<double>();
  }
  options.grid = read_int_at_least(j, root, "grid", 1, false, 1);
  if (options.grid > max_grid) fail_at(root / "grid", " = ", options.grid, " must be at most 2^40 (1: no grid)");
  return options;
}

/// A balance input's optional "inter_node_ratio" (a number in (0, 1e12]; when
/// absent, default_inter_node_ratio, the NVLink / InfiniBand ratio).
inline double inter_node_ratio_from_json(const nlohmann::json& j) {
  using namespace detail;
  const auto root = JsonPath::root("input");
  const json* v = member(read_object(j, root), root, "inter_node_ratio", false);
  if (!v) return default_inter_node_ratio;
  if (!v->is_number() || !(v->get<double>() > 0) || v->get<double>() > 1e12) {
    fail_at(root / "inter_node_ratio", ": expected a number in (0, 1e12], got ", describe(*v));
  }
  return v->get<double>();
}

/// The JSON of a balanced plan, as cpdispatch-plan balance writes it (every
/// document with its slices, as plan_to_json writes them); balanced for dedup, it also asks for the
/// deduplicated exchange ("dedup": true).
inline nlohmann::json balanced_plan_to_json(const Plan& plan, bool dedup) {
  nlohmann::json out = plan_to_json(plan);
  if (dedup) out["dedup"] = true;
  return out;
}

}  // namespace cpdispatch
