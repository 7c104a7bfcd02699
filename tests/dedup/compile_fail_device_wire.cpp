// Must NOT compile: a KvWireDispatcher over a device transport whose data
// path is not the CUDA one (here: a device mock that names none).
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/testing/mock_transport.hpp"

int main() {
  (void)sizeof(cpdispatch::KvWireDispatcher<cpdispatch::testing::BasicMockTransport<cpdispatch::MemorySpace::device>>);
}
