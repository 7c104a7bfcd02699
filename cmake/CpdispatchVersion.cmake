# include/cpdispatch/version.hpp is written by hand (header-only use needs no
# generated file); configuring fails when it disagrees with project(VERSION).

set(_cpd_version_header "${PROJECT_SOURCE_DIR}/include/cpdispatch/version.hpp")
set_property(DIRECTORY "${PROJECT_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_cpd_version_header}")
file(READ "${_cpd_version_header}" _cpd_version_text)

set(_cpd_version_expected
  "#define CPDISPATCH_VERSION_MAJOR ${PROJECT_VERSION_MAJOR}\n"
  "#define CPDISPATCH_VERSION_MINOR ${PROJECT_VERSION_MINOR}\n"
  "#define CPDISPATCH_VERSION_PATCH ${PROJECT_VERSION_PATCH}\n"
  "version_string = \"${PROJECT_VERSION}\";")
foreach(_cpd_version_line IN LISTS _cpd_version_expected)
  string(FIND "${_cpd_version_text}" "${_cpd_version_line}" _cpd_version_at)
  if(_cpd_version_at EQUAL -1)
    string(STRIP "${_cpd_version_line}" _cpd_version_line)
    message(FATAL_ERROR "${_cpd_version_header} disagrees with project(VERSION ${PROJECT_VERSION}): "
                        "it lacks '${_cpd_version_line}'")
  endif()
endforeach()

unset(_cpd_version_header)
unset(_cpd_version_text)
unset(_cpd_version_expected)
unset(_cpd_version_line)
unset(_cpd_version_at)
