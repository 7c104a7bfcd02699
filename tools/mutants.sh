#!/usr/bin/env bash
# Mutation check of the test suite: applies each mutation of a list to a copy
# of the tree, builds only the targets the mutation names and runs its check.
# A mutant is killed when the check fails; a survivor means the tests cannot
# see that bug. Not part of CI's default run (it builds for many minutes).
#
#   tools/mutants.sh [--list FILE] [--work DIR] [--only NAME]... [--keep]
#
# --list  the mutations (default tools/mutants.txt beside this script)
# --work  scratch folder for the copy and its build (default
#         ${TMPDIR:-/tmp}/cpdispatch-mutants); reused between runs, so a
#         second run only rebuilds what the mutations touch
# --only  run only the named mutant(s)
#
# The list holds blocks separated by blank lines; lines starting with '#'
# outside the fields are comments, '## NAME: text' names a mutant:
#   ## NAME: what the mutation does
#   file: path in the repository
#   find: an exact text that occurs exactly once in that file (one line)
#   replace: its replacement
#   build: CMake targets to build (space-separated)
#   run: shell command, run in the copy's build folder; non-zero = killed
# Exit status: 0 when every mutant was killed, 1 when one survived or could not
# be applied or does not compile (a stale 'find' is an error: the list
# follows the code; a mutant that does not compile proves nothing).
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
list="$source_dir/tools/mutants.txt"
work="${TMPDIR:-/tmp}/cpdispatch-mutants"
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --list) list=$(realpath "$2"); shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --only) only+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "mutants: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -f "$list" ] || { echo "mutants: no list at $list" >&2; exit 2; }

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tree="$work/tree"
build="$work/build"
mkdir -p "$tree" "$build"
# The copy follows the working tree (uncommitted changes included); build
# folders and git's own files stay behind.
tar -C "$source_dir" --exclude=./.git --exclude='./build*' -cf - . | tar -C "$tree" -xf -
cmake -S "$tree" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCPDISPATCH_BUILD_BENCHMARKS=OFF >"$work/configure.log" 2>&1 ||
  { echo "mutants: configuring the copy failed, see $work/configure.log" >&2; exit 2; }

# Prints the blocks as NAME<TAB>file<TAB>find<TAB>replace<TAB>build<TAB>run lines.
parse_list() {
  /usr/bin/env python3 - "$1" <<'EOF'
import sys
blocks, cur = [], None
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.rstrip("\n")
    if line.startswith("## "):
        name = line[3:].split(":", 1)[0].strip()
        cur = {"name": name}
        blocks.append(cur)
    elif cur is not None and ":" in line and not line.startswith("#"):
        key, value = line.split(":", 1)
        if key in ("file", "find", "replace", "build", "run"):
            cur[key] = value[1:] if value.startswith(" ") else value
for b in blocks:
    missing = [k for k in ("file", "find", "replace", "build", "run") if k not in b]
    if missing:
        sys.exit(f"mutants: '{b['name']}' lacks {', '.join(missing)}")
    if any("\t" in v for v in b.values()):
        sys.exit(f"mutants: '{b['name']}' has a tab in a field")
    print("\t".join(b[k] for k in ("name", "file", "find", "replace", "build", "run")))
EOF
}

# Replaces the one occurrence of $2 by $3 in file $1; fails unless it occurs once.
apply_once() {
  /usr/bin/env python3 - "$1" "$2" "$3" <<'EOF'
import sys
path, find, replace = sys.argv[1:4]
text = open(path, encoding="utf-8").read()
count = text.count(find)
if count != 1:
    sys.exit(f"'find' occurs {count} times in {path}, not once")
open(path, "w", encoding="utf-8").write(text.replace(find, replace))
EOF
}

wanted() {
  [ ${#only[@]} -eq 0 ] && return 0
  local n
  for n in "${only[@]}"; do [ "$n" = "$1" ] && return 0; done
  return 1
}

killed=0 survived=0 broken=0 total=0
rows=$(parse_list "$list")
while IFS=$'\t' read -r name file find replace targets run; do
  [ -n "$name" ] && wanted "$name" || continue
  total=$((total + 1))
  log="$work/$name.log"
  cp "$source_dir/$file" "$tree/$file"
  # shellcheck disable=SC2086 # the targets are a word list
  if ! apply_once "$tree/$file" "$find" "$replace" >"$log" 2>&1; then
    echo "BROKEN   $name: $(tail -1 "$log")"; broken=$((broken + 1)); continue
  fi
  if ! cmake --build "$build" -j"$(nproc)" --target $targets </dev/null >>"$log" 2>&1; then
    echo "BROKEN   $name: does not compile (see $log)"; broken=$((broken + 1))
  elif (cd "$build" && timeout 900 bash -c "$run") </dev/null >>"$log" 2>&1; then
    echo "SURVIVED $name (see $log)"; survived=$((survived + 1))
  else
    echo "KILLED   $name"; killed=$((killed + 1))
  fi
  cp "$source_dir/$file" "$tree/$file"
done <<<"$rows"
echo "mutants: $total run, $killed killed, $survived survived, $broken not applicable"
[ $((survived + broken)) -eq 0 ]
