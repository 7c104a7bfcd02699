#pragma once
// CPDISPATCH_HOST_DEVICE marks a function that the device kernels call too:
// __host__ __device__ under nvcc, nothing for a host compiler (and for the
// cuda-cpu harness, whose kernels are host code).

#if defined(__CUDACC__)
#define CPDISPATCH_HOST_DEVICE __host__ __device__
#else
#define CPDISPATCH_HOST_DEVICE
#endif
