#!/usr/bin/env bash
# tools/mutants.sh must never report a stale kill: after a mutant is put back,
# whatever was built from it is rebuilt before the next check, within one run
# and in a later run that reuses the scratch folder.
#
#   tests/packaging/check_mutants_script.sh [SCRATCH]
#
# It builds a tiny project of two translation units (one reads value.hpp, the
# other other.hpp; the program exits with value + other) beside a copy of the
# script, and a list of two mutants: 'wrong-value' changes value.hpp (the
# program then fails: killed), 'same-other' rewrites other.hpp without changing
# its meaning (the program still passes: a survivor). The object built under
# 'wrong-value' must not be reused by 'same-other', so 'same-other' survives
# after 'wrong-value' in the same run and in the next run. Exits non-zero on
# the first wrong verdict. Takes about 15 s (seven CMake runs).
set -euo pipefail
script_dir=$(cd "$(dirname "$0")" && pwd)
mutants="$script_dir/../../tools/mutants.sh"
scratch=${1:-$(mktemp -d "${TMPDIR:-/tmp}/mutants-script.XXXXXX")}
project="$scratch/project"
work="$scratch/work"
rm -rf "$project" "$work"
mkdir -p "$project/tools" "$project/src"
cp "$mutants" "$project/tools/mutants.sh"

cat >"$project/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(mutants_script_check CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(check src/main.cpp src/value.cpp src/other.cpp)
EOF
cat >"$project/src/value.hpp" <<'EOF'
constexpr int value_term = 0;
EOF
cat >"$project/src/other.hpp" <<'EOF'
constexpr int other_term = 0;
EOF
cat >"$project/src/value.cpp" <<'EOF'
#include "value.hpp"
int value() { return value_term; }
EOF
cat >"$project/src/other.cpp" <<'EOF'
#include "other.hpp"
int other() { return other_term; }
EOF
cat >"$project/src/main.cpp" <<'EOF'
int value();
int other();
int main() { return value() + other(); }
EOF
cat >"$project/tools/mutants.txt" <<'EOF'
## wrong-value: the program exits with 1
file: src/value.hpp
find: constexpr int value_term = 0;
replace: constexpr int value_term = 1;
build: check
run: bin/check

## same-other: the same program, written differently
file: src/other.hpp
find: constexpr int other_term = 0;
replace: constexpr int other_term = 1 - 1;
build: check
run: bin/check
EOF
# The sources look old, as a checkout's files do: only their contents may tell a build what changed.
find "$project" -type f -exec touch -d '2001-01-01 00:00:00' {} +

failures=0
# Runs the script with "$@" and expects the verdict lines $expected, in order.
expect() {
  local expected=$1
  shift
  local out
  out=$(cd "$project" && tools/mutants.sh --work "$work" "$@" 2>&1 || true)
  local verdicts
  verdicts=$(grep -oE '^(KILLED|SURVIVED|BROKEN) +[a-z-]+' <<<"$out" | tr -s ' ' | paste -sd, -)
  if [ "$verdicts" = "$expected" ]; then
    echo "ok: $* -> $verdicts"
  else
    echo "FAILED: $* gave '$verdicts', expected '$expected'; its output:"
    echo "$out"
    failures=$((failures + 1))
  fi
}

expect 'SURVIVED same-other' --only same-other
expect 'KILLED wrong-value,SURVIVED same-other' --only wrong-value --only same-other
expect 'SURVIVED same-other' --only same-other
expect 'KILLED wrong-value' --only wrong-value
# The last run ended with wrong-value's object built, then its source put back.
expect 'SURVIVED same-other' --only same-other
expect 'KILLED wrong-value' --only wrong-value
# A run stopped before putting its mutant back leaves it in the copy: the next run must build from the source.
sed -i 's/value_term = 0/value_term = 1/' "$work/tree/src/value.hpp"
expect 'SURVIVED same-other' --only same-other
[ "$failures" -eq 0 ] || exit 1
[ -n "${1:-}" ] || rm -rf "$scratch"
echo "mutants.sh rebuilds what each mutant touched"
