// The ContextParallelAttention tests of tests/cuda/test_cp_attention_device.cu
// on the device sim (cuda-cpu harness).
#include "../cuda/test_cp_attention_device.cu"
