// include/cpdispatch/io/json.hpp: plan parsing with path-named errors, metadata
// to_json / from_json, and the worked examples of docs/plan-format.md
// (section 4) through JSON.

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/io/json.hpp"
#include "spec_examples.hpp"

namespace cpdispatch {
// Readable tensors in failure messages (found by ADL).
template <class T>
void PrintTo(const Tensor<T>& t, std::ostream* os) {
  *os << nlohmann::json(detail::tensor_to_json(t)).dump();
}
}  // namespace cpdispatch

namespace {

using cpdispatch::Metadata;
using cpdispatch::Tensor;
using json = nlohmann::json;
using I = std::int64_t;

/// The message of the cpdispatch::invalid_input `f` throws ("" and a failure if none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  ADD_FAILURE() << "no invalid_input thrown";
  return "";
}

std::string plan_error(std::string_view text) {
  return error_of([&] { cpdispatch::parse_plan(text); });
}

std::string planning_error(std::string_view text) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(text);
  return error_of([&] { cpdispatch::plan_metadata(plan); });
}

json metadata_json(std::string_view plan_text) {
  return cpdispatch::metadata_to_json(cpdispatch::plan_metadata(cpdispatch::parse_plan(plan_text)));
}

void expect_same(const Metadata& got, const Metadata& want, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(got.world_size, want.world_size);
  EXPECT_EQ(got.dst_rank, want.dst_rank);
  EXPECT_EQ(got.dst_offset, want.dst_offset);
  EXPECT_EQ(got.seq_len, want.seq_len);
  EXPECT_EQ(got.num_recv_tokens, want.num_recv_tokens);
  EXPECT_EQ(got.num_seqs, want.num_seqs);
  EXPECT_EQ(got.num_total_recv_tokens, want.num_total_recv_tokens);
  ASSERT_EQ(got.seq_recv_mask.has_value(), want.seq_recv_mask.has_value());
  ASSERT_EQ(got.recv_seq_lens.has_value(), want.recv_seq_lens.has_value());
  if (want.seq_recv_mask) {
    EXPECT_EQ(*got.seq_recv_mask, *want.seq_recv_mask);
    EXPECT_EQ(*got.recv_seq_lens, *want.recv_seq_lens);
  }
}

void expect_same(const cpdispatch::QkvMetadata& got, const cpdispatch::QkvMetadata& want) {
  expect_same(got.q_fwd, want.q_fwd, "q_fwd");
  expect_same(got.q_rev, want.q_rev, "q_rev");
  expect_same(got.kv_fwd, want.kv_fwd, "kv_fwd");
  expect_same(got.kv_rev, want.kv_rev, "kv_rev");
  EXPECT_EQ(got.attn.seqlens_q, want.attn.seqlens_q);
  EXPECT_EQ(got.attn.seqlens_kv, want.attn.seqlens_kv);
  EXPECT_EQ(got.attn.cu_seqlens_q, want.attn.cu_seqlens_q);
  EXPECT_EQ(got.attn.cu_seqlens_kv, want.attn.cu_seqlens_kv);
  EXPECT_EQ(got.attn.max_seqlen_q, want.attn.max_seqlen_q);
  EXPECT_EQ(got.attn.max_seqlen_kv, want.attn.max_seqlen_kv);
}

/// JSON -> metadata -> JSON gives the same structs and the same text, and
/// the metadata read back passes validate().
void expect_round_trip(const cpdispatch::PlanMetadata& planned) {
  const json j = cpdispatch::metadata_to_json(planned);
  if (const auto* qkv = std::get_if<cpdispatch::QkvMetadata>(&planned)) {
    const cpdispatch::QkvMetadata back = cpdispatch::qkv_metadata_from_json(j);
    expect_same(back, *qkv);
    EXPECT_EQ(json(back), j);
    for (const auto* m : {&back.q_fwd, &back.q_rev, &back.kv_fwd, &back.kv_rev}) EXPECT_NO_THROW(m->validate());
  } else {
    const auto& query = std::get<cpdispatch::QueryMetadata>(planned);
    const cpdispatch::QueryMetadata back = cpdispatch::query_metadata_from_json(j);
    expect_same(back.fwd, query.fwd, "fwd");
    expect_same(back.rev, query.rev, "rev");
    EXPECT_EQ(json(back), j);
    EXPECT_NO_THROW(back.fwd.validate("fwd"));
    EXPECT_NO_THROW(back.rev.validate("rev"));
  }
  // And through text, pretty and compact.
  EXPECT_EQ(json::parse(cpdispatch::to_pretty_string(j)), j);
  EXPECT_EQ(json::parse(j.dump()), j);
}

// ---------------------------------------------------------------- the spec's worked examples

TEST(JsonSpecExamples, QkvPlanGivesTheSpecNumbers) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(cli_test::spec_qkv_plan);
  ASSERT_TRUE(std::holds_alternative<cpdispatch::QkvPlan>(plan));
  EXPECT_STREQ(cpdispatch::plan_kind(plan), "qkv");
  const auto& qkv = std::get<cpdispatch::QkvPlan>(plan);
  EXPECT_EQ(qkv.world_size, 2);
  EXPECT_EQ(qkv.max_cp_degree, std::optional<I>(3));
  ASSERT_EQ(qkv.ranks.size(), 2u);
  ASSERT_EQ(qkv.ranks[0].docs.size(), 2u);
  EXPECT_EQ(qkv.ranks[0].docs[0].shard_len, (std::vector<I>{4, 2}));
  EXPECT_EQ(qkv.ranks[0].docs[0].dst, (std::vector<I>{1, 0}));
  EXPECT_EQ(qkv.ranks[1].docs[0].shard_len, (std::vector<I>{5, 1, 2}));
  EXPECT_EQ(qkv.ranks[1].docs[0].dst, (std::vector<I>{0, 1, 0}));

  const json out = metadata_json(cli_test::spec_qkv_plan);
  cli_test::expect_numbers(out, cli_test::spec_qkv_numbers);
  EXPECT_EQ(out.at("kv_fwd").at("num_copies"), 3);
  EXPECT_EQ(out.at("kv_fwd").at("has_copies"), true);
  EXPECT_EQ(out.at("q_fwd").at("has_copies"), false);
  EXPECT_EQ(out.at("kv_rev").at("mask_copies"), 3);
  EXPECT_EQ(out.at("q_fwd").at("world_size"), 2);
}

TEST(JsonSpecExamples, QueryPlanGivesTheSpecNumbers) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(cli_test::spec_query_plan);
  ASSERT_TRUE(std::holds_alternative<cpdispatch::QueryPlan>(plan));
  EXPECT_STREQ(cpdispatch::plan_kind(plan), "query");
  EXPECT_EQ(std::get<cpdispatch::QueryPlan>(plan).dispatch.dim(), 2u);
  cli_test::expect_numbers(metadata_json(cli_test::spec_query_plan), cli_test::spec_query_numbers);
}

TEST(JsonSpecExamples, MetadataRoundTrips) {
  expect_round_trip(cpdispatch::plan_metadata(cpdispatch::parse_plan(cli_test::spec_qkv_plan)));
  expect_round_trip(cpdispatch::plan_metadata(cpdispatch::parse_plan(cli_test::spec_query_plan)));
}

// ---------------------------------------------------------------- plans

TEST(JsonPlan, KindIsInferredOrExplicit) {
  EXPECT_STREQ(cpdispatch::plan_kind(cpdispatch::parse_plan(R"({"world_size":1,"ranks":[{"docs":[]}]})")), "qkv");
  EXPECT_STREQ(cpdispatch::plan_kind(cpdispatch::parse_plan(R"({"kind":"qkv","world_size":1,"ranks":[{"docs":[]}]})")), "qkv");
  EXPECT_STREQ(cpdispatch::plan_kind(cpdispatch::parse_plan(R"({"world_size":1,"seq_len":[[2]],"dispatch":[[0]]})")), "query");
  EXPECT_STREQ(cpdispatch::plan_kind(cpdispatch::parse_plan(R"({"kind":"query","world_size":1,"seq_len":[[2]],"dispatch":[[0]]})")),
               "query");
  // max_cp_degree is optional; null reads as absent.
  const auto plan = cpdispatch::parse_plan(R"({"world_size":1,"max_cp_degree":null,"ranks":[{"docs":[]}]})");
  EXPECT_FALSE(std::get<cpdispatch::QkvPlan>(plan).max_cp_degree.has_value());
}

TEST(JsonPlan, ThreeDimensionalDispatch) {
  const char* text = R"({"world_size":2,"seq_len":[[3,2],[4,0]],"dispatch":[[[0,1],[1,-1]],[[1,0],[-1,-1]]]})";
  const auto plan = cpdispatch::parse_plan(text);
  const auto& q = std::get<cpdispatch::QueryPlan>(plan);
  EXPECT_EQ(q.dispatch.shape(), (std::vector<std::size_t>{2, 2, 2}));
  const json out = metadata_json(text);
  EXPECT_EQ(out.at("fwd").at("dst_rank"), json::parse("[[[0,1],[1,-1]],[[1,0],[-1,-1]]]"));
  EXPECT_EQ(out.at("fwd").at("has_copies"), true);
  EXPECT_EQ(out.at("rev").at("seq_recv_mask"), json::parse("[[[1,1],[1,0]],[[1,1],[0,0]]]"));
  EXPECT_EQ(out.at("rev").at("recv_seq_lens"), json::parse("[[3,2],[4,0]]"));
  expect_round_trip(cpdispatch::plan_metadata(plan));
  EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::plan_from_json(cpdispatch::plan_to_json(plan))), cpdispatch::plan_to_json(plan));
  EXPECT_EQ(cpdispatch::plan_to_json(plan).at("dispatch"), json::parse("[[[0,1],[1,-1]],[[1,0],[-1,-1]]]"));
}

TEST(JsonPlan, PlansRoundTripThroughJson) {
  for (const char* text : {cli_test::spec_qkv_plan, cli_test::spec_query_plan}) {
    const json once = cpdispatch::plan_to_json(cpdispatch::parse_plan(text));
    const json twice = cpdispatch::plan_to_json(cpdispatch::plan_from_json(once));
    EXPECT_EQ(once, twice);
    EXPECT_EQ(metadata_json(once.dump()), metadata_json(text));
  }
}

struct BadInput {
  const char* text;
  const char* message;
};

TEST(JsonPlan, MalformedPlansNameThePath) {
  const std::vector<BadInput> cases = {
      // the document
      {"[1]", "plan: expected an object, got an array"},
      {"42", "plan: expected an object, got 42"},
      {"{}", "plan: cannot tell its kind: expected \"ranks\" or \"documents\" (qkv plan), \"seq_len\" (query plan) or \"kind\""},
      {R"({"world_size":1,"ranks":[],"seq_len":[]})",
       "plan: has both \"ranks\" (qkv plan) and \"seq_len\" (query plan); set \"kind\""},
      {R"({"kind":"mlp","world_size":1})", "kind: expected \"query\" or \"qkv\", got \"mlp\""},
      {R"({"kind":3,"world_size":1})", "kind: expected \"query\" or \"qkv\", got 3"},
      // world_size
      {R"({"ranks":[]})", "plan: missing \"world_size\""},
      {R"({"world_size":"2","ranks":[]})", "world_size: expected an integer, got \"2\""},
      {R"({"world_size":2.0,"ranks":[]})", "world_size: expected an integer, got 2.0"},
      {R"({"world_size":2.5,"ranks":[]})", "world_size: expected an integer, got 2.5"},
      {R"({"world_size":true,"ranks":[]})", "world_size: expected an integer, got true"},
      {R"({"world_size":null,"ranks":[]})", "world_size: expected an integer, got null"},
      {R"({"world_size":0,"ranks":[]})", "world_size = 0 must be at least 1"},
      {R"({"world_size":-3,"ranks":[]})", "world_size = -3 must be at least 1"},
      {R"({"world_size":9223372036854775808,"ranks":[]})",
       "world_size: 9223372036854775808 is outside the 64-bit signed integer range"},
      {R"({"world_size":1e30,"ranks":[]})", "world_size: expected an integer, got 1e+30"},
      // qkv plans
      {R"({"world_size":2,"ranks":[{"docs":[]}]})", "ranks has 1 entry, but world_size = 2"},
      {R"({"world_size":1,"ranks":[{"docs":[]},{"docs":[]}]})", "ranks has 2 entries, but world_size = 1"},
      {R"({"world_size":1,"ranks":{}})", "ranks: expected an array, got an empty object"},
      {R"({"kind":"qkv","world_size":1})", "plan: missing \"ranks\" or \"documents\" (a qkv plan has one of them)"},
      {R"({"world_size":2,"ranks":[[],{"docs":[]}]})", "ranks[0]: expected an object, got an empty array"},
      {R"({"world_size":2,"ranks":[{"docs":[]},{}]})", "ranks[1]: missing \"docs\""},
      {R"({"world_size":2,"ranks":[{"docs":[]},{"docs":5}]})", "ranks[1].docs: expected an array, got 5"},
      {R"({"world_size":1,"ranks":[{"doc":[]}]})", "ranks[0]: unknown key \"doc\" (a rank has \"docs\")"},
      {R"({"world_size":1,"ranks":[{"docs":[7]}]})", "ranks[0].docs[0]: expected an object, got 7"},
      {R"({"world_size":1,"ranks":[{"docs":[{"dst":[0]}]}]})", "ranks[0].docs[0]: missing \"shard_len\""},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[1]}]}]})", "ranks[0].docs[0]: missing \"dst\""},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":4,"dst":[0]}]}]})",
       "ranks[0].docs[0].shard_len: expected an array, got 4"},
      {R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[{"shard_len":[1,2,3],"dst":[1,1,"x"]}]}]})",
       "ranks[1].docs[0].dst[2]: expected an integer, got \"x\""},
      {R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[{"shard_len":[1,[2]],"dst":[1,1]}]}]})",
       "ranks[1].docs[0].shard_len[1]: expected an integer, got an array"},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[4,2],"dst":[0]}]}]})",
       "ranks[0].docs[0].dst has 1 entry, but shard_len has 2"},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[4],"dst":[0],"len":4}]}]})",
       "ranks[0].docs[0]: unknown key \"len\" (a document has \"shard_len\", \"dst\")"},
      {R"({"world_size":1,"max_cp_degree":0,"ranks":[{"docs":[]}]})", "max_cp_degree = 0 must be at least 1"},
      {R"({"world_size":1,"max_cp_degree":"3","ranks":[{"docs":[]}]})", "max_cp_degree: expected an integer, got \"3\""},
      {R"({"world_size":1,"max_cp_deg":3,"ranks":[{"docs":[]}]})",
       "plan: unknown key \"max_cp_deg\" (a qkv plan has \"kind\", \"world_size\", \"max_cp_degree\", \"mask\", \"dedup\", \"ranks\")"},
      {R"({"world_size":1,"ranks":[{"docs":[]}],"seqlen":[]})",
       "plan: unknown key \"seqlen\" (a qkv plan has \"kind\", \"world_size\", \"max_cp_degree\", \"mask\", \"dedup\", \"ranks\")"},
      // query plans
      {R"({"kind":"query","world_size":1,"dispatch":[[0]]})", "plan: missing \"seq_len\""},
      {R"({"world_size":1,"seq_len":[[1]]})", "plan: missing \"dispatch\""},
      {R"({"world_size":3,"seq_len":[[1],[2]],"dispatch":[[0],[0]]})", "seq_len has 2 entries, expected 3 (world_size)"},
      {R"({"world_size":2,"seq_len":[[1,2,3],[4,5]],"dispatch":[[0,0,0],[0,0]]})",
       "seq_len[1] has 2 entries, but seq_len[0] has 3 (arrays must be rectangular)"},
      {R"({"world_size":2,"seq_len":[[1,true],[4,5]],"dispatch":[[0,0],[0,0]]})", "seq_len[0][1]: expected an integer, got true"},
      {R"({"world_size":1,"seq_len":[[[1]]],"dispatch":[[0]]})", "seq_len[0][0]: expected an integer, got an array"},
      {R"({"world_size":1,"seq_len":[3],"dispatch":[[0]]})", "seq_len[0]: expected an array, got 3"},
      {R"({"world_size":1,"seq_len":"abc","dispatch":[[0]]})", "seq_len: expected an array, got \"abc\""},
      {R"({"world_size":2,"seq_len":[[1],[2]],"dispatch":[[0]]})", "dispatch has 1 entry, expected 2 (world_size)"},
      {R"({"world_size":2,"seq_len":[[1,2],[3,4]],"dispatch":[[0,0],[1]]})", "dispatch[1] has 1 entry, expected 2 (as seq_len)"},
      {R"({"world_size":2,"seq_len":[[1,2],[3,4]],"dispatch":[[[0],[0]],[1,2]]})", "dispatch[1][0]: expected an array, got 1"},
      {R"({"world_size":2,"seq_len":[[1],[3]],"dispatch":[[[0,1]],[[1]]]})",
       "dispatch[1][0] has 1 entry, but dispatch[0][0] has 2 (arrays must be rectangular)"},
      {R"({"world_size":1,"seq_len":[[1]],"dispatch":[[[[0]]]]})", "dispatch[0][0][0]: expected an integer, got an array"},
      {R"({"kind":"query","world_size":1,"seq_len":[[1]],"dispatch":[[0]],"ranks":[]})",
       "plan: unknown key \"ranks\" (a query plan has \"kind\", \"world_size\", \"seq_len\", \"dispatch\")"},
      // long values are cut short, odd keys are escaped (one line, always)
      {R"({"world_size":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","ranks":[]})",
       "world_size: expected an integer, got \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa..."},
      {"{\"world_size\":\"a\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\",\"ranks\":[]}",
       "world_size: expected an integer, got \"a\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9..."},  // cut between characters
      {"{\"world_size\":1,\"ranks\":[{\"docs\":[]}],\"a\\nb\":1}",
       "plan: unknown key \"a\\nb\" (a qkv plan has \"kind\", \"world_size\", \"max_cp_degree\", \"mask\", \"dedup\", \"ranks\")"},
  };
  for (const BadInput& c : cases) EXPECT_EQ(plan_error(c.text), c.message) << c.text;
}

TEST(JsonPlan, InvalidJsonIsInvalidInput) {
  for (const char* text : {"", "{", "{\"world_size\": 2,", "{} x", "[1, 2", "{'a': 1}", "\"\xff\""}) {
    const std::string message = plan_error(text);
    EXPECT_EQ(message.rfind("invalid JSON: parse error at line 1, column ", 0), 0u) << text << " -> " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(JsonPlan, PlanningErrorsComeFromThePlanners) {
  const std::vector<BadInput> cases = {
      {R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[{"shard_len":[1,2,3],"dst":[1,1,9]}]}]})",
       "plan_qkv: ranks[1].docs[0].dst[2] = 9 is outside [0, 2)"},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[4,0],"dst":[0,0]}]}]})",
       "plan_qkv: ranks[0].docs[0].shard_len[1] = 0 must be positive"},
      {R"({"world_size":1,"ranks":[{"docs":[{"shard_len":[],"dst":[]}]}]})",
       "plan_qkv: ranks[0].docs[0].shard_len is empty (a document has at least one shard)"},
      {R"({"world_size":1,"max_cp_degree":1,"ranks":[{"docs":[{"shard_len":[4,2],"dst":[0,0]}]}]})",
       "plan_qkv: max_cp_degree = 1 is smaller than the 2 shards of ranks[0].docs[0]"},
      {R"({"world_size":3,"seq_len":[[1,2],[1,0],[1,1]],"dispatch":[[0,5],[0,-1],[1,1]]})",
       "plan_query: dispatch[0][1] = 5 is outside [0, 3) (-1 means no copy)"},
      {R"({"world_size":1,"seq_len":[[1,-2]],"dispatch":[[0,0]]})", "plan_query: seq_len[0][1] = -2 is negative"},
      {R"({"world_size":1,"seq_len":[[0,2]],"dispatch":[[-1,0]]})",
       "plan_query: seq_len[0][1] = 2 follows a padding shard (padding sits only at the end of a row)"},
  };
  for (const BadInput& c : cases) EXPECT_EQ(planning_error(c.text), c.message) << c.text;
}

// ---------------------------------------------------------------- metadata

TEST(JsonMetadata, ToJsonWritesTheSpecKeys) {
  const json out = metadata_json(cli_test::spec_qkv_plan);
  for (const char* name : {"q_fwd", "q_rev", "kv_fwd", "kv_rev"}) {
    for (const char* key : {"dst_rank", "dst_offset", "seq_len", "num_recv_tokens", "num_seqs", "seq_recv_mask", "recv_seq_lens"}) {
      EXPECT_TRUE(out.at(name).contains(key)) << name << "." << key;
    }
  }
  // Masks are 0/1 integers, not booleans.
  for (const json& row : out.at("kv_rev").at("seq_recv_mask"))
    for (const json& shard : row)
      for (const json& bit : shard) EXPECT_TRUE(bit.is_number_integer() && (bit == 0 || bit == 1)) << bit;
  const auto planned = cpdispatch::plan_metadata(cpdispatch::parse_plan(cli_test::spec_qkv_plan));
  EXPECT_EQ(json(std::get<cpdispatch::QkvMetadata>(planned)), out);
}

TEST(JsonMetadata, GetUsesFromJson) {
  const auto planned = cpdispatch::plan_metadata(cpdispatch::parse_plan(cli_test::spec_qkv_plan));
  const auto& qkv = std::get<cpdispatch::QkvMetadata>(planned);
  const json j = qkv.kv_rev;
  expect_same(j.get<Metadata>(), qkv.kv_rev, "kv_rev");
  expect_same(json(qkv).get<cpdispatch::QkvMetadata>(), qkv);
  EXPECT_EQ(json(qkv.attn).get<cpdispatch::AttentionLayout>().cu_seqlens_kv, qkv.attn.cu_seqlens_kv);
}

TEST(JsonMetadata, RandomPlansRoundTrip) {
  struct Shape {
    I world, total, docs, cp;
  };
  for (const Shape s : {Shape{1, 16, 2, 1}, Shape{2, 32, 3, 2}, Shape{4, 64, 4, 4}, Shape{8, 96, 5, 8}}) {
    for (std::uint64_t seed = 1; seed <= 5; ++seed) {
      SCOPED_TRACE(testing::Message() << "W=" << s.world << " C=" << s.cp << " seed=" << seed);
      const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(s.world, s.total, s.docs, s.cp, seed);
      expect_round_trip(cpdispatch::plan_qkv(plan));
      // The plan itself survives JSON too.
      const cpdispatch::Plan back = cpdispatch::plan_from_json(json(plan));
      EXPECT_EQ(cpdispatch::plan_to_json(back), json(plan));
      // Query plans on the same shard lengths, 2-D and 3-D.
      const Tensor<I> seq_len = cpdispatch::gen_seq_lens(s.world, s.docs, s.total, seed);
      Tensor<I> dispatch2({seq_len.size(0), seq_len.size(1)});
      Tensor<I> dispatch3({seq_len.size(0), seq_len.size(1), 2}, -1);
      cpdispatch::Rng rng(seed);
      for (std::size_t r = 0; r < seq_len.size(0); ++r) {
        for (std::size_t j = 0; j < seq_len.size(1); ++j) {
          dispatch2(r, j) = rng.between(0, s.world - 1);
          dispatch3(r, j, 0) = rng.between(0, s.world - 1);
          if (rng.below(2) == 1) dispatch3(r, j, 1) = rng.between(0, s.world - 1);
        }
      }
      expect_round_trip(cpdispatch::plan_query(seq_len, dispatch2));
      expect_round_trip(cpdispatch::plan_query(seq_len, dispatch3));
    }
  }
}

TEST(JsonMetadata, EmptyShapesRoundTripExactly) {
  // No documents at all: kv_fwd is [W][0][1] and kv_rev's mask [W][0][1];
  // has_copies / num_copies / mask_copies keep those shapes.
  const auto planned = cpdispatch::plan_metadata(cpdispatch::parse_plan(R"({"world_size":2,"ranks":[{"docs":[]},{"docs":[]}]})"));
  const auto& qkv = std::get<cpdispatch::QkvMetadata>(planned);
  EXPECT_EQ(qkv.kv_fwd.dst_rank.shape(), (std::vector<std::size_t>{2, 0, 1}));
  expect_round_trip(planned);
  expect_round_trip(cpdispatch::plan_metadata(cpdispatch::parse_plan(R"({"world_size":2,"seq_len":[[],[]],"dispatch":[[],[]]})")));
  // Without the extra keys, empty shapes are read as far as the arrays tell.
  json j = qkv.kv_fwd;
  for (const char* key : {"has_copies", "num_copies", "mask_copies", "world_size"}) j.erase(key);
  const Metadata m = cpdispatch::metadata_from_json(j);
  EXPECT_EQ(m.dst_rank.shape(), (std::vector<std::size_t>{2, 0}));
  EXPECT_EQ(m.world_size, 2);
}

/// The spec QKV example's metadata JSON with `edit` applied, read back.
std::string metadata_error(const char* name, const std::function<void(json&)>& edit) {
  json j = metadata_json(cli_test::spec_qkv_plan).at(name);
  edit(j);
  return error_of([&] { cpdispatch::metadata_from_json(j, name); });
}

TEST(JsonMetadata, MalformedMetadataNamesThePath) {
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j.erase("dst_offset"); }), "q_fwd: missing \"dst_offset\"");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["dst_rank"] = nullptr; }), "q_fwd.dst_rank: expected an array, got null");
  EXPECT_EQ(metadata_error("kv_fwd", [](json& j) { j["dst_rank"][1][2][0] = "a"; }),
            "kv_fwd.dst_rank[1][2][0]: expected an integer, got \"a\"");
  EXPECT_EQ(metadata_error("kv_rev", [](json& j) { j["dst_offset"][1].erase(6); }),
            "kv_rev.dst_offset[1] has 6 entries, expected 7 (as dst_rank)");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["num_recv_tokens"][0].erase(2); }),
            "q_fwd.num_recv_tokens[0] has 2 entries, expected 3 (world_size + 1)");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["world_size"] = 3; }), "q_fwd.dst_rank has 2 entries, expected 3 (world_size)");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["world_size"] = 0; }), "q_fwd.world_size = 0 must be at least 1");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["seq_len"][1][0] = 1.5; }), "q_fwd.seq_len[1][0]: expected an integer, got 1.5");
  EXPECT_EQ(metadata_error("kv_rev", [](json& j) { j["recv_seq_lens"] = nullptr; }),
            "kv_rev: seq_recv_mask and recv_seq_lens must be both null or both present");
  EXPECT_EQ(metadata_error("kv_rev", [](json& j) { j["seq_recv_mask"][0][1].push_back(0); }),
            "kv_rev.seq_recv_mask[0][1] has 4 entries, expected 3 (mask_copies)");
  EXPECT_EQ(metadata_error("kv_rev", [](json& j) { j["recv_seq_lens"][1].push_back(0); }),
            "kv_rev.recv_seq_lens[1] has 4 entries, expected 3 (as seq_recv_mask)");
  EXPECT_EQ(metadata_error("kv_fwd", [](json& j) { j["has_copies"] = "yes"; }), "kv_fwd.has_copies: expected true or false, got \"yes\"");
  EXPECT_EQ(metadata_error("kv_fwd", [](json& j) { j["num_copies"] = 2; }), "kv_fwd.dst_rank[0][0] has 3 entries, expected 2 (num_copies)");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["num_copies"] = 2; }),
            "q_fwd.num_copies = 2, but dst_rank has no copy dimension (expected 1)");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["has_copies"] = true; }), "q_fwd.dst_rank[0][0]: expected an array, got 1");
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["dst_rank"] = json::array(); j.erase("world_size"); }),
            "q_fwd.dst_rank has no rows (world_size must be at least 1)");
  // What is left to the shape rules of the format (detail::check_shapes).
  EXPECT_EQ(metadata_error("q_fwd", [](json& j) { j["num_seqs"][0] = 9; }), "q_fwd.num_seqs[0] = 9 is outside [0, 3]");
  // Unnamed: the object is the document.
  EXPECT_EQ(error_of([] { cpdispatch::metadata_from_json(json::array()); }), "metadata: expected an object, got an empty array");
  EXPECT_EQ(error_of([] { cpdispatch::metadata_from_json(json{{"dst_rank", 1}}); }), "dst_rank: expected an array, got 1");
}

TEST(JsonMetadata, MalformedQkvAndQueryMetadata) {
  json j = metadata_json(cli_test::spec_qkv_plan);
  j.erase("attn");
  EXPECT_EQ(error_of([&] { cpdispatch::qkv_metadata_from_json(j); }), "qkv metadata: missing \"attn\"");
  j = metadata_json(cli_test::spec_qkv_plan);
  j["attn"]["max_seqlen_q"] = {5};
  EXPECT_EQ(error_of([&] { cpdispatch::qkv_metadata_from_json(j); }), "attn.max_seqlen_q has 1 entry, but seqlens_q has 2");
  j["attn"]["seqlens_kv"][1][0] = "x";
  EXPECT_EQ(error_of([&] { cpdispatch::qkv_metadata_from_json(j); }), "attn.seqlens_kv[1][0]: expected an integer, got \"x\"");
  j = metadata_json(cli_test::spec_query_plan);
  j["rev"]["num_seqs"] = {3, 3};
  EXPECT_EQ(error_of([&] { cpdispatch::query_metadata_from_json(j); }), "rev.num_seqs has 2 entries, expected 3 (world_size)");
  EXPECT_EQ(error_of([] { cpdispatch::query_metadata_from_json(json::object()); }), "query metadata: missing \"fwd\"");
}

TEST(JsonMetadata, ValidateCatchesWhatFromJsonLeavesToIt) {
  json j = metadata_json(cli_test::spec_qkv_plan).at("q_fwd");
  j["dst_offset"][0][1] = 1;  // overlaps dst_offset[0][2] on rank 0
  const Metadata m = cpdispatch::metadata_from_json(j, "q_fwd");
  EXPECT_EQ(error_of([&] { m.validate("q_fwd"); }).rfind("q_fwd.dst_offset", 0), 0u);
}

// ---------------------------------------------------------------- text

TEST(JsonText, PrettyKeepsRowsOnOneLine) {
  const json j = json::parse(R"({"b": {"c": [[1, 2], [3, 4]], "d": null}, "a": [], "e": {}})");
  EXPECT_EQ(cpdispatch::to_pretty_string(j),
            "{\n"
            "  \"a\": [],\n"
            "  \"b\": {\n"
            "    \"c\": [[1, 2], [3, 4]],\n"
            "    \"d\": null\n"
            "  },\n"
            "  \"e\": {}\n"
            "}");
  // Too wide for one line: one row a line, indented by 2 more.
  EXPECT_EQ(cpdispatch::to_pretty_string(json::parse(R"({"rows": [[1, 2, 3], [4, 5, 6]]})"), 24),
            "{\n"
            "  \"rows\": [\n"
            "    [1, 2, 3],\n"
            "    [4, 5, 6]\n"
            "  ]\n"
            "}");
  const json big = metadata_json(cli_test::spec_qkv_plan);
  for (std::size_t width : {0u, 10u, 40u, 100u, 1000u}) EXPECT_EQ(json::parse(cpdispatch::to_pretty_string(big, width)), big);
}

TEST(JsonMasks, PlansKeepTheirMaskAndDedupSwitch) {
  for (const char* mask : {R"({"type":"full"})", R"({"type":"sliding_window","window":7})", R"({"type":"causal"})"}) {
    const std::string text = std::string(R"({"world_size":2,"dedup":true,"mask":)") + mask +
                             R"(,"documents":[{"shards":[{"rank":0,"len":3,"dst":1},{"rank":1,"len":2,"dst":0}]}]})";
    const auto plan = std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::parse_plan(text));
    EXPECT_EQ(cpdispatch::detail::mask_to_json(plan.mask), json::parse(mask));
    EXPECT_TRUE(plan.dedup);
    EXPECT_TRUE(cpdispatch::dedup_requested(json::parse(text)));
    // Written and read again: the same plan.
    const auto again = std::get<cpdispatch::QkvDocumentsPlan>(cpdispatch::plan_from_json(cpdispatch::plan_to_json(plan)));
    EXPECT_EQ(again.mask, plan.mask);
    EXPECT_EQ(again.dedup, plan.dedup);
    EXPECT_EQ(again.documents, plan.documents);
    // The output carries the mask as attn.mask, and reads back with it.
    const json out = cpdispatch::metadata_to_json(cpdispatch::plan_metadata(plan));
    EXPECT_EQ(out["attn"]["mask"], json::parse(mask));
    EXPECT_EQ(cpdispatch::qkv_metadata_from_json(out).attn.mask, plan.mask);
  }
  // A causal plan is written as it always was: no "mask" key.
  EXPECT_FALSE(cpdispatch::plan_to_json(cpdispatch::parse_plan(R"({"world_size":1,"ranks":[{"docs":[]}]})")).contains("mask"));
}

TEST(JsonMasks, BadMasksNameTheField) {
  const auto error = [](const std::string& mask) {
    return plan_error(R"({"world_size":1,"mask":)" + mask + R"(,"ranks":[{"docs":[]}]})");
  };
  EXPECT_EQ(error(R"({"type":"diagonal"})"),
            "mask.type: unknown mask type \"diagonal\"; expected \"causal\", \"full\" or \"sliding_window\"");
  EXPECT_EQ(error(R"({"type":"sliding_window","window":2.5})"), "mask.window: expected an integer, got 2.5");
  EXPECT_EQ(error(R"({"type":"sliding_window","window":0})"), "mask.window = 0 must be at least 1 (a query sees at least itself)");
  EXPECT_EQ(error(R"({"type":"sliding_window"})"),
            "mask: a sliding_window mask needs \"window\" (the tokens a query sees, itself included)");
  EXPECT_EQ(error(R"({"type":"causal","window":4})"), "mask: unknown key \"window\" (a causal mask has \"type\")");
  EXPECT_EQ(plan_error(R"({"world_size":1,"mask":{"type":"full"},"seq_len":[[1]],"dispatch":[[0]]})"),
            "mask: an attention mask applies to qkv plans (it decides which key-values each query needs); a query plan has none");
}

}  // namespace

// ---------------------------------------------------------------- documents form (section 2b)

TEST(JsonDocumentsPlan, ReadsTheSection2bExample) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(cli_test::spec_documents_plan);
  ASSERT_TRUE(std::holds_alternative<cpdispatch::QkvDocumentsPlan>(plan));
  EXPECT_STREQ(cpdispatch::plan_kind(plan), "qkv");
  const auto& d = std::get<cpdispatch::QkvDocumentsPlan>(plan);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.max_cp_degree, 3);
  ASSERT_EQ(d.documents.size(), 3u);
  EXPECT_EQ(d.documents[0], (cpdispatch::PackedDocument{{{0, 3, 1}, {1, 2, 0}, {1, 4, 1}}}));
  cli_test::expect_numbers(metadata_json(cli_test::spec_documents_plan), cli_test::spec_documents_numbers);
}

TEST(JsonDocumentsPlan, KindIsImpliedByDocuments) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(R"({"world_size":1,"documents":[]})");
  EXPECT_TRUE(std::holds_alternative<cpdispatch::QkvDocumentsPlan>(plan));
  EXPECT_FALSE(std::get<cpdispatch::QkvDocumentsPlan>(plan).max_cp_degree.has_value());
}

TEST(JsonDocumentsPlan, RoundTripsThroughPlanToJson) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(cli_test::spec_documents_plan);
  const cpdispatch::Plan again = cpdispatch::plan_from_json(cpdispatch::plan_to_json(plan));
  ASSERT_TRUE(std::holds_alternative<cpdispatch::QkvDocumentsPlan>(again));
  EXPECT_EQ(std::get<cpdispatch::QkvDocumentsPlan>(again).documents, std::get<cpdispatch::QkvDocumentsPlan>(plan).documents);
  EXPECT_EQ(metadata_json(cpdispatch::plan_to_json(again).dump()), metadata_json(cli_test::spec_documents_plan));
}

TEST(JsonDocumentsPlan, BothFormsOfOnePlanGiveTheSameJson) {
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    const cpdispatch::QkvPlan p = cpdispatch::create_qkv_dispatch(4, 64, 3, 4, seed);
    EXPECT_EQ(metadata_json(json(p).dump()), metadata_json(json(cpdispatch::to_documents(p)).dump())) << "seed " << seed;
  }
}

TEST(JsonDocumentsPlan, MalformedPlansNameThePath) {
  const std::vector<BadInput> cases = {
      {R"({"world_size":1,"ranks":[{"docs":[]}],"documents":[]})", "plan: has both \"ranks\" and \"documents\" (a qkv plan has one of them)"},
      {R"({"world_size":1,"documents":{}})", "documents: expected an array, got an empty object"},
      {R"({"world_size":1,"documents":[3]})", "documents[0]: expected an object, got 3"},
      {R"({"world_size":1,"documents":[{}]})", "documents[0]: missing \"shards\""},
      {R"({"world_size":1,"documents":[{"shards":[],"x":1}]})", "documents[0]: unknown key \"x\" (a document has \"shards\")"},
      {R"({"world_size":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0}]},{"shards":[{"rank":0,"len":1}]}]})",
       "documents[1].shards[0]: missing \"dst\""},
      {R"({"world_size":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0,"home":0}]}]})",
       "documents[0].shards[0]: unknown key \"home\" (a shard has \"rank\", \"len\", \"dst\")"},
      {R"({"world_size":1,"documents":[{"shards":[{"rank":0,"len":"7","dst":0}]}]})", "documents[0].shards[0].len: expected an integer, got \"7\""},
      {R"({"world_size":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0}]}],"ranks_":1})",
       "plan: unknown key \"ranks_\" (a qkv plan has \"kind\", \"world_size\", \"max_cp_degree\", \"mask\", \"dedup\", \"documents\")"},
      {R"({"world_size":1,"max_cp_degree":0,"documents":[]})", "max_cp_degree = 0 must be at least 1"},
  };
  for (const BadInput& c : cases) EXPECT_EQ(plan_error(c.text), c.message) << c.text;
}

TEST(JsonDocumentsPlan, OutOfRangeValuesNameTheShard) {
  const std::vector<BadInput> cases = {
      {R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":1,"dst":0},{"rank":2,"len":1,"dst":0}]}]})",
       "plan_qkv: documents[0].shards[1].rank = 2 is outside [0, 2)"},
      {R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":0,"dst":0}]}]})", "plan_qkv: documents[0].shards[0].len = 0 must be positive"},
      {R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":1,"dst":-1}]}]})", "plan_qkv: documents[0].shards[0].dst = -1 is outside [0, 2)"},
      {R"({"world_size":2,"documents":[{"shards":[{"rank":0,"len":1,"dst":0}]},{"shards":[]}]})",
       "plan_qkv: documents[1].shards is empty (a document has at least one shard)"},
      {R"({"world_size":2,"max_cp_degree":1,"documents":[{"shards":[{"rank":0,"len":1,"dst":0},{"rank":1,"len":1,"dst":0}]}]})",
       "plan_qkv: documents[0].shards has 2 shards, more than max_cp_degree = 1"},
  };
  for (const BadInput& c : cases) EXPECT_EQ(planning_error(c.text), c.message) << c.text;
}
