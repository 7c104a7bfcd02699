#pragma once
// The host kernel's invariant mode, bound into the _cpdispatch module (invariant_kernel.cpp).

#include <pybind11/pybind11.h>

void bind_invariant_kernel(pybind11::module_& m);
