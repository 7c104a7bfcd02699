# The MPI tests (included from tests/transports/CMakeLists.txt): GoogleTest
# programs run under mpiexec, one CTest test per rank count, label `mpi`.
#   ctest -L mpi
if(NOT TARGET cpdispatch::mpi)
  message(STATUS "cpdispatch: the MPI transport is not built; skipping the MPI tests")
  return()
endif()

# CPDISPATCH_MPIEXEC_PREFLAGS (with --oversubscribe for Open MPI) comes from transports/mpi.

#   cpdispatch_add_mpi_test(<name> SOURCES <files...> RANKS <n...> [LIBS <targets...>])
# One program (with the MPI GoogleTest main) and one CTest test per rank count.
# The shared main, compiled once for every MPI test program.
add_library(cpdispatch_mpi_test_main OBJECT ${CMAKE_CURRENT_LIST_DIR}/mpi_main.cpp)
target_link_libraries(cpdispatch_mpi_test_main PRIVATE cpdispatch::mpi GTest::gtest)
cpdispatch_own_target(cpdispatch_mpi_test_main)
target_precompile_headers(cpdispatch_mpi_test_main REUSE_FROM cpdispatch_test_pch)

function(cpdispatch_add_mpi_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;RANKS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE cpdispatch_mpi_test_main cpdispatch::mpi GTest::gtest ${ARG_LIBS})
  cpdispatch_own_target(${name})
  target_precompile_headers(${name} REUSE_FROM cpdispatch_test_pch)
  foreach(n IN LISTS ARG_RANKS)
    add_test(NAME ${name}.np${n}
             COMMAND "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} ${n} ${CPDISPATCH_MPIEXEC_PREFLAGS}
                     $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${name}.np${n} PROPERTIES
      LABELS mpi
      PROCESSORS ${n}
      TIMEOUT 300
      # Open MPI refuses root without these two (other MPIs ignore them).
      # Under AddressSanitizer, LeakSanitizer skips Open MPI's own leaks from
      # MPI_Init (see tests/lsan-openmpi.supp; matching them needs full stacks);
      # appended, so options set by the caller (CI) stay.
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
      ENVIRONMENT_MODIFICATION
        "ASAN_OPTIONS=string_append::fast_unwind_on_malloc=0;LSAN_OPTIONS=string_append::suppressions=${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../lsan-openmpi.supp:print_suppressions=0")
  endforeach()
endfunction()

cpdispatch_add_mpi_test(mpi_transport_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/mpi_transport_test.cpp RANKS 2 4)
cpdispatch_add_mpi_test(mpi_dispatch_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/mpi_dispatch_test.cpp RANKS 1 2 3 4)
cpdispatch_add_mpi_test(mpi_handles_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/mpi_handles_test.cpp RANKS 2)

# CPDISPATCH_WITH_MPI=ON where MPI is missing (hidden here with
# CMAKE_DISABLE_FIND_PACKAGE_MPI) stops the configure with a clear message.
add_test(NAME mpi_option_on_without_mpi
         COMMAND "${CMAKE_COMMAND}" -S "${PROJECT_SOURCE_DIR}" -B "${CMAKE_CURRENT_BINARY_DIR}/mpi_option_on_without_mpi"
                 -G "${CMAKE_GENERATOR}" "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
                 -DCPDISPATCH_WITH_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCPDISPATCH_BUILD_TESTS=OFF
                 -DCPDISPATCH_BUILD_TOOLS=OFF -DCPDISPATCH_BUILD_EXAMPLES=OFF -DCPDISPATCH_BUILD_BENCHMARKS=OFF)
set_tests_properties(mpi_option_on_without_mpi PROPERTIES
  LABELS mpi
  TIMEOUT 120
  PASS_REGULAR_EXPRESSION "CPDISPATCH_WITH_MPI=ON, but no MPI implementation was found")
