#!/usr/bin/env bash
# Makes the project's Python environment: a venv with python/requirements.txt
# (PyTorch, transformers, NumPy, pytest, pybind11) from the package index,
# reached as .venv in the checkout, where python/CMakeLists.txt looks for its
# interpreter. The venv itself lives in CPDISPATCH_VENV (default
# ~/.cache/cpdispatch/venv), so that every clone on the machine shares one
# install; .venv is a link to it (a real .venv folder is used as it is).
# Idempotent: a venv made from the same requirements is left alone, silently.
# CPDISPATCH_SKIP_VENV=1 skips this (bring your own environment and give
# CMake its interpreter with -DPython3_EXECUTABLE=...). With --ready it
# installs nothing and tells by its exit status whether it would (1) or not (0).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${CPDISPATCH_SKIP_VENV:-0}" = 1 ] && exit 0
ready_only=0
[ "${1:-}" = --ready ] && ready_only=1

if [ -d .venv ] && [ ! -L .venv ]; then
  venv=.venv
else
  venv=${CPDISPATCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cpdispatch/venv}
  mkdir -p "$(dirname "$venv")"
  venv=$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")
  [ "$(readlink .venv 2>/dev/null)" = "$venv" ] || ln -sfn "$venv" .venv
fi
requirements=python/requirements.txt
stamp="$venv/cpdispatch-requirements.txt"
if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$stamp"; then
  exit 0
fi
[ "$ready_only" = 1 ] && exit 1

# Debian's interpreter (python3-venv; python3-dev for the module's headers),
# else the python3 first on PATH.
base=/usr/bin/python3
[ -x "$base" ] || base=$(command -v python3)
SECONDS=0
echo "python-env: installing $(grep -v '^#' "$requirements" | tr '\n' ' ')into $venv (the first time: 2.9 GB from the package index)"
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -r "$requirements"
cp "$requirements" "$stamp"
echo "python-env: $venv ready in ${SECONDS}s ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
