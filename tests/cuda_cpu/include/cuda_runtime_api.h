#pragma once
// The CUDA runtime double (test-only): see cuda_runtime.h.
#include "cuda_runtime.h"
