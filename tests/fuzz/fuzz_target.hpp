#pragma once
// What every fuzz target shares: the one exception family a bad input may
// raise. Anything else escaping a target (another exception, a sanitizer
// report, a crash) is a finding.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"

namespace cpdispatch_fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// What the targets plan and read under: a budget far below the fuzzer's
/// malloc and RSS limits (tests/fuzz/CMakeLists.txt), so a plan that
/// allocates beyond its own estimate is a finding, not a pass.
inline constexpr cpdispatch::PlanLimits limits{.max_bytes = std::uint64_t{16} << 20};

/// Runs `body`; bad input must surface as cpdispatch::invalid_input (which
/// includes capacity_error), and that is the only exception tolerated.
template <class F>
void expect_valid_or_invalid_input(F&& body) {
  try {
    body();
  } catch (const cpdispatch::invalid_input&) {
  }
}

}  // namespace cpdispatch_fuzz
