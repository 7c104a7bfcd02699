# FindNCCL: NVIDIA's collective communication library.
#
# Result: NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY and the
# imported target NCCL::NCCL (the shared library, with its include directory).
#
# Searched: NCCL_ROOT (CMake or environment variable), then the CUDA toolkit
# (CUDAToolkit_INCLUDE_DIRS / CUDAToolkit_LIBRARY_DIR when FindCUDAToolkit
# ran, e.g. NVIDIA's images ship nccl.h beside cuda.h), then the system paths
# (Debian's libnccl-dev). The version comes from NCCL_MAJOR/MINOR/PATCH in nccl.h.

include(FindPackageHandleStandardArgs)

set(_nccl_include_hints "")
set(_nccl_library_hints "")
foreach(_nccl_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}")
  if(_nccl_root)
    list(APPEND _nccl_include_hints "${_nccl_root}/include")
    list(APPEND _nccl_library_hints "${_nccl_root}/lib" "${_nccl_root}/lib64")
  endif()
endforeach()
if(CUDAToolkit_INCLUDE_DIRS)
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(CUDAToolkit_LIBRARY_DIR)
  list(APPEND _nccl_library_hints "${CUDAToolkit_LIBRARY_DIR}")
endif()

find_path(NCCL_INCLUDE_DIR NAMES nccl.h HINTS ${_nccl_include_hints})
find_library(NCCL_LIBRARY NAMES nccl HINTS ${_nccl_library_hints})

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_nccl_part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX MATCH "#define NCCL_${_nccl_part} +([0-9]+)" _nccl_match "${_nccl_version_lines}")
    set(_nccl_${_nccl_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
foreach(_nccl_var IN ITEMS include_hints library_hints root version_lines part match MAJOR MINOR PATCH)
  unset(_nccl_${_nccl_var})
endforeach()
unset(_nccl_var)
