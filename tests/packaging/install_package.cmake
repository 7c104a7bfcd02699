# Installs the development component of build BUILD_DIR into a fresh PREFIX,
# after removing PREFIX and the directories listed in CLEAN (stale consumer
# builds). Run as: cmake -DBUILD_DIR=... -DPREFIX=... [-DCLEAN=...] -P install_package.cmake
foreach(var BUILD_DIR PREFIX)
  if(NOT ${var})
    message(FATAL_ERROR "install_package.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${PREFIX}" ${CLEAN})
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" --component cpdispatch_Development
  COMMAND_ERROR_IS_FATAL ANY)
foreach(file include/cpdispatch/cpdispatch.hpp)
  if(NOT EXISTS "${PREFIX}/${file}")
    message(FATAL_ERROR "install_package.cmake: ${PREFIX}/${file} was not installed")
  endif()
endforeach()
file(GLOB_RECURSE config "${PREFIX}/*/cpdispatchConfig.cmake")
if(NOT config)
  message(FATAL_ERROR "install_package.cmake: no cpdispatchConfig.cmake under ${PREFIX}")
endif()
