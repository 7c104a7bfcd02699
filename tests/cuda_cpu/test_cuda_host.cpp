// The host-side tests of tests/cuda/test_cuda_host.cpp (error messages, work
// split, metadata normalisation) against the CUDA runtime double, so that
// they run where CUDA is not installed (cuda-cpu harness).
#include "../cuda/test_cuda_host.cpp"
