# FindCUDNN: NVIDIA's cuDNN (the backend/graph API of cuDNN 9).
#
# Result: CUDNN_FOUND, CUDNN_VERSION, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY and the
# imported target CUDNN::cudnn (libcudnn, the shim that loads its
# sub-libraries at run time, with its include directory).
#
# Searched: CUDNN_ROOT (CMake or environment variable), then the CUDA toolkit
# (CUDAToolkit_INCLUDE_DIRS / CUDAToolkit_LIBRARY_DIR when FindCUDAToolkit
# ran: NVIDIA's tarballs are often unpacked into the toolkit), then the system
# paths (Debian/Ubuntu's libcudnn9-dev-cuda-*). The version comes from
# CUDNN_MAJOR/MINOR/PATCHLEVEL in cudnn_version.h.

include(FindPackageHandleStandardArgs)

set(_cudnn_include_hints "")
set(_cudnn_library_hints "")
foreach(_cudnn_root IN ITEMS "${CUDNN_ROOT}" "$ENV{CUDNN_ROOT}")
  if(_cudnn_root)
    list(APPEND _cudnn_include_hints "${_cudnn_root}/include")
    list(APPEND _cudnn_library_hints "${_cudnn_root}/lib" "${_cudnn_root}/lib64")
  endif()
endforeach()
if(CUDAToolkit_INCLUDE_DIRS)
  list(APPEND _cudnn_include_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(CUDAToolkit_LIBRARY_DIR)
  list(APPEND _cudnn_library_hints "${CUDAToolkit_LIBRARY_DIR}")
endif()

find_path(CUDNN_INCLUDE_DIR NAMES cudnn_graph.h cudnn.h HINTS ${_cudnn_include_hints})
find_library(CUDNN_LIBRARY NAMES cudnn HINTS ${_cudnn_library_hints})

if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(STRINGS "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _cudnn_version_lines
       REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ")
  foreach(_cudnn_part IN ITEMS MAJOR MINOR PATCHLEVEL)
    string(REGEX MATCH "#define CUDNN_${_cudnn_part} +([0-9]+)" _cudnn_match "${_cudnn_version_lines}")
    set(_cudnn_${_cudnn_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _cudnn_MAJOR STREQUAL "")
    set(CUDNN_VERSION "${_cudnn_MAJOR}.${_cudnn_MINOR}.${_cudnn_PATCHLEVEL}")
  endif()
endif()

find_package_handle_standard_args(CUDNN
  REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
  VERSION_VAR CUDNN_VERSION)

if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()

mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
foreach(_cudnn_var IN ITEMS include_hints library_hints root version_lines part match MAJOR MINOR PATCHLEVEL)
  unset(_cudnn_${_cudnn_var})
endforeach()
unset(_cudnn_var)
