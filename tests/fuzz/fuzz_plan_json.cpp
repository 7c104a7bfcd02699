// Fuzz target: a plan document (query form, QKV per-rank and documents forms) as a user hands it to
// cpdispatch-plan. Reading and planning must either succeed or throw
// invalid_input; a plan that plans must survive writing and reading back
// unchanged (same metadata), and a QKV layout it plans must cover every
// allowed pair once (verify_coverage).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <variant>

#include "cpdispatch/io/json.hpp"
#include "fuzz_coverage.hpp"
#include "fuzz_target.hpp"

namespace {

std::string metadata_text(const cpdispatch::Plan& plan) {
  return cpdispatch::metadata_to_json(cpdispatch::plan_metadata(plan, cpdispatch_fuzz::limits)).dump();
}

/// A QKV plan's layout covers every allowed pair once.
void expect_coverage(const cpdispatch::Plan& plan, const cpdispatch::PlanMetadata& metadata) {
  const auto* qkv = std::get_if<cpdispatch::QkvMetadata>(&metadata);
  if (const auto* documents = std::get_if<cpdispatch::QkvDocumentsPlan>(&plan)) cpdispatch_fuzz::expect_coverage(*documents, *qkv);
  if (const auto* ranks = std::get_if<cpdispatch::QkvPlan>(&plan)) cpdispatch_fuzz::expect_coverage(*ranks, *qkv);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
    const cpdispatch::Plan plan = cpdispatch::plan_from_json(cpdispatch::parse_json(cpdispatch_fuzz::as_text(data, size), cpdispatch_fuzz::limits));
    const cpdispatch::PlanMetadata metadata = cpdispatch::plan_metadata(plan, cpdispatch_fuzz::limits);
    const std::string planned = cpdispatch::metadata_to_json(metadata).dump();
    const std::string written = cpdispatch::to_pretty_string(cpdispatch::plan_to_json(plan));
    // Past this point the input was valid: any exception is a finding.
    try {
      if (metadata_text(cpdispatch::parse_plan(written)) != planned) std::abort();
      expect_coverage(plan, metadata);
    } catch (...) {
      std::abort();
    }
  });
  return 0;
}
