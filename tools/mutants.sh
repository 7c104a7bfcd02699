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
#         second run only rebuilds what the mutations touch. The copy takes
#         a file anew, with a newer time, only when its contents changed, and
#         a mutated file goes back with a newer time too: nothing built under
#         one mutant is reused under another, in this run or a later one
#         (tests/packaging/check_mutants_script.sh checks this, in ~15 s)
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
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "mutants: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -f "$list" ] || { echo "mutants: no list at $list" >&2; exit 2; }

# Copies the repository's working tree (uncommitted changes included; build
# folders, git's own files, Python caches and the .venv stay behind: the copy
# links to the repository's .venv) into the scratch copy: `tree SRC
# DST`, or one file: `file SRC DST`. A file whose contents differ from the
# copy's (or that the copy lacks) is written anew with a modification time
# later than both its old one and now, so a build sees it as newer than every
# object built from the old contents -- among them those built under a mutant
# (of this run, or of an earlier run that stopped before putting it back). A
# file with the same contents keeps its time, so a second run rebuilds only
# what changed. The copy's files that the working tree lacks are removed.
sync_files() {
  /usr/bin/env python3 - "$@" <<'EOF'
import os, sys, time

def write_newer(src, dst):
    with open(src, "rb") as f:
        data = f.read()
    try:
        with open(dst, "rb") as f:
            if f.read() == data:
                return
        old = os.stat(dst).st_mtime_ns
    except FileNotFoundError:
        old = 0
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "wb") as f:
        f.write(data)
    os.chmod(dst, os.stat(src).st_mode & 0o7777)
    stamp = max(time.time_ns(), old + 1_000_000)
    os.utime(dst, ns=(stamp, stamp))

def left_behind(rel):
    parts = rel.split(os.sep)
    top = parts[0]
    if top in (".git", ".venv", ".gl", ".whl") or top.startswith(("build", "_install")):
        return True
    return "__pycache__" in parts

mode, source, tree = sys.argv[1:4]
if mode == "file":
    write_newer(source, tree)
    sys.exit(0)
kept = set()
for root, dirs, files in os.walk(source):
    here = os.path.relpath(root, source)
    dirs[:] = [d for d in dirs if not left_behind(os.path.normpath(os.path.join(here, d)))]
    for name in files:
        path, rel = os.path.join(root, name), os.path.normpath(os.path.join(here, name))
        if os.path.isfile(path) and not os.path.islink(path):
            kept.add(rel)
            write_newer(path, os.path.join(tree, rel))
for root, dirs, files in os.walk(tree):
    here = os.path.relpath(root, tree)
    for name in files:
        rel = os.path.normpath(os.path.join(here, name))
        if rel not in kept and not left_behind(rel):
            os.remove(os.path.join(root, name))
EOF
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tree="$work/tree"
build="$work/build"
mkdir -p "$tree" "$build"
sync_files tree "$source_dir" "$tree"
# The copy's build takes the repository's Python environment (python/CMakeLists.txt looks for .venv).
if [ -e "$source_dir/.venv" ]; then
  [ -L "$tree/.venv" ] || rm -rf "$tree/.venv"
  ln -sfn "$source_dir/.venv" "$tree/.venv"
fi
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
  sync_files file "$source_dir/$file" "$tree/$file"
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
  sync_files file "$source_dir/$file" "$tree/$file"
done <<<"$rows"
echo "mutants: $total run, $killed killed, $survived survived, $broken not applicable"
[ $((survived + broken)) -eq 0 ]
