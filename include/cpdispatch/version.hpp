#pragma once

#define CPDISPATCH_VERSION_MAJOR 0
#define CPDISPATCH_VERSION_MINOR 1
#define CPDISPATCH_VERSION_PATCH 0

namespace cpdispatch {
inline constexpr const char* version_string = "0.1.0";
}  // namespace cpdispatch
