# cpdispatch::blas: the CBLAS GEMM backend of the tensor-parallel layers
# (include/cpdispatch/gemm/gemm_cblas.hpp). Debian: libopenblas-dev.
#
# CPDISPATCH_WITH_BLAS = AUTO (default: the target exists when a BLAS with
# cblas.h is found), ON (a missing BLAS is a configure error) or OFF.
# OpenBLAS is preferred (BLA_VENDOR=OpenBLAS) because CblasGemm can then set
# one BLAS thread per simulated rank; any CBLAS works otherwise.

set(CPDISPATCH_WITH_BLAS "AUTO" CACHE STRING "Build the CBLAS GEMM backend target cpdispatch::blas (AUTO, ON, OFF)")
set_property(CACHE CPDISPATCH_WITH_BLAS PROPERTY STRINGS AUTO ON OFF)

if(NOT CPDISPATCH_WITH_BLAS STREQUAL "OFF")
  if(NOT DEFINED BLA_VENDOR)
    set(BLA_VENDOR OpenBLAS)
    find_package(BLAS QUIET)
    unset(BLA_VENDOR)
  endif()
  if(NOT BLAS_FOUND)
    find_package(BLAS QUIET)
  endif()
  find_path(CPDISPATCH_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-pthread openblas
            DOC "Directory of cblas.h (CBLAS GEMM backend)")
  if(BLAS_FOUND AND CPDISPATCH_CBLAS_INCLUDE_DIR AND TARGET BLAS::BLAS)
    cpdispatch_add_component(blas LINK cpdispatch BLAS::BLAS)
    # SYSTEM: OpenBLAS's headers use C99 _Complex, which -Wpedantic rejects in C++.
    # Build tree only: the installed package looks cblas.h up again on the
    # consumer's machine (cpdispatchConfig.cmake), so no path of this machine
    # is written into the exported targets.
    target_include_directories(cpdispatch_blas SYSTEM INTERFACE $<BUILD_INTERFACE:${CPDISPATCH_CBLAS_INCLUDE_DIR}>)
    message(STATUS "cpdispatch: CBLAS GEMM backend (cpdispatch::blas): ${BLAS_LIBRARIES}, ${CPDISPATCH_CBLAS_INCLUDE_DIR}/cblas.h")
  elseif(CPDISPATCH_WITH_BLAS STREQUAL "ON")
    message(FATAL_ERROR "cpdispatch: CPDISPATCH_WITH_BLAS=ON but no BLAS with cblas.h was found "
                        "(Debian: apt-get install libopenblas-dev)")
  else()
    message(STATUS "cpdispatch: no BLAS with cblas.h (Debian: libopenblas-dev); cpdispatch::blas is not built")
  endif()
endif()
