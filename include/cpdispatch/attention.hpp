#pragma once
// Attention over the context-parallel layouts: the kernel concept and
// ContextParallelAttention, the per-layer op that equals attention over each
// whole document (docs/attention.md).

#include "cpdispatch/attention/context_parallel.hpp"  // IWYU pragma: export
#include "cpdispatch/attention/host_kernel.hpp"       // IWYU pragma: export
#include "cpdispatch/attention/invariant.hpp"         // IWYU pragma: export
#include "cpdispatch/attention/kernel.hpp"            // IWYU pragma: export
#include "cpdispatch/attention/step_trace.hpp"        // IWYU pragma: export
