#pragma once
// The version of cpdispatch. Kept in the source tree so that the headers
// work without CMake; configuring checks that it agrees with project(VERSION)
// in CMakeLists.txt (cmake/CpdispatchVersion.cmake).

#define CPDISPATCH_VERSION_MAJOR 0
#define CPDISPATCH_VERSION_MINOR 1
#define CPDISPATCH_VERSION_PATCH 0

namespace cpdispatch {
inline constexpr const char* version_string = "0.1.0";
}  // namespace cpdispatch
