# The MPI tests (included from tests/transports/CMakeLists.txt): GoogleTest
# programs run under mpiexec, one CTest test per rank count, label `mpi`.
#   ctest -L mpi
if(NOT TARGET cpdispatch::mpi)
  message(STATUS "cpdispatch: the MPI transport is not built; skipping the MPI tests")
  return()
endif()

# CPDISPATCH_MPIEXEC_PREFLAGS (with --oversubscribe for Open MPI) comes from transports/mpi.

#   cpdispatch_add_mpi_test(<name> SOURCES <files...> RANKS <n...> [LIBS <targets...>]
#                           [PROGRAM <program> [INCLUDES <dirs...>]])
# One CTest test per rank count, <name>.np<n>, label `mpi`, running the test
# files under mpiexec with the MPI GoogleTest main. Without PROGRAM they are
# program <name>. With PROGRAM, the files of every <name> naming the same
# <program> compile into that one program (one translation unit with
# CPDISPATCH_TEST_UNITY; see cpdispatch_test_sources in tests/CMakeLists.txt),
# made at the end of tests/ (hence INCLUDES and LIBS as arguments, not as
# target_* calls on it), and each <name>.np<n> runs the GoogleTest suites of
# <name>'s files alone (--gtest_filter): the same cases at the same rank
# counts as a program of their own, for one compile of what they share
# (the MPI transport, the dispatchers, the test helpers). Their files must
# compile together: no compile definitions of their own, no reopened library
# namespace, suite names of their own.
# The shared main, compiled once for every MPI test program.
add_library(cpdispatch_mpi_test_main OBJECT ${CMAKE_CURRENT_LIST_DIR}/mpi_main.cpp)
target_link_libraries(cpdispatch_mpi_test_main PRIVATE cpdispatch::mpi GTest::gtest)
cpdispatch_own_target(cpdispatch_mpi_test_main)
target_precompile_headers(cpdispatch_mpi_test_main REUSE_FROM cpdispatch_test_pch)

# The MPI test program <name> of <sources...>.
function(cpdispatch_mpi_test_program name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;INCLUDES" ${ARGN})
  cpdispatch_test_sources(sources ${name} ${ARG_SOURCES})
  add_executable(${name} ${sources})
  target_link_libraries(${name} PRIVATE cpdispatch_mpi_test_main cpdispatch::mpi GTest::gtest ${ARG_LIBS})
  target_include_directories(${name} PRIVATE ${ARG_INCLUDES})
  cpdispatch_own_target(${name})
  target_precompile_headers(${name} REUSE_FROM cpdispatch_test_pch)
endfunction()

# The GoogleTest filter of the suites defined in <sources...> (by TEST,
# TEST_F, TEST_P, TYPED_TEST or TYPED_TEST_P at the start of a line), into
# <out>; the suites themselves into <suites_out>. CMake runs again when one
# of the files changes.
function(cpdispatch_gtest_suites_filter out suites_out)
  set(suites "")
  set(patterns "")
  set(macro "^[ \t]*(TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)[ \t]*\\([ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*,")
  foreach(source IN LISTS ARGN)
    file(STRINGS "${source}" lines REGEX "${macro}")
    foreach(line IN LISTS lines)
      string(REGEX MATCH "${macro}" line "${line}")
      set(suite "${CMAKE_MATCH_2}")
      list(APPEND suites "${suite}")
      # The names GoogleTest gives: Suite.Case, Prefix/Suite.Case/Param,
      # Suite/Type.Case, Prefix/Suite/Type.Case.
      if(CMAKE_MATCH_1 STREQUAL "TEST_P")
        list(APPEND patterns "*/${suite}.*")
      elseif(CMAKE_MATCH_1 STREQUAL "TYPED_TEST")
        list(APPEND patterns "${suite}/*")
      elseif(CMAKE_MATCH_1 STREQUAL "TYPED_TEST_P")
        list(APPEND patterns "*/${suite}/*")
      else()
        list(APPEND patterns "${suite}.*")
      endif()
    endforeach()
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${source}")
  endforeach()
  if(NOT suites)
    message(FATAL_ERROR "cpdispatch: no GoogleTest suite found in ${ARGN}")
  endif()
  list(REMOVE_DUPLICATES suites)
  list(REMOVE_DUPLICATES patterns)
  list(JOIN patterns ":" filter)
  set(${out} "${filter}" PARENT_SCOPE)
  set(${suites_out} "${suites}" PARENT_SCOPE)
endfunction()

# Makes every shared program registered so far (deferred to the end of tests/).
function(cpdispatch_make_shared_mpi_test_programs)
  get_property(programs GLOBAL PROPERTY CPDISPATCH_SHARED_MPI_PROGRAMS)
  foreach(program IN LISTS programs)
    get_property(sources GLOBAL PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_SOURCES)
    get_property(libs GLOBAL PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_LIBS)
    get_property(includes GLOBAL PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_INCLUDES)
    list(REMOVE_DUPLICATES libs)
    list(REMOVE_DUPLICATES includes)
    cpdispatch_mpi_test_program(${program} SOURCES ${sources} LIBS ${libs} INCLUDES ${includes})
  endforeach()
endfunction()

function(cpdispatch_add_mpi_test name)
  cmake_parse_arguments(ARG "" "PROGRAM" "SOURCES;LIBS;RANKS;INCLUDES" ${ARGN})
  set(sources "")
  foreach(source IN LISTS ARG_SOURCES)
    get_filename_component(source "${source}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND sources "${source}")
  endforeach()
  set(includes "")
  foreach(dir IN LISTS ARG_INCLUDES)
    get_filename_component(dir "${dir}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND includes "${dir}")
  endforeach()
  set(arguments "")
  if(NOT ARG_PROGRAM OR ARG_PROGRAM STREQUAL name)
    set(program ${name})
    cpdispatch_mpi_test_program(${name} SOURCES ${sources} LIBS ${ARG_LIBS} INCLUDES ${includes})
  else()
    set(program ${ARG_PROGRAM})
    cpdispatch_gtest_suites_filter(filter suites ${sources})
    # A suite of two members would run in both members' tests, at both rank counts.
    foreach(suite IN LISTS suites)
      get_property(owner GLOBAL PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_SUITE_${suite})
      if(owner)
        message(FATAL_ERROR "cpdispatch: GoogleTest suite ${suite} is in MPI tests ${owner} and ${name}, both of program ${program}")
      endif()
      set_property(GLOBAL PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_SUITE_${suite} ${name})
    endforeach()
    set(arguments "--gtest_filter=${filter}")
    get_property(programs GLOBAL PROPERTY CPDISPATCH_SHARED_MPI_PROGRAMS)
    if(NOT programs)
      cmake_language(DEFER DIRECTORY "${PROJECT_SOURCE_DIR}/tests" CALL cpdispatch_make_shared_mpi_test_programs)
    endif()
    if(NOT program IN_LIST programs)
      set_property(GLOBAL APPEND PROPERTY CPDISPATCH_SHARED_MPI_PROGRAMS ${program})
    endif()
    set_property(GLOBAL APPEND PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_SOURCES ${sources})
    set_property(GLOBAL APPEND PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_LIBS ${ARG_LIBS})
    set_property(GLOBAL APPEND PROPERTY CPDISPATCH_MPI_PROGRAM_${program}_INCLUDES ${includes})
  endif()
  # What runs <name>'s cases (tests/multihost runs them too).
  set_property(GLOBAL PROPERTY CPDISPATCH_MPI_TEST_${name}_COMMAND "$<TARGET_FILE:${program}>" ${arguments})
  foreach(n IN LISTS ARG_RANKS)
    add_test(NAME ${name}.np${n}
             COMMAND "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} ${n} ${CPDISPATCH_MPIEXEC_PREFLAGS}
                     $<TARGET_FILE:${program}> ${MPIEXEC_POSTFLAGS} ${arguments})
    # One ctest slot, not n: the ranks mostly wait on one another (Open MPI
    # yields when oversubscribed), and a test that needs n slots free at once
    # starts only at the end of a run whose slots keep filling (on 2 cores
    # the np3 and np4 tests ran last, one at a time, a core idle). Tests
    # that time stalls on purpose ask for their n slots back (tests/faults).
    set_tests_properties(${name}.np${n} PROPERTIES
      LABELS mpi
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

# What runs MPI test <name>'s cases (its program, and a filter where the
# program holds other tests too), into <out>: `mpiexec -n N ${out}`.
function(cpdispatch_mpi_test_command out name)
  get_property(command GLOBAL PROPERTY CPDISPATCH_MPI_TEST_${name}_COMMAND)
  set(${out} "${command}" PARENT_SCOPE)
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
  LABELS "mpi;configure"
  TIMEOUT 120
  COST 100  # started before the unit tests (a configure), not in the run's tail
  PASS_REGULAR_EXPRESSION "CPDISPATCH_WITH_MPI=ON, but no MPI implementation was found")
