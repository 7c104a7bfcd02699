// Slices (docs/plan-format.md, section 2e) through JSON and the
// cpdispatch-plan executable: the worked example's every number, its summary,
// one rank's share, the picture and dedup; slices written back with a plan;
// attn.entries read back; and the JSON errors, each naming its path. The
// same for head-parallel documents (section 2f, example 4.7).

#include <gtest/gtest.h>

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cpdispatch/io/json.hpp"
#include "../common/plan_cli.hpp"
#include "spec_examples.hpp"

namespace {

using json = nlohmann::json;

const std::string data_dir = CPDISPATCH_CLI_DATA_DIR;

// Section 2e's worked example (data/spec_slices.json holds the same plan).
constexpr const char* spec_slices_plan = R"({"kind": "qkv", "world_size": 2, "documents": [
  {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 0, "len": 2, "dst": 0}, {"rank": 1, "len": 3, "dst": 1}],
   "slices": [{"q": [0, 3], "k": [0, 3], "type": "causal"},
              {"q": [3, 5], "k": [0, 3], "type": "full"}, {"q": [3, 5], "k": [3, 5], "type": "causal"},
              {"q": [5, 8], "k": [0, 3], "type": "full"}, {"q": [5, 8], "k": [5, 8], "type": "causal"}]},
  {"shards": [{"rank": 1, "len": 2, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}]}]})";

// Section 2e verbatim.
const cli_test::Expected spec_slices_numbers = {
    {"/kv_fwd/dst_rank", "[[[1,0,1],[0,-1,-1],[-1,-1,-1]],[[1,-1,-1],[1,0,-1],[0,-1,-1]]]"},
    {"/kv_fwd/dst_offset", "[[[0,0,3],[3,0,0],[0,0,0]],[[6,0,0],[9,5,0],[7,0,0]]]"},
    {"/kv_fwd/num_recv_tokens", "[[5,4,9],[6,5,11]]"},
    {"/kv_fwd/num_seqs", "[2,3]"},
    {"/kv_rev/dst_rank", "[[0,0,1,1],[0,0,1,1]]"},
    {"/kv_rev/dst_offset", "[[5,3,10,5],[0,10,0,3]]"},
    {"/kv_rev/seq_len", "[[3,2,2,2],[3,3,3,2]]"},
    {"/kv_rev/num_recv_tokens", "[[5,6,11],[4,5,9]]"},
    {"/kv_rev/num_seqs", "[4,4]"},
    {"/kv_rev/seq_recv_mask", "[[[1,1,1],[1,0,0],[0,0,0]],[[1,0,0],[1,1,0],[1,0,0]]]"},
    {"/attn/seqlens_q", "[[2,2],[3,3,2]]"},
    {"/attn/seqlens_kv", "[[5,4],[3,6,2]]"},
    {"/attn/entries", "[[[[0,2,0,3,null,null],[0,2,3,5,null,3]],[[0,2,0,4,null,2]]],"
                      "[[[0,3,0,3,null,0]],[[0,3,0,3,null,null],[0,3,3,6,null,3]],[[0,2,0,2,null,0]]]]"},
    // implied by sections 1-2e
    {"/kv_fwd/num_copies", "3"},
    {"/attn/mask", R"({"type": "causal"})"},
    {"/attn/cu_seqlens_kv", "[[0,5,9],[0,3,9,11]]"},
    {"/attn/max_seqlen_kv", "[5,6]"},
};

class CliSlicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "cpdispatch-cli-slices-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const char* name : {"stdin", "stdout", "stderr", "plan.svg"}) ::unlink((dir_ + "/" + name).c_str());
    ::rmdir(dir_.c_str());
  }

  plan_cli::CliRun run(const std::vector<std::string>& args, const std::string& input = "") { return plan_cli::run(args, input, dir_ + "/"); }

  std::string dir_;
};

json expect_json(const plan_cli::CliRun& r) {
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  return json::parse(r.out);
}

/// Invalid input: status 2, nothing on stdout, one stderr line naming the problem.
void expect_invalid(const plan_cli::CliRun& r, const std::string& message_part) {
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not exactly one line: " << r.err;
  EXPECT_NE(r.err.find(message_part), std::string::npos) << "stderr: " << r.err << "expected to contain: " << message_part;
}

/// The worked example's plan with `documents[0].slices` replaced by `slices` (JSON text).
std::string with_slices(const std::string& slices) {
  json plan = json::parse(spec_slices_plan);
  plan["documents"][0]["slices"] = json::parse(slices);
  return plan.dump();
}

TEST_F(CliSlicesTest, SpecSlicesExampleFile) {
  const std::string path = data_dir + "/spec_slices.json";
  EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::parse_plan(plan_cli::read_file(path))),
            cpdispatch::plan_to_json(cpdispatch::parse_plan(spec_slices_plan)));
  const json out = expect_json(run({path}));
  cli_test::expect_numbers(out, spec_slices_numbers);
  EXPECT_EQ(out, cpdispatch::metadata_to_json(cpdispatch::plan_metadata(cpdispatch::parse_plan(spec_slices_plan))));
}

TEST_F(CliSlicesTest, SummarySaysWhichDocumentsHaveSlices) {
  const plan_cli::CliRun r = run({data_dir + "/spec_slices.json", "--summary"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  // Attention cost from the entries: rank 0 attends the first response, 2 x 3
  // (the prompt) + 3 (itself, causal), and the plain document's second shard,
  // 3 + 4 (after 2 tokens of context) = 16; rank 1 the prompt, 6 (causal), the
  // second response, 9 + 6, and the plain document's first shard, 3 = 24.
  EXPECT_EQ(r.out,
            "qkv plan: world_size 2, max_cp_degree 3\n"
            "documents: 2, 1 spanning ranks, 1 with slices (5 slices, 7 attention entries)\n"
            "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost  spanning\n"
            "   0       2       5                3       4        9         16         2\n"
            "   1       3       7                2       8       11         24         1\n"
            "imbalance (max/mean of tokens received): q 1.333 (max 8, mean 6), kv 1.100 (max 11, mean 10)\n"
            "imbalance of attention cost (max/mean): 1.200 (max 24, mean 20)\n");
}

TEST_F(CliSlicesTest, RankShareCarriesItsEntries) {
  const json out = expect_json(run({data_dir + "/spec_slices.json", "--rank", "1", "--compact"}));
  EXPECT_EQ(out["attn"]["entries"], json::parse("[[[0,3,0,3,null,0]],[[0,3,0,3,null,null],[0,3,3,6,null,3]],[[0,2,0,2,null,0]]]"));
  EXPECT_EQ(out["kv_fwd"]["dst_rank"], json::parse("[[1,-1,-1],[1,0,-1],[0,-1,-1]]"));
  // A plan without slices keeps the key out.
  const json plain = expect_json(run({data_dir + "/spec_documents.json", "--rank", "1", "--compact"}));
  EXPECT_FALSE(plain["attn"].contains("entries"));
}

TEST_F(CliSlicesTest, PictureAndDedupOfTheExample) {
  const std::string svg = dir_ + "/plan.svg";
  const json out = expect_json(run({data_dir + "/spec_slices.json", "--svg", svg, "--dedup", "--compact"}));
  EXPECT_NE(plan_cli::read_file(svg).find("<svg"), std::string::npos);
  // Prompt shard 0 goes to rank 1 twice (two query shards there), over the wire once.
  EXPECT_EQ(out["kv_wire_fwd"]["dst_rank"], json::parse("[[[1,0,-1],[0,-1,-1],[-1,-1,-1]],[[1,-1,-1],[1,0,-1],[0,-1,-1]]]"));
  EXPECT_EQ(out["kv_wire_fwd"]["num_recv_tokens"], json::parse("[[5,4,9],[3,5,8]]"));
}

TEST_F(CliSlicesTest, PlansCarryTheirSlicesBackToJson) {
  const json plan = cpdispatch::plan_to_json(cpdispatch::parse_plan(spec_slices_plan));
  EXPECT_EQ(plan["documents"][0]["slices"], json::parse(spec_slices_plan)["documents"][0]["slices"]);
  EXPECT_FALSE(plan["documents"][1].contains("slices"));
  EXPECT_EQ(std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::parse_plan(plan.dump())).documents,
            std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::parse_plan(spec_slices_plan)).documents);
  // attn.entries read back, open ends included.
  const auto m = std::get<cpdispatch::QkvMetadata>(cpdispatch::plan_metadata(cpdispatch::parse_plan(spec_slices_plan)));
  EXPECT_EQ(cpdispatch::qkv_metadata_from_json(json(m)).attn.entries, m.attn.entries);
  const auto plain = std::get<cpdispatch::QkvMetadata>(cpdispatch::plan_metadata(cpdispatch::parse_plan(cli_test::spec_documents_plan)));
  EXPECT_FALSE(json(plain)["attn"].contains("entries"));
  EXPECT_TRUE(cpdispatch::qkv_metadata_from_json(json(plain)).attn.entries.empty());
}

TEST_F(CliSlicesTest, JsonErrorsNameTheirPath) {
  expect_invalid(run({}, with_slices("[]")), "cpdispatch-plan: documents[0].slices: an empty list; leave \"slices\" out for the plan's mask");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3], "k": [0, 3], "type": "diagonal"}])")),
                 "documents[0].slices[0].type: unknown slice type \"diagonal\"; expected \"full\", \"causal\", \"inv_causal\" or \"bi_causal\"");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3], "k": [0, 3], "type": 1}])")), "documents[0].slices[0].type: expected \"full\"");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3, 4], "k": [0, 3], "type": "full"}])")),
                 "documents[0].slices[0].q has 3 entries, expected 2");
  expect_invalid(run({}, with_slices(R"([{"q": [0, "3"], "k": [0, 3], "type": "full"}])")),
                 "documents[0].slices[0].q[1]: expected an integer, got \"3\"");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3], "type": "full"}])")), "documents[0].slices[0]: missing \"k\"");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3], "k": [0, 3], "type": "full", "band": 1}])")),
                 "documents[0].slices[0]: unknown key \"band\" (a slice has \"q\", \"k\", \"type\")");
  expect_invalid(run({}, with_slices(R"({"q": [0, 3]})")), "documents[0].slices: expected an array, got an object");
  expect_invalid(run({}, R"({"world_size": 1, "ranks": [{"docs": [{"shard_len": [2], "dst": [0], "slices": []}]}]})"),
                 "cpdispatch-plan: ranks[0].docs[0].slices: slices exist only in the documents form");
}

TEST_F(CliSlicesTest, PlanningErrorsNameDocumentAndSlice) {
  expect_invalid(run({}, with_slices(R"([{"q": [0, 3], "k": [0, 9], "type": "full"}])")),
                 "cpdispatch-plan: documents[0].slices[0].k = [0, 9] is empty or outside the document (0 <= k[0] < k[1] <= 8, its length)\n");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 4], "k": [0, 2], "type": "bi_causal"}])")),
                 "cpdispatch-plan: documents[0].slices[0] (bi_causal, q [0, 4], k [0, 2]) has no (query, key) pair inside its band: key - query in [0, -2]\n");
  expect_invalid(run({}, with_slices(R"([{"q": [0, 8], "k": [0, 8], "type": "causal"}, {"q": [2, 3], "k": [0, 1], "type": "full"}])")),
                 "cpdispatch-plan: documents[0].slices[0] and documents[0].slices[1] share the pair (query 2, key 0); each allowed pair belongs to exactly one slice\n");
}

}  // namespace

// ---- section 2f: head-parallel documents (data/spec_head_parallel.json is example 4.7)

const cli_test::Expected spec_head_parallel_numbers = {
    {"/q_fwd/dst_rank", "[[-1,-1],[-1,2],[3,-1],[0,-1]]"},
    {"/q_rev/seq_recv_mask", "[[[0],[0]],[[0],[1]],[[1],[0]],[[1],[0]]]"},
    {"/q_rev/recv_seq_lens", "[[3,0],[2,2],[4,0],[1,0]]"},
    {"/kv_fwd/dst_rank", "[[[-1,-1],[-1,-1]],[[-1,-1],[2,3]],[[3,-1],[-1,-1]],[[0,-1],[-1,-1]]]"},
    {"/kv_rev/seq_recv_mask", "[[[0,0],[0,0]],[[0,0],[1,1]],[[1,0],[0,0]],[[1,0],[0,0]]]"},
    {"/attn/seqlens_q", "[[1],[],[2],[4]]"},
    {"/attn/seqlens_kv", "[[1],[],[2],[6]]"},
    {"/hp_fwd/dst_rank", "[[[0,1],[-1,-1]],[[0,1],[-1,-1]],[[-1,-1],[-1,-1]],[[-1,-1],[-1,-1]]]"},
    {"/hp_fwd/dst_offset", "[[[0,0],[0,0]],[[3,3],[0,0]],[[0,0],[0,0]],[[0,0],[0,0]]]"},
    {"/hp_fwd/num_recv_tokens", "[[3,2,0,0,5],[3,2,0,0,5],[0,0,0,0,0],[0,0,0,0,0]]"},
    {"/hp_fwd/num_seqs", "[1,2,1,1]"},
    {"/hp_rev/dst_rank", "[[0,1],[0,1],[-1,-1],[-1,-1]]"},
    {"/hp_rev/dst_offset", "[[0,0],[3,4],[0,0],[0,0]]"},
    {"/hp_rev/seq_len", "[[3,2],[3,2],[0,0],[0,0]]"},
    {"/hp_rev/num_recv_tokens", "[[3,3,0,0,6],[2,2,0,0,4],[0,0,0,0,0],[0,0,0,0,0]]"},
    {"/hp_rev/num_seqs", "[2,2,0,0]"},
    {"/hp_rev/seq_recv_mask", "[[[1,1],[0,0]],[[1,1],[0,0]],[[0,0],[0,0]],[[0,0],[0,0]]]"},
    {"/hp_rev/recv_seq_lens", "[[3,0],[2,2],[4,0],[1,0]]"},
    {"/hp_attn/degree", "2"},
    {"/hp_attn/documents", "[[0],[0],[],[]]"},
    {"/hp_attn/seqlens", "[[5],[5],[],[]]"},
    {"/hp_attn/cu_seqlens", "[[0,5],[0,5],[0],[0]]"},
    {"/hp_attn/max_seqlen", "[5,5,0,0]"},
    {"/hp_attn/group_rank", "[0,1,0,1]"},
};

TEST_F(CliSlicesTest, SpecHeadParallelExampleFile) {
  const std::string text = plan_cli::read_file(data_dir + "/spec_head_parallel.json");
  const json out = expect_json(run({data_dir + "/spec_head_parallel.json"}));
  cli_test::expect_numbers(out, spec_head_parallel_numbers);
  EXPECT_FALSE(out["hp_attn"].contains("entries"));
  // The metadata reads back whole, head-parallel part included.
  const auto m = std::get<cpdispatch::QkvMetadata>(cpdispatch::plan_metadata(cpdispatch::parse_plan(text)));
  EXPECT_EQ(json(cpdispatch::qkv_metadata_from_json(out)), out);
  EXPECT_EQ(json(m), out);
  // The plan writes its keys back, and reads back the same.
  const json plan = cpdispatch::plan_to_json(cpdispatch::parse_plan(text));
  EXPECT_EQ(plan["head_parallel_degree"], 2);
  EXPECT_EQ(plan["documents"][0]["head_parallel"], true);
  EXPECT_FALSE(plan["documents"][1].contains("head_parallel"));
  EXPECT_EQ(std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::parse_plan(plan.dump())).documents,
            std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::parse_plan(text)).documents);
  // Plans and outputs without head-parallel documents keep the keys out.
  const json plain_plan = cpdispatch::plan_to_json(cpdispatch::parse_plan(cli_test::spec_documents_plan));
  EXPECT_FALSE(plain_plan.contains("head_parallel_degree"));
  EXPECT_FALSE(plain_plan["documents"][0].contains("head_parallel"));
  const json plain = expect_json(run({data_dir + "/spec_documents.json"}));
  for (const char* key : {"hp_fwd", "hp_rev", "hp_attn"}) EXPECT_FALSE(plain.contains(key)) << key;
  EXPECT_TRUE(plain["q_rev"]["seq_recv_mask"].is_null());
}

TEST_F(CliSlicesTest, HeadParallelEntriesReadBack) {
  json plan = json::parse(plan_cli::read_file(data_dir + "/spec_head_parallel.json"));
  plan["documents"][0]["slices"] = json::parse(R"([{"q": [0, 2], "k": [0, 2], "type": "causal"}, {"q": [2, 5], "k": [0, 5], "type": "causal"}])");
  const json out = expect_json(run({"--compact"}, plan.dump()));
  EXPECT_EQ(out["hp_attn"]["entries"], json::parse("[[[[0,2,0,2,null,0],[2,5,0,5,null,0]]],[[[0,2,0,2,null,0],[2,5,0,5,null,0]]],[],[]]"));
  EXPECT_FALSE(out["attn"].contains("entries"));  // the dispatched documents have no slices
  EXPECT_EQ(json(cpdispatch::qkv_metadata_from_json(out)), out);
}

TEST_F(CliSlicesTest, SummaryAndRankShareOfHeadParallelDocuments) {
  const plan_cli::CliRun r = run({data_dir + "/spec_head_parallel.json", "--summary"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("documents: 3, 2 spanning ranks, 1 head-parallel (head_parallel_degree 2, up to 5 tokens a rank)\n"), std::string::npos)
      << r.out;
  // attn_cost: ranks 0 and 1 each attend half the heads of document 0 (15 causal pairs: 8 and 7) beside their dispatched shards.
  EXPECT_NE(r.out.find("   0       1       3                0       1        1          9         1\n"
                       "   1       2       4                2       0        0          7         2\n"),
            std::string::npos)
      << r.out;
  const json share = expect_json(run({data_dir + "/spec_head_parallel.json", "--rank", "1", "--compact"}));
  EXPECT_EQ(share["hp_fwd"]["dst_rank"], json::parse("[[0,1],[-1,-1]]"));
  EXPECT_EQ(share["hp_rev"]["dst_offset"], json::parse("[3,4]"));
  EXPECT_EQ(share["hp_attn"]["documents"], json::parse("[0]"));
  EXPECT_EQ(share["hp_attn"]["group_rank"], 1);
  const json plain = expect_json(run({data_dir + "/spec_documents.json", "--rank", "1", "--compact"}));
  EXPECT_FALSE(plain.contains("hp_attn"));
}

TEST_F(CliSlicesTest, HeadParallelErrorsNameTheirPath) {
  json plan = json::parse(plan_cli::read_file(data_dir + "/spec_head_parallel.json"));
  json bad = plan;
  bad["documents"][0]["head_parallel"] = 1;
  expect_invalid(run({}, bad.dump()), "documents[0].head_parallel: expected true or false, got 1");
  bad = plan;
  bad["head_parallel_degree"] = 3;
  expect_invalid(run({}, bad.dump()), "head_parallel_degree = 3 must divide world_size = 4");
  bad = plan;
  bad["documents"][1]["shards"][0].erase("dst");  // a dispatched document still needs its destinations
  expect_invalid(run({}, bad.dump()), "documents[1].shards[0]: missing \"dst\"");
  bad = plan;
  bad["documents"][0]["shards"][1]["rank"] = 2;
  expect_invalid(run({}, bad.dump()), "documents[0] is head-parallel but its shards live on ranks 0 (shards[0]) and 2 (shards[1])");
  expect_invalid(run({}, R"({"world_size": 1, "head_parallel_degree": 1, "ranks": [{"docs": []}]})"), "unknown key \"head_parallel_degree\"");
  expect_invalid(run({data_dir + "/spec_head_parallel.json", "--svg", dir_ + "/plan.svg"}), "--svg does not draw head-parallel documents");
}
