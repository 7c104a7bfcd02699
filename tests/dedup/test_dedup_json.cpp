// "dedup": true in a plan, kv_wire_fwd / kv_wire_rev in the JSON output, and
// cpdispatch-plan --dedup, run for real (spec section 2c's worked example).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

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

json with_dedup(const char* text, json value) {
  json j = json::parse(text);
  j["dedup"] = std::move(value);
  return j;
}

/// Section 2c's numbers, as the JSON output carries them.
void expect_spec_wire(const json& out) {
  const json& f = out.at("kv_wire_fwd");
  EXPECT_EQ(f.at("dst_rank"), json::parse("[[[1,0,-1],[0,-1,-1],[-1,-1,-1]],[[0,1,-1],[1,-1,-1],[1,-1,-1]]]"));
  EXPECT_EQ(f.at("dst_offset"), json::parse("[[[0,0,0],[3,0,0],[0,0,0]],[[8,3,0],[5,0,0],[9,0,0]]]"));
  EXPECT_EQ(f.at("num_recv_tokens"), json::parse("[[8,2,10],[3,7,10]]"));
  EXPECT_EQ(f.at("num_seqs"), json::parse("[2,3]"));
  const json& r = out.at("kv_wire_rev");
  EXPECT_EQ(r.at("dst_rank"), json::parse("[[0,0,1,-1],[0,1,1,1]]"));
  EXPECT_EQ(r.at("dst_offset"), json::parse("[[8,3,0,0],[0,7,2,6]]"));
  EXPECT_EQ(r.at("seq_len"), json::parse("[[3,5,2,0],[3,2,4,1]]"));
  EXPECT_EQ(r.at("num_recv_tokens"), json::parse("[[8,3,11],[2,7,9]]"));
  EXPECT_EQ(r.at("num_seqs"), json::parse("[3,4]"));
  EXPECT_EQ(r.at("seq_recv_mask"), json::parse("[[[1,1,0],[1,0,0],[0,0,0]],[[1,1,0],[1,0,0],[1,0,0]]]"));
}

template <class F>
std::string invalid_message(F&& f) {
  try {
    f();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "no invalid_input";
}

TEST(DedupJson, TheDedupKeyIsReadAndChecked) {
  EXPECT_FALSE(cpdispatch::dedup_requested(json::parse(spec_documents)));
  EXPECT_TRUE(cpdispatch::dedup_requested(with_dedup(spec_documents, true)));
  EXPECT_FALSE(cpdispatch::dedup_requested(with_dedup(spec_documents, false)));
  EXPECT_NO_THROW(cpdispatch::plan_from_json(with_dedup(spec_documents, true)));
  EXPECT_THAT(invalid_message([] { cpdispatch::dedup_requested(with_dedup(spec_documents, 1)); }),
              HasSubstr("dedup: expected true or false, got 1"));
  const char* query = R"({"world_size": 1, "seq_len": [[2]], "dispatch": [[0]]})";
  EXPECT_THAT(invalid_message([&] { cpdispatch::plan_from_json(with_dedup(query, true)); }),
              HasSubstr("dedup: deduplication applies to qkv plans"));
}

TEST(DedupJson, AddKvWireWritesSection2c) {
  const auto meta = std::get<cpdispatch::QkvMetadata>(cpdispatch::plan_metadata(cpdispatch::parse_plan(spec_documents)));
  json out = cpdispatch::metadata_to_json(meta);
  cpdispatch::add_kv_wire(out, cpdispatch::plan_kv_wire(meta));
  expect_spec_wire(out);
  EXPECT_EQ(out.at("kv_fwd"), json(meta.kv_fwd));  // the rest is unchanged
}

#ifdef CPDISPATCH_PLAN_EXE
using dedup_cli::CliRun;

CliRun run_cli(const std::string& plan, const std::string& args) { return dedup_cli::run_cli("", plan, args); }

TEST(DedupCli, DedupOptionAndKeyWriteTheWireMetadata) {
  const CliRun opt = run_cli(spec_documents, "--dedup");
  ASSERT_EQ(opt.status, 0) << opt.err;
  expect_spec_wire(json::parse(opt.out));
  const CliRun key = run_cli(with_dedup(spec_documents, true).dump(), "");
  ASSERT_EQ(key.status, 0) << key.err;
  EXPECT_EQ(json::parse(key.out), json::parse(opt.out));
  const CliRun plain = run_cli(spec_documents, "");
  EXPECT_FALSE(json::parse(plain.out).contains("kv_wire_fwd"));
}

TEST(DedupCli, SummaryCountsOffRankKvTokensWithAndWithoutDedup) {
  const CliRun r = run_cli(spec_documents, "--summary --dedup");
  ASSERT_EQ(r.status, 0) << r.err;
  // Rank 0 sends doc0.0 (3 tokens) to rank 1 twice, rank 1 sends 2 to rank 0: 8 without, 5 with.
  EXPECT_THAT(r.out, HasSubstr("\nkv tokens sent off-rank: 8, deduplicated 5 (0.625x)\n"));
}

TEST(DedupCli, DedupOfAQueryPlanIsInvalidInput) {
  const CliRun r = run_cli(R"({"world_size": 1, "seq_len": [[2]], "dispatch": [[0]]})", "--dedup");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, HasSubstr("--dedup applies to qkv plans"));
  EXPECT_EQ(r.out, "");
}
#endif

}  // namespace
