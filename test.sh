#!/usr/bin/env bash
# Quick start: install what is missing, configure and build everything into
# build/, and run the whole test suite. Arguments go to ctest (e.g. -R core,
# -L packaging); BUILD_DIR overrides the build directory.
set -euo pipefail
cd "$(dirname "$0")"

# Open MPI refuses to start as root unless told that it is on purpose.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

build_dir=${BUILD_DIR:-build}
tools/install-deps.sh
cmake -S . -B "$build_dir"
cmake --build "$build_dir" -j"$(nproc)"
cd "$build_dir"
ctest --output-on-failure -j"$(nproc)" "$@"
