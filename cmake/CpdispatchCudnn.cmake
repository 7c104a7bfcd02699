# cuDNN (CPDISPATCH_WITH_CUDNN): cpdispatch::cudnn, the attention kernel on
# cuDNN's fused flash attention (cuda::CudnnAttentionKernel, headers in
# include/cpdispatch/cudnn/, docs/attention-kernel.md). Included from the
# top-level CMakeLists.txt right after CpdispatchCuda.cmake: it needs the CUDA
# toolkit that file found.
#
#   CPDISPATCH_WITH_CUDNN=AUTO  on when CUDA is enabled and cuDNN >= 9 is found
#                               (cudnn_graph.h and libcudnn; default)
#   CPDISPATCH_WITH_CUDNN=ON    require it: CUDA off or cuDNN missing is a
#                               configure error
#   CPDISPATCH_WITH_CUDNN=OFF   never built
#
# cuDNN is looked for in CUDNN_ROOT, then next to the CUDA toolkit, then in
# the system paths (cmake/FindCUDNN.cmake). Sets CPDISPATCH_CUDNN_ENABLED.
set(CPDISPATCH_WITH_CUDNN AUTO CACHE STRING
    "cuDNN fused attention kernel cpdispatch::cudnn: AUTO (when CUDA is enabled and cuDNN 9 is found), ON or OFF")
set_property(CACHE CPDISPATCH_WITH_CUDNN PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${CPDISPATCH_WITH_CUDNN}" _cpd_with_cudnn)
if(NOT _cpd_with_cudnn MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "CPDISPATCH_WITH_CUDNN is '${CPDISPATCH_WITH_CUDNN}'; it must be AUTO, ON or OFF")
endif()
set(CPDISPATCH_CUDNN_ENABLED OFF)

macro(_cpd_cudnn_missing what)
  if(_cpd_with_cudnn STREQUAL "ON")
    message(FATAL_ERROR "cpdispatch: CPDISPATCH_WITH_CUDNN=ON, but ${what}. "
                        "Configure with -DCPDISPATCH_WITH_CUDNN=AUTO or OFF to build without cuDNN.")
  endif()
  message(STATUS "cpdispatch: cuDNN attention off: ${what}")
  unset(_cpd_with_cudnn)
  return()
endmacro()

if(_cpd_with_cudnn STREQUAL "OFF")
  message(STATUS "cpdispatch: cuDNN attention off (CPDISPATCH_WITH_CUDNN=OFF)")
  unset(_cpd_with_cudnn)
  return()
endif()
if(NOT CPDISPATCH_CUDA_ENABLED)
  _cpd_cudnn_missing("CUDA is not enabled (CPDISPATCH_WITH_CUDA)")
endif()
find_package(CUDNN QUIET)
if(NOT CUDNN_FOUND)
  _cpd_cudnn_missing("cuDNN was not found (cudnn_graph.h and libcudnn; set CUDNN_ROOT)")
endif()
if(CUDNN_VERSION VERSION_LESS 9.0)
  _cpd_cudnn_missing("cuDNN ${CUDNN_VERSION} is older than 9.0 (the graph API of cudnn_graph.h)")
endif()

set(CPDISPATCH_CUDNN_ENABLED ON)
message(STATUS "cpdispatch: cuDNN attention on (cuDNN ${CUDNN_VERSION}, ${CUDNN_LIBRARY})")
unset(_cpd_with_cudnn)

cpdispatch_add_component(cudnn LINK cpdispatch_cuda_runtime CUDNN::cudnn)
