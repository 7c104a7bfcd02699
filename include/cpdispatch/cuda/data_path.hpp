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
// The device data path (cuda::DeviceDataPath; the interface and the host
// path are in execute/data_path.hpp). Per plan (clear, add_*, commit) each
// piece list is split into warp-sized chunks, the fan-ins and the home
// combines are planned, and all of it is uploaded on the transport's stream;
// the lists of the plan before are freed then (cudaFree waits for the work
// still using them). Offsets and lengths stay 64-bit: every plan the host
// path accepts, the device path accepts. Each call then only enqueues
// kernels (copy, fan-in, combine, fill) and cudaMemsetAsync on that stream:
// no allocation, no host synchronisation, no host access to device memory,
// so whole calls can be captured in a CUDA graph. Make and replan the owners
// outside a capture (they allocate and free device memory). Results equal
// the host path's bit for bit (same order and accumulation; integers wrap).
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
#include <memory>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "cpdispatch/cuda/crc32c.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
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
  void add(std::size_t i, std::span<const CopyPiece> pieces) {
    if (lists_.size() <= i) lists_.resize(i + 1);
    const std::vector<cuda::CopyChunk> chunks = cuda::plan_copy_chunks(pieces);
    lists_[i] = {pieces.size(), host_.size(), chunks.size()};
    host_.insert(host_.end(), chunks.begin(), chunks.end());
  }
  void upload() {
    device_.allocate(host_.size());
    device_.upload(std::span<const cuda::CopyChunk>(host_), stream_);
  }

  /// Runs list i; `pieces` is the size of the host list it was made from,
  /// checked. With `sums`, the copy checksums what it writes on the way.
  void run(std::size_t i, std::size_t pieces, const std::byte* src, std::byte* dst, const char* who, const cuda::CrcTarget* sums = nullptr) const {
    const List& list = lists_.at(i);
    if (pieces != list.pieces) fail(who, ": ", pieces, " copy pieces, but the plan it was built from has ", list.pieces);
    if (sums) cuda::launch_copy_crc(src, dst, device_.data() + list.offset, list.count, *sums, stream_);
    else cuda::launch_copy(src, dst, device_.data() + list.offset, list.count, stream_);
  }

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

}  // namespace cpdispatch::detail

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

}  // namespace cpdispatch::detail

namespace cpdispatch::cuda {

/// The device data path, as device transports name it: `using data_path = cuda::DeviceDataPath;`.
class DeviceDataPath {
 public:
  static constexpr bool available = true;
  using const_buffer = DeviceConstBytes;
  using mutable_buffer = DeviceBytes;

  template <class U>
  using span = DeviceSpan<U>;

  template <class U>
  static auto bytes_of(DeviceSpan<U> s) noexcept { return as_bytes(s); }

  /// Owned device memory of U: a fresh allocation when it grows (the old
  /// contents are not kept, new elements are uninitialised), never a
  /// zero-byte one, so data() is a live device pointer once sized at all.
  template <class U>
  class buffer {
   public:
    void resize(std::size_t n) {
      reserve(n);
      size_ = n;
    }
    void reserve(std::size_t n) {
      if (mem_.empty() || mem_.size() < n) mem_.allocate(std::max<std::size_t>(n, 1));
    }
    U* data() noexcept { return mem_.data(); }
    const U* data() const noexcept { return mem_.data(); }
    std::size_t size() const noexcept { return size_; }

   private:
    DeviceBuffer<U> mem_;
    std::size_t size_ = 0;
  };

  template <class Transport>
  explicit DeviceDataPath(Transport& transport) : stream_(detail::stream_of(transport)) {}

  /// The stream everything here is ordered on (the transport's).
  cudaStream_t stream() const noexcept { return stream_; }

  /// Forgets the last plan's lists, freeing their device memory.
  void clear() noexcept {
    copies_.reset();
    copy_pieces_.clear();
    fans_.clear();
    combines_.clear();
    committed_ = false;
  }

  std::size_t add_copies(std::span<const detail::CopyPiece> pieces) {
    if (!copies_) copies_.emplace(stream_);
    const std::size_t id = copy_pieces_.size();
    copies_->add(id, pieces);
    copy_pieces_.push_back(pieces.size());
    committed_ = false;
    return id;
  }

  /// Uploaded at once. Entries with one copy are copied to their wire offset.
  std::size_t add_fan_in(const KvFanList& fan, std::size_t token_bytes) {
    fans_.push_back(std::make_unique<Fan>(fan, token_bytes, false, stream_));
    return fans_.size() - 1;
  }

  /// Uploaded at once. Entries whose fan-in does nothing (one copy, at its
  /// own wire offset; or no tokens) are left out: in place, they would be
  /// copies onto themselves.
  std::size_t add_fan_in_place(const KvFanList& fan, std::size_t token_bytes) {
    fans_.push_back(std::make_unique<Fan>(without_no_ops(fan), token_bytes, true, stream_));
    return fans_.size() - 1;
  }

  /// Uploaded at once (`rev` need not outlive the call).
  std::size_t add_combine(const RankMetadata& rev, std::size_t token_bytes) {
    combines_.push_back(std::make_unique<Combine>(rev, token_bytes, stream_));
    return combines_.size() - 1;
  }

  void commit() {
    if (copies_) copies_->upload();
    committed_ = true;
  }

  void copy(std::size_t id, const std::byte* src, std::byte* dst) const {
    check_copy_list(id);
    copies_->run(id, copy_pieces_[id], src, dst, who);
  }
  /// The exchange engine's form: a list added here, by its id (its pieces
  /// are the host list it was made from, checked to be the same size).
  void copy(detail::PieceList list, const std::byte* src, std::byte* dst) const {
    check_copy_list(list.id);
    copies_->run(list.id, list.pieces.size(), src, dst, who);
  }
  /// The same, the checksums of what it writes XORed into `sums` on the way
  /// (a pack whose transport checks what it sends: DeviceChecksummedTransport).
  void copy(detail::PieceList list, const std::byte* src, std::byte* dst, const CrcTarget& sums) const {
    check_copy_list(list.id);
    copies_->run(list.id, list.pieces.size(), src, dst, who, &sums);
  }

  /// Entries with one copy are copied, the others summed by the fan-in
  /// kernel; an in-place list's in place (dst == src).
  void fan_in(std::size_t id, ElementType type, const std::byte* src, std::byte* dst) const {
    const Fan& f = at(fans_, id, "fan-in");
    if (f.in_place && src != dst) detail::fail(who, ": fan-in list ", id, " sums in place, but its source and destination differ");
    aligned(type, f.token_bytes, src, "fan-in");
    aligned(type, f.token_bytes, dst, "fan-in");
    f.run(type, src, dst);
  }
  void fan_in(std::size_t id, ElementType type, std::byte* attention) const { fan_in(id, type, attention, attention); }

  /// The KV-gradient combine: same order and accumulation as combine_copies
  /// (bit-identical for finite values; integers wrap).
  void combine(std::size_t id, ElementType type, const std::byte* replica, std::size_t replica_bytes, std::byte* grad, std::size_t grad_bytes) const {
    const Combine& c = at(combines_, id, "combine");
    c.run(DeviceConstBytes(replica, replica_bytes), DeviceBytes(grad, grad_bytes), c.token_bytes, type);
  }

  void fill(float* p, std::size_t n, float value) const { launch_fill(p, n, value, stream_); }
  void zero(std::byte* p, std::size_t bytes) const {
    if (bytes > 0) CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }

 protected:
  static constexpr const char* who = "device data path";

 private:
  struct Fan {
    Fan(const KvFanList& fan, std::size_t bytes, bool place, cudaStream_t stream) : run(fan, bytes, stream), token_bytes(bytes), in_place(place) {}
    detail::DeviceFanIn run;
    std::size_t token_bytes;
    bool in_place;
  };
  struct Combine {
    Combine(const RankMetadata& rev, std::size_t bytes, cudaStream_t stream) : run(rev, bytes, stream), token_bytes(bytes) {}
    detail::DeviceCombine run;
    std::size_t token_bytes;
  };

  void check_copy_list(std::size_t id) const {
    if (!committed_ || id >= copy_pieces_.size()) {
      detail::fail(who, ": copy list ", id, " of ", copy_pieces_.size(), committed_ ? "" : " (not committed)");
    }
  }

  template <class X>
  static const X& at(const std::vector<std::unique_ptr<X>>& lists, std::size_t id, const char* what) {
    if (id >= lists.size()) detail::fail(who, ": ", what, " list ", id, " of ", lists.size());
    return *lists[id];
  }

  static void aligned(ElementType type, std::size_t token_bytes, const std::byte* p, const char* what) {
    const std::size_t es = element_size(type);
    if (token_bytes % es != 0 || reinterpret_cast<std::uintptr_t>(p) % es != 0) {
      detail::fail(who, ": the ", what, " of ", element_name(type), " needs token_bytes and the buffer aligned to ", es, " bytes");
    }
  }

  /// `fan` without the entries whose fan-in changes nothing.
  static KvFanList without_no_ops(const KvFanList& fan) {
    KvFanList out;
    out.wire_tokens = fan.wire_tokens;
    out.attention_tokens = fan.attention_tokens;
    out.copy_splits.push_back(0);
    for (std::size_t e = 0; e < fan.num_entries(); ++e) {
      const std::span<const std::int64_t> copies = fan.copies(e);
      if (fan.seq_len[e] == 0 || copies.empty() || (copies.size() == 1 && copies[0] == fan.wire_offset[e])) continue;
      out.wire_offset.push_back(fan.wire_offset[e]);
      out.seq_len.push_back(fan.seq_len[e]);
      if (e < fan.src_rank.size()) out.src_rank.push_back(fan.src_rank[e]);
      if (e < fan.src_shard.size()) out.src_shard.push_back(fan.src_shard[e]);
      out.attn_offset.insert(out.attn_offset.end(), copies.begin(), copies.end());
      out.copy_splits.push_back(out.attn_offset.size());
    }
    return out;
  }

  cudaStream_t stream_;
  std::optional<detail::DeviceCopyLists> copies_;
  std::vector<std::size_t> copy_pieces_;  // each copy list's piece count
  // Held by pointer: the pending uploads read host arrays that must not move.
  std::vector<std::unique_ptr<Fan>> fans_;
  std::vector<std::unique_ptr<Combine>> combines_;
  bool committed_ = false;
};

}  // namespace cpdispatch::cuda

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
