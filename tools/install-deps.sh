#!/usr/bin/env bash
# Installs the Debian packages cpdispatch builds and tests against, and only
# those that are missing: nothing is downloaded when all are present.
# Extra package names may be given as arguments; `--list` prints the list and
# installs nothing (the packaging test checks that it names every package the
# sources use). Set CPDISPATCH_SKIP_DEPS=1 to skip this step (e.g. on a
# non-Debian system with the dependencies at hand).
set -euo pipefail

# libboost-dev: Boost.CRC, the independent oracle of the CRC32C tests.
# libclang-rt-14-dev: libFuzzer for Debian 12's clang 14 (the fuzz targets); iproute2: network namespaces (multihost tests).
# ninja-build: the build tool of ./test.sh and CI (CMake's Ninja generator).
# python3-venv, python3-dev: the project's Python environment (tools/python-env.sh
# installs PyTorch, transformers, NumPy, pytest and pybind11 into it from the
# package index); pybind11-dev, python3-numpy, python3-pytest: the fallbacks for a
# plain /usr/bin/python3; python3-pip, python3-setuptools, python3-wheel: the
# installed-package test.
packages=(cmake ninja-build g++ clang libgtest-dev libgmock-dev libbenchmark-dev libboost-dev
          libopenmpi-dev openmpi-bin nlohmann-json3-dev libopenblas-dev
          libclang-rt-14-dev iproute2
          pybind11-dev python3-dev python3-numpy python3-pytest
          python3-venv python3-pip python3-setuptools python3-wheel)

if [ "${1:-}" = --list ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
packages+=("$@")
if [ "${CPDISPATCH_SKIP_DEPS:-0}" = 1 ]; then
  exit 0
fi
if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-deps: no dpkg here; install these (or their equivalents) yourself: ${packages[*]}" >&2
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-deps: missing ${missing[*]}, and this is not root and there is no sudo" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
