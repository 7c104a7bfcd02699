# The library's targets: the core cpdispatch::cpdispatch, and one optional
# INTERFACE target cpdispatch::<name> per component in the list below, made
# by cpdispatch_add_component() where the component's dependency is found.
# The install rules, the package config and the packaging tests read this
# list; nothing else names the components.
#
# Each component owns its headers (a FILE_SET HEADERS of its target, so an
# install carries only the headers of the targets built); the core owns
# every header of include/ that no component claims.

set(CPDISPATCH_COMPONENTS "")

# _cpd_component(<name> <headers> <dependencies>)
#   headers       a glob, from the source tree, of the component's own headers
#                 (below an include/ folder, which becomes the file set's base)
#   dependencies  what the package config finds for it, one find_dependency()
#                 argument list per entry (`|` separates entries)
macro(_cpd_component name headers dependencies)
  list(APPEND CPDISPATCH_COMPONENTS ${name})
  set(CPDISPATCH_COMPONENT_${name}_HEADERS "${headers}")
  string(REPLACE "|" ";" CPDISPATCH_COMPONENT_${name}_DEPENDENCIES "${dependencies}")
endmacro()

#              name        its own headers                         found by the package config
_cpd_component(json       "include/cpdispatch/io/*json.hpp"        "nlohmann_json 3.10")
_cpd_component(blas       "include/cpdispatch/gemm/gemm_cblas.hpp" "BLAS")
_cpd_component(sim        "transports/sim/include/*.hpp"           "Threads")
_cpd_component(mpi        "transports/mpi/include/*.hpp"           "MPI COMPONENTS CXX")
_cpd_component(cuda_runtime "include/cpdispatch/cuda_runtime/*.hpp" "CUDAToolkit")
_cpd_component(cuda       "include/cpdispatch/cuda/*.hpp"          "CUDAToolkit")
_cpd_component(cudnn      "include/cpdispatch/cudnn/*.hpp"         "CUDAToolkit|CUDNN")
_cpd_component(nccl       "transports/nccl/include/*.hpp"          "CUDAToolkit|NCCL")
_cpd_component(device_sim "transports/device_sim/include/*.hpp"    "CUDAToolkit|Threads")

# The files a header glob of the list names, and its include/ base folder.
function(_cpd_component_files glob out_files out_base)
  string(REGEX MATCH "^(.*include)/" _ "${glob}")
  set(${out_base} "${PROJECT_SOURCE_DIR}/${CMAKE_MATCH_1}" PARENT_SCOPE)
  file(GLOB_RECURSE files CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${glob}")
  set(${out_files} "${files}" PARENT_SCOPE)
endfunction()

# cpdispatch_add_component(<name> LINK <targets...>)
# Makes the INTERFACE target cpdispatch_<name> (cpdispatch::<name>, exported
# as <name>) of a listed component, with its headers and what it links.
function(cpdispatch_add_component name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "LINK")
  if(NOT name IN_LIST CPDISPATCH_COMPONENTS)
    message(FATAL_ERROR "cpdispatch_add_component: '${name}' is not in the list of cmake/CpdispatchComponents.cmake")
  endif()
  add_library(cpdispatch_${name} INTERFACE)
  add_library(cpdispatch::${name} ALIAS cpdispatch_${name})
  set_target_properties(cpdispatch_${name} PROPERTIES EXPORT_NAME ${name})
  _cpd_component_files("${CPDISPATCH_COMPONENT_${name}_HEADERS}" files base)
  target_sources(cpdispatch_${name} INTERFACE FILE_SET HEADERS BASE_DIRS "${base}" FILES ${files})
  target_link_libraries(cpdispatch_${name} INTERFACE ${ARG_LINK})
endfunction()

# The core's headers: every header of include/ that no component claims.
function(cpdispatch_core_headers target)
  file(GLOB_RECURSE files CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/include/*.hpp")
  foreach(component IN LISTS CPDISPATCH_COMPONENTS)
    _cpd_component_files("${CPDISPATCH_COMPONENT_${component}_HEADERS}" claimed base)
    if(claimed)
      list(REMOVE_ITEM files ${claimed})
    endif()
  endforeach()
  target_sources(${target} INTERFACE FILE_SET HEADERS BASE_DIRS "${PROJECT_SOURCE_DIR}/include" FILES ${files})
endfunction()
