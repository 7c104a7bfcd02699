// The QkvDispatch tests of tests/cuda/test_qkv_dispatch_device.cu on the
// device sim at W = 1, 2, 3, 5 (cuda-cpu harness).
#include "../cuda/test_qkv_dispatch_device.cu"
