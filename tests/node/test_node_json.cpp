// The topology in JSON ("ranks_per_node", "nodes"; docs/node-exchange.md) and
// cpdispatch-plan --summary's inter-node lines on the page's worked example.

#include <gtest/gtest.h>

#include <string>

#include "cpdispatch/error.hpp"
#include "cpdispatch/io/json.hpp"
#include "../dedup/dedup_cli.hpp"

namespace {

const std::string worked_example = R"({"kind": "qkv", "world_size": 4, "ranks_per_node": 2, "documents": [
  {"shards": [{"rank": 0, "len": 2, "dst": 2}, {"rank": 0, "len": 3, "dst": 3}, {"rank": 1, "len": 1, "dst": 2}, {"rank": 1, "len": 2, "dst": 0}]},
  {"shards": [{"rank": 3, "len": 4, "dst": 1}]}]})";

/// The message of the invalid_input that topology_from_json throws for `text`.
std::string topology_error(const std::string& text, std::int64_t world_size) {
  try {
    (void)cpdispatch::topology_from_json(nlohmann::json::parse(text), world_size);
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "accepted";
}

TEST(NodeJson, PlansCarryRanksPerNodeOrAnExplicitNodeList) {
  const nlohmann::json j = nlohmann::json::parse(worked_example);
  EXPECT_EQ(cpdispatch::topology_from_json(j, 4), cpdispatch::Topology::uniform(4, 2));
  (void)cpdispatch::plan_from_json(j);  // the topology is not part of the plan
  nlohmann::json interleaved = j;
  interleaved.erase("ranks_per_node");
  interleaved["nodes"] = {1, 0, 1, 0};
  EXPECT_EQ(cpdispatch::topology_from_json(interleaved, 4), cpdispatch::Topology::from_nodes({1, 0, 1, 0}));
  interleaved.erase("nodes");
  EXPECT_FALSE(cpdispatch::topology_from_json(interleaved, 4).has_value());
}

TEST(NodeJson, BadTopologiesNameTheField) {
  EXPECT_NE(topology_error(R"({"ranks_per_node": 0})", 4).find("ranks_per_node = 0 must be at least 1"), std::string::npos);
  EXPECT_NE(topology_error(R"({"ranks_per_node": 2.5})", 4).find("ranks_per_node: expected an integer"), std::string::npos);
  EXPECT_NE(topology_error(R"({"nodes": [0, 1]})", 4).find("nodes has 2 entries, but world_size = 4"), std::string::npos);
  EXPECT_NE(topology_error(R"({"nodes": [0, 1, 7, 0]})", 4).find("nodes[2] = 7 is outside [0, 4)"), std::string::npos);
  EXPECT_NE(topology_error(R"({"nodes": [0, 2, 2, 0]})", 4).find("no rank is on node 1"), std::string::npos);
  EXPECT_NE(topology_error(R"({"nodes": [0, 0], "ranks_per_node": 1})", 2).find("both"), std::string::npos);
}

#ifdef CPDISPATCH_PLAN_EXE
TEST(NodeJson, SummaryPrintsTheInterNodeTokensOfEachExchange) {
  const dedup_cli::CliRun run = dedup_cli::run_cli("node-json-", worked_example, "--summary");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("\ninter-node KV tokens: flat 17, dedup 15, node-level 10\n"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("\ninter-node query tokens: 10\n"), std::string::npos) << run.out;
  const dedup_cli::CliRun plain = dedup_cli::run_cli("node-json-", R"({"world_size": 1, "documents": [{"shards": [{"rank": 0, "len": 1, "dst": 0}]}]})",
                                                     "--summary");
  EXPECT_EQ(plain.out.find("inter-node"), std::string::npos) << "no topology, no inter-node lines";
  const dedup_cli::CliRun bad = dedup_cli::run_cli("node-json-", R"({"world_size": 2, "nodes": [0, 2], "documents": [{"shards": [{"rank": 0, "len": 1, "dst": 1}]}]})",
                                                   "--summary");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("nodes[1] = 2"), std::string::npos) << bad.err;
}

/// cpdispatch-plan balance on an input file holding `input`, then `args`.
dedup_cli::CliRun run_balance(const std::string& input, const std::string& args) {
  return plan_cli::run_cli("node-balance-", input, args, "balance");
}

/// The number after `key` in `text` (-1 when absent).
long long number_after(const std::string& text, const std::string& key) {
  const std::size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stoll(text.substr(at + key.size()));
}

TEST(NodeJson, BalanceWithATopologyKeepsTheBalanceAndCrossesNodesLess) {
  std::string ranks;
  for (int r = 0; r < 16; ++r) ranks += std::string(r ? "," : "") + "{\"docs\": [" + std::to_string(4000 + (r * 997) % 5000) + ", " + std::to_string(1000 + 10 * r) + "]}";
  const std::string input = R"({"world_size": 16, "max_cp_degree": 8, "ranks_per_node": 8, "ranks": [)" + ranks + "]}";
  const dedup_cli::CliRun placed = run_balance(input, "--summary");
  ASSERT_EQ(placed.status, 0) << placed.err;
  // The same batch balanced without the topology, then summarised with it.
  const dedup_cli::CliRun blind_plan = run_balance(R"({"world_size": 16, "max_cp_degree": 8, "ranks": [)" + ranks + "]}", "");
  ASSERT_EQ(blind_plan.status, 0) << blind_plan.err;
  nlohmann::json plan = nlohmann::json::parse(blind_plan.out);
  plan["ranks_per_node"] = 8;
  const dedup_cli::CliRun blind = dedup_cli::run_cli("node-json-", plan.dump(), "--summary");
  ASSERT_EQ(blind.status, 0) << blind.err;
  const std::string balance_line = "imbalance of attention cost (max/mean): ";
  EXPECT_EQ(placed.out.substr(placed.out.find(balance_line), 60), blind.out.substr(blind.out.find(balance_line), 60));
  const long long placed_kv = number_after(placed.out, "inter-node KV tokens: flat "), blind_kv = number_after(blind.out, "inter-node KV tokens: flat ");
  EXPECT_GT(placed_kv, 0);
  EXPECT_LT(placed_kv, blind_kv);
  const dedup_cli::CliRun bad = run_balance(R"({"world_size": 2, "max_cp_degree": 2, "ranks_per_node": 1, "inter_node_ratio": 0, "ranks": [{"docs": [3]}, {"docs": [1]}]})", "");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("inter_node_ratio: expected a number in (0, 1e12], got 0"), std::string::npos) << bad.err;
}
#endif

}  // namespace
