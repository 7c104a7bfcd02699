// The NodeWireDispatcher tests of tests/cuda/test_node_device.cu on the
// device sim (cuda-cpu harness).
#include "../cuda/test_node_device.cu"
