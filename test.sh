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
tools/python-env.sh  # .venv: PyTorch, transformers, NumPy, pytest (first time: 2.9 GB, about 2 minutes)
# Ninja where there is no build folder yet (install-deps.sh installs it); an
# existing folder keeps the generator it was made with.
generator=()
[ -f "$build_dir/CMakeCache.txt" ] || generator=(-G Ninja)
cmake -S . -B "$build_dir" "${generator[@]}"
cmake --build "$build_dir" -j"$(nproc)"
cd "$build_dir"
# Two tests a core: many wait (MPI start-up, fault tests' stalls and timeouts,
# Python's imports) rather than compute.
ctest --output-on-failure -j"$(( $(nproc) * 2 ))" "$@"
