# Warnings-as-errors and sanitizers for the project's own targets only: they
# are attached per target and never exported to consumers.
function(cpdispatch_own_target target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Werror>)
  if(CPDISPATCH_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${CPDISPATCH_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=${CPDISPATCH_SANITIZE})
  endif()
endfunction()
