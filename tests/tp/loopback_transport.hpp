#pragma once
// LoopbackTransport: a dependency-free test transport that plays rank `rank`
// of `world_size` ranks which all hold the SAME data as this one:
// all_gather replicates this rank's block (then lets a test edit the other
// ranks' blocks, to fake a disagreeing rank), all_reduce(sum) multiplies by
// world_size. It counts every call, so the no-transport tests can check
// call counts before (and independently of) the gMock transports.

#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace tp_test {

class LoopbackTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;

  struct Call {
    std::string op;
    std::size_t count;  // elements (typed) or bytes (broadcast)
  };

  LoopbackTransport(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }

  void all_to_all_v(const void*, std::span<const std::size_t>, std::span<const std::size_t>, void*,
                    std::span<const std::size_t>, std::span<const std::size_t>) {
    calls.push_back({"all_to_all_v", 0});
  }
  cpdispatch::Request isend(const void*, std::size_t bytes, int, int) {
    calls.push_back({"isend", bytes});
    return {};
  }
  cpdispatch::Request irecv(void*, std::size_t bytes, int, int) {
    calls.push_back({"irecv", bytes});
    return {};
  }
  void wait(cpdispatch::Request) {}
  void barrier() { calls.push_back({"barrier", 0}); }
  void broadcast(void*, std::size_t bytes, int) { calls.push_back({"broadcast", bytes}); }

  void all_reduce(void* buf, std::size_t count, cpdispatch::ElementType type, cpdispatch::ReduceOp) {
    calls.push_back({"all_reduce", count});
    if (type == cpdispatch::ElementType::float32) scale(static_cast<float*>(buf), count);
    if (type == cpdispatch::ElementType::float64) scale(static_cast<double*>(buf), count);
  }

  void all_gather(const void* send, void* recv, std::size_t count, cpdispatch::ElementType type) {
    calls.push_back({"all_gather", count});
    const std::size_t bytes = count * cpdispatch::element_size(type);
    std::vector<char> mine(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
    for (int r = 0; r < world_size_; ++r) {
      char* slot = static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes;
      if (bytes != 0) std::memcpy(slot, mine.data(), bytes);
      if (r != rank_ && edit_peer) edit_peer(r, slot, bytes);
    }
  }

  void reduce_scatter(const void*, void*, std::size_t count, cpdispatch::ElementType, cpdispatch::ReduceOp) {
    calls.push_back({"reduce_scatter", count});
  }

  std::size_t count(const std::string& op) const {
    std::size_t n = 0;
    for (const auto& c : calls) n += c.op == op ? 1 : 0;
    return n;
  }

  std::vector<Call> calls;
  /// Edits rank r's gathered block (r != this rank) after it was replicated.
  std::function<void(int r, char* block, std::size_t bytes)> edit_peer;

 private:
  template <class T>
  void scale(T* p, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) p[i] *= static_cast<T>(world_size_);
  }

  int rank_;
  int world_size_;
};

static_assert(cpdispatch::Transport<LoopbackTransport>);

}  // namespace tp_test
