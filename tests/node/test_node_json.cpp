// The topology in JSON ("ranks_per_node", "nodes"; docs/node-exchange.md) and
// cpdispatch-plan --summary's inter-node lines on the page's worked example.

#include <gtest/gtest.h>

#include <string>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/json.hpp"
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
#endif

}  // namespace
