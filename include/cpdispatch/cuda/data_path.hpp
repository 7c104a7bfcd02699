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
#include "cpdispatch/execute/detail/data_path.hpp"
#include "cpdispatch/execute/detail/dispatch_plan.hpp"
#include "cpdispatch/execute/dedup.hpp"
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

template <>
class data_path<MemorySpace::device> {
 public:
  static constexpr bool available = true;
  using const_buffer = cuda::DeviceConstBytes;
  using mutable_buffer = cuda::DeviceBytes;

  template <class Transport>
  data_path(Transport& transport, const DispatchPlan& plan, const RankMetadata& rev, std::size_t token_bytes,
            std::size_t staging_bytes)
      : stream_(stream_of(transport)) {
    std::size_t total = 0;
    for (Direction dir : {Direction::forward, Direction::reverse}) {
      const ExchangePlan& ex = dir == Direction::forward ? plan.forward : plan.reverse;
      for (Stage stage : {Stage::pack, Stage::self, Stage::unpack}) {
        const std::vector<CopyPiece>& pieces = stage == Stage::pack ? ex.send.copies : stage == Stage::self ? ex.self : ex.recv.copies;
        std::vector<cuda::CopyChunk> chunks = cuda::plan_copy_chunks(pieces);
        List& list = lists_[index(dir, stage)];
        list.pieces = pieces.size();
        list.offset = total;
        list.count = chunks.size();
        total += chunks.size();
        host_chunks_.insert(host_chunks_.end(), chunks.begin(), chunks.end());
      }
    }
    chunks_.allocate(host_chunks_.size());
    chunks_.upload(std::span<const cuda::CopyChunk>(host_chunks_), stream_);
    if (rev.seq_recv_mask) combine_.emplace(rev, token_bytes, stream_);  // reverse KV
    staging_.ensure(staging_bytes);
  }

  cudaStream_t stream() const noexcept { return stream_; }

  /// Runs one of the plan's piece lists (uploaded at construction; `pieces`
  /// is the host list it was made from, checked to be the same size).
  void copy(Direction dir, Stage stage, std::span<const CopyPiece> pieces, const std::byte* src, std::byte* dst) const {
    const List& list = lists_[index(dir, stage)];
    if (pieces.size() != list.pieces) {
      fail("device data path: ", pieces.size(), " copy pieces, but the plan it was built from has ", list.pieces);
    }
    cuda::launch_copy(src, dst, chunks_.data() + list.offset, list.count, stream_);
  }

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
  struct List {
    std::size_t pieces = 0;  // host pieces it came from
    std::size_t offset = 0;  // first chunk in chunks_
    std::size_t count = 0;   // chunks
  };

  static constexpr std::size_t index(Direction dir, Stage stage) noexcept {
    return (dir == Direction::forward ? 0 : 3) + (stage == Stage::pack ? 0 : stage == Stage::self ? 1 : 2);
  }

  cudaStream_t stream_;
  std::array<List, 6> lists_{};
  std::vector<cuda::CopyChunk> host_chunks_;  // kept: the stream-ordered upload reads it
  cuda::DeviceBuffer<cuda::CopyChunk> chunks_;
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
    if (fan.copy_splits[e + 1] - fan.copy_splits[e] == 1) {
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
      : stream_(stream_of(transport)), combine_(rev, token_bytes, stream_) {
    static_assert(!PieceTransport<Transport>, "cpdispatch: the device wire path serves transports without all_to_all_pieces");
    for (WireExchange which : {WireExchange::forward, WireExchange::reverse}) {
      const ExchangePlan& ex = which == WireExchange::forward ? plan.forward : plan.reverse;
      for (Stage stage : {Stage::pack, Stage::self, Stage::unpack}) {
        add_list(index(which, stage), stage == Stage::pack ? ex.send.copies : stage == Stage::self ? ex.self : ex.recv.copies);
      }
    }
    add_list(fan_out_list, plan.fan_out);
    cuda::FanInPlan fan_in = cuda::plan_fan_in(fan, token_bytes);
    add_list(single_copy_list, fan_in.single_copies);
    upload(copy_chunks_, host_copy_chunks_);
    host_fan_in_chunks_ = std::move(fan_in.chunks);
    upload(fan_in_chunks_, host_fan_in_chunks_);
    for (std::int64_t at : fan.attn_offset) host_copy_at_.push_back(static_cast<std::uint64_t>(at) * token_bytes);
    host_splits_.assign(fan.copy_splits.begin(), fan.copy_splits.end());
    upload(copy_at_, host_copy_at_);
    upload(splits_, host_splits_);
    staging_.allocate(staging_bytes);
  }

  /// Runs one of the plan's piece lists (uploaded at construction; `pieces`
  /// is the host list it was made from, checked to be the same size).
  void copy(WireExchange which, Stage stage, std::span<const CopyPiece> pieces, const std::byte* src, std::byte* dst) const {
    run_list(index(which, stage), pieces.size(), src, dst);
  }
  void fan_out(std::span<const CopyPiece> pieces, std::byte* attention) const { run_list(fan_out_list, pieces.size(), attention, attention); }

  /// Entries with one copy are copied, the others summed by the fan-in kernel.
  void fan_in(const KvFanList&, ElementType type, const std::byte* attention, std::byte* wire, std::size_t) const {
    run_list(single_copy_list, lists_[single_copy_list].pieces, attention, wire);
    cuda::launch_fan_in(type, attention, wire, fan_in_chunks_.data(), host_fan_in_chunks_.size(), copy_at_.data(), splits_.data(), stream_);
  }
  void combine(const RankMetadata&, const_buffer replica, mutable_buffer grad, std::size_t token_bytes, ElementType type) const {
    combine_(replica, grad, token_bytes, type);
  }
  std::byte* staging() noexcept { return staging_.data(); }

 private:
  struct List {
    std::size_t pieces = 0;  // host pieces it came from
    std::size_t offset = 0;  // first chunk in copy_chunks_
    std::size_t count = 0;   // chunks
  };
  static constexpr std::size_t fan_out_list = 6, single_copy_list = 7;

  /// forward 0..2, reverse 3..5 (reverse_in_place only serves all_to_all_pieces).
  static std::size_t index(WireExchange which, Stage stage) {
    if (which == WireExchange::reverse_in_place) fail("device wire path: no in-place exchange without all_to_all_pieces");
    return (which == WireExchange::forward ? 0 : 3) + (stage == Stage::pack ? 0 : stage == Stage::self ? 1 : 2);
  }

  void add_list(std::size_t i, const std::vector<CopyPiece>& pieces) {
    const std::vector<cuda::CopyChunk> chunks = cuda::plan_copy_chunks(pieces);
    lists_[i] = {pieces.size(), host_copy_chunks_.size(), chunks.size()};
    host_copy_chunks_.insert(host_copy_chunks_.end(), chunks.begin(), chunks.end());
  }

  void run_list(std::size_t i, std::size_t pieces, const std::byte* src, std::byte* dst) const {
    const List& list = lists_[i];
    if (pieces != list.pieces) fail("device wire path: ", pieces, " copy pieces, but the plan it was built from has ", list.pieces);
    cuda::launch_copy(src, dst, copy_chunks_.data() + list.offset, list.count, stream_);
  }

  template <class X>
  void upload(cuda::DeviceBuffer<X>& device, const std::vector<X>& host) {
    device.allocate(host.size());
    device.upload(std::span<const X>(host), stream_);
  }

  cudaStream_t stream_;
  DeviceCombine combine_;
  std::array<List, 8> lists_{};
  // The host arrays are kept: the stream-ordered uploads read them.
  std::vector<cuda::CopyChunk> host_copy_chunks_;
  std::vector<cuda::FanInChunk> host_fan_in_chunks_;
  std::vector<std::uint64_t> host_copy_at_, host_splits_;
  cuda::DeviceBuffer<cuda::CopyChunk> copy_chunks_;
  cuda::DeviceBuffer<cuda::FanInChunk> fan_in_chunks_;
  cuda::DeviceBuffer<std::uint64_t> copy_at_, splits_;
  cuda::DeviceBuffer<std::byte> staging_;
};

}  // namespace cpdispatch::detail
