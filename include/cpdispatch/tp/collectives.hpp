#pragma once
// The communication utilities of the Python tensor-parallel module the layers
// follow (tp/linear.hpp), over any Transport: all_reduce_sum,
// broadcast_tensor, synchronize_across_ranks (and all_gather, which the
// layers use to check their shapes across ranks and to gather shards).
//
// Unlike the Python functions these take the rank's transport
// explicitly: there is no process-global communicator (simulated ranks are
// threads of one process).
//
// On one rank (world_size() == 1) every collective returns at once without a
// transport call, so a one-rank model behaves exactly as the unsharded one.
//
// TP_DEBUG=1 in the environment (read once, on the first collective; see
// set_debug_logging) logs every collective to stderr, one line each:
//   [TP_DEBUG] rank 1/4 all_reduce_sum float32 x 1024 (4096 bytes) 0.052 ms
// A collective that throws (e.g. the transport's "All-reduce timeout") is
// logged with "FAILED after ... ms" and the exception goes on.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::tp {

namespace detail {

inline std::atomic<int>& debug_state() {
  static std::atomic<int> state{-1};  // -1: not read yet, 0: off, 1: on
  return state;
}

inline bool debug_from_environment() {
  const char* v = std::getenv("TP_DEBUG");
  if (v == nullptr) return false;
  const std::string_view s(v);
  return !(s.empty() || s == "0" || s == "false" || s == "off");
}

}  // namespace detail

/// Whether collectives are logged (TP_DEBUG, or the last set_debug_logging).
inline bool debug_logging() {
  int s = detail::debug_state().load(std::memory_order_relaxed);
  if (s < 0) {
    s = detail::debug_from_environment() ? 1 : 0;
    detail::debug_state().store(s, std::memory_order_relaxed);
  }
  return s == 1;
}

/// Overrides TP_DEBUG for the whole process.
inline void set_debug_logging(bool on) { detail::debug_state().store(on ? 1 : 0, std::memory_order_relaxed); }

/// Forgets the override: the next collective reads TP_DEBUG again.
inline void reset_debug_logging() { detail::debug_state().store(-1, std::memory_order_relaxed); }

namespace detail {

/// Times one collective and logs it when TP_DEBUG is on.
class CollectiveLog {
 public:
  CollectiveLog(int rank, int world_size, const char* operation, ElementType type, std::size_t count)
      : on_(debug_logging()), rank_(rank), world_size_(world_size), operation_(operation), type_(type), count_(count) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  CollectiveLog(const CollectiveLog&) = delete;
  CollectiveLog& operator=(const CollectiveLog&) = delete;

  ~CollectiveLog() {
    if (!on_) return;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
    // One fprintf per line, so lines of concurrent ranks do not interleave.
    std::fprintf(stderr, "[TP_DEBUG] rank %d/%d %s %s x %zu (%zu bytes) %s%.3f ms\n", rank_, world_size_, operation_,
                 element_name(type_), count_, count_ * element_size(type_), done_ ? "" : "FAILED after ", ms);
  }

  void done() noexcept { done_ = true; }

 private:
  bool on_;
  bool done_ = false;
  int rank_;
  int world_size_;
  const char* operation_;
  ElementType type_;
  std::size_t count_;
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace detail

/// Sums `count` elements across all ranks, in place; every rank ends with the sum.
template <class Tr, class T>
void all_reduce_sum(Tr& transport, T* data, std::size_t count) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  if (transport.world_size() == 1) return;
  detail::CollectiveLog log(transport.rank(), transport.world_size(), "all_reduce_sum", element_type_of<T>(), count);
  transport.all_reduce(data, count, element_type_of<T>(), ReduceOp::sum);
  log.done();
}
template <class Tr, class T>
void all_reduce_sum(Tr& transport, std::span<T> data) {
  all_reduce_sum(transport, data.data(), data.size());
}
template <class Tr, class T>
void all_reduce_sum(Tr& transport, Tensor<T>& tensor) {
  all_reduce_sum(transport, tensor.data(), tensor.numel());
}

/// Copies rank `src`'s `count` elements to every rank.
template <class Tr, class T>
void broadcast_tensor(Tr& transport, T* data, std::size_t count, int src = 0) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  if (src < 0 || src >= transport.world_size()) {
    cpdispatch::detail::fail("broadcast_tensor: src = ", src, " is outside [0, ", transport.world_size(), ")");
  }
  if (transport.world_size() == 1) return;
  detail::CollectiveLog log(transport.rank(), transport.world_size(), "broadcast_tensor", element_type_of<T>(), count);
  transport.broadcast(data, count * sizeof(T), src);
  log.done();
}
template <class Tr, class T>
void broadcast_tensor(Tr& transport, std::span<T> data, int src = 0) {
  broadcast_tensor(transport, data.data(), data.size(), src);
}
template <class Tr, class T>
void broadcast_tensor(Tr& transport, Tensor<T>& tensor, int src = 0) {
  broadcast_tensor(transport, tensor.data(), tensor.numel(), src);
}

/// Barrier: returns once every rank has called it.
template <class Tr>
void synchronize_across_ranks(Tr& transport) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  if (transport.world_size() == 1) return;
  detail::CollectiveLog log(transport.rank(), transport.world_size(), "synchronize_across_ranks", ElementType::uint8, 0);
  transport.barrier();
  log.done();
}

/// recv[r * count_per_rank + i] = rank r's send[i], on every rank.
template <class Tr, class T>
void all_gather(Tr& transport, const T* send, T* recv, std::size_t count_per_rank) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  if (transport.world_size() == 1) {
    if (count_per_rank != 0 && send != recv) std::copy(send, send + count_per_rank, recv);
    return;
  }
  detail::CollectiveLog log(transport.rank(), transport.world_size(), "all_gather", element_type_of<T>(),
                            count_per_rank);
  transport.all_gather(send, recv, count_per_rank, element_type_of<T>());
  log.done();
}

}  // namespace cpdispatch::tp
