#pragma once
// The data path of the dispatcher: the local copies (pack, unpack, traffic to
// oneself), the KV-gradient combine and the dispatcher-owned staging. The
// transport names its data path (data_path_for below): a member type
// `data_path` when it has one (the device transports name
// cuda::DeviceDataPath, defined in cpdispatch/cuda/data_path.hpp), the host
// path for host transports otherwise. So no include order chooses it: a
// device dispatcher whose data path is not defined in the translation unit
// is refused at compile time, never silently given another path. The
// dispatch logic (who sends what where) lives in dispatcher.hpp and never
// touches memory itself. Each dispatcher owns one data path object:
//
//   template <> class data_path<Space> {
//    public:
//     static constexpr bool available = true;
//     using const_buffer = ...;  using mutable_buffer = ...;   // the dispatcher's buffer types
//     template <class Transport>
//     data_path(Transport&, const DispatchPlan&, const RankMetadata& rev, std::size_t token_bytes,
//               std::size_t staging_bytes);                      // once per plan
//     void copy(PieceList, const std::byte* src, std::byte* dst);  // one of the plan's piece lists
//     void combine(const RankMetadata& rev, const_buffer replica, mutable_buffer grad,
//                  std::size_t token_bytes, ElementType type);
//     mutable_buffer staging(std::size_t bytes);                // the dispatcher-owned staging
//     template <class U> using span = ...;                      // a typed buffer of this space
//     static auto bytes_of(span<U>);                            // its bytes (const_buffer or mutable_buffer)
//     class scratch;                                            // owned memory that grows: ensure(bytes)
//   };
//
// copy() is the one interface every data path gives the exchange engine
// (execute/staged_exchange.hpp): a PieceList is a piece list's id besides
// its pieces, so a path that prepared the lists at construction (the device
// path uploads them once per plan, by id) need not look them up, and the
// host path copies the pieces.

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// One contiguous copy, in bytes from the start of the source and destination buffers.
struct CopyPiece {
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t bytes = 0;
  friend bool operator==(const CopyPiece&, const CopyPiece&) = default;
};

struct DispatchPlan;  // dispatch_plan.hpp

/// The two exchanges of a dispatcher.
enum class Direction : std::size_t { forward, reverse };
/// The three piece lists of one exchange: input -> staging, input -> output
/// (traffic to oneself), staging -> output. A caller numbers an exchange's
/// lists in this order from the id of its pack list (exchange_lists).
enum class Stage : std::size_t { pack, self, unpack };

/// The id of the pack list of a caller's exchange `e` (an index or an enum) when every exchange has its three lists in a row.
template <class E>
constexpr std::size_t exchange_lists(E e) noexcept {
  return 3 * static_cast<std::size_t>(e);
}

/// One piece list as the engine hands it to a data path: its id and its pieces.
struct PieceList {
  std::size_t id = 0;
  std::span<const CopyPiece> pieces{};
};

/// The host copy of a piece list: one memcpy per piece.
inline void copy_pieces(std::span<const CopyPiece> pieces, const std::byte* src, std::byte* dst) noexcept {
  for (const CopyPiece& p : pieces) std::memcpy(dst + p.dst, src + p.src, p.bytes);
}

/// The data path of a memory space: the host one below; none (refused at
/// compile time with a readable message) for other spaces. The device path
/// specialises it in cpdispatch/cuda/data_path.hpp.
template <MemorySpace Space>
class data_path {
 public:
  static constexpr bool available = false;
  // Only so that the dispatcher's static_assert is the one error reported.
  using const_buffer = ConstBytes;
  using mutable_buffer = MutableBytes;
};

template <>
class data_path<MemorySpace::host> {
 public:
  static constexpr bool available = true;
  using const_buffer = ConstBytes;
  using mutable_buffer = MutableBytes;

  template <class Transport>
  data_path(Transport&, const DispatchPlan&, const RankMetadata&, std::size_t, std::size_t) noexcept {}

  void copy(PieceList list, const std::byte* src, std::byte* dst) const noexcept { copy_pieces(list.pieces, src, dst); }

  /// Sum of the returned copies, fixed order, fp32 accumulation for 16-bit types.
  void combine(const RankMetadata& rev, const_buffer replica, mutable_buffer grad, std::size_t token_bytes,
               ElementType type) const {
    combine_copies(rev, replica, grad, token_bytes, type);
  }

  /// Allocated on the first call that needs it, then reused.
  mutable_buffer staging(std::size_t bytes) { return staging_.ensure(bytes); }

  template <class U>
  using span = std::span<U>;

  template <class U>
  static auto bytes_of(std::span<U> s) noexcept {
    if constexpr (std::is_const_v<U>) return std::as_bytes(s); else return std::as_writable_bytes(s);
  }

  /// Memory a dispatcher's owner keeps for its calls: grows, never shrinks.
  class scratch {
   public:
    mutable_buffer ensure(std::size_t bytes) {
      if (bytes_.size() < bytes) bytes_.resize(bytes);
      return mutable_buffer(bytes_).first(bytes);
    }

   private:
    std::vector<std::byte> bytes_;
  };

 private:
  scratch staging_;
};

/// What a device transport that names no data path gets: refused.
struct unnamed_data_path {
  static constexpr bool available = false;
  using const_buffer = ConstBytes;
  using mutable_buffer = MutableBytes;
};

/// The data path a transport names: its member type `data_path`, or the host
/// path for a host transport without one (a device transport must name one).
template <class T>
struct data_path_for {
  using type = std::conditional_t<T::memory_space == MemorySpace::host, data_path<MemorySpace::host>, unnamed_data_path>;
};
template <class T>
  requires requires { typename T::data_path; }
struct data_path_for<T> {
  using type = typename T::data_path;
};

/// Whether a type is defined here (a device data path is only declared
/// unless cpdispatch/cuda/data_path.hpp is included).
template <class P>
concept defined_type = requires { sizeof(P); };

}  // namespace cpdispatch::detail
