// The JSON readers' bounds: a document's nesting and size are checked before
// it is parsed, and the tiny hostile plans end in a clear error through the
// JSON front as through the library, having allocated under 100 MB (counted
// by tests/common/counting_allocator.hpp).

#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "cpdispatch/io/json.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "../common/counting_allocator.hpp"

namespace {

using counting_allocator::expect_refused;
using cpdispatch::PlanLimits;

TEST(ResourceLimits, JsonOfTheHostilePlansEndsInAClearError) {
  const std::string text = R"({"kind":"qkv","world_size":1000000000,"documents":[{"shards":[{"rank":0,"len":5,"dst":0}]}]})";
  expect_refused([&] { (void)cpdispatch::plan_metadata(cpdispatch::parse_plan(text)); }, {"world_size = 1000000000"});
  expect_refused([&] { (void)cpdispatch::plan_metadata_for_rank(cpdispatch::parse_plan(text), 0); }, {"world_size = 1000000000"});
  expect_refused([&] { (void)cpdispatch::rank_share_with_wire_to_json(cpdispatch::parse_plan(text), 0); }, {"world_size = 1000000000"});
}

TEST(ResourceLimits, JsonNestingAndSizeAreBoundedBeforeParsing) {
  for (const std::size_t depth : {std::size_t{65}, std::size_t{100'000}, std::size_t{1'000'000}}) {
    const std::string deep = std::string(depth, '[') + std::string(depth, ']');
    expect_refused([&] { (void)cpdispatch::parse_json(deep); }, {"nesting deeper than 64 levels", "max_json_depth"});
    const std::string objects = [&] {
      std::string s;
      for (std::size_t i = 0; i < depth; ++i) s += "{\"a\":";
      return s + "1" + std::string(depth, '}');
    }();
    expect_refused([&] { (void)cpdispatch::parse_json(objects); }, {"nesting deeper than 64 levels"});
  }
  // 64 levels parse; brackets inside strings do not count.
  EXPECT_NO_THROW((void)cpdispatch::parse_json(std::string(64, '[') + std::string(64, ']')));
  EXPECT_NO_THROW((void)cpdispatch::parse_json("[\"" + std::string(1000, '[') + "\\\"\"]"));
  const std::string wide = "[" + std::string(200'000, ' ') + "]";
  expect_refused([&] { (void)cpdispatch::parse_json(wide, PlanLimits{.max_bytes = 1 << 20}); },
                 {"a document of 200002 bytes", "limit of 1.0 MiB"});
}

}  // namespace
