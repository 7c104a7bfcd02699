#pragma once
// What the planning fuzz targets ask of every layout they plan: it covers
// every allowed (query, key) pair once (verify_coverage). A planned layout
// that fails the check is a finding; so is any exception but the two the
// verifier is allowed for a valid plan: a document beyond the pair counts it
// handles, or a layout beyond the fuzz budget.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "cpdispatch/check/coverage.hpp"
#include "fuzz_target.hpp"

namespace cpdispatch_fuzz {

/// Whether some document is longer than verify_coverage handles.
inline bool has_long_document(const cpdispatch::QkvDocumentsPlan& plan) {
  for (const auto& doc : plan.documents) {
    std::int64_t length = 0;
    for (const auto& shard : doc.shards) {
      if (shard.len > cpdispatch::max_verified_document_tokens - length) return true;
      length += shard.len;
    }
  }
  return false;
}

/// Aborts unless `metadata`, planned from `plan`, passes verify_coverage.
template <class QkvPlanForm>
void expect_coverage(const QkvPlanForm& form, const cpdispatch::QkvMetadata& metadata) {
  try {
    const cpdispatch::QkvDocumentsPlan plan = [&] {
      if constexpr (requires { form.ranks; }) return cpdispatch::to_documents(form);
      else return form;
    }();
    if (has_long_document(plan)) return;
    cpdispatch::verify_coverage(plan, metadata, limits);
  } catch (const cpdispatch::invalid_input& e) {
    if (std::string_view(e.what()).find("PlanLimits::max_bytes") != std::string_view::npos) return;
    std::fprintf(stderr, "a planned layout fails verify_coverage: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::abort();
  }
}

}  // namespace cpdispatch_fuzz
