# CUDA: the device data path (kernels) as cpdispatch::cuda; the transports
# over it, the single-GPU simulation cpdispatch::device_sim and, when NCCL is
# found too, cpdispatch::nccl, are defined in transports/. Included from the top-level CMakeLists.txt, because
# enable_language(CUDA) must run in the directory that holds every target
# using the language (tests/ and benchmarks/ do).
#
#   CPDISPATCH_WITH_CUDA=AUTO  on when a CUDA compiler (nvcc) and the CUDA
#                              toolkit are found (default); NCCL is optional
#   CPDISPATCH_WITH_CUDA=ON    require nvcc, the toolkit and NCCL: anything
#                              missing is a configure error
#   CPDISPATCH_WITH_CUDA=OFF   no CUDA at all (CUDA is never enabled)
#
# Sets CPDISPATCH_CUDA_ENABLED and CPDISPATCH_NCCL_ENABLED (ON/OFF), defines
# the target cpdispatch::cuda (the device data path over the CUDA runtime; an
# installed package component) and
# cpdispatch_cuda_target().
#
# --use_fast_math (or -ftz=true) in CMAKE_CUDA_FLAGS is refused: it flushes
# bf16/fp16 subnormals in the device combine and breaks its bit-identical
# results (nvcc defines no macro the headers could test). Set
# CPDISPATCH_ALLOW_FAST_MATH=ON to accept that.
# Architectures: CMAKE_CUDA_ARCHITECTURES (or the CUDAARCHS environment
# variable) when given, otherwise "90-real;90-virtual": native code for sm_90
# (H100/H200) plus PTX that newer GPUs compile at load time. One architecture
# keeps the build fast on CI machines (nvcc, no GPU, 2 cores).
set(CPDISPATCH_WITH_CUDA AUTO CACHE STRING
    "CUDA data path, single-GPU simulation and NCCL transport cpdispatch::nccl: AUTO (when nvcc, the toolkit and NCCL are found), ON or OFF")
set_property(CACHE CPDISPATCH_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${CPDISPATCH_WITH_CUDA}" _cpd_with_cuda)
if(NOT _cpd_with_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "CPDISPATCH_WITH_CUDA is '${CPDISPATCH_WITH_CUDA}'; it must be AUTO, ON or OFF")
endif()
set(CPDISPATCH_CUDA_ENABLED OFF)
if(_cpd_with_cuda STREQUAL "OFF")
  message(STATUS "cpdispatch: CUDA disabled (CPDISPATCH_WITH_CUDA=OFF)")
  unset(_cpd_with_cuda)
  return()
endif()

# Something is missing: an error when CUDA was required, a note otherwise.
macro(_cpd_cuda_missing what)
  if(_cpd_with_cuda STREQUAL "ON")
    message(FATAL_ERROR "cpdispatch: CPDISPATCH_WITH_CUDA=ON, but ${what}. "
                        "Configure with -DCPDISPATCH_WITH_CUDA=AUTO or OFF to build without CUDA.")
  endif()
  message(STATUS "cpdispatch: ${what}; the CUDA data path and cpdispatch::nccl are not built")
  unset(_cpd_with_cuda)
  return()
endmacro()

if(NOT DEFINED CMAKE_CUDA_COMPILER)
  include(CheckLanguage)
  check_language(CUDA)
endif()
if(NOT CMAKE_CUDA_COMPILER OR (IS_ABSOLUTE "${CMAKE_CUDA_COMPILER}" AND NOT EXISTS "${CMAKE_CUDA_COMPILER}"))
  _cpd_cuda_missing("no working CUDA compiler was found (nvcc; put it on PATH or set CMAKE_CUDA_COMPILER or CUDACXX)")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual" CACHE STRING "CUDA architectures (default: sm_90 code plus PTX)")
endif()
enable_language(CUDA)

if(_cpd_with_cuda STREQUAL "ON")
  find_package(CUDAToolkit)
else()
  find_package(CUDAToolkit QUIET)
endif()
if(NOT CUDAToolkit_FOUND)
  _cpd_cuda_missing("the CUDA toolkit (runtime library) was not found next to ${CMAKE_CUDA_COMPILER}")
endif()
if(_cpd_with_cuda STREQUAL "ON")
  find_package(NCCL)
else()
  find_package(NCCL QUIET)
endif()
if(NOT NCCL_FOUND AND _cpd_with_cuda STREQUAL "ON")
  _cpd_cuda_missing("NCCL was not found (nccl.h and libnccl; set NCCL_ROOT, or Debian: libnccl-dev)")
endif()

option(CPDISPATCH_ALLOW_FAST_MATH "Accept --use_fast_math / -ftz=true in CMAKE_CUDA_FLAGS (the device combine is then not bit-identical for subnormals)" OFF)
if(CMAKE_CUDA_FLAGS MATCHES "(use_fast_math|ftz=true)" AND NOT CPDISPATCH_ALLOW_FAST_MATH)
  message(FATAL_ERROR "cpdispatch: CMAKE_CUDA_FLAGS has --use_fast_math or -ftz=true, which flushes bf16/fp16 subnormals to zero on the "
                      "device and breaks the combine's bit-identical results; remove it, or set CPDISPATCH_ALLOW_FAST_MATH=ON")
endif()

set(CPDISPATCH_CUDA_ENABLED ON)
# The nvcc test and benchmark programs need a GPU to run (without one their
# tests skip), and nvcc on two cores was a sixth of the build: they are built
# on request (tools/gpu-check.sh asks). Without them one compile-only nvcc
# check (tests/cuda) keeps the device code compiling in every build.
option(CPDISPATCH_BUILD_CUDA_PROGRAMS "Build the nvcc test and benchmark programs (they need a GPU to run)" OFF)
set(CPDISPATCH_NCCL_ENABLED ${NCCL_FOUND})
if(NCCL_FOUND)
  message(STATUS "cpdispatch: CUDA enabled (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}, "
                 "NCCL ${NCCL_VERSION})")
else()
  message(STATUS "cpdispatch: CUDA enabled (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}); "
                 "NCCL was not found, cpdispatch::nccl is not built")
endif()
unset(_cpd_with_cuda)

# cpdispatch::cuda_runtime: the CUDA runtime layer below the device
# transports (errors, device memory, streams, kernel launches; headers in
# include/cpdispatch/cuda_runtime/). cpdispatch::cuda: the device data path
# of the dispatchers and the attention op over it (headers in
# include/cpdispatch/cuda/, kernels included from .cu files).
cpdispatch_add_component(cuda_runtime LINK cpdispatch CUDA::cudart)
cpdispatch_add_component(cuda LINK cpdispatch_cuda_runtime)

# For the project's own CUDA targets (tests, benchmarks): C++20 for .cu
# files, and warnings as errors on the host code nvcc hands to the host
# compiler, and on nvcc's own diagnostics. Nothing of this reaches consumers.
# (CMake 3.25 does not know nvcc's -std=c++20 flag, hence the fallback.) The
# sanitizers (CPDISPATCH_SANITIZE) are not applied to CUDA code: the host
# compiler behind nvcc need not be the one whose sanitizer runtime links.
function(cpdispatch_cuda_target target)
  if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  else()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Werror --Werror=all-warnings>)
endfunction()
