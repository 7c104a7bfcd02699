#pragma once
// Deprecated: cuda_error and CPDISPATCH_CUDA_CHECK moved to
// cpdispatch/cuda_runtime/error.hpp (target cpdispatch::cuda_runtime, the
// CUDA runtime layer below the transports). This header forwards there for
// one version.
#include "cpdispatch/cuda_runtime/error.hpp"
