#pragma once
// What every dispatcher holds for its transport, in one place: the data path
// its lists are registered with (the transport's memory space picks it), the
// ids of its exchanges by slot, its owned staging, and the checks of a call's
// buffers. Dispatcher, KvWireDispatcher and NodeWireDispatcher (and through
// them QkvDispatch) are each a plan, an ExchangeOwner and the calls that run
// the plan's exchanges by slot.
//
//   owner.lay_out({&plan.forward, &plan.reverse}, [&](auto& path) {  // slots 0 and 1
//     combine = path.add_combine(rev, token_bytes);                  // the owner's own lists
//   });
//   owner.check_buffers("forward", {{mlp, "mlp", bytes}, {attention, "attention", bytes}});
//   owner.run(0, plan.forward, mlp.data(), attention.data(), staging, "forward");
//
// A replan lays out again in the same storage (the host path keeps views of
// the plan's vectors, so the owner may move; once the lists have been seen,
// nothing is allocated). ReplanPair keeps an owner's plan beside the one its
// prepare_replan makes, so that a refused plan leaves the plan in use (and
// an owner of several dispatchers, QkvDispatch, prepares all before it
// commits any).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// The transport's memory space; host while its own check fails (one diagnostic).
template <class T>
constexpr MemorySpace memory_space_of() {
  if constexpr (transport_has_memory_space<T>) return T::memory_space; else return MemorySpace::host;
}

/// The transport's data path; the host one while the transport's own checks fail (one diagnostic each).
template <class T>
struct dispatcher_path {
  using type = HostDataPath;
};
template <class T>
  requires transport_has_memory_space<T>
struct dispatcher_path<T> : data_path_for<T> {};
template <class P>
constexpr bool data_path_available() {
  if constexpr (defined_type<P>) return P::available; else return false;
}

/// A caller's buffer as a call's checks see it: `used` bytes of it take part
/// in the call (`tokens` of them, -1 where not whole tokens, e.g. staging).
/// Only its address and size are looked at: device memory is never read here.
struct BufferUse {
  const std::byte* data;
  std::size_t size;
  const char* name;
  std::size_t used = 0;
  std::int64_t tokens = -1;
  template <class Bytes>
  BufferUse(const Bytes& b, const char* n, std::size_t u = 0, std::int64_t t = -1) : data(b.data()), size(b.size()), name(n), used(u), tokens(t) {}
};

/// An owner's plan (`now`) and the one prepare_replan makes (`next`); commit
/// swaps them, so both keep their storage and a refused plan leaves `now` in use.
template <class State>
struct ReplanPair {
  State now, next;
  bool prepared = false;

  /// Plans into `next` through `plan(next)` (it may throw; `now` stays).
  template <class F>
  void prepare(F&& plan) {
    prepared = false;
    std::forward<F>(plan)(next);
    prepared = true;
  }
  /// Switches to the prepared plan; false when there is none.
  bool commit() noexcept {
    if (!prepared) return false;
    std::swap(now, next);
    prepared = false;
    return true;
  }
};

template <class T, std::size_t Slots>
class ExchangeOwner {
 public:
  using path = typename dispatcher_path<T>::type;
  static_assert(data_path_available<path>(),
                "cpdispatch: device transports need the CUDA data path (cpdispatch/cuda) for Dispatcher, KvWireDispatcher, "
                "NodeWireDispatcher and QkvDispatch: the transport names it as `using data_path = cuda::DeviceDataPath;`, defined by "
                "cpdispatch/cuda/data_path.hpp, which a .cu file that makes the dispatcher includes");
  using const_buffer = typename path::const_buffer;  ///< in the transport's memory space
  using mutable_buffer = typename path::mutable_buffer;
  using staging_buffer = typename path::template buffer<std::byte>;

  /// `who`: the owner's class name, in front of every error ("<who>::<call> (rank r of W): ...").
  ExchangeOwner(T& transport, const char* who)
      : transport_(transport), rank_(transport.rank()), world_size_(transport.world_size()), who_(who), path_(transport) {}

  /// Registers the exchanges (slot s: exchanges[s]; none where null),
  /// between the path's clear and commit, then the owner's own lists
  /// through more(path).
  template <class More>
  void lay_out(const std::array<const ExchangePlan*, Slots>& exchanges, More&& more) {
    path_.clear();
    for (std::size_t slot = 0; slot < Slots; ++slot) {
      if (exchanges[slot] != nullptr) lists_[slot] = add_exchange(path_, *exchanges[slot]);
    }
    std::forward<More>(more)(path_);
    path_.commit();
  }

  /// Runs `ex`, the exchange laid out in `slot`, from `in` to `out`; `staging`
  /// holds ex.staging_bytes() (unused over all_to_all_pieces). `Pieces` false:
  /// all_to_all_v even over a PieceTransport.
  template <bool Pieces = true>
  void run(std::size_t slot, const ExchangePlan& ex, const std::byte* in, std::byte* out, std::byte* staging, const char* call) {
    run_exchange<Pieces>(transport_, path_, lists_[slot], ex, in, out, staging, {who_, call});
  }

  path& data_path() noexcept { return path_; }
  T& transport() noexcept { return transport_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }

  /// The owned staging grows to `bytes` (never shrinks; the owners grow it
  /// at construction, so that a device owner's calls never allocate).
  void grow_staging(std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
  }
  std::byte* staging() noexcept { return staging_.data(); }
  mutable_buffer staging(std::size_t bytes) {
    grow_staging(bytes);
    return mutable_buffer(staging_.data(), bytes);
  }

  /// Capacity of every buffer first, then each pair's overlap (named in the
  /// list's order): nothing is written before all pass. `token_bytes` words
  /// the token counts of a short buffer.
  void check_buffers(const char* call, std::initializer_list<BufferUse> buffers, std::size_t token_bytes = 0) const {
    for (const BufferUse& b : buffers) {
      if (b.size >= b.used) continue;
      if (b.tokens < 0) fail<capacity_error>(call, b.name, " holds ", b.size, " bytes, the plan needs ", b.used);
      fail<capacity_error>(call, b.name, " holds ", b.size, " bytes, the plan needs ", b.used, " (", b.tokens, " tokens x ", token_bytes, " bytes)");
    }
    for (auto a = buffers.begin(); a != buffers.end(); ++a) {
      for (auto b = a + 1; b != buffers.end(); ++b) {
        if (regions_overlap(a->data, a->used, b->data, b->used)) fail(call, a->name, " and ", b->name, " overlap");
      }
    }
  }

  /// The element type's fit, before check_buffers: token_bytes a multiple
  /// of its size, and each buffer the call reads or writes as elements
  /// (`typed`) aligned to it.
  void check_elements(const char* call, ElementType type, std::size_t token_bytes, std::initializer_list<BufferUse> typed) const {
    const std::size_t es = element_size(type);
    if (token_bytes % es != 0) fail(call, "token_bytes = ", token_bytes, " is not a multiple of the ", es, "-byte ", element_name(type), " element");
    for (const BufferUse& b : typed) {
      if (reinterpret_cast<std::uintptr_t>(b.data) % es != 0) fail(call, b.name, " is not aligned to ", es, " bytes for ", element_name(type));
    }
  }

  template <class E = invalid_input, class... Args>
  [[noreturn]] void fail(const char* call, Args&&... args) const {
    detail::fail<E>(who_, "::", call, " (rank ", rank_, " of ", world_size_, "): ", std::forward<Args>(args)...);
  }

 private:
  T& transport_;
  int rank_;
  int world_size_;
  const char* who_;
  path path_;
  std::array<std::size_t, Slots> lists_{};  // each slot's first piece list with path_
  staging_buffer staging_;
};

}  // namespace cpdispatch::detail
