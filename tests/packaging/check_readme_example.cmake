# Checks that README.md shows the README example verbatim: the lines of SOURCE
# between "// README: begin" and "// README: end" must appear in README exactly.
# Run as: cmake -DREADME=README.md -DSOURCE=readme_example.cpp -P check_readme_example.cmake
file(READ "${SOURCE}" source)
string(FIND "${source}" "// README: begin\n" begin)
string(FIND "${source}" "// README: end\n" end)
if(begin EQUAL -1 OR end EQUAL -1 OR end LESS begin)
  message(FATAL_ERROR "${SOURCE}: no '// README: begin' ... '// README: end' block")
endif()
math(EXPR begin "${begin} + 17")  # past "// README: begin\n"
math(EXPR length "${end} - ${begin}")
string(SUBSTRING "${source}" ${begin} ${length} snippet)
file(READ "${README}" readme)
string(FIND "${readme}" "${snippet}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${README} does not show the example of ${SOURCE} verbatim: "
                      "copy the lines between '// README: begin' and '// README: end' into its code block.")
endif()
