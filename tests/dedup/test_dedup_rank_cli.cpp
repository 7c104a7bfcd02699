// cpdispatch-plan --dedup --rank R, run for real: rank R's share gains its
// kv_wire_fwd / kv_wire_rev slices, equal to the global wire metadata's
// get_slice(R), the rest unchanged; both plan forms; the errors.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "cpdispatch/io/json.hpp"
#include "dedup_cli.hpp"

namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

using dedup_cli::spec_documents;

// A per-rank plan of three ranks, repeated destinations, rank 2 empty.
const char* const per_rank = R"({"world_size": 3, "ranks": [
  {"docs": [{"shard_len": [4, 2, 3], "dst": [1, 1, 0]}, {"shard_len": [5], "dst": [2]}]},
  {"docs": [{"shard_len": [1, 6], "dst": [0, 0]}]},
  {"docs": []}]})";

using dedup_cli::CliRun;

CliRun run_cli(const std::string& plan, const std::string& args) { return dedup_cli::run_cli("rank-cli-", plan, args); }

void expect_round_trip(const char* plan_text) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(plan_text);
  const auto meta = std::get<cpdispatch::QkvMetadata>(cpdispatch::plan_metadata(plan));
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  for (std::int64_t r = 0; r < wire.fwd.world_size; ++r) {
    const CliRun with = run_cli(plan_text, "--dedup --rank " + std::to_string(r) + " --compact");
    ASSERT_EQ(with.status, 0) << with.err;
    json got = json::parse(with.out);
    EXPECT_EQ(got.at("kv_wire_fwd"), json(wire.fwd.get_slice(r))) << "rank " << r;
    EXPECT_EQ(got.at("kv_wire_rev"), json(wire.rev.get_slice(r))) << "rank " << r;
    const CliRun without = run_cli(plan_text, "--rank " + std::to_string(r));
    ASSERT_EQ(without.status, 0) << without.err;
    got.erase("kv_wire_fwd");
    got.erase("kv_wire_rev");
    EXPECT_EQ(got, json::parse(without.out)) << "rank " << r;
  }
}

TEST(DedupRankCli, DocumentsPlanSlicesEqualTheGlobalWire) { expect_round_trip(spec_documents); }

TEST(DedupRankCli, PerRankPlanSlicesEqualTheGlobalWire) { expect_round_trip(per_rank); }

TEST(DedupRankCli, TheDedupKeyAsksForTheSlicesToo) {
  json plan = json::parse(per_rank);
  plan["dedup"] = true;
  const CliRun r = run_cli(plan.dump(), "--rank 1");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(json::parse(r.out).contains("kv_wire_rev"));
}

TEST(DedupRankCli, ErrorsAreUsageErrors) {
  const CliRun out_of_range = run_cli(spec_documents, "--dedup --rank 2");
  EXPECT_EQ(out_of_range.status, 2);
  EXPECT_THAT(out_of_range.err, HasSubstr("rank 2 is outside [0, 2)"));
  EXPECT_EQ(out_of_range.out, "");
  const CliRun query = run_cli(R"({"world_size": 1, "seq_len": [[2]], "dispatch": [[0]]})", "--dedup --rank 0");
  EXPECT_EQ(query.status, 2);
  EXPECT_THAT(query.err, HasSubstr("--dedup applies to qkv plans"));
  EXPECT_EQ(query.out, "");
}

}  // namespace
