#!/usr/bin/env bash
# Quick start: install what is missing (Debian packages, the Python venv),
# configure and build everything into build/, and run the whole test suite.
# Arguments go to ctest (e.g. -R core, -L packaging); BUILD_DIR overrides the
# build directory.
set -euo pipefail
cd "$(dirname "$0")"

# Open MPI refuses to start as root unless told that it is on purpose.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

build_dir=${BUILD_DIR:-build}
tools/install-deps.sh
# Ninja where there is no build folder yet (install-deps.sh installs it); an
# existing folder keeps the generator it was made with.
configure=(cmake -S . -B "$build_dir")
[ -f "$build_dir/CMakeCache.txt" ] || configure+=(-G Ninja)
# .venv: PyTorch, transformers, NumPy, pytest (tools/python-env.sh; the first
# time 2.9 GB). A new build folder does not wait for it: the download runs
# beside the C++ build, configured without the Python module, and the module
# follows once the environment is there (an existing folder keeps its own
# CPDISPATCH_WITH_PYTHON, so it waits as before).
# A run stopped before the module's turn leaves a mark, so that the next one
# turns the module back on.
pending="$build_dir/python-module-pending"
if ! tools/python-env.sh --ready && [ ! -f "$build_dir/CMakeCache.txt" ]; then
  mkdir -p "$build_dir"
  touch "$pending"
  venv_log="$build_dir/python-env.log"
  echo "test.sh: making the Python environment beside the C++ build (log: $venv_log)"
  tools/python-env.sh > "$venv_log" 2>&1 &
  venv_job=$!
  "${configure[@]}" -DCPDISPATCH_WITH_PYTHON=OFF
  cmake --build "$build_dir" -j"$(nproc)"
  wait "$venv_job" || { cat "$venv_log" >&2; exit 1; }
  cat "$venv_log"
fi
tools/python-env.sh
[ -f "$pending" ] && configure+=(-DCPDISPATCH_WITH_PYTHON=AUTO)
"${configure[@]}"
rm -f "$pending"
cmake --build "$build_dir" -j"$(nproc)"
cd "$build_dir"
# Four tests a core: many wait (MPI start-up, fault tests' stalls and
# timeouts) or spin in MPI's progress loop rather than compute; with more at
# once the machine stays busy (on 2 cores the tests take 198 s instead of
# 229 s with two a core, and less CPU time: the spinning ranks get less).
ctest --output-on-failure -j"$(( $(nproc) * 4 ))" "$@"
