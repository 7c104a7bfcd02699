// NcclTransport's argument and NCCL failures of tests/cuda/test_nccl_errors.cpp,
// through the NCCL double (cuda-cpu harness).
#include "../cuda/test_nccl_errors.cpp"
