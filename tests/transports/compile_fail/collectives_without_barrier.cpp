// Must NOT compile: a tensor-parallel collective over a type without
// barrier(). The build output must carry the concept's one-line diagnostic.
#include <cstddef>
#include <span>

#include "cpdispatch/tp/collectives.hpp"

struct NoBarrier {
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, cpdispatch::ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
};

int main() {
  NoBarrier t;
  cpdispatch::tp::synchronize_across_ranks(t);
}
