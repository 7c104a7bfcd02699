#pragma once
// An all-to-all of `chunk` bytes from every rank to every rank (itself too),
// each rank's send buffer a pattern of its own: the posted-exchange tests of
// the device transports (NCCL on a GPU, the device sim on the harness).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transport.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"

namespace cptest {

struct AllToAllCase {
  using Buffer = cpdispatch::cuda::DeviceBuffer<std::byte>;

  int W;
  std::size_t chunk;
  std::uint64_t salt;
  std::vector<std::size_t> counts, displs;

  AllToAllCase(int w, std::size_t c, std::uint64_t s) : W(w), chunk(c), salt(s) {
    for (int p = 0; p < W; ++p) {
      counts.push_back(chunk);
      displs.push_back(static_cast<std::size_t>(p) * chunk);
    }
  }
  std::size_t bytes() const { return static_cast<std::size_t>(W) * chunk; }
  Bytes send(int r) const { return pattern(bytes(), salt * 64 + static_cast<std::uint64_t>(r)); }
  /// What rank r receives: chunk r of every rank's send buffer, in rank order.
  Bytes expected(int r) const {
    Bytes out(bytes());
    for (int p = 0; p < W; ++p) {
      std::memcpy(out.data() + static_cast<std::size_t>(p) * chunk, send(p).data() + static_cast<std::size_t>(r) * chunk, chunk);
    }
    return out;
  }
  /// Per rank: its send buffer (uploaded) and a receive buffer of 0xA5.
  std::vector<Buffer> sends() const {
    std::vector<Buffer> out;
    for (int r = 0; r < W; ++r) out.push_back(to_device(send(r)));
    return out;
  }
  std::vector<Buffer> receives() const {
    std::vector<Buffer> out;
    for (int r = 0; r < W; ++r) out.push_back(to_device(Bytes(bytes(), std::byte{0xA5})));
    return out;
  }
  /// Posts the transport's rank's share; send and recv are its device buffers.
  template <class Transport>
  cpdispatch::Request post(Transport& t, const Buffer& send, const Buffer& recv) const {
    return t.post_all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
  }
};

}  // namespace cptest
