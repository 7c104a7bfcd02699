# Header-only use without CMake: compiles header_only.cpp with COMPILER and
# nothing but the C++20 switch, warnings as errors and two include folders
# (the core's include/ and the sim transport's), as a user's own build would;
# then runs it. Run as:
#   cmake -DCOMPILER=... -DSOURCE_DIR=... -DOUT=... -P header_only.cmake
foreach(var COMPILER SOURCE_DIR OUT)
  if(NOT ${var})
    message(FATAL_ERROR "header_only.cmake: ${var} is not set")
  endif()
endforeach()
set(command "${COMPILER}" -std=c++20 -Wall -Wextra -Wpedantic -Werror
    "-I${SOURCE_DIR}/include" "-I${SOURCE_DIR}/transports/sim/include"
    "${SOURCE_DIR}/tests/packaging/header_only.cpp" -o "${OUT}" -pthread)
list(JOIN command " " shown)
message(STATUS "${shown}")
execute_process(COMMAND ${command} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND "${OUT}" COMMAND_ERROR_IS_FATAL ANY)
