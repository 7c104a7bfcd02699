// The device tests of tests/cuda/test_cuda_device.cu, compiled by the host
// compiler against the CUDA runtime double (cuda-cpu harness).
#include "../cuda/test_cuda_device.cu"
