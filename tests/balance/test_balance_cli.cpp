// `cpdispatch-plan balance`, `--summary` attention costs and `--svg`, run for
// real: exit status, stdout, stderr and the files written.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "../common/plan_cli.hpp"
#include "balance_helpers.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/io/json.hpp"

namespace {

using baltest::I;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using Result = plan_cli::CliRun;
using plan_cli::read_file;

/// Scratch files named after the test, removed with it.
class BalanceCli : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const {
    return ::testing::TempDir() + "cpdispatch-balance-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" + name;
  }
  std::string file(const std::string& name, const std::string& text) {
    const std::string p = path(name);
    std::ofstream(p, std::ios::binary) << text;
    made_.push_back(p);
    return p;
  }
  void TearDown() override {
    for (const std::string& p : made_) std::remove(p.c_str());
  }

  /// cpdispatch-plan with `args` (words separated by spaces), `input` on stdin.
  Result run(const std::string& args, const std::string& input = "") {
    for (const char* name : {"stdin", "stdout", "stderr"}) made_.push_back(path(name));
    return plan_cli::run(plan_cli::words(args), input, path(""));
  }

  std::vector<std::string> made_;
};

constexpr const char* kInput = R"({"world_size": 4, "max_cp_degree": 4,
  "ranks": [{"docs": [9000, 300]}, {"docs": [500, 700, 40]}, {"docs": [1200]}, {"docs": [100, 100, 100]}]})";

cpdispatch::BalanceProblem input_problem() {
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 4;
  p.docs = {{9000, 300}, {500, 700, 40}, {1200}, {100, 100, 100}};
  return p;
}

TEST_F(BalanceCli, WritesTheLibrarysPlanWhichCpdispatchPlanAccepts) {
  const Result r = run("balance " + file("in.json", kInput));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const cpdispatch::Plan plan = cpdispatch::parse_plan(r.out);
  ASSERT_EQ(plan.index(), 1u);
  const auto& qkv = std::get<cpdispatch::QkvPlan>(plan);
  const cpdispatch::BalanceProblem p = input_problem();
  ASSERT_TRUE(baltest::valid_plan(p, qkv));
  EXPECT_EQ(cpdispatch::plan_to_json(plan), cpdispatch::plan_to_json(cpdispatch::Plan(cpdispatch::to_rank_plan(cpdispatch::plan_balanced(p)))));
  // ... and plan mode plans it.
  const Result planned = run(file("plan.json", r.out));
  EXPECT_EQ(planned.status, 0) << planned.err;
  EXPECT_THAT(planned.out, HasSubstr("\"kv_rev\""));
  // Standard input and --compact work as in plan mode.
  const Result compact = run("balance - --compact", kInput);
  EXPECT_EQ(compact.status, 0);
  EXPECT_EQ(nlohmann::json::parse(compact.out), nlohmann::json::parse(r.out));
  EXPECT_EQ(std::count(compact.out.begin(), compact.out.end(), '\n'), 1);
}

TEST_F(BalanceCli, OptionalCapacityAndBytesPerToken) {
  const Result r = run("balance --summary",
                       R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [100, 100, 100]}, {"docs": [100]}],
                           "recv_capacity": [100, 1000], "q_bytes": 8, "kv_bytes": 2})");
  ASSERT_EQ(r.status, 0) << r.err;
  // Rank 0 may hold 100 KV tokens: two of its three documents leave; each moves 8*100 + 2*100 bytes.
  EXPECT_THAT(r.out, HasSubstr("bytes moved 2000 (1600 query, 400 key-value)"));
}

TEST_F(BalanceCli, SummaryShowsAttentionCostAndTheComparison) {
  const Result r = run("balance --summary " + file("in.json", kInput));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("qkv plan: world_size 4, max_cp_degree 4\n"
                                "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost\n"));
  EXPECT_THAT(r.out, HasSubstr("imbalance of attention cost (max/mean): 1.00"));
  EXPECT_THAT(r.out, HasSubstr("x the lower bound"));
  EXPECT_THAT(r.out, HasSubstr("(before balancing 40549650, 3.894 x)"));  // rank 0: 9000*9001/2 + 300*301/2
  // Plan mode's summary of the plan balance wrote has the same table.
  const Result plan = run("balance " + file("in.json", kInput));
  const Result summary = run("--summary " + file("plan.json", plan.out));
  EXPECT_EQ(summary.status, 0);
  EXPECT_THAT(r.out, StartsWith(summary.out));
}

TEST_F(BalanceCli, SvgOfTheBalancedPlanIsWellFormed) {
  const std::string svg = path("plan.svg");
  made_.push_back(svg);
  const Result r = run("balance " + file("in.json", kInput) + " --svg " + svg);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"kind\": \"qkv\""));  // the plan still goes to stdout
  const std::string picture = read_file(svg);
  ASSERT_TRUE(baltest::well_formed_xml(picture));
  EXPECT_THAT(picture, HasSubstr("before (every piece at its home rank)"));
  EXPECT_THAT(picture, HasSubstr("attention cost per rank"));
  // Plan mode draws any qkv plan; an unbalanced one has no "before" bars.
  const Result again = run(file("plan.json", R"({"world_size": 2, "ranks": [{"docs": [{"shard_len": [3], "dst": [0]}]}, {"docs": []}]})") +
                           " --svg=" + svg + " --summary");
  ASSERT_EQ(again.status, 0) << again.err;
  ASSERT_TRUE(baltest::well_formed_xml(read_file(svg)));
  EXPECT_THAT(read_file(svg), ::testing::Not(HasSubstr("before (")));
}

TEST_F(BalanceCli, ErrorsNameTheField) {
  struct Case {
    std::string input, message;
  };
  const std::vector<Case> cases = {
      {R"({"world_size": 2, "ranks": [{"docs": [1]}, {"docs": [2]}]})", "input: missing \"max_cp_degree\""},
      {R"({"world_size": 2, "max_cp_degree": 0, "ranks": [{"docs": [1]}, {"docs": [2]}]})", "max_cp_degree = 0 must be at least 1"},
      {R"({"world_size": 3, "max_cp_degree": 2, "ranks": [{"docs": [1]}, {"docs": [2]}]})", "ranks has 2 entries, but world_size = 3"},
      {R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [1]}, {"docs": [0]}]})", "ranks[1].docs[0] = 0 must be a positive length"},
      {R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [1]}, {"docs": ["a"]}]})", "ranks[1].docs[0]: expected an integer"},
      {R"({"world_size": 1, "max_cp_degree": 2, "ranks": [{"docs": [1]}], "q_byte": 2})", "unknown key \"q_byte\""},
      {R"({"world_size": 1, "max_cp_degree": 2, "ranks": [{"docs": [1]}], "kv_bytes": -1})", "kv_bytes = -1 must be at least 0"},
      {R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [1]}, {"docs": [2]}], "recv_capacity": [5]})",
       "recv_capacity has 1 entry, but world_size = 2"},
      {R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [50, 700]}, {"docs": [30]}], "recv_capacity": [600, 650]})",
       "docs[0][1] has 700 tokens and its last shard's KV group holds all of them, but the largest recv_capacity is 650 tokens (rank 1)"},
      {"[1, 2]", "input: expected an object"},
      {"{", "invalid JSON"},
  };
  for (const Case& c : cases) {
    const Result r = run("balance", c.input);
    EXPECT_EQ(r.status, 2) << c.input;
    EXPECT_EQ(r.out, "") << c.input;
    EXPECT_THAT(r.err, StartsWith("cpdispatch-plan: ")) << c.input;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.input;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// A packed batch: document 0 spans ranks 0..2, document 2 ranks 2..3.
constexpr const char* kPacked = R"({"world_size": 4, "max_cp_degree": 6, "documents": [
  {"pieces": [{"rank": 0, "len": 900}, {"rank": 1, "len": 1000}, {"rank": 2, "len": 200}]},
  {"pieces": [{"rank": 2, "len": 500}]},
  {"pieces": [{"rank": 2, "len": 300}, {"rank": 3, "len": 1000}]}]})";

cpdispatch::BalanceProblem packed_problem() {
  cpdispatch::BalanceProblem p;
  p.world_size = 4;
  p.max_cp_degree = 6;
  p.documents = {{{{0, 900}, {1, 1000}, {2, 200}}}, {{{2, 500}}}, {{{2, 300}, {3, 1000}}}};
  return p;
}

/// The documents-form plan in cpdispatch-plan's JSON.
cpdispatch::QkvDocumentsPlan documents_plan(const nlohmann::json& j) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = j.at("world_size").get<I>();
  plan.max_cp_degree = j.at("max_cp_degree").get<I>();
  for (const auto& d : j.at("documents")) {
    auto& doc = plan.documents.emplace_back();
    for (const auto& s : d.at("shards")) doc.shards.push_back({s.at("rank").get<I>(), s.at("len").get<I>(), s.at("dst").get<I>()});
  }
  return plan;
}

TEST_F(BalanceCli, APackedBatchGivesTheLibrarysDocumentsFormPlan) {
  const Result r = run("balance " + file("in.json", kPacked));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("kind"), "qkv");
  const cpdispatch::QkvDocumentsPlan plan = documents_plan(j);
  const cpdispatch::BalanceProblem p = packed_problem();
  ASSERT_TRUE(baltest::valid_packed_plan(p, plan));
  EXPECT_EQ(plan.documents, cpdispatch::plan_balanced(p).documents);
  // ... which plan mode plans.
  const Result planned = run(file("plan.json", r.out));
  EXPECT_EQ(planned.status, 0) << planned.err;
  EXPECT_THAT(planned.out, HasSubstr("\"kv_rev\""));
  const Result compact = run("balance - --compact", kPacked);
  EXPECT_EQ(compact.status, 0);
  EXPECT_EQ(nlohmann::json::parse(compact.out), j);
}

TEST_F(BalanceCli, PackedSummaryCountsShardsOfDocumentsThatSpanRanks) {
  const std::string svg = path("packed.svg");
  made_.push_back(svg);
  const Result r = run("balance --summary --svg " + svg, kPacked);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("qkv plan: world_size 4, max_cp_degree 6\ndocuments: 3, 2 spanning ranks\n"
                                "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost  spanning\n"));
  EXPECT_THAT(r.out, HasSubstr("x the lower bound"));
  ASSERT_TRUE(baltest::well_formed_xml(read_file(svg)));
  EXPECT_THAT(read_file(svg), HasSubstr("before (every piece at its home rank)"));
  // Plan mode draws a documents-form plan too.
  std::remove(svg.c_str());
  const Result plan = run("balance", kPacked);
  const Result drawn = run(file("plan.json", plan.out) + " --summary --svg " + svg);
  ASSERT_EQ(drawn.status, 0) << drawn.err;
  ASSERT_TRUE(baltest::well_formed_xml(read_file(svg)));
}

TEST_F(BalanceCli, PackedErrorsNameTheJsonPath) {
  struct Case {
    std::string input, message;
  };
  auto batch = [](const std::string& docs, const std::string& extra = "") {
    return R"({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 3}]}, )" + docs + "]" + extra + "}";
  };
  const std::vector<Case> cases = {
      {batch(R"({"pieces": [{"rank": 1, "len": 2}, {"rank": 2, "len": 1}]})"), "documents[1].pieces[1].rank = 2 is outside [0, 2)"},
      {batch(R"({"pieces": [{"rank": 1, "len": 2}, {"rank": 1, "len": 0}]})"), "documents[1].pieces[1].len = 0 must be a positive length"},
      {batch(R"({"pieces": [{"rank": 1, "len": -4}]})"), "documents[1].pieces[0].len = -4 must be a positive length"},
      {batch(R"({"pieces": []})"), "documents[1].pieces is empty"},
      {batch(R"({"pieces": [{"rank": 0, "len": 1}, {"rank": 1, "len": 1}, {"rank": 0, "len": 1}]})"),
       "documents[1].pieces has 3 entries, but max_cp_degree = 2"},
      {batch(R"({"pieces": [{"rank": 1, "len": 2, "dst": 0}]})"), "documents[1].pieces[0]: unknown key \"dst\""},
      {batch(R"({"pieces": [{"rank": 1}]})"), "documents[1].pieces[0]: missing \"len\""},
      {batch(R"({"shards": []})"), "documents[1]: unknown key \"shards\""},
      {batch(R"({"pieces": [{"rank": 1, "len": 2}]})", R"(, "ranks": [{"docs": [1]}, {"docs": [2]}])"), "both \"documents\" and \"ranks\""},
      {R"({"world_size": 2, "max_cp_degree": 2})", "missing \"documents\" (a packed batch) or \"ranks\""},
  };
  for (const Case& c : cases) {
    const Result r = run("balance", c.input);
    EXPECT_EQ(r.status, 2) << c.input;
    EXPECT_EQ(r.out, "") << c.input;
    EXPECT_THAT(r.err, StartsWith("cpdispatch-plan: ")) << c.input;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.input;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// A shared prompt (4 tokens) with two responses beside a plain document
// (section 2e): the plan written carries the slices as given, plan mode
// plans it, and --summary and --dedup run on it.
constexpr const char* kSlices = R"({"world_size": 2, "max_cp_degree": 2, "documents": [
  {"pieces": [{"rank": 0, "len": 8}], "slices": [{"q": [0, 4], "k": [0, 4], "type": "causal"},
    {"q": [4, 6], "k": [0, 4], "type": "full"}, {"q": [4, 6], "k": [4, 6], "type": "causal"},
    {"q": [6, 8], "k": [0, 4], "type": "full"}, {"q": [6, 8], "k": [6, 8], "type": "causal"}]},
  {"pieces": [{"rank": 1, "len": 2}]}]})";

TEST_F(BalanceCli, SlicesTravelWithTheBalancedPlan) {
  const Result r = run("balance", kSlices);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(r.out);
  EXPECT_EQ(plan.at("documents")[0].at("slices"), nlohmann::json::parse(kSlices).at("documents")[0].at("slices"));
  EXPECT_FALSE(plan.at("documents")[1].contains("slices"));
  EXPECT_FALSE(plan.contains("max_cp_degree"));  // planning derives C from the needed sets
  const cpdispatch::BalanceProblem p = cpdispatch::balance_problem_from_json(nlohmann::json::parse(kSlices));
  const cpdispatch::QkvDocumentsPlan expected = cpdispatch::plan_balanced(p);
  EXPECT_EQ(std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::plan_from_json(plan)).documents, expected.documents);
  const Result planned = run(file("plan.json", r.out));
  EXPECT_EQ(planned.status, 0) << planned.err;
  EXPECT_THAT(planned.out, HasSubstr("\"entries\""));
  for (const char* options : {"--summary", "--summary --dedup"}) {
    const Result summary = run(std::string("balance ") + options, kSlices);
    EXPECT_EQ(summary.status, 0) << options << ": " << summary.err;
    EXPECT_THAT(summary.out, HasSubstr("x the lower bound")) << options;
  }
}

TEST_F(BalanceCli, BadSlicesAreNamedByTheirJsonPath) {
  auto batch = [](const std::string& slices) {
    return R"({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 3}], "slices": )" + slices + "}]}";
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {batch("[]"), "documents[0].slices: an empty list"},
      {batch(R"([{"q": [0, 3], "k": [1, 4], "type": "full"}])"), "documents[0].slices[0].k = [1, 4] reaches outside the document (3 tokens)"},
      {batch(R"([{"q": [0, 3], "k": [0, 3], "type": "band"}])"), "documents[0].slices[0].type: unknown slice type \"band\""},
      {batch(R"([{"q": [0, 3], "k": [0, 1], "type": "bi_causal"}])"), "documents[0].slices[0] (bi_causal, q [0, 3], k [0, 1]) has no"},
  };
  for (const auto& [input, message] : cases) {
    const Result r = run("balance", input);
    EXPECT_EQ(r.status, 2) << input;
    EXPECT_THAT(r.err, HasSubstr(message)) << input;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST_F(BalanceCli, UsageErrorsAndHelp) {
  EXPECT_EQ(run("balance --svg").status, 2);
  EXPECT_THAT(run("balance --svg").err, HasSubstr("--svg needs a file name"));
  EXPECT_EQ(run("balance --frobnicate").status, 2);
  const Result help = run("balance --help");
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, StartsWith("Usage: cpdispatch-plan balance [FILE|-]"));
  EXPECT_THAT(run("--help").out, HasSubstr("cpdispatch-plan balance"));
  // --svg draws documents: a query plan has none.
  const Result query = run("--svg " + path("q.svg"), R"({"world_size": 1, "seq_len": [[2]], "dispatch": [[0]]})");
  EXPECT_EQ(query.status, 2);
  EXPECT_THAT(query.err, HasSubstr("--svg draws qkv plans"));
  // An unwritable picture is a failure, not invalid input.
  const Result unwritable = run("balance --svg /nonexistent-dir/x.svg", kInput);
  EXPECT_EQ(unwritable.status, 1);
  EXPECT_THAT(unwritable.err, HasSubstr("cannot write '/nonexistent-dir/x.svg'"));
}

TEST_F(BalanceCli, ThePlanningPageExampleIsWhatTheToolWrites) {
  // docs/planning.md's "Load-balanced planning" shows this command's summary and
  // docs/balance-example.svg. After a planner change, regenerate both:
  //   build/bin/cpdispatch-plan balance docs/balance-example.json --summary --svg docs/balance-example.svg
  const std::string src = CPDISPATCH_SOURCE_DIR;
  const std::string svg = path("example.svg");
  made_.push_back(svg);
  const Result r = run("balance " + src + "/docs/balance-example.json --summary --svg " + svg);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(svg), read_file(src + "/docs/balance-example.svg")) << "docs/balance-example.svg is stale";
  const std::string page = read_file(src + "/docs/planning.md");
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) EXPECT_THAT(page, HasSubstr(line + "\n")) << "docs/planning.md's example summary is stale";
}

TEST_F(BalanceCli, ThePackedExampleIsWhatTheToolWrites) {
  // docs/balance-example-packed.*: a ProLong batch (W = 16, 16K tokens per
  // rank, C = 32) whose documents span up to 6 ranks. After a planner change:
  //   build/bin/cpdispatch-plan balance docs/balance-example-packed.json --summary
  //     --svg docs/balance-example-packed.svg > docs/balance-example-packed.txt
  const std::string src = CPDISPATCH_SOURCE_DIR;
  const std::string svg = path("packed.svg");
  made_.push_back(svg);
  const Result r = run("balance " + src + "/docs/balance-example-packed.json --summary --svg " + svg);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, read_file(src + "/docs/balance-example-packed.txt")) << "docs/balance-example-packed.txt is stale";
  EXPECT_EQ(read_file(svg), read_file(src + "/docs/balance-example-packed.svg")) << "docs/balance-example-packed.svg is stale";
  EXPECT_THAT(r.out, HasSubstr("documents: 46, 11 spanning ranks"));
  // ... and the plan is valid and within 3% of the bound.
  const Result plan = run("balance " + src + "/docs/balance-example-packed.json");
  ASSERT_EQ(plan.status, 0) << plan.err;
  const nlohmann::json input = nlohmann::json::parse(read_file(src + "/docs/balance-example-packed.json"));
  cpdispatch::BalanceProblem p;
  p.world_size = input.at("world_size").get<I>();
  p.max_cp_degree = input.at("max_cp_degree").get<I>();
  for (const auto& d : input.at("documents")) {
    auto& doc = p.documents.emplace_back().pieces;
    for (const auto& pc : d.at("pieces")) doc.push_back({pc.at("rank").get<I>(), pc.at("len").get<I>()});
  }
  const cpdispatch::QkvDocumentsPlan balanced = documents_plan(nlohmann::json::parse(plan.out));
  ASSERT_TRUE(baltest::valid_packed_plan(p, balanced));
  EXPECT_EQ(cpdispatch::widest_span(p.documents), 6u);
  EXPECT_LE(static_cast<double>(cpdispatch::plan_cost(balanced).max_attention()), 1.03 * cpdispatch::balance_lower_bound(p));
}

// Rank 2 may take two shards of document 2 (from ranks 1 and 0) when bytes
// are counted as the deduplicated exchange sends them (test_dedup_balance.cpp).
constexpr const char* kDedupBatch = R"({"world_size": 3, "max_cp_degree": 3, "documents": [
  {"pieces": [{"rank": 2, "len": 6}]}, {"pieces": [{"rank": 1, "len": 11}]},
  {"pieces": [{"rank": 1, "len": 5}, {"rank": 0, "len": 9}]}]})";

cpdispatch::BalanceProblem dedup_problem() {
  cpdispatch::BalanceProblem p;
  p.world_size = 3;
  p.max_cp_degree = 3;
  p.documents = {{{{2, 6}}}, {{{1, 11}}}, {{{1, 5}, {0, 9}}}};
  return p;
}

TEST_F(BalanceCli, DedupBalancesForTheWireAndTheOutputAsksForIt) {
  cpdispatch::BalanceOptions dedup;
  dedup.dedup = true;
  const cpdispatch::QkvDocumentsPlan expected = cpdispatch::plan_balanced(dedup_problem(), dedup);
  ASSERT_NE(expected.documents, cpdispatch::plan_balanced(dedup_problem()).documents);  // the option matters here
  nlohmann::json with_key = nlohmann::json::parse(kDedupBatch);
  with_key["dedup"] = true;
  const Result from_key = run("balance " + file("in.json", with_key.dump()));
  const Result from_flag = run("balance --dedup " + file("plain.json", kDedupBatch));
  for (const Result* r : {&from_key, &from_flag}) {
    ASSERT_EQ(r->status, 0) << r->err;
    const nlohmann::json out = nlohmann::json::parse(r->out);
    EXPECT_EQ(out.at("dedup"), true);
    EXPECT_EQ(documents_plan(out).documents, expected.documents);
  }
  // Plan mode then writes the wire metadata of section 2c.
  const Result planned = run(file("plan.json", from_key.out));
  ASSERT_EQ(planned.status, 0) << planned.err;
  EXPECT_THAT(planned.out, HasSubstr("\"kv_wire_fwd\""));
  // Off (absent or false): the plan of plain balancing, without the key.
  with_key["dedup"] = false;
  const Result off = run("balance " + file("off.json", with_key.dump()));
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_FALSE(nlohmann::json::parse(off.out).contains("dedup"));
  EXPECT_EQ(documents_plan(nlohmann::json::parse(off.out)).documents, cpdispatch::plan_balanced(dedup_problem()).documents);
  // --summary adds the wire line: 19 KV tokens in the section 2 exchange, 14 deduplicated.
  const Result summary = run("balance --summary --dedup " + file("sum.json", kDedupBatch));
  ASSERT_EQ(summary.status, 0) << summary.err;
  EXPECT_THAT(summary.out, HasSubstr("kv tokens sent off-rank: 19, deduplicated 14 (0.737x)"));
}

TEST_F(BalanceCli, DedupMustBeABoolean) {
  // (null, like any optional key's, means absent.)
  for (const char* bad : {"1", "\"yes\"", "[true]"}) {
    nlohmann::json input = nlohmann::json::parse(kDedupBatch);
    input["dedup"] = nlohmann::json::parse(bad);
    const Result r = run("balance", input.dump());
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr("dedup: expected true or false, got ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// ---- head-parallel documents chosen by balance (section 2f)

/// One 12000-token document over all 8 ranks, and a short one on each.
const std::string kWideBatch = [] {
  nlohmann::json j = {{"world_size", 8}, {"max_cp_degree", 8}, {"q_bytes", 2}, {"kv_bytes", 2}};
  nlohmann::json wide = nlohmann::json::array(), documents = nlohmann::json::array();
  for (int r = 0; r < 8; ++r) wide.push_back({{"rank", r}, {"len", 1500}});
  documents.push_back({{"pieces", wide}});
  for (int r = 0; r < 8; ++r) documents.push_back({{"pieces", {{{"rank", r}, {"len", 90 - 10 * r}}}}});
  j["documents"] = documents;
  return j.dump();
}();

TEST_F(BalanceCli, HeadParallelAutoFromFlagsOrKeysGivesTheLibrarysPlan) {
  const std::string in = file("in.json", kWideBatch);
  cpdispatch::BalanceOptions o;
  o.head_parallel = cpdispatch::HeadParallel::automatic;
  o.heads_q = 8;
  const cpdispatch::QkvDocumentsPlan expected = cpdispatch::plan_balanced(cpdispatch::balance_problem_from_json(nlohmann::json::parse(kWideBatch)), o);
  ASSERT_TRUE(expected.documents[0].head_parallel);  // the choice matters here
  nlohmann::json keyed = nlohmann::json::parse(kWideBatch);
  keyed["head_parallel"] = "auto";
  keyed["heads_q"] = 8;
  const Result from_flags = run("balance --head-parallel auto --heads-q 8 " + in);
  const Result from_keys = run("balance " + file("keyed.json", keyed.dump()));
  const Result equals_form = run("balance --head-parallel=auto --heads-q=8 " + in);
  for (const Result* r : {&from_flags, &from_keys, &equals_form}) {
    ASSERT_EQ(r->status, 0) << r->err;
    const nlohmann::json out = nlohmann::json::parse(r->out);
    EXPECT_EQ(out.at("head_parallel_degree"), 8);
    EXPECT_EQ(std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::plan_from_json(out)).documents, expected.documents);
  }
  const Result planned = run(file("plan.json", from_flags.out));  // plan mode plans it, with the head-parallel exchange
  ASSERT_EQ(planned.status, 0) << planned.err;
  EXPECT_THAT(planned.out, HasSubstr("\"hp_fwd\""));
  const Result summary = run("balance --summary --head-parallel auto --heads-q 8 " + in);
  ASSERT_EQ(summary.status, 0) << summary.err;
  EXPECT_THAT(summary.out, HasSubstr("head-parallel: 1 document in groups of 8 ranks"));
  // off, by flag over the key, is plain balancing.
  const Result off = run("balance --head-parallel off " + file("off.json", keyed.dump()));
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_EQ(nlohmann::json::parse(off.out), nlohmann::json::parse(run("balance " + in).out));
}

TEST_F(BalanceCli, HeadParallelErrorsNameTheFlagOrField) {
  const std::string in = file("in.json", kWideBatch);
  const std::pair<const char*, const char*> cases[] = {
      {"--head-parallel maybe", "--head-parallel: expected \"off\" or \"auto\", got \"maybe\""},
      {"--head-parallel", "--head-parallel needs a value"},
      {"--head-parallel auto", "heads_q = 0"},
      {"--head-parallel auto --heads-q 6", "head_parallel_degree = 8 does not fit heads_q = 6"},
      {"--head-parallel auto --heads-q 8 --heads-kv 3", "heads_kv = 3"},
      {"--heads-q 0", "--heads-q needs a whole number at least 1"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r = run(std::string("balance ") + in + " " + flags);
    EXPECT_EQ(r.status, 2) << flags;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr(message)) << flags;
  }
  nlohmann::json keyed = nlohmann::json::parse(kWideBatch);
  keyed["head_parallel"] = true;
  const Result r = run("balance", keyed.dump());
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, HasSubstr("head_parallel: expected \"off\" or \"auto\", got true"));
}

// A packed batch as a loader packs it, ranks of 1000 tokens: document 1 runs
// from packed 900 to 2500 (rank boundaries at 1000 and 2000), document 2 from
// 2500 to 3300 (at 3000). On a grid of 100 (or 50) those are on it; on 64 not.
constexpr const char* kGridBatch = R"({"world_size": 4, "max_cp_degree": 8, "documents": [
  {"pieces": [{"rank": 0, "len": 900}]},
  {"pieces": [{"rank": 0, "len": 100}, {"rank": 1, "len": 1000}, {"rank": 2, "len": 500}]},
  {"pieces": [{"rank": 2, "len": 500}, {"rank": 3, "len": 300}]},
  {"pieces": [{"rank": 3, "len": 700}]}]})";

TEST_F(BalanceCli, GridFromTheFlagOrTheKeyGivesTheLibrarysPlanCutOnIt) {
  const std::string in = file("in.json", kGridBatch);
  const cpdispatch::BalanceProblem p = cpdispatch::balance_problem_from_json(nlohmann::json::parse(kGridBatch));
  cpdispatch::BalanceOptions o;
  o.grid = 100;
  const cpdispatch::QkvDocumentsPlan expected = cpdispatch::plan_balanced(p, o);
  ASSERT_TRUE(baltest::cuts_on_grid(p, expected, 100));
  ASSERT_NE(expected.documents, cpdispatch::plan_balanced(p).documents);  // the grid matters here
  nlohmann::json keyed = nlohmann::json::parse(kGridBatch);
  keyed["grid"] = 100;
  nlohmann::json overridden = keyed;
  overridden["grid"] = 64;
  const Result from_flag = run("balance --grid 100 " + in), equals_form = run("balance --grid=100 " + in);
  const Result from_key = run("balance " + file("keyed.json", keyed.dump()));
  const Result flag_over_key = run("balance --grid 100 " + file("overridden.json", overridden.dump()));
  for (const Result* r : {&from_flag, &equals_form, &from_key, &flag_over_key}) {
    ASSERT_EQ(r->status, 0) << r->err;
    const auto plan = std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::plan_from_json(nlohmann::json::parse(r->out)));
    EXPECT_EQ(plan.documents, expected.documents);
    EXPECT_FALSE(cpdispatch::first_off_grid(plan, 100));
  }
  const Result planned = run(file("plan.json", from_flag.out));  // plan mode plans it
  EXPECT_EQ(planned.status, 0) << planned.err;
  // The summary: the bound on the grid, and whether every cut is on it; the input's own cuts, at packed
  // 1000, 2000 and 3000, are not on a grid of 64, and the summary names the first.
  const Result on = run("balance --summary --grid 100 " + in);
  ASSERT_EQ(on.status, 0) << on.err;
  char bound[64];
  std::snprintf(bound, sizeof bound, "x the lower bound %.6g", cpdispatch::balance_lower_bound(p, o));
  EXPECT_THAT(on.out, HasSubstr(bound));
  EXPECT_THAT(on.out, HasSubstr("grid: 100 tokens; every cut of the plan is on it\n"));
  const Result off = run("balance --summary --grid 64 " + in);
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_THAT(off.out, HasSubstr("grid: 64 tokens; a cut off it, the input's own: documents[1] at offset 100 (packed position 1000)\n"));
  EXPECT_THAT(run("balance --summary " + in).out, ::testing::Not(HasSubstr("grid:")));
  // Grid 1, by flag or key, is the plan without a grid.
  keyed["grid"] = 1;
  EXPECT_EQ(nlohmann::json::parse(run("balance --grid 1 " + in).out), nlohmann::json::parse(run("balance " + in).out));
  EXPECT_EQ(nlohmann::json::parse(run("balance " + file("one.json", keyed.dump())).out), nlohmann::json::parse(run("balance " + in).out));
}

TEST_F(BalanceCli, GridErrorsNameTheFlagOrField) {
  const std::string in = file("in.json", kGridBatch);
  const std::pair<const char*, const char*> cases[] = {
      {"--grid 0", "--grid needs a whole number at least 1, got '0'"},
      {"--grid=-64", "--grid needs a whole number at least 1, got '-64'"},
      {"--grid 6.4", "--grid needs a whole number at least 1, got '6.4'"},
      {"--grid 1099511627777", "--grid needs a whole number at most 2^40 (1: no grid), got '1099511627777'"},
      {"--grid", "--grid needs a value"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r = run(std::string("balance ") + in + " " + flags);
    EXPECT_EQ(r.status, 2) << flags;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr(message)) << flags;
  }
  nlohmann::json keyed = nlohmann::json::parse(kGridBatch);
  for (const auto& [value, message] : std::vector<std::pair<nlohmann::json, std::string>>{
           {0, "grid = 0 must be at least 1"}, {"64", "grid: expected an integer, got"}, {1099511627777, "must be at most 2^40"}}) {
    keyed["grid"] = value;
    const Result r = run("balance", keyed.dump());
    EXPECT_EQ(r.status, 2) << value;
    EXPECT_THAT(r.err, HasSubstr(message)) << value;
  }
  // Plan mode plans a plan as it is: the grid is balance's.
  EXPECT_THAT(run("--grid 64 " + file("plan.json", run("balance " + in).out)).err, HasSubstr("unknown option '--grid'"));
}

}  // namespace
