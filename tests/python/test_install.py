"""The documented install: pip install --no-build-isolation ./python into a
venv that sees the test interpreter's packages, without network; then
the installed package (not the build tree's) plans and imports cpdispatch.torch."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import require

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    require("numpy")
    tmp = tmp_path_factory.mktemp("install")
    # A copy of python/ beside links to the headers it builds from, so that
    # the build's by-products (build/, *.egg-info) stay out of the checkout.
    src = tmp / "src"
    shutil.copytree(os.path.join(CHECKOUT, "python"), src / "python", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    for name in ("include", "tools", "CMakeLists.txt"):
        os.symlink(os.path.join(CHECKOUT, name), src / name)
    env_dir = tmp / "venv"
    # The venv sees the test interpreter's pip, setuptools, pybind11, NumPy and
    # PyTorch; no ensurepip. Run from a virtual environment (the project's
    # .venv), that environment's packages (a venv made from a venv is made
    # from the base interpreter); else the system's.
    in_venv = sys.prefix != sys.base_prefix
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)] + ([] if in_venv else ["--system-site-packages"]), check=True)
    python = str(env_dir / "bin" / "python")
    if in_venv:
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                              text=True).stdout.strip()
        with open(os.path.join(site, "parent.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CPDISPATCH_OPT"] = "-O0 -g0"  # what is tested here is the install, not the planner's speed (nor its debug info: a third of the compile)
    if shutil.which("ccache") and "CC" not in env:
        env["CC"] = "ccache " + (shutil.which("x86_64-linux-gnu-gcc") or "gcc")  # a rebuilt module compiles once
    done = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--quiet", str(src / "python")],
                          env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return python, env, tmp


PLAN = {"world_size": 2, "ranks": [{"docs": [{"shard_len": [4, 2], "dst": [1, 0]}]}, {"docs": [{"shard_len": [5], "dst": [1]}]}]}


def test_installed_package_plans(venv):
    cpdispatch = require("cpdispatch")  # the build tree's, to compare with
    python, env, tmp = venv
    script = (
        "import cpdispatch, sys\n"
        "assert cpdispatch.__file__.startswith(sys.prefix), cpdispatch.__file__\n"
        f"m = cpdispatch.plan({PLAN!r})\n"
        "print(m['kv_fwd']['dst_offset'].tolist())\n"
        "try:\n"
        "    cpdispatch.plan({'world_size': 1, 'ranks': [{'docs': [{'shard_len': [1], 'dst': [3]}]}]})\n"
        "except ValueError as e:\n"
        "    print(e)\n")
    done = subprocess.run([python, "-c", script], cwd=tmp, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == str(cpdispatch.plan(PLAN)["kv_fwd"]["dst_offset"].tolist())
    assert lines[1].startswith("ranks[0].docs[0].dst[0]")


def test_installed_package_has_torch_layer(venv):
    require("torch")
    python, env, tmp = venv
    done = subprocess.run([python, "-c", "import cpdispatch.torch as t, sys; assert t.__file__.startswith(sys.prefix); print(t.ContextParallelAttention.__name__)"],
                          cwd=tmp, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ContextParallelAttention"
