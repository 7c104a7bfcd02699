// The library's reader of a balance input (io/balance_json.hpp), without
// the CLI: both forms give the BalanceProblem they describe, absent options
// their defaults (the grid too), and a bad field is an invalid_input naming its path.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/io/json.hpp"

namespace {

using cpdispatch::BalanceProblem;
using cpdispatch::DocumentPiece;
using ::testing::HasSubstr;
using I = std::int64_t;

/// The invalid_input message reading `text` as a balance input gives.
std::string reading_error(const std::string& text) {
  try {
    const nlohmann::json j = cpdispatch::parse_json(text);
    (void)cpdispatch::balance_problem_from_json(j);
    (void)cpdispatch::balance_options_from_json(j);
    (void)cpdispatch::inter_node_ratio_from_json(j);
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "(read without error)";
}

TEST(BalanceJson, PackedBatchGivesItsProblem) {
  const nlohmann::json j = cpdispatch::parse_json(R"({
    "world_size": 3, "max_cp_degree": 2,
    "documents": [{"pieces": [{"rank": 0, "len": 5}, {"rank": 1, "len": 3}]}, {"pieces": [{"rank": 2, "len": 4}]}],
    "recv_capacity": [10, 11, 12], "q_bytes": 4, "kv_bytes": 0,
    "mask": {"type": "sliding_window", "window": 3}, "dedup": true, "inter_node_ratio": 2.5})");
  const BalanceProblem p = cpdispatch::balance_problem_from_json(j);
  EXPECT_EQ(p.world_size, 3);
  EXPECT_EQ(p.max_cp_degree, 2);
  const std::vector<cpdispatch::BalanceDocument> documents{{{{0, 5}, {1, 3}}}, {{{2, 4}}}};
  EXPECT_EQ(p.documents, documents);
  EXPECT_TRUE(p.docs.empty());
  EXPECT_EQ(p.recv_capacity, (std::vector<I>{10, 11, 12}));
  EXPECT_EQ(p.q_bytes, 4);
  EXPECT_EQ(p.kv_bytes, 0);
  EXPECT_EQ(p.mask, cpdispatch::AttentionMask::sliding_window(3));
  EXPECT_TRUE(cpdispatch::balance_options_from_json(j).dedup);
  EXPECT_EQ(cpdispatch::inter_node_ratio_from_json(j), 2.5);
}

TEST(BalanceJson, DocumentsPerRankTakeTheDefaults) {
  const nlohmann::json j = cpdispatch::parse_json(R"({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3, 1]}, {"docs": []}]})");
  const BalanceProblem p = cpdispatch::balance_problem_from_json(j);
  EXPECT_EQ(p.docs, (std::vector<std::vector<I>>{{3, 1}, {}}));
  EXPECT_TRUE(p.documents.empty());
  EXPECT_TRUE(p.recv_capacity.empty());
  EXPECT_EQ(p.q_bytes, 1);
  EXPECT_EQ(p.kv_bytes, 1);
  EXPECT_EQ(p.mask, cpdispatch::AttentionMask::causal());
  EXPECT_FALSE(cpdispatch::balance_options_from_json(j).dedup);
  EXPECT_EQ(cpdispatch::inter_node_ratio_from_json(j), cpdispatch::default_inter_node_ratio);
}

TEST(BalanceJson, BadFieldIsInvalidInputNamingIt) {
  const std::string W2 = R"("world_size": 2, "max_cp_degree": 2, )";
  EXPECT_THAT(reading_error("[1]"), HasSubstr("input: expected an object"));
  EXPECT_THAT(reading_error(R"({"world_size": 2, "ranks": [{"docs": [1]}, {"docs": [2]}]})"), HasSubstr("input: missing \"max_cp_degree\""));
  EXPECT_THAT(reading_error("{" + W2 + R"("documents": [{"pieces": [{"rank": 1, "len": 2}, {"rank": 1, "len": 0}]}]})"),
              HasSubstr("documents[0].pieces[1].len = 0 must be a positive length"));
  EXPECT_THAT(reading_error("{" + W2 + R"("documents": [{"pieces": [{"rank": 2, "len": 1}]}]})"),
              HasSubstr("documents[0].pieces[0].rank = 2 is outside [0, 2)"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [-1]}]})"), HasSubstr("ranks[1].docs[0] = -1 must be a positive length"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}], "documents": []})"), HasSubstr("both \"documents\" and \"ranks\""));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [1]}], "recv_capacity": [1]})"),
              HasSubstr("recv_capacity has 1 entry, but world_size = 2"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [1]}], "q_bytes": -1})"), HasSubstr("q_bytes = -1 must be at least 0"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [1]}], "dedup": 1})"), HasSubstr("dedup: expected true or false"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [1]}], "inter_node_ratio": 0})"),
              HasSubstr("inter_node_ratio: expected a number in (0, 1e12]"));
  EXPECT_THAT(reading_error("{" + W2 + R"("ranks": [{"docs": [1]}, {"docs": [1]}], "qbytes": 1})"), HasSubstr("input: unknown key \"qbytes\" (a balance input has"));
}

TEST(BalanceJson, BalancedPlanReadsBackAsThePlanWithItsDedup) {
  const nlohmann::json j = cpdispatch::parse_json(R"({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 6}]}]})");
  const cpdispatch::Plan plan(cpdispatch::plan_balanced(cpdispatch::balance_problem_from_json(j)));
  for (const bool dedup : {false, true}) {
    const nlohmann::json out = cpdispatch::balanced_plan_to_json(plan, dedup);
    EXPECT_EQ(cpdispatch::dedup_requested(out), dedup);
    EXPECT_EQ(out.contains("dedup"), dedup);
    EXPECT_EQ(cpdispatch::plan_to_json(cpdispatch::plan_from_json(out)), out) << dedup;  // the plan itself, unchanged
  }
}

TEST(BalanceJson, GridIsReadAndABadOneIsNamed) {
  const std::string W2 = R"({"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [1]}, {"docs": [1]}])";
  EXPECT_EQ(cpdispatch::balance_options_from_json(cpdispatch::parse_json(W2 + "}")).grid, 1);
  EXPECT_EQ(cpdispatch::balance_options_from_json(cpdispatch::parse_json(W2 + R"(, "grid": 64})")).grid, 64);
  EXPECT_EQ(cpdispatch::balance_options_from_json(cpdispatch::parse_json(W2 + R"(, "grid": 1099511627776})")).grid, cpdispatch::max_grid);
  EXPECT_THAT(reading_error(W2 + R"(, "grid": 0})"), HasSubstr("grid = 0 must be at least 1"));
  EXPECT_THAT(reading_error(W2 + R"(, "grid": 1099511627777})"), HasSubstr("grid = 1099511627777 must be at most 2^40"));
  EXPECT_THAT(reading_error(W2 + R"(, "grid": "64"})"), HasSubstr("grid: expected an integer, got \"64\""));
  EXPECT_THAT(reading_error(W2 + R"(, "grid": 6.5})"), HasSubstr("grid: expected an integer, got 6.5"));
}

}  // namespace
