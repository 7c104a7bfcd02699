# Install rules and the exported CMake package `cpdispatch`.
#
# Consumers write
#   find_package(cpdispatch CONFIG REQUIRED)               # cpdispatch::cpdispatch
#   find_package(cpdispatch CONFIG REQUIRED COMPONENTS mpi) # + cpdispatch::mpi
# Every installed target is header-only (INTERFACE). What the targets link
# (nlohmann-json, BLAS, MPI, CUDA) is found again by the package
# config on the consumer's side, only for the components being loaded; no
# compile flags are pushed on consumers beyond the C++20 requirement.
#
# Two install components:
#   cpdispatch_Development  headers, targets, package config (all a consumer needs)
#   cpdispatch_Runtime      the cpdispatch-plan CLI, when it was built
# `cmake --install build --component cpdispatch_Development` needs nothing built.

include(CMakePackageConfigHelpers)

set(CPDISPATCH_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/cpdispatch"
    CACHE STRING "Where the cpdispatch CMake package files are installed (relative to the prefix)")
mark_as_advanced(CPDISPATCH_INSTALL_CMAKEDIR)
# The document-length samples of data/, for realistic workloads downstream
# (the package config names this folder cpdispatch_DATA_DIR).
set(CPDISPATCH_INSTALL_DATADIR "${CMAKE_INSTALL_DATADIR}/cpdispatch/data")

set(_cpd_dev COMPONENT cpdispatch_Development)

# ---- the document-length samples --------------------------------------------
install(FILES "${CPDISPATCH_DOC_LENGTHS_DIR}/prolong.json" "${CPDISPATCH_DOC_LENGTHS_DIR}/wlbllm.json"
              "${CPDISPATCH_DOC_LENGTHS_DIR}/README.md"
        DESTINATION "${CPDISPATCH_INSTALL_DATADIR}" ${_cpd_dev})

# ---- targets and their headers -----------------------------------------------
# The core, then each component of cmake/CpdispatchComponents.cmake that this
# configuration built (INTERFACE target cpdispatch_<name>, EXPORT_NAME <name>).
# Each target installs its own FILE_SET HEADERS into the one include
# directory. Every target but the core is a package component; the config
# looks for a component's dependencies only when that component is loaded
# (requested, or all installed ones when none are).
set(_cpd_targets cpdispatch)
set(_cpd_components "")
set(_cpd_dependencies "")
set(_cpd_installed_modules "")
foreach(_cpd_component IN LISTS CPDISPATCH_COMPONENTS)
  if(NOT TARGET cpdispatch_${_cpd_component})
    continue()
  endif()
  list(APPEND _cpd_targets cpdispatch_${_cpd_component})
  list(APPEND _cpd_components ${_cpd_component})
  set(_cpd_find "")
  foreach(_cpd_dependency IN LISTS CPDISPATCH_COMPONENT_${_cpd_component}_DEPENDENCIES)
    if(_cpd_dependency MATCHES "^(NCCL|CUDNN)$")
      # NCCL and cuDNN have no module in CMake itself: the project's
      # Find<name>.cmake travels with the package so consumers find them the
      # same way we did.
      list(APPEND _cpd_installed_modules "${PROJECT_SOURCE_DIR}/cmake/Find${_cpd_dependency}.cmake")
      string(APPEND _cpd_find "\n  list(PREPEND CMAKE_MODULE_PATH \"\${CMAKE_CURRENT_LIST_DIR}\")"
                              "\n  find_dependency(${_cpd_dependency})"
                              "\n  list(POP_FRONT CMAKE_MODULE_PATH)")
    else()
      string(APPEND _cpd_find "\n  find_dependency(${_cpd_dependency})")
    endif()
  endforeach()
  if(_cpd_find)
    string(APPEND _cpd_dependencies "if(\"${_cpd_component}\" IN_LIST _cpdispatch_load)${_cpd_find}\nendif()\n")
  endif()
endforeach()

install(TARGETS ${_cpd_targets} EXPORT cpdispatchTargets
        FILE_SET HEADERS DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" ${_cpd_dev})
install(EXPORT cpdispatchTargets
        NAMESPACE cpdispatch::
        DESTINATION "${CPDISPATCH_INSTALL_CMAKEDIR}" ${_cpd_dev})

# ---- package config and version --------------------------------------------
set(CPDISPATCH_CONFIG_COMPONENTS "${_cpd_components}")
set(CPDISPATCH_CONFIG_DEPENDENCIES "${_cpd_dependencies}")
configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/cpdispatchConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/cpdispatchConfig.cmake"
  INSTALL_DESTINATION "${CPDISPATCH_INSTALL_CMAKEDIR}"
  PATH_VARS CPDISPATCH_INSTALL_DATADIR
  NO_SET_AND_CHECK_MACRO)
# Header-only: the package does not depend on the consumer's pointer size.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/cpdispatchConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion
  ARCH_INDEPENDENT)
install(FILES
          "${PROJECT_BINARY_DIR}/cpdispatchConfig.cmake"
          "${PROJECT_BINARY_DIR}/cpdispatchConfigVersion.cmake"
          ${_cpd_installed_modules}
        DESTINATION "${CPDISPATCH_INSTALL_CMAKEDIR}" ${_cpd_dev})

# ---- the CLI ---------------------------------------------------------------
if(TARGET cpdispatch-plan)
  install(TARGETS cpdispatch-plan RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT cpdispatch_Runtime)
endif()

foreach(_cpd_var IN ITEMS dev targets components dependencies installed_modules find component dependency)
  unset(_cpd_${_cpd_var})
endforeach()
unset(_cpd_var)
