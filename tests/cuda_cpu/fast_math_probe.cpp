// Compiled with fast math by the test cuda_cpu_fast_math_is_refused, which
// expects the kernels header to refuse it.
#include "cpdispatch/cuda/kernels.hpp"
