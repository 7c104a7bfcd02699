#pragma once
// Deprecated: DeviceSpan, DeviceBuffer, Stream and Event moved to
// cpdispatch/cuda_runtime/memory.hpp (target cpdispatch::cuda_runtime, the
// CUDA runtime layer below the transports). This header forwards there for
// one version.
#include "cpdispatch/cuda_runtime/memory.hpp"
