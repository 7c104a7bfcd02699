#pragma once
// The host kernel's invariant mode, bound into the _cpdispatch module, and
// the reader of attention entries from Python (invariant_kernel.cpp).

#include <pybind11/pybind11.h>

#include <vector>

#include "cpdispatch/plan/mask.hpp"

void bind_invariant_kernel(pybind11::module_& m);

/// Attention entries from Python's (q_start, q_len, kv_start, kv_len, lo, hi) tuples, None for an open band end.
std::vector<cpdispatch::AttentionEntry> entries_of(pybind11::handle list);
