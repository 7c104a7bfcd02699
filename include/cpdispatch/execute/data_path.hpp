#pragma once
// The data path: everything an exchange owner does with memory, by memory
// space. The dispatchers and ContextParallelAttention write their logic
// (what moves where, when) once over it; the host path (HostDataPath) is
// below, the device path (cuda::DeviceDataPath) in
// cpdispatch/cuda/data_path.hpp, and the op adds its arithmetic on top
// (AttentionDataPath, attention/data_path.hpp).
//
//   class HostDataPath / cuda::DeviceDataPath {
//    public:
//     static constexpr bool available = true;
//     using const_buffer = ...;  using mutable_buffer = ...;   // bytes of this space
//     template <class U> using span = ...;                      // a typed buffer of this space
//     static auto bytes_of(span<U>);                            // its bytes
//     template <class U> class buffer;                          // owned; grows, never shrinks
//     template <class Transport> explicit HostDataPath(Transport&);  // (or DeviceDataPath: its stream)
//     // Per plan: clear(), then add_* (each kind's ids count from 0 in order), then commit().
//     std::size_t add_copies(std::span<const CopyPiece>);                 // bytes, src -> dst
//     std::size_t add_fan_in(const KvFanList&, std::size_t token_bytes);  // copies at src -> sums at dst's wire offsets
//     std::size_t add_fan_in_place(const KvFanList&, std::size_t);        // the same where wire offsets are first copies
//     std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes);
//     void commit();                                             // (the device path uploads here)
//     // Per call, ordered after everything before it:
//     void copy(id, const std::byte* src, std::byte* dst);
//     void copy(PieceList, const std::byte* src, std::byte* dst);          // the exchange engine's: an id with its pieces
//     void fan_in(id, ElementType, const std::byte* src, std::byte* dst);  // dst == src for an in-place list
//     void combine(id, ElementType, const std::byte* replica, std::size_t, std::byte* grad, std::size_t);
//     void fill(float*, std::size_t n, float value);  void zero(std::byte*, std::size_t bytes);
//   };
//
// The host path runs everything at once on the calling thread. It keeps
// views of what is added (the arrays of each piece list, fan list and
// combine's metadata), which must stay unchanged until the next clear(); the
// objects that hold them may move (a vector's elements stay where they are
// when the vector moves), and so may their owner. A plan allocates nothing
// once its number of lists has been seen. The device path uploads what is
// added (the piece lists at commit()) and launches kernels on the
// transport's stream.
//
// A transport names its data path (data_path_for below): a member type
// `data_path` when it has one (the device transports name
// cuda::DeviceDataPath), the host path for host transports otherwise. So no
// include order chooses it: a dispatcher over a device transport whose data
// path is not defined in the translation unit is refused at compile time,
// never silently given another path.

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/fan_in.hpp"
#include "cpdispatch/memory_space.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// One contiguous copy, in bytes from the start of the source and destination buffers.
struct CopyPiece {
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t bytes = 0;
  friend bool operator==(const CopyPiece&, const CopyPiece&) = default;
};

/// The two exchanges of a dispatcher.
enum class Direction : std::size_t { forward, reverse };
/// The three piece lists of one exchange: input -> staging, input -> output
/// (traffic to oneself), staging -> output; registered in this order from
/// the id of its pack list (add_exchange, execute/staged_exchange.hpp).
enum class Stage : std::size_t { pack, self, unpack };

/// One piece list as the engine hands it to a data path: its id and its pieces.
struct PieceList {
  std::size_t id = 0;
  std::span<const CopyPiece> pieces{};
};

/// The host copy of a piece list: one memcpy per piece.
inline void copy_pieces(std::span<const CopyPiece> pieces, const std::byte* src, std::byte* dst) noexcept {
  for (const CopyPiece& p : pieces) std::memcpy(dst + p.dst, src + p.src, p.bytes);
}

}  // namespace cpdispatch::detail

namespace cpdispatch {

/// The host data path (the device one is cuda::DeviceDataPath, in
/// cpdispatch/cuda/data_path.hpp).
class HostDataPath {
 public:
  static constexpr bool available = true;
  using const_buffer = ConstBytes;
  using mutable_buffer = MutableBytes;

  template <class U>
  using span = std::span<U>;

  template <class U>
  static auto bytes_of(std::span<U> s) noexcept {
    if constexpr (std::is_const_v<U>) return std::as_bytes(s); else return std::as_writable_bytes(s);
  }

  /// Owned memory of U: resize keeps the storage once it is large enough.
  template <class U>
  class buffer {
   public:
    void resize(std::size_t n) { v_.resize(n); }
    void reserve(std::size_t n) { v_.reserve(n); }
    U* data() noexcept { return v_.data(); }
    const U* data() const noexcept { return v_.data(); }
    std::size_t size() const noexcept { return v_.size(); }

   private:
    std::vector<U> v_;
  };

  template <class Transport>
  explicit HostDataPath(Transport&) noexcept {}

  /// Forgets the last plan's lists (keeping their storage).
  void clear() noexcept { copies_used_ = fans_used_ = combines_used_ = 0; }

  /// Keeps a view: the pieces must stay unchanged until the next clear().
  std::size_t add_copies(std::span<const detail::CopyPiece> pieces) {
    next(copies_, copies_used_) = pieces;
    return copies_used_ - 1;
  }
  /// Keeps views of its arrays: they must stay unchanged until the next clear() (the list may move).
  std::size_t add_fan_in(const KvFanList& fan, std::size_t token_bytes) {
    next(fans_, fans_used_) = {fan, token_bytes};
    return fans_used_ - 1;
  }
  /// The same function on the host: an entry whose sum lands on its only copy is left as it is.
  std::size_t add_fan_in_place(const KvFanList& fan, std::size_t token_bytes) { return add_fan_in(fan, token_bytes); }
  /// Keeps views of its arrays, as add_fan_in.
  std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes) {
    next(combines_, combines_used_) = {rev, token_bytes};
    return combines_used_ - 1;
  }
  void commit() noexcept {}

  void copy(std::size_t id, const std::byte* src, std::byte* dst) const noexcept { detail::copy_pieces(copies_[id], src, dst); }
  /// The exchange engine's form: a list added here, with its pieces.
  void copy(detail::PieceList list, const std::byte* src, std::byte* dst) const noexcept { detail::copy_pieces(list.pieces, src, dst); }

  /// Sums each entry's copies (at src) at its wire offset (at dst), in the fixed order of the fan-in.
  void fan_in(std::size_t id, ElementType type, const std::byte* src, std::byte* dst) const {
    const Fan& f = fans_[id];
    detail::with_element_type(type, [&]<class E>(E*) { detail::fan_in<E>(f.list, src, dst, f.token_bytes / sizeof(E)); });
  }
  /// An in-place list's fan-in.
  void fan_in(std::size_t id, ElementType type, std::byte* attention) const { fan_in(id, type, attention, attention); }

  /// Sum of the returned copies, fixed order, fp32 accumulation for 16-bit types.
  void combine(std::size_t id, ElementType type, const std::byte* replica, std::size_t replica_bytes, std::byte* grad, std::size_t grad_bytes) const {
    const Combine& c = combines_[id];
    detail::combine_copies(c.rev, ConstBytes(replica, replica_bytes), MutableBytes(grad, grad_bytes), c.token_bytes, type);
  }

  void fill(float* p, std::size_t n, float value) const noexcept { std::fill(p, p + n, value); }
  void zero(std::byte* p, std::size_t bytes) const noexcept {
    if (bytes > 0) std::memset(p, 0, bytes);
  }

 private:
  struct Fan {
    detail::FanView list;
    std::size_t token_bytes = 0;
  };
  struct Combine {
    detail::CombineView rev;
    std::size_t token_bytes = 0;
  };

  template <class X>
  static X& next(std::vector<X>& v, std::size_t& used) {
    if (v.size() <= used) v.emplace_back();
    return v[used++];
  }

  std::vector<std::span<const detail::CopyPiece>> copies_;
  std::vector<Fan> fans_;
  std::vector<Combine> combines_;
  std::size_t copies_used_ = 0, fans_used_ = 0, combines_used_ = 0;
};

}  // namespace cpdispatch

namespace cpdispatch::detail {

/// What a device transport that names no data path gets: refused.
struct unnamed_data_path {
  static constexpr bool available = false;
  using const_buffer = ConstBytes;  // only so that the user's static_assert is the one error reported
  using mutable_buffer = MutableBytes;
};

/// The data path a transport names: its member type `data_path`, or the host
/// path for a host transport without one (a device transport must name one).
template <class T>
struct data_path_for {
  using type = std::conditional_t<T::memory_space == MemorySpace::host, HostDataPath, unnamed_data_path>;
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
