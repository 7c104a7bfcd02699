"""The C++ extension of the cpdispatch package (see pyproject.toml)."""

import os
import re
import shlex

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)  # the project root: include/ next to python/


def version():
    with open(os.path.join(CHECKOUT, "CMakeLists.txt"), encoding="utf-8") as f:
        return re.search(r"project\(cpdispatch VERSION ([0-9.]+)", f.read()).group(1)


def pybind11_include():
    """The interpreter's own pybind11 headers where it has them (NumPy 2 needs pybind11 2.12 or later), else the system's."""
    try:
        import pybind11
    except ImportError:
        return []
    return [pybind11.get_include()]


module = Extension(
    "cpdispatch._cpdispatch",
    sources=[os.path.join("src", "module.cpp"), os.path.join("src", "invariant_kernel.cpp")],
    include_dirs=[os.path.join(CHECKOUT, "include")] + pybind11_include(),
    language="c++",
    # CPDISPATCH_OPT: the optimisation flags (the install test builds with "-O0 -g0", faster to compile)
    extra_compile_args=["-std=c++20", *shlex.split(os.environ.get("CPDISPATCH_OPT", "-O2")), "-fvisibility=hidden"],
)

setup(version=version(), ext_modules=[module])
