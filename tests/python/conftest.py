"""Shared fixtures of the Python tests.

CPDISPATCH_REQUIRE_TORCH=1 (set by .ci/run) makes a missing NumPy or PyTorch
an error instead of a skip, so that CI cannot pass without running them.
CPDISPATCH_PLAN names the cpdispatch-plan CLI (ctest sets it)."""

import importlib
import os
import shutil

import pytest

REQUIRED = os.environ.get("CPDISPATCH_REQUIRE_TORCH") == "1"


def require(module):
    """The module, or a skip (a failure under CPDISPATCH_REQUIRE_TORCH=1)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if REQUIRED:
            raise RuntimeError(f"{module} is required here (CPDISPATCH_REQUIRE_TORCH=1): {e}") from e
        pytest.skip(f"{module} is not installed")


@pytest.fixture(scope="session")
def cli():
    """The path of cpdispatch-plan."""
    path = os.environ.get("CPDISPATCH_PLAN") or shutil.which("cpdispatch-plan")
    if not path or not os.path.exists(path):
        if REQUIRED:
            raise RuntimeError("cpdispatch-plan not found (set CPDISPATCH_PLAN)")
        pytest.skip("cpdispatch-plan not found (set CPDISPATCH_PLAN)")
    return path
