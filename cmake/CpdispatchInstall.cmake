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

# ---- headers ---------------------------------------------------------------
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" ${_cpd_dev}
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")

# ---- the document-length samples --------------------------------------------
install(FILES "${CPDISPATCH_DOC_LENGTHS_DIR}/prolong.json" "${CPDISPATCH_DOC_LENGTHS_DIR}/wlbllm.json"
              "${CPDISPATCH_DOC_LENGTHS_DIR}/README.md"
        DESTINATION "${CPDISPATCH_INSTALL_DATADIR}" ${_cpd_dev})

# ---- targets ---------------------------------------------------------------
# The core, then each optional INTERFACE target cpdispatch_<name> (EXPORT_NAME
# <name>) that this configuration built: JSON I/O, the CBLAS GEMM backend and
# the transports, whose headers live under transports/<name>/include/. Every
# target but the core is a package component; the config looks for a
# component's dependencies only when that component is loaded (requested, or
# all installed ones when none are).
set(_cpd_targets cpdispatch)
set(_cpd_components "")
set(_cpd_dependencies "")
set(_cpd_installed_modules "")
# What the package config has to find for each component (what it links).
set(_cpd_dependency_json "find_dependency(nlohmann_json 3.10)")
set(_cpd_dependency_blas "find_dependency(BLAS)")
set(_cpd_dependency_sim "find_dependency(Threads)")
set(_cpd_dependency_mpi "find_dependency(MPI COMPONENTS CXX)")
set(_cpd_dependency_cuda "find_dependency(CUDAToolkit)")
set(_cpd_dependency_nccl "find_dependency(CUDAToolkit)")
set(_cpd_dependency_device_sim "find_dependency(CUDAToolkit)\n  find_dependency(Threads)")
foreach(_cpd_component IN ITEMS json blas sim mpi cuda nccl device_sim)
  if(NOT TARGET cpdispatch_${_cpd_component})
    continue()
  endif()
  list(APPEND _cpd_targets cpdispatch_${_cpd_component})
  list(APPEND _cpd_components ${_cpd_component})
  set(_cpd_include "${PROJECT_SOURCE_DIR}/transports/${_cpd_component}/include/")
  if(IS_DIRECTORY "${_cpd_include}")
    install(DIRECTORY "${_cpd_include}"
            DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" ${_cpd_dev}
            FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
  endif()
  set(_cpd_find "${_cpd_dependency_${_cpd_component}}")
  # NCCL has no module in CMake itself: a project-provided FindNCCL.cmake
  # travels with the package so consumers find NCCL the same way we did.
  if(_cpd_component STREQUAL "nccl" AND EXISTS "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake")
    list(APPEND _cpd_installed_modules "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake")
    string(APPEND _cpd_find "\n  list(PREPEND CMAKE_MODULE_PATH \"\${CMAKE_CURRENT_LIST_DIR}\")"
                            "\n  find_dependency(NCCL)"
                            "\n  list(POP_FRONT CMAKE_MODULE_PATH)")
  endif()
  if(_cpd_find)
    string(APPEND _cpd_dependencies "if(\"${_cpd_component}\" IN_LIST _cpdispatch_load)\n  ${_cpd_find}\nendif()\n")
  endif()
endforeach()

# Transport headers are installed next to the core's: the installed include
# directory reaches every target through cpdispatch::cpdispatch, which they
# link, so a transport needs only a $<BUILD_INTERFACE:...> include directory.
install(TARGETS ${_cpd_targets} EXPORT cpdispatchTargets)
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

foreach(_cpd_var IN ITEMS dev targets components dependencies installed_modules include find component
                         dependency_json dependency_blas dependency_sim dependency_mpi dependency_cuda dependency_nccl
                         dependency_device_sim)
  unset(_cpd_${_cpd_var})
endforeach()
unset(_cpd_var)
