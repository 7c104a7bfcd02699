// Must NOT compile: a dispatcher over a type without all_to_all_v (it has
// every other member). The build output must carry the concept's one-line
// diagnostic (see CMakeLists.txt).
#include <cstddef>

#include "cpdispatch/execute/dispatcher.hpp"

struct NoAllToAll {
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  cpdispatch::Request isend(const void*, std::size_t, int, int) { return {}; }
  cpdispatch::Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(cpdispatch::Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, cpdispatch::ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
};

int main() { (void)sizeof(cpdispatch::Dispatcher<NoAllToAll>); }
