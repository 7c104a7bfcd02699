// The device checksum tests of tests/cuda/test_checksummed_device.cu on the
// cuda-cpu harness (the device sim and the NCCL double).
#include "../cuda/test_checksummed_device.cu"
