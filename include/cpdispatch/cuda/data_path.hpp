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

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda/memory.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/execute/detail/data_path.hpp"
#include "cpdispatch/execute/detail/dispatch_plan.hpp"
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
    if (rev.seq_recv_mask) {  // reverse KV: the combine's chunks and mask
      cuda::NormalizedRankMetadata n = cuda::normalize_slice(rev, "rev");
      combine_plan_ = cuda::plan_combine_chunks(n, token_bytes);
      combine_chunks_.allocate(combine_plan_.chunks.size());
      combine_chunks_.upload(std::span<const cuda::CombineChunk>(combine_plan_.chunks), stream_);
      mask_copies_ = n.mask_copies;
      host_mask_ = std::move(n.seq_recv_mask);
      mask_.allocate(host_mask_.size());
      mask_.upload(std::span<const std::uint8_t>(host_mask_), stream_);
      has_combine_ = true;
    }
    staging_.allocate(staging_bytes);
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
    const std::size_t es = element_size(type);
    if (!has_combine_) fail("device data path: the combine needs reverse KV metadata (with seq_recv_mask)");
    if (token_bytes % es != 0 || reinterpret_cast<std::uintptr_t>(replica.data()) % es != 0 ||
        reinterpret_cast<std::uintptr_t>(grad.data()) % es != 0) {
      fail("device data path: the combine of ", element_name(type), " needs token_bytes and both buffers aligned to ", es, " bytes");
    }
    const std::uint64_t copies = mask_copies_;
    if (replica.size() < combine_plan_.slab_bytes * copies || grad.size() < combine_plan_.slab_bytes) {
      fail<capacity_error>("device data path: the combine needs ", combine_plan_.slab_bytes * copies, " bytes of replica and ",
                           combine_plan_.slab_bytes, " of grad, got ", replica.size(), " and ", grad.size());
    }
    cuda::launch_combine(type, replica.data(), grad.data(), combine_chunks_.data(), combine_plan_.chunks.size(), combine_plan_.slab_bytes,
                         mask_.data(), mask_copies_, stream_);
  }

  /// The dispatcher-owned staging, allocated at construction.
  mutable_buffer staging(std::size_t bytes) {
    if (staging_.size() < bytes) staging_.allocate(bytes);  // not for the sizes the dispatcher asks: those exist already
    return staging_.span();
  }

 private:
  struct List {
    std::size_t pieces = 0;  // host pieces it came from
    std::size_t offset = 0;  // first chunk in chunks_
    std::size_t count = 0;   // chunks
  };

  static constexpr std::size_t index(Direction dir, Stage stage) noexcept {
    return (dir == Direction::forward ? 0 : 3) + (stage == Stage::pack ? 0 : stage == Stage::self ? 1 : 2);
  }

  template <class Transport>
  static cudaStream_t stream_of(const Transport& transport) {
    static_assert(cuda::StreamOrdered<Transport>,
                  "cpdispatch: a device transport must offer `cudaStream_t stream() const` (the stream its work is ordered on)");
    return transport.stream();
  }

  cudaStream_t stream_;
  std::array<List, 6> lists_{};
  std::vector<cuda::CopyChunk> host_chunks_;  // kept: the stream-ordered upload reads it
  cuda::DeviceBuffer<cuda::CopyChunk> chunks_;
  bool has_combine_ = false;
  std::uint32_t mask_copies_ = 0;
  std::vector<std::uint8_t> host_mask_;  // kept: the stream-ordered upload reads it
  cuda::DeviceBuffer<std::uint8_t> mask_;
  cuda::CombinePlan combine_plan_;
  cuda::DeviceBuffer<cuda::CombineChunk> combine_chunks_;
  cuda::DeviceBuffer<std::byte> staging_;
};

}  // namespace cpdispatch::detail

namespace cpdispatch::cuda {

/// The device data path, as device transports name it: `using data_path = cuda::DeviceDataPath;`.
class DeviceDataPath : public detail::data_path<MemorySpace::device> {
 public:
  using detail::data_path<MemorySpace::device>::data_path;
};

}  // namespace cpdispatch::cuda
