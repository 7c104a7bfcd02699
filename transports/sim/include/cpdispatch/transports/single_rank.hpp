#pragma once
// SingleRankTransport: a host transport of world size 1 (all-to-all and
// collectives; no point-to-point), with no threads and no dependency. It is
// the "Single GPU (No Parallelism)" case of the Python tensor-parallel module
// the layers follow: a layer or a wrapper over it behaves exactly as the
// unsharded model.
//
//   cpdispatch::SingleRankTransport one;
//   cpdispatch::gemm::ReferenceGemm gemm;
//   cpdispatch::tp::RowParallelLinear layer(one, gemm, 4096, 16384);   // works like nn.Linear

#include <cstddef>
#include <cstring>
#include <span>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

class SingleRankTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;

  int rank() const noexcept { return 0; }
  int world_size() const noexcept { return 1; }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, void* recv, std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs) {
    if (send_counts.size() != 1 || send_displs.size() != 1 || recv_counts.size() != 1 || recv_displs.size() != 1) {
      cpdispatch::detail::fail("SingleRankTransport::all_to_all_v: counts and displacements need 1 entry each");
    }
    if (send_counts[0] != recv_counts[0]) {
      cpdispatch::detail::fail("SingleRankTransport::all_to_all_v: sends ", send_counts[0], " bytes to itself but ",
                               "receives ", recv_counts[0]);
    }
    move(static_cast<const char*>(send) + send_displs[0], static_cast<char*>(recv) + recv_displs[0], send_counts[0]);
  }

  void barrier() {}
  void broadcast(void*, std::size_t, int root) {
    if (root != 0) no_peer("broadcast", root);
  }
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void* send, void* recv, std::size_t count, ElementType type) {
    move(send, recv, cpdispatch::detail::checked_bytes(count, element_size(type), 1, "SingleRankTransport::all_gather"));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, ElementType type, ReduceOp) {
    move(send, recv, cpdispatch::detail::checked_bytes(count, element_size(type), 1, "SingleRankTransport::reduce_scatter"));
  }

 private:
  static void move(const void* src, void* dst, std::size_t bytes) {
    if (bytes != 0 && src != dst) std::memmove(dst, src, bytes);
  }
  [[noreturn]] static void no_peer(const char* op, int peer) {
    cpdispatch::detail::fail("SingleRankTransport::", op, ": rank ", peer, " is outside [0, 1)");
  }
};

// One rank has no peer to message: no point-to-point members, so the
// comm-GEMM overlap (which needs them) refuses it at compile time.
static_assert(AllToAllTransport<SingleRankTransport> && CollectiveTransport<SingleRankTransport>);
static_assert(!PointToPointTransport<SingleRankTransport>);

}  // namespace cpdispatch
