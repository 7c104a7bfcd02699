#pragma once
// A device transport wrapper for the device checksum tests: on one rank, the
// nth all-to-all exchange (blocking or posted, counted together) gets one
// byte of what it received from one source flipped, on the stream, once the
// exchange is complete there (after the blocking call, or in the posted
// exchange's wait), as a bit flipped on the wire would leave it.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/transport.hpp"

namespace cptest {

template <class = void>
__global__ void flip_byte_kernel(unsigned char* p) {
  *p ^= 0x20;
}

/// Which byte to flip: in exchange `nth` (from 1) on rank `receiver`, byte
/// `offset` of the segment from `source`.
struct Flip {
  int receiver = 0;
  int source = 1;
  std::uint64_t nth = 1;
  std::size_t offset = 0;
};

template <class Inner>
class CorruptingTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = Inner::memory_space;
  using data_path = typename Inner::data_path;

  CorruptingTransport(Inner& inner, Flip flip) : inner_(inner), flip_(flip) {}

  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }
  cudaStream_t stream() const { return inner_.stream(); }
  /// Exchanges seen so far (the checksummed transport's own included).
  std::uint64_t exchanges() const { return exchanges_; }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    if (hit()) flip(recv, recv_displs);
  }
  cpdispatch::Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                                        void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    const cpdispatch::Request r = inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    if (hit()) pending_.push_back({r.id, recv, std::vector<std::size_t>(recv_displs.begin(), recv_displs.end())});
    return r;
  }
  void wait(cpdispatch::Request r) {
    inner_.wait(r);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->id != r.id) continue;
      flip(it->recv, it->displs);
      pending_.erase(it);
      return;
    }
  }
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, cpdispatch::ElementType type) {
    inner_.all_gather(send, recv, count_per_rank, type);
  }

 private:
  struct Pending {
    std::uint64_t id;
    void* recv;
    std::vector<std::size_t> displs;
  };
  bool hit() { return ++exchanges_ == flip_.nth && rank() == flip_.receiver; }
  void flip(void* recv, std::span<const std::size_t> displs) {
    auto* at = static_cast<unsigned char*>(recv) + displs[static_cast<std::size_t>(flip_.source)] + flip_.offset;
    cpdispatch::cuda::launch_kernel("flip_byte_kernel", &flip_byte_kernel<>, 1, 1, stream(), at);
  }

  Inner& inner_;
  Flip flip_;
  std::uint64_t exchanges_ = 0;
  std::vector<Pending> pending_;
};

}  // namespace cptest
