"""Shared fixtures of the Python tests.

CPDISPATCH_REQUIRE_TORCH=1 (set by .ci/run) makes a missing NumPy or PyTorch
an error instead of a skip, so that CI cannot pass without running them.
CPDISPATCH_PLAN names the cpdispatch-plan CLI (ctest sets it)."""

import functools
import importlib
import os
import shutil
import sys

import pytest

# One OpenMP thread, before PyTorch loads: the multi-process tests fork, and a
# child forked after the parent ran an OpenMP team hangs in its first one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REQUIRED = os.environ.get("CPDISPATCH_REQUIRE_TORCH") == "1"


def require(module):
    """The module, or a skip (a failure under CPDISPATCH_REQUIRE_TORCH=1)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if REQUIRED:
            raise RuntimeError(f"{module} is required here (CPDISPATCH_REQUIRE_TORCH=1): {e}") from e
        pytest.skip(f"{module} is not installed", allow_module_level=True)  # also from a module's top


@pytest.fixture
def fakes(monkeypatch):
    """The stand-ins of kernel_fakes.py installed for one test, their call log emptied."""
    kernel_fakes = require("kernel_fakes")
    kernel_fakes.install_flash(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    kernel_fakes.install_sdpa(functools.partial(monkeypatch.setattr, raising=False))
    kernel_fakes.CALLS.clear()
    return kernel_fakes.CALLS


@pytest.fixture(scope="session")
def cli():
    """The path of cpdispatch-plan."""
    path = os.environ.get("CPDISPATCH_PLAN") or shutil.which("cpdispatch-plan")
    if not path or not os.path.exists(path):
        if REQUIRED:
            raise RuntimeError("cpdispatch-plan not found (set CPDISPATCH_PLAN)")
        pytest.skip("cpdispatch-plan not found (set CPDISPATCH_PLAN)")
    return path
