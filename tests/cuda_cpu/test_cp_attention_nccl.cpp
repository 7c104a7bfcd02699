// The ContextParallelAttention tests of tests/cuda/test_cp_attention_nccl.cu
// on the NCCL double (cuda-cpu harness).
#include "../cuda/test_cp_attention_nccl.cu"
