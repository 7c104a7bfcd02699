#pragma once
// The dispatcher's data path for device transports (memory_space ==
// MemorySpace::device): include this header, from a CUDA translation unit,
// wherever a Dispatcher over a device transport is instantiated.
//
//   #include "cpdispatch/cuda/data_path.hpp"        // anywhere: NcclTransport names its data path
//   #include "cpdispatch/transports/nccl.hpp"
//   cpdispatch::NcclTransport t(comm, stream);
//   cpdispatch::Dispatcher q(t, qkv.q_fwd, qkv.q_rev, token_bytes);
//   q.forward(cuda::DeviceConstBytes(mlp, n), cuda::DeviceBytes(attn, m));
//
// At construction (once per plan) the data path splits each of the plan's six
// piece lists into warp-sized chunks and uploads them, splits the combine
// into chunks and uploads them with the one array of the reverse metadata the
// combine kernel reads (seq_recv_mask), and allocates the dispatcher's own
// staging, all on the transport's stream. Offsets and lengths stay 64-bit:
// every plan the host path accepts, the device path accepts. Each dispatcher
// call then launches the copy kernel for the pack, the traffic to itself and
// the unpack, and the combine kernel, on that stream: no allocation, no host
// synchronisation, no host access to device memory, so whole calls can be
// captured in a CUDA graph. Construct and destroy dispatchers outside a
// capture (they allocate and free device memory).
//
// Device transports must offer `cudaStream_t stream() const`: the stream
// their work, and so the data path's, is ordered on.

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/data_path.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/dedup.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/execute/plan_agreement.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/execute/combine.hpp"

namespace cpdispatch::cuda {

/// A device transport: orders its work on one CUDA stream.
template <class T>
concept StreamOrdered = requires(const T& t) {
  { t.stream() } -> std::convertible_to<cudaStream_t>;
};

}  // namespace cpdispatch::cuda

namespace cpdispatch::detail {

/// The stream a device transport orders its work on.
template <class Transport>
cudaStream_t stream_of(const Transport& transport) {
  static_assert(cuda::StreamOrdered<Transport>,
                "cpdispatch: a device transport must offer `cudaStream_t stream() const` (the stream its work is ordered on)");
  return transport.stream();
}

/// The KV-gradient combine of one reverse KV slice on the device: its
/// chunks and seq_recv_mask uploaded once (on `stream`), then one kernel per
/// call, same order and accumulation as combine_copies (bit-identical for
/// finite values; integers wrap).
class DeviceCombine {
 public:
  DeviceCombine(const RankMetadata& rev, std::size_t token_bytes, cudaStream_t stream) : stream_(stream) {
    cuda::NormalizedRankMetadata n = cuda::normalize_slice(rev, "rev");
    plan_ = cuda::plan_combine_chunks(n, token_bytes);
    chunks_.allocate(plan_.chunks.size());
    chunks_.upload(std::span<const cuda::CombineChunk>(plan_.chunks), stream_);
    mask_copies_ = n.mask_copies;
    host_mask_ = std::move(n.seq_recv_mask);
    mask_.allocate(host_mask_.size());
    mask_.upload(std::span<const std::uint8_t>(host_mask_), stream_);
  }

  void operator()(cuda::DeviceConstBytes replica, cuda::DeviceBytes grad, std::size_t token_bytes, ElementType type) const {
    const std::size_t es = element_size(type);
    if (token_bytes % es != 0 || reinterpret_cast<std::uintptr_t>(replica.data()) % es != 0 ||
        reinterpret_cast<std::uintptr_t>(grad.data()) % es != 0) {
      fail("device data path: the combine of ", element_name(type), " needs token_bytes and both buffers aligned to ", es, " bytes");
    }
    const std::uint64_t copies = mask_copies_;
    if (replica.size() < plan_.slab_bytes * copies || grad.size() < plan_.slab_bytes) {
      fail<capacity_error>("device data path: the combine needs ", plan_.slab_bytes * copies, " bytes of replica and ", plan_.slab_bytes,
                           " of grad, got ", replica.size(), " and ", grad.size());
    }
    cuda::launch_combine(type, replica.data(), grad.data(), chunks_.data(), plan_.chunks.size(), plan_.slab_bytes, mask_.data(), mask_copies_,
                         stream_);
  }

 private:
  cudaStream_t stream_;
  std::uint32_t mask_copies_ = 0;
  std::vector<std::uint8_t> host_mask_;  // kept: the stream-ordered upload reads it
  cuda::DeviceBuffer<std::uint8_t> mask_;
  cuda::CombinePlan plan_;
  cuda::DeviceBuffer<cuda::CombineChunk> chunks_;
};

/// Piece lists split into copy chunks, all in one device array uploaded once:
/// list i runs as one launch of the copy kernel.
class DeviceCopyLists {
 public:
  explicit DeviceCopyLists(cudaStream_t stream) : stream_(stream) {}

  /// Appends list i (lists are added in any order, before upload()).
  void add(std::size_t i, const std::vector<CopyPiece>& pieces) {
    if (lists_.size() <= i) lists_.resize(i + 1);
    const std::vector<cuda::CopyChunk> chunks = cuda::plan_copy_chunks(pieces);
    lists_[i] = {pieces.size(), host_.size(), chunks.size()};
    host_.insert(host_.end(), chunks.begin(), chunks.end());
  }
  /// Appends an exchange's lists, by Stage from id `first`.
  void add_exchange(std::size_t first, const ExchangePlan& ex) {
    add(first + static_cast<std::size_t>(Stage::pack), ex.send.copies);
    add(first + static_cast<std::size_t>(Stage::self), ex.self);
    add(first + static_cast<std::size_t>(Stage::unpack), ex.recv.copies);
  }
  void upload() {
    device_.allocate(host_.size());
    device_.upload(std::span<const cuda::CopyChunk>(host_), stream_);
  }

  /// Runs list i; `pieces` is the size of the host list it was made from, checked.
  void run(std::size_t i, std::size_t pieces, const std::byte* src, std::byte* dst, const char* who) const {
    const List& list = lists_.at(i);
    if (pieces != list.pieces) fail(who, ": ", pieces, " copy pieces, but the plan it was built from has ", list.pieces);
    cuda::launch_copy(src, dst, device_.data() + list.offset, list.count, stream_);
  }
  void run(PieceList list, const std::byte* src, std::byte* dst, const char* who) const { run(list.id, list.pieces.size(), src, dst, who); }

 private:
  struct List {
    std::size_t pieces = 0;  // host pieces it came from
    std::size_t offset = 0;  // first chunk
    std::size_t count = 0;   // chunks
  };
  cudaStream_t stream_;
  std::vector<List> lists_;
  std::vector<cuda::CopyChunk> host_;  // kept: the stream-ordered upload reads it
  cuda::DeviceBuffer<cuda::CopyChunk> device_;
};

template <>
class data_path<MemorySpace::device> {
 public:
  static constexpr bool available = true;
  using const_buffer = cuda::DeviceConstBytes;
  using mutable_buffer = cuda::DeviceBytes;

  template <class Transport>
  data_path(Transport& transport, const DispatchPlan& plan, const RankMetadata& rev, std::size_t token_bytes,
            std::size_t staging_bytes)
      : stream_(stream_of(transport)), lists_(stream_) {
    for (Direction dir : {Direction::forward, Direction::reverse}) {
      lists_.add_exchange(exchange_lists(dir), dir == Direction::forward ? plan.forward : plan.reverse);
    }
    lists_.upload();
    if (rev.seq_recv_mask) combine_.emplace(rev, token_bytes, stream_);  // reverse KV
    staging_.ensure(staging_bytes);
  }

  cudaStream_t stream() const noexcept { return stream_; }

  /// Runs one of the plan's piece lists (uploaded at construction under its
  /// id; its pieces are the host list it was made from, checked to be the same size).
  void copy(PieceList list, const std::byte* src, std::byte* dst) const { lists_.run(list, src, dst, "device data path"); }

  /// The KV-gradient combine on the device: same order and accumulation as
  /// combine_copies (bit-identical for finite values; integers wrap).
  void combine(const RankMetadata&, const_buffer replica, mutable_buffer grad, std::size_t token_bytes, ElementType type) const {
    if (!combine_) fail("device data path: the combine needs reverse KV metadata (with seq_recv_mask)");
    (*combine_)(replica, grad, token_bytes, type);
  }

  /// The dispatcher-owned staging, allocated at construction.
  mutable_buffer staging(std::size_t bytes) { return staging_.ensure(bytes); }  // the sizes the dispatcher asks exist already

  template <class U>
  using span = cuda::DeviceSpan<U>;

  template <class U>
  static auto bytes_of(cuda::DeviceSpan<U> s) noexcept { return cuda::as_bytes(s); }

  /// Device memory a dispatcher's owner keeps for its calls: grows (a fresh
  /// cudaMalloc), never shrinks.
  class scratch {
   public:
    mutable_buffer ensure(std::size_t bytes) {
      if (bytes_.size() < bytes) bytes_.allocate(bytes);
      return bytes_.span().first(bytes);
    }

   private:
    cuda::DeviceBuffer<std::byte> bytes_;
  };

 private:
  cudaStream_t stream_;
  DeviceCopyLists lists_;
  std::optional<DeviceCombine> combine_;
  scratch staging_;
};

}  // namespace cpdispatch::detail

namespace cpdispatch::cuda {

/// The device data path, as device transports name it: `using data_path = cuda::DeviceDataPath;`.
class DeviceDataPath : public detail::data_path<MemorySpace::device> {
 public:
  using detail::data_path<MemorySpace::device>::data_path;
};

}  // namespace cpdispatch::cuda

namespace cpdispatch::cuda {

/// The fan-in of one fan list on the device, in bytes for tokens of
/// `token_bytes` bytes: entries with several copies as fan-in chunks (at
/// most combine_chunk_bytes each, so chunks keep 16-byte alignment), summed
/// into the wire buffer at the entry's wire offset; entries with one copy as
/// plain copies into the wire buffer. Throws invalid_input when the fan list
/// has more entries than 32-bit indices reach.
struct FanInPlan {
  std::vector<FanInChunk> chunks;
  std::vector<cpdispatch::detail::CopyPiece> single_copies;  ///< attention -> wire
};

inline FanInPlan plan_fan_in(const KvFanList& fan, std::size_t token_bytes) {
  if (fan.num_entries() > std::numeric_limits<std::uint32_t>::max()) {
    cpdispatch::detail::fail("plan_fan_in: ", fan.num_entries(), " fan entries do not fit 32-bit indices");
  }
  FanInPlan plan;
  for (std::size_t e = 0; e < fan.num_entries(); ++e) {
    const std::size_t first = static_cast<std::size_t>(fan.attn_offset[fan.copy_splits[e]]) * token_bytes;
    const std::size_t wire = static_cast<std::size_t>(fan.wire_offset[e]) * token_bytes;
    const std::size_t bytes = static_cast<std::size_t>(fan.seq_len[e]) * token_bytes;
    if (fan.copies(e).size() == 1) {
      if (bytes > 0) plan.single_copies.push_back({first, wire, bytes});
      continue;
    }
    for (std::size_t done = 0; done < bytes; done += combine_chunk_bytes) {
      const auto n = static_cast<std::uint32_t>(std::min(combine_chunk_bytes, bytes - done));
      plan.chunks.push_back({wire + done, done, n, static_cast<std::uint32_t>(e)});
    }
  }
  return plan;
}

}  // namespace cpdispatch::cuda

namespace cpdispatch::detail {

/// One fan list's fan-in on the device (FanInPlan), uploaded once on
/// `stream`: entries with one copy are copied, the others summed by the
/// fan-in kernel, from `src` (the copies' offsets) into `dst` (the entries'
/// wire offsets).
class DeviceFanIn {
 public:
  DeviceFanIn(const KvFanList& fan, std::size_t token_bytes, cudaStream_t stream) : stream_(stream) {
    cuda::FanInPlan plan = cuda::plan_fan_in(fan, token_bytes);
    host_single_ = cuda::plan_copy_chunks(plan.single_copies);
    host_chunks_ = std::move(plan.chunks);
    for (std::int64_t at : fan.attn_offset) host_copy_at_.push_back(static_cast<std::uint64_t>(at) * token_bytes);
    host_splits_.assign(fan.copy_splits.begin(), fan.copy_splits.end());
    upload(single_, host_single_);
    upload(chunks_, host_chunks_);
    upload(copy_at_, host_copy_at_);
    upload(splits_, host_splits_);
  }

  void operator()(ElementType type, const std::byte* src, std::byte* dst) const {
    cuda::launch_copy(src, dst, single_.data(), host_single_.size(), stream_);
    cuda::launch_fan_in(type, src, dst, chunks_.data(), host_chunks_.size(), copy_at_.data(), splits_.data(), stream_);
  }

 private:
  template <class X>
  void upload(cuda::DeviceBuffer<X>& device, const std::vector<X>& host) {
    device.allocate(host.size());
    device.upload(std::span<const X>(host), stream_);
  }

  cudaStream_t stream_;
  // The host arrays are kept: the stream-ordered uploads read them.
  std::vector<cuda::CopyChunk> host_single_;
  std::vector<cuda::FanInChunk> host_chunks_;
  std::vector<std::uint64_t> host_copy_at_, host_splits_;
  cuda::DeviceBuffer<cuda::CopyChunk> single_;
  cuda::DeviceBuffer<cuda::FanInChunk> chunks_;
  cuda::DeviceBuffer<std::uint64_t> copy_at_, splits_;
};

/// The deduplicated exchange's device path (see execute/dedup.hpp): at
/// construction the piece lists of its exchanges and of the fan-out are
/// split into chunks, the fan list's copy offsets and the fan-in are
/// planned, all uploaded once with the home combine's chunks and mask, and
/// the staging allocated, on the transport's stream. Calls then only launch
/// kernels on that stream. For transports without all_to_all_pieces (as
/// every device transport is): reverse_combine_in_place then fans in
/// straight into the staging, never in place.
template <>
class wire_path<cuda::DeviceDataPath> {
 public:
  static constexpr bool available = true;
  using const_buffer = cuda::DeviceConstBytes;
  using mutable_buffer = cuda::DeviceBytes;

  template <class Transport>
  wire_path(Transport& transport, const WirePlan& plan, const KvFanList& fan, const RankMetadata& rev, std::size_t token_bytes,
            std::size_t staging_bytes)
      : stream_(stream_of(transport)), combine_(rev, token_bytes, stream_), lists_(stream_), fan_in_(fan, token_bytes, stream_) {
    static_assert(!PieceTransport<Transport>, "cpdispatch: the device wire path serves transports without all_to_all_pieces");
    // reverse_in_place serves all_to_all_pieces only: its lists stay empty here.
    lists_.add_exchange(exchange_lists(WireExchange::forward), plan.forward);
    lists_.add_exchange(exchange_lists(WireExchange::reverse), plan.reverse);
    lists_.add(wire_fan_out_list, plan.fan_out);
    lists_.upload();
    staging_.allocate(staging_bytes);
  }

  /// Runs one of the plan's piece lists (uploaded at construction; `pieces`
  /// is the host list it was made from, checked to be the same size).
  void copy(PieceList list, const std::byte* src, std::byte* dst) const { lists_.run(list, src, dst, who); }

  /// Entries with one copy are copied, the others summed by the fan-in kernel.
  void fan_in(const KvFanList&, ElementType type, const std::byte* attention, std::byte* wire, std::size_t) const { fan_in_(type, attention, wire); }
  void combine(const RankMetadata&, const_buffer replica, mutable_buffer grad, std::size_t token_bytes, ElementType type) const {
    combine_(replica, grad, token_bytes, type);
  }
  std::byte* staging() noexcept { return staging_.data(); }

 private:
  static constexpr const char* who = "device wire path";

  cudaStream_t stream_;
  DeviceCombine combine_;
  DeviceCopyLists lists_;
  DeviceFanIn fan_in_;
  cuda::DeviceBuffer<std::byte> staging_;
};

/// The node-level exchange's device path (see execute/node_wire.hpp): the
/// plan's piece lists as copy chunks, the two fan-ins, the home combine and
/// the arena, all uploaded or allocated at construction on the transport's
/// stream; calls only launch kernels on that stream.
template <>
class node_path<cuda::DeviceDataPath> {
 public:
  static constexpr bool available = true;
  using const_buffer = cuda::DeviceConstBytes;
  using mutable_buffer = cuda::DeviceBytes;

  template <class Transport>
  node_path(Transport& transport, const NodeWirePlan& plan, const KvFanList& fan, const RankMetadata& combine, std::size_t token_bytes)
      : stream_(stream_of(transport)),
        combine_(combine, token_bytes, stream_),
        lists_(stream_),
        attention_fan_in_(fan, token_bytes, stream_),
        relay_fan_in_(plan.relay_fan, token_bytes, stream_) {
    for (std::size_t i = 0; i < NodeWirePlan::num_lists; ++i) lists_.add(i, plan.pieces(i));
    lists_.upload();
    arena_.allocate(plan.arena_bytes);
  }

  void copy(PieceList list, const std::byte* src, std::byte* dst) const { lists_.run(list, src, dst, "device node path"); }
  void fan_in(NodeFanIn which, const KvFanList&, ElementType type, const std::byte* src, std::byte* dst, std::size_t) const {
    (which == NodeFanIn::attention ? attention_fan_in_ : relay_fan_in_)(type, src, dst);
  }
  void combine(const RankMetadata&, const_buffer replica, mutable_buffer grad, std::size_t token_bytes, ElementType type) const {
    combine_(replica, grad, token_bytes, type);
  }
  std::byte* arena() noexcept { return arena_.data(); }

 private:
  cudaStream_t stream_;
  DeviceCombine combine_;
  DeviceCopyLists lists_;
  DeviceFanIn attention_fan_in_, relay_fan_in_;
  cuda::DeviceBuffer<std::byte> arena_;
};

}  // namespace cpdispatch::detail

namespace cpdispatch::detail {

/// Plan agreement over a device transport: the records go through device
/// memory on the transport's stream, and the host waits for them (once per
/// plan, where the plan's piece lists are uploaded anyway).
template <>
struct AgreementExchange<MemorySpace::device> {
  template <class T>
  static void run(T& t, const std::byte* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, std::byte* recv,
                  std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    std::size_t send_bytes = 0, recv_bytes = 0;
    for (std::size_t p = 0; p < send_counts.size(); ++p) send_bytes = std::max(send_bytes, send_displs[p] + send_counts[p]);
    for (std::size_t p = 0; p < recv_counts.size(); ++p) recv_bytes = std::max(recv_bytes, recv_displs[p] + recv_counts[p]);
    cuda::DeviceBuffer<std::byte> out(std::max<std::size_t>(send_bytes, 1)), in(std::max<std::size_t>(recv_bytes, 1));
    out.upload(std::span<const std::byte>(send, send_bytes), t.stream());
    t.all_to_all_v(out.data(), send_counts, send_displs, in.data(), recv_counts, recv_displs);
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(recv, in.data(), recv_bytes, cudaMemcpyDeviceToHost, t.stream()));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  }
};

}  // namespace cpdispatch::detail
