// The cpdispatch-plan executable, run for real: stdout, stderr and the exit
// status of each invocation.

#include <gtest/gtest.h>

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "cpdispatch/balance/balance_problem.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/io/json.hpp"
#include "../common/plan_cli.hpp"
#include "spec_examples.hpp"

namespace {

using json = nlohmann::json;

const std::string data_dir = CPDISPATCH_CLI_DATA_DIR;

using plan_cli::read_file;

using Result = plan_cli::CliRun;

/// A scratch directory per test, removed with it.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "cpdispatch-cli-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const char* name : {"stdin", "stdout", "stderr", "plan.json"}) ::unlink((dir_ + "/" + name).c_str());
    ::rmdir(dir_.c_str());
  }

  std::string file(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  /// Runs cpdispatch-plan with `args`, `input` on its stdin; stdout goes to
  /// `stdout_path` when given (e.g. /dev/full), else is captured.
  Result run(const std::vector<std::string>& args, const std::string& input = "", const std::string& stdout_path = "") {
    return plan_cli::run(args, input, dir_ + "/", stdout_path);
  }

  std::string dir_;
};

/// Success: status 0, nothing on stderr; returns stdout parsed.
json expect_json(const Result& r) {
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  return json::parse(r.out);
}

/// Invalid input: status 2, nothing on stdout, exactly one stderr line that
/// starts with the program name.
void expect_invalid(const Result& r, const std::string& message_part) {
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not exactly one line: " << r.err;
  EXPECT_EQ(r.err.rfind("cpdispatch-plan: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(message_part), std::string::npos) << "stderr: " << r.err << "expected to contain: " << message_part;
}

json planned_json(const std::string& plan_text) {
  return cpdispatch::metadata_to_json(cpdispatch::plan_metadata(cpdispatch::parse_plan(plan_text)));
}

// ---------------------------------------------------------------- plans in, metadata out

TEST_F(CliTest, SpecQkvExampleFile) {
  const std::string path = data_dir + "/spec_qkv.json";
  // The checked-in file is the spec's plan.
  EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::parse_plan(read_file(path))),
            cpdispatch::plan_to_json(cpdispatch::parse_plan(cli_test::spec_qkv_plan)));
  const json out = expect_json(run({path}));
  cli_test::expect_numbers(out, cli_test::spec_qkv_numbers);
  EXPECT_EQ(out, planned_json(read_file(path)));
}

TEST_F(CliTest, SpecQueryExampleFile) {
  const std::string path = data_dir + "/spec_query.json";
  EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::parse_plan(read_file(path))),
            cpdispatch::plan_to_json(cpdispatch::parse_plan(cli_test::spec_query_plan)));
  const json out = expect_json(run({path}));
  cli_test::expect_numbers(out, cli_test::spec_query_numbers);
  EXPECT_EQ(out, planned_json(read_file(path)));
}

TEST_F(CliTest, OutputEqualsPlanQkvOfTheSamePlan) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(4, 64, 3, 4, seed);
    const json out = expect_json(run({file("plan.json", json(plan).dump())}));
    EXPECT_EQ(out, json(cpdispatch::plan_qkv(plan)));
    EXPECT_EQ(cpdispatch::qkv_metadata_from_json(out).kv_rev.dst_offset, cpdispatch::plan_qkv(plan).kv_rev.dst_offset);
  }
}

TEST_F(CliTest, ReadsStandardInput) {
  const std::string plan = read_file(data_dir + "/spec_qkv.json");
  const Result from_file = run({data_dir + "/spec_qkv.json"});
  const Result dash = run({"-"}, plan);
  const Result no_arg = run({}, plan);
  EXPECT_EQ(expect_json(dash), expect_json(from_file));
  EXPECT_EQ(dash.out, from_file.out);
  EXPECT_EQ(no_arg.out, from_file.out);
  EXPECT_EQ(no_arg.status, 0);
}

TEST_F(CliTest, PrettyByDefaultCompactOnRequest) {
  const std::string path = data_dir + "/spec_qkv.json";
  const Result pretty = run({path});
  const Result compact = run({path, "--compact"});
  EXPECT_EQ(expect_json(compact), expect_json(pretty));
  // Compact: one line. Pretty: 2-space indentation, one key a line.
  EXPECT_EQ(compact.out.find('\n'), compact.out.size() - 1);
  EXPECT_EQ(compact.out.find(' '), std::string::npos);
  EXPECT_EQ(pretty.out.rfind("{\n  \"attn\": {\n    \"cu_seqlens_kv\": ", 0), 0u) << pretty.out;
  EXPECT_NE(pretty.out.find("\n    \"dst_rank\": [[1, 0, 0], [0, 1, 0]],\n"), std::string::npos) << pretty.out;
  EXPECT_EQ(pretty.out.back(), '\n');
}

TEST_F(CliTest, SummaryOfTheSpecQkvExample) {
  const Result r = run({data_dir + "/spec_qkv.json", "--summary"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  // rank 0: shards 4,2,3 (9 tokens), sends the 4 to rank 1, receives 12
  // query and 22 KV tokens; rank 1: 5,1,2 (8 tokens), sends 5 and 2 to rank 0.
  // Attention cost (causal token pairs): rank 0 attends 2 tokens after 4
  // (11), 3 (6), 5 (15) and 2 after 6 (15) = 47; rank 1: 4 (10), 1 after 5 (6) = 16.
  EXPECT_EQ(r.out,
            "qkv plan: world_size 2, max_cp_degree 3\n"
            "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost\n"
            "   0       3       9                4      12       22         47\n"
            "   1       3       8                7       5       10         16\n"
            "imbalance (max/mean of tokens received): q 1.412 (max 12, mean 8.5), kv 1.375 (max 22, mean 16)\n"
            "imbalance of attention cost (max/mean): 1.492 (max 47, mean 31.5)\n");
}

TEST_F(CliTest, SummaryOfTheSpecQueryExample) {
  const Result r = run({"--summary", data_dir + "/spec_query.json"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(r.out,
            "query plan: world_size 3, dispatch [W][S]\n"
            "rank  shards  tokens  q_sent_off_rank  q_recv\n"
            "   0       3      12                4      13\n"
            "   1       3       9                9      14\n"
            "   2       3      15               15       9\n"
            "imbalance (max/mean of tokens received): q 1.167 (max 14, mean 12)\n");
}

TEST_F(CliTest, SummaryOfAnEmptyPlan) {
  const Result r = run({"--summary"}, R"({"world_size": 2, "ranks": [{"docs": []}, {"docs": []}]})");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("q n/a (no tokens), kv n/a (no tokens)"), std::string::npos) << r.out;
}

// ---------------------------------------------------------------- documents form (section 2b)

TEST_F(CliTest, SpecDocumentsExampleFile) {
  const std::string path = data_dir + "/spec_documents.json";
  EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::parse_plan(read_file(path))),
            cpdispatch::plan_to_json(cpdispatch::parse_plan(cli_test::spec_documents_plan)));
  const json out = expect_json(run({path}));
  cli_test::expect_numbers(out, cli_test::spec_documents_numbers);
  EXPECT_EQ(out, planned_json(read_file(path)));
}

TEST_F(CliTest, SummaryOfTheSpecDocumentsExample) {
  const Result r = run({data_dir + "/spec_documents.json", "--summary"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  // rank 0 holds doc0.0 (3) and doc1.0 (5), rank 1 doc0.1 (2), doc0.2 (4),
  // doc2.0 (1); document 0 spans both, so 1 and 2 of their shards continue
  // on another rank. Attention cost: rank 0 attends 5 (15) and 2 after 3
  // (9) = 24; rank 1 attends 3 (6), 4 after 5 (30) and 1 (1) = 37.
  EXPECT_EQ(r.out,
            "qkv plan: world_size 2, max_cp_degree 3\n"
            "documents: 3, 1 spanning ranks\n"
            "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost  spanning\n"
            "   0       2       8                3       7       10         24         1\n"
            "   1       3       7                2       8       13         37         2\n"
            "imbalance (max/mean of tokens received): q 1.067 (max 8, mean 7.5), kv 1.130 (max 13, mean 11.5)\n"
            "imbalance of attention cost (max/mean): 1.213 (max 37, mean 30.5)\n");
}

TEST_F(CliTest, DocumentsFormBadInput) {
  expect_invalid(run({}, R"({"world_size":1,"ranks":[{"docs":[]}],"documents":[]})"),
                 "cpdispatch-plan: plan: has both \"ranks\" and \"documents\" (a qkv plan has one of them)\n");
  expect_invalid(run({}, R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":1,"dst":0},{"rank":5,"len":1,"dst":0}]}]})"),
                 "cpdispatch-plan: documents[0].shards[1].rank = 5 is outside [0, 2)\n");
  expect_invalid(run({"--summary"}, R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":-3,"dst":0}]}]})"),
                 "cpdispatch-plan: documents[0].shards[0].len = -3 must be positive\n");
  expect_invalid(run({}, R"({"world_size":2,"documents":[{"shards":[]}]})"),
                 "cpdispatch-plan: documents[0].shards is empty (a document has at least one shard)\n");
  expect_invalid(run({}, R"({"world_size":2,"max_cp_degree":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0},{"rank":1,"len":1,"dst":1}]}]})"),
                 "cpdispatch-plan: documents[0].shards has 2 shards, more than max_cp_degree = 1\n");
  expect_invalid(run({}, R"({"world_size":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0,"extra":1}]}]})"),
                 "documents[0].shards[0]: unknown key \"extra\"");
}

TEST_F(CliTest, DocumentsFormEqualsThePerRankForm) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(4, 64, 3, 4, seed);
    const Result per_rank = run({file("plan.json", json(plan).dump())});
    const Result documents = run({file("plan.json", json(cpdispatch::to_documents(plan)).dump())});
    EXPECT_EQ(expect_json(documents), expect_json(per_rank)) << "seed " << seed;
  }
}

// ---------------------------------------------------------------- --rank

/// What --rank R must print: rank R's get_slice() of the global plan.
json expected_rank_json(const std::string& plan_text, std::int64_t r) {
  const auto planned = cpdispatch::plan_metadata(cpdispatch::parse_plan(plan_text));
  if (const auto* q = std::get_if<cpdispatch::QueryMetadata>(&planned)) {
    return {{"rank", r}, {"fwd", q->fwd.get_slice(r)}, {"rev", q->rev.get_slice(r)}};
  }
  const auto& m = std::get<cpdispatch::QkvMetadata>(planned);
  const auto u = static_cast<std::size_t>(r);
  const json attn = {{"seqlens_q", m.attn.seqlens_q[u]},       {"seqlens_kv", m.attn.seqlens_kv[u]},
                     {"cu_seqlens_q", m.attn.cu_seqlens_q[u]}, {"cu_seqlens_kv", m.attn.cu_seqlens_kv[u]},
                     {"max_seqlen_q", m.attn.max_seqlen_q[u]}, {"max_seqlen_kv", m.attn.max_seqlen_kv[u]},
                     {"mask", json(m.attn)["mask"]}};
  return {{"rank", r},
          {"q_fwd", m.q_fwd.get_slice(r)},
          {"q_rev", m.q_rev.get_slice(r)},
          {"kv_fwd", m.kv_fwd.get_slice(r)},
          {"kv_rev", m.kv_rev.get_slice(r)},
          {"attn", attn}};
}

TEST_F(CliTest, RankPrintsTheGlobalSliceOfEveryRank) {
  const cpdispatch::QkvPlan random = cpdispatch::create_qkv_dispatch(4, 64, 3, 4, 5);
  for (const std::string& text :
       {std::string(cli_test::spec_documents_plan), std::string(cli_test::spec_query_plan), json(cpdispatch::to_documents(random)).dump()}) {
    const std::string path = file("plan.json", text);
    const auto W = json::parse(text)["world_size"].get<std::int64_t>();
    for (std::int64_t r = 0; r < W; ++r) {
      EXPECT_EQ(expect_json(run({path, "--rank", std::to_string(r)})), expected_rank_json(text, r)) << text << " rank " << r;
    }
  }
}

TEST_F(CliTest, RankOfTheSection2bExample) {
  // Rank 1 receives doc0.0 (3) and doc0.2 (4, after 5 tokens of context) and doc2.0 (1).
  const json out = expect_json(run({data_dir + "/spec_documents.json", "--rank=1", "--compact"}));
  EXPECT_EQ(out["kv_fwd"]["dst_rank"], json::parse("[[0,1,-1],[1,-1,-1],[1,-1,-1]]"));
  EXPECT_EQ(out["kv_fwd"]["num_recv_tokens"], json::parse("[6,7,13]"));
  EXPECT_EQ(out["kv_rev"]["dst_offset"], json::parse("[0,16,7,2,6]"));
  EXPECT_EQ(out["kv_rev"]["seq_recv_mask"], json::parse("[[1,1,0],[1,0,0],[1,0,0]]"));
  EXPECT_EQ(out["attn"]["cu_seqlens_kv"], json::parse("[0,3,12,13]"));
  EXPECT_EQ(out["attn"]["max_seqlen_kv"], 9);
}

TEST_F(CliTest, RankErrors) {
  const std::string plan = data_dir + "/spec_documents.json";
  expect_invalid(run({plan, "--rank", "2"}), "cpdispatch-plan: rank 2 is outside [0, 2)\n");
  expect_invalid(run({plan, "--rank=-1"}), "cpdispatch-plan: rank -1 is outside [0, 2)\n");
  expect_invalid(run({plan, "--rank", "one"}), "--rank needs a rank number, got 'one'");
  expect_invalid(run({plan, "--rank"}), "--rank needs a rank number (--rank R)");
  expect_invalid(run({plan, "--rank", "0", "--summary"}), "does not combine with --summary");
  expect_invalid(run({"--rank", "0"}, R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":1,"dst":3}]}]})"),
                 "cpdispatch-plan: documents[0].shards[0].dst = 3 is outside [0, 2)\n");
}

TEST_F(CliTest, Help) {
  for (const char* flag : {"--help", "-h"}) {
    const Result r = run({flag});
    EXPECT_EQ(r.status, 0);
    EXPECT_EQ(r.err, "");
    EXPECT_EQ(r.out.rfind("Usage: cpdispatch-plan [FILE|-] [--summary | --rank R] [--svg FILE] [--compact]\n", 0), 0u) << r.out;
  }
}

// ---------------------------------------------------------------- invalid input: exit 2, one stderr line

TEST_F(CliTest, MalformedJson) {
  expect_invalid(run({}, "{\"world_size\": 2,"), "cpdispatch-plan: invalid JSON: parse error at line 1, column ");
  expect_invalid(run({}, ""), "invalid JSON");
  expect_invalid(run({}, "{\"world_size\": 2,\n\n  \"ranks\": [}\n"), "invalid JSON: parse error at line 3, column ");
}

TEST_F(CliTest, WrongTypesAndShapes) {
  expect_invalid(run({}, R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[{"shard_len":[1,2,3],"dst":[1,1,"x"]}]}]})"),
                 "cpdispatch-plan: ranks[1].docs[0].dst[2]: expected an integer, got \"x\"\n");
  expect_invalid(run({}, R"({"world_size":2,"ranks":[{"docs":[]}]})"), "cpdispatch-plan: ranks has 1 entry, but world_size = 2\n");
  expect_invalid(run({}, R"({"world_size":2,"seq_len":[[1,2],[3]],"dispatch":[[0,0],[1]]})"),
                 "cpdispatch-plan: seq_len[1] has 1 entry, but seq_len[0] has 2 (arrays must be rectangular)\n");
  expect_invalid(run({}, R"({"world_size":2,"seq_len":[[1,2],[3,4]],"dispatch":[[0,0],[1]]})"),
                 "cpdispatch-plan: dispatch[1] has 1 entry, expected 2 (as seq_len)\n");
  expect_invalid(run({}, "[]"), "cpdispatch-plan: plan: expected an object, got an empty array\n");
  // A key with a newline in it still gives one line.
  expect_invalid(run({}, "{\"world_size\":1,\"ranks\":[{\"docs\":[]}],\"a\\nb\":1}"), "unknown key \"a\\nb\"");
}

TEST_F(CliTest, OutOfRangeValues) {
  expect_invalid(run({}, R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[{"shard_len":[1,2,3],"dst":[1,1,9]}]}]})"),
                 "cpdispatch-plan: ranks[1].docs[0].dst[2] = 9 is outside [0, 2)\n");
  expect_invalid(run({}, R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[4,-1],"dst":[0,0]}]}]})"),
                 "cpdispatch-plan: ranks[0].docs[0].shard_len[1] = -1 must be positive\n");
  expect_invalid(run({}, R"({"world_size":3,"seq_len":[[1,2],[1,0],[1,1]],"dispatch":[[0,5],[0,-1],[1,1]]})"),
                 "cpdispatch-plan: dispatch[0][1] = 5 is outside [0, 3) (-1 means no copy)\n");
  expect_invalid(run({}, R"({"world_size":0,"ranks":[]})"), "cpdispatch-plan: world_size = 0 must be at least 1\n");
  expect_invalid(run({"--summary"}, R"({"world_size":1,"max_cp_degree":1,"ranks":[{"docs":[{"shard_len":[4,2],"dst":[0,0]}]}]})"),
                 "cpdispatch-plan: max_cp_degree = 1 is smaller than the 2 shards of ranks[0].docs[0]\n");
}

TEST_F(CliTest, HugeCopyDimensionIsRefusedBeforeAllocating) {
  // W * S * C = 4 * 1 * 2^62 would wrap to 0 in 64 bits; the planner refuses the copy dimension first.
  expect_invalid(run({}, R"({"world_size":4,"max_cp_degree":4611686018427387904,"ranks":[
                 {"docs":[{"shard_len":[1],"dst":[0]}]},{"docs":[]},{"docs":[]},{"docs":[]}]})"),
                 "max_cp_degree = 4611686018427387904 exceeds the supported maximum of 65536");
}

TEST_F(CliTest, UsageErrors) {
  const std::string plan = data_dir + "/spec_qkv.json";
  expect_invalid(run({plan, "--bogus"}), "cpdispatch-plan: unknown option '--bogus' (see --help)\n");
  expect_invalid(run({"-x"}), "unknown option '-x'");
  expect_invalid(run({plan, plan}), "more than one input file");
  expect_invalid(run({plan, "--summary", "--compact"}), "--compact applies to the JSON output, not to --summary");
}

TEST_F(CliTest, UnreadableInput) {
  expect_invalid(run({dir_ + "/no-such-file.json"}), "cannot open '" + dir_ + "/no-such-file.json': No such file or directory\n");
  expect_invalid(run({dir_}), "cannot read '" + dir_ + "': Is a directory\n");
  // "--" ends the options: a file may be called "--summary".
  expect_invalid(run({"--", "--summary"}), "cannot open '--summary'");
}

TEST_F(CliTest, UnwritableOutputIsAFailureNotInvalidInput) {
  const Result r = run({data_dir + "/spec_qkv.json"}, "", "/dev/full");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "cpdispatch-plan: cannot write the output: No space left on device\n");
}

// Section 2d's plan, with `mask` spliced in (empty: the causal default).
std::string mask_plan(const std::string& mask) {
  return R"({"kind": "qkv", "world_size": 2, )" + (mask.empty() ? std::string() : R"("mask": )" + mask + ", ") +
         R"("documents": [
      {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 0, "len": 2, "dst": 0},
                  {"rank": 1, "len": 4, "dst": 1}, {"rank": 1, "len": 3, "dst": 0}]},
      {"shards": [{"rank": 1, "len": 2, "dst": 1}]}]})";
}

TEST_F(CliTest, MaskWorkedExampleInThreeMasks) {
  const json window = expect_json(run({file("plan.json", mask_plan(R"({"type": "sliding_window", "window": 4})")), "--compact", "--dedup"}));
  EXPECT_EQ(window["kv_fwd"]["dst_rank"], json::parse("[[[1,0,1],[0,1,-1],[-1,-1,-1]],[[1,0,-1],[0,-1,-1],[1,-1,-1]]]"));
  EXPECT_EQ(window["kv_fwd"]["dst_offset"], json::parse("[[[0,0,3],[3,6,0],[0,0,0]],[[8,5,0],[9,0,0],[12,0,0]]]"));
  EXPECT_EQ(window["kv_fwd"]["num_recv_tokens"], json::parse("[[5,7,12],[8,6,14]]"));
  EXPECT_EQ(window["kv_rev"]["dst_offset"], json::parse("[[5,3,9,4,0],[0,10,8,0,7]]"));
  EXPECT_EQ(window["kv_rev"]["num_recv_tokens"], json::parse("[[5,8,13],[7,6,13]]"));
  EXPECT_EQ(window["kv_rev"]["seq_recv_mask"], json::parse("[[[1,1,1],[1,1,0],[0,0,0]],[[1,1,0],[1,0,0],[1,0,0]]]"));
  EXPECT_EQ(window["attn"]["seqlens_kv"], json::parse("[[5,7],[3,9,2]]"));
  EXPECT_EQ(window["attn"]["mask"], json::parse(R"({"type": "sliding_window", "window": 4})"));
  EXPECT_EQ(window["kv_wire_fwd"]["num_recv_tokens"], json::parse("[[5,7,12],[5,6,11]]"));

  const json full = expect_json(run({file("plan.json", mask_plan(R"({"type": "full"})")), "--compact", "--dedup"}));
  EXPECT_EQ(full["kv_fwd"]["dst_offset"], json::parse("[[[0,0,12,12],[3,3,15,15],[0,0,0,0]],[[5,5,17,17],[9,9,21,21],[24,0,0,0]]]"));
  EXPECT_EQ(full["kv_fwd"]["num_recv_tokens"], json::parse("[[10,14,24],[10,16,26]]"));
  EXPECT_EQ(full["attn"]["seqlens_kv"], json::parse("[[12,12],[12,12,2]]"));
  EXPECT_EQ(full["attn"]["mask"], json::parse(R"({"type": "full"})"));
  EXPECT_EQ(full["kv_wire_rev"]["dst_offset"], json::parse("[[5,8,9,13,0],[0,3,0,4,7]]"));
  EXPECT_EQ(full["kv_wire_rev"]["num_recv_tokens"], json::parse("[[5,5,10],[7,9,16]]"));

  const json causal = expect_json(run({file("plan.json", mask_plan("")), "--compact"}));
  EXPECT_EQ(causal["kv_fwd"]["dst_offset"], json::parse("[[[0,0,3,5],[3,6,8,0],[0,0,0,0]],[[8,10,0,0],[14,0,0,0],[12,0,0,0]]]"));
  EXPECT_EQ(causal["kv_fwd"]["num_recv_tokens"], json::parse("[[10,7,17],[8,6,14]]"));
  EXPECT_EQ(causal["attn"]["seqlens_kv"], json::parse("[[5,12],[3,9,2]]"));
  EXPECT_EQ(causal["attn"]["mask"], json::parse(R"({"type": "causal"})"));
}

TEST_F(CliTest, MaskRankShareEqualsTheGlobalSlice) {
  for (const std::string mask : {R"({"type": "full"})", R"({"type": "sliding_window", "window": 2})", R"({"type": "causal"})"}) {
    const std::string text = mask_plan(mask);
    const std::string path = file("plan.json", text);
    for (std::int64_t r = 0; r < 2; ++r) {
      EXPECT_EQ(expect_json(run({path, "--rank", std::to_string(r)})), expected_rank_json(text, r)) << mask << " rank " << r;
    }
  }
}

TEST_F(CliTest, MaskSummaryShowsTheMaskAndItsCounts) {
  const Result r = run({file("plan.json", mask_plan(R"({"type": "sliding_window", "window": 4})")), "--summary"});
  EXPECT_EQ(r.status, 0) << r.err;
  // Window 4: rank 0 attends positions 3-4 and 9-11 of document 0 (4 keys each);
  // rank 1 positions 0-2 (1 + 2 + 3), 5-8 (4 each) and document 1's 0-1 (1 + 2).
  EXPECT_EQ(r.out,
            "qkv plan: world_size 2, max_cp_degree 3, mask sliding_window(4)\n"
            "documents: 2, 1 spanning ranks\n"
            "rank  shards  tokens  q_sent_off_rank  q_recv  kv_recv  attn_cost  spanning\n"
            "   0       2       5                3       5       12         20         2\n"
            "   1       3       9                3       9       14         25         2\n"
            "imbalance (max/mean of tokens received): q 1.286 (max 9, mean 7), kv 1.077 (max 14, mean 13)\n"
            "imbalance of attention cost (max/mean): 1.111 (max 25, mean 22.5)\n");
}

TEST_F(CliTest, MaskBadInput) {
  const auto plan = [](const std::string& mask) {
    return R"({"world_size":1,"mask":)" + mask + R"(,"ranks":[{"docs":[{"shard_len":[2,2],"dst":[0,0]}]}]})";
  };
  expect_invalid(run({}, plan(R"({"type":"sliding"})")), "mask.type: unknown mask type \"sliding\"");
  expect_invalid(run({}, plan(R"({"type":3})")), "mask.type: expected \"causal\", \"full\" or \"sliding_window\", got 3");
  expect_invalid(run({}, plan(R"({"window":3})")), "mask: missing \"type\"");
  expect_invalid(run({}, plan(R"({"type":"sliding_window"})")), "mask: a sliding_window mask needs \"window\"");
  expect_invalid(run({}, plan(R"({"type":"sliding_window","window":4.0})")), "mask.window: expected an integer, got 4.0");
  expect_invalid(run({}, plan(R"({"type":"sliding_window","window":"4"})")), "mask.window: expected an integer");
  expect_invalid(run({}, plan(R"({"type":"sliding_window","window":0})")), "mask.window = 0 must be at least 1");
  expect_invalid(run({}, plan(R"({"type":"sliding_window","window":-5})")), "mask.window = -5 must be at least 1");
  expect_invalid(run({}, plan(R"({"type":"full","window":3})")), "mask: unknown key \"window\"");
  expect_invalid(run({}, plan(R"("full")")), "mask: expected an object");
  expect_invalid(run({}, R"({"world_size":1,"mask":{"type":"full"},"seq_len":[[1]],"dispatch":[[0]]})"),
                 "mask: an attention mask applies to qkv plans");
  expect_invalid(run({}, R"({"world_size":1,"max_cp_degree":1,"mask":{"type":"full"},"ranks":[{"docs":[{"shard_len":[2,2],"dst":[0,0]}]}]})"),
                 "max_cp_degree = 1 is smaller than the 2 shards of ranks[0].docs[0] whose queries need its shard_len[0] (full mask)");
}

// ---------------------------------------------------------------- balance --grid

TEST_F(CliTest, BalanceOnAGridWritesAPlanCutOnItThatPlanModePlans) {
  // Three ranks of 250 tokens (no multiple of the grid), a window mask and dedup: every cut the
  // balancer makes falls on a multiple of 16 in the packed coordinate, and plan mode plans the plan.
  const std::string batch = R"({"world_size": 3, "max_cp_degree": 6, "mask": {"type": "sliding_window", "window": 40},
    "documents": [{"pieces": [{"rank": 0, "len": 230}]}, {"pieces": [{"rank": 0, "len": 20}, {"rank": 1, "len": 250}, {"rank": 2, "len": 40}]},
                  {"pieces": [{"rank": 2, "len": 210}]}]})";
  for (const std::string grid : {"16", "1"}) {
    const Result balanced = run({"balance", "-", "--grid", grid, "--dedup"}, batch);
    const json out = expect_json(balanced);
    const auto plan = std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::plan_from_json(out));
    // The input's own cuts, at packed 250 and 500, are off a grid of 16; with it, every other cut is on it.
    const std::optional<cpdispatch::GridCut> first = cpdispatch::first_off_grid(plan, 16);
    ASSERT_TRUE(first);
    if (grid == "16") {
      EXPECT_EQ(*first, (cpdispatch::GridCut{1, 0, 20, 250}));
    }
    std::int64_t cuts = 0, off = 0, start = 230;  // document 1 starts at packed 230, and its pieces lie end to end
    for (std::size_t k = 0; k + 1 < plan.documents[1].shards.size(); ++k) {
      start += plan.documents[1].shards[k].len;
      if (start == 250 || start == 500) continue;
      ++cuts;
      off += start % 16 != 0 ? 1 : 0;
    }
    for (const std::size_t d : {std::size_t{0}, std::size_t{2}}) {
      std::int64_t at = d == 0 ? 0 : 540;
      for (std::size_t k = 0; k + 1 < plan.documents[d].shards.size(); ++k) {
        at += plan.documents[d].shards[k].len;
        ++cuts;
        off += at % 16 != 0 ? 1 : 0;
      }
    }
    EXPECT_GT(cuts, 0) << grid;
    if (grid == "16") {
      EXPECT_EQ(off, 0) << "cuts off the grid";
    } else {
      EXPECT_GT(off, 0) << "without a grid the balancer cuts where the cost says";
    }
    const Result planned = run({"-", "--summary"}, balanced.out);
    EXPECT_EQ(planned.status, 0) << planned.err;
    EXPECT_NE(planned.out.find("mask sliding_window(40)"), std::string::npos) << planned.out;
  }
}

}  // namespace
