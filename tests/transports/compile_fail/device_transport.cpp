// Must NOT compile: a dispatcher over a device transport has no data path yet.
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/testing/mock_transport.hpp"

int main() {
  (void)sizeof(cpdispatch::Dispatcher<cpdispatch::testing::BasicMockTransport<cpdispatch::MemorySpace::device>>);
}
