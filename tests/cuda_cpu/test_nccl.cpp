// The NCCL transport tests of tests/cuda/test_nccl.cu, through the NCCL
// double at W = 1..8 (cuda-cpu harness).
#include "../cuda/test_nccl.cu"
