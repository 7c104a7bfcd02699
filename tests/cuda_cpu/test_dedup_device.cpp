// The deduplicated KV exchange tests of tests/cuda/test_dedup_device.cu on
// the device sim and the NCCL double at W = 1..8 (cuda-cpu harness).
#include "../cuda/test_dedup_device.cu"
