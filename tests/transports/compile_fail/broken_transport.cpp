// Must NOT compile: a dispatcher over a type without barrier(). The build
// output must carry the concept's one-line diagnostic (see CMakeLists.txt).
#include <cstddef>
#include <span>

#include "cpdispatch/execute/dispatcher.hpp"

struct NoBarrier {
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, std::span<const std::size_t>, std::span<const std::size_t>, void*, std::span<const std::size_t>,
                    std::span<const std::size_t>) {}
  cpdispatch::Request isend(const void*, std::size_t, int, int) { return {}; }
  cpdispatch::Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(cpdispatch::Request) {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, cpdispatch::ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
};

int main() {
  NoBarrier t;
  cpdispatch::Dispatcher<NoBarrier>* d = nullptr;
  (void)sizeof(cpdispatch::Dispatcher<NoBarrier>);
  (void)d;
  (void)t;
}
