// What the fuzz targets found, one test per finding, in plain GoogleTest so
// every build (not only clang's libFuzzer build) checks it. The inputs that
// found them are also in tests/fuzz/corpus/<target>/regression-*.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cpdispatch/error.hpp"
#include "cpdispatch/io/json.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace {

using ::testing::HasSubstr;

template <class F>
std::string invalid_input_message(F&& f) {
  try {
    f();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "no invalid_input thrown";
}

cpdispatch::QkvMetadata small_plan() {
  cpdispatch::QkvPlan plan;
  plan.world_size = 2;
  plan.ranks = {cpdispatch::RankDocuments{{cpdispatch::Document{{3, 2}, {1, 0}}}},
                cpdispatch::RankDocuments{{cpdispatch::Document{{4}, {1}}}}};
  return cpdispatch::plan_qkv(plan);
}

// get_slice trusted num_seqs and read past the end of the row when it
// exceeded the padded row length.
TEST(FuzzFindings, GetSliceRejectsNumSeqsBeyondTheRow) {
  cpdispatch::Metadata m = small_plan().q_fwd;
  m.num_seqs(1) = static_cast<std::int64_t>(m.max_seqs()) + 3;
  EXPECT_THAT(invalid_input_message([&] { (void)m.get_slice(1); }), HasSubstr("num_seqs[1]"));
  m.num_seqs(1) = -1;
  EXPECT_THAT(invalid_input_message([&] { (void)m.get_slice(0); }), HasSubstr("num_seqs[1] = -1"));
}

// A number beyond double's range made nlohmann-json throw out_of_range,
// which escaped parse_json as a non-cpdispatch exception.
TEST(FuzzFindings, ParseJsonReportsNumberOverflowAsInvalidInput) {
  EXPECT_THAT(invalid_input_message([] { (void)cpdispatch::parse_json("1e2133"); }), HasSubstr("invalid JSON: number overflow"));
  EXPECT_THAT(invalid_input_message([] { (void)cpdispatch::parse_plan(R"({"world_size": 1e999, "ranks": []})"); }),
              HasSubstr("invalid JSON"));
}

// output_tokens multiplied the copy count by the summed recv_seq_lens
// unchecked: negative lengths in unvalidated metadata overflowed downwards
// (signed overflow, undefined behaviour).
TEST(FuzzFindings, OutputTokensRefusesAReplicaSizeThatOverflowsDownwards) {
  cpdispatch::Metadata m = small_plan().kv_rev;
  ASSERT_TRUE(m.recv_seq_lens.has_value());
  ASSERT_GE(m.seq_recv_mask->size(2), 2u);
  (*m.recv_seq_lens)(0, 0) = std::numeric_limits<std::int64_t>::min() / 2 - 100;
  EXPECT_THAT(invalid_input_message([&] { (void)m.output_tokens(0); }), HasSubstr("overflows 64 bits"));
}

}  // namespace
