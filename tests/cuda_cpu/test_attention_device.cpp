// The CudaAttentionKernel tests of tests/cuda/test_attention_device.cu
// through the cuda-cpu harness.
#include "../cuda/test_attention_device.cu"
