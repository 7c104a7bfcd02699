# Runs the rank-death program under mpiexec (cmake -P, with MPIEXEC, NP,
# PREFLAGS, PROGRAM, LIMIT): the job must end by itself, within LIMIT
# seconds, with a non-zero exit status, after the victim said it exits.
separate_arguments(preflags UNIX_COMMAND "${PREFLAGS}")
string(TIMESTAMP start "%s")
# Output through a file, not a pipe: a process the launcher is still
# tearing down may hold a pipe open after mpiexec itself has ended.
set(log ${CMAKE_CURRENT_BINARY_DIR}/rank_death_$ENV{PPID}_${start}.log)
execute_process(COMMAND ${MPIEXEC} -n ${NP} ${preflags} ${PROGRAM} 2
                TIMEOUT ${LIMIT} RESULT_VARIABLE rc OUTPUT_FILE ${log} ERROR_FILE ${log}.err)
file(READ ${log} out)
file(READ ${log}.err err)
file(REMOVE ${log} ${log}.err)
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message("${out}${err}")
message("rank death: mpiexec ended with '${rc}' after ${seconds} s")
if(rc MATCHES "timeout" OR rc MATCHES "terminated")
  message(FATAL_ERROR "the job hung: still running after ${LIMIT} s")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job ended with status 0 although rank 2 died")
endif()
if(NOT out MATCHES "rank 2 exits mid-step")
  message(FATAL_ERROR "the victim never reached the step")
endif()
if(out MATCHES "WRONG")
  message(FATAL_ERROR "a survivor's forward returned wrong data")
endif()
