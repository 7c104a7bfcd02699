#pragma once
// One rank's metadata slice on the device, in the device dtypes (int32
// ranks, 64-bit offsets, lengths and counts, uint8 masks): normalised
// and copied once per plan, then reused by every step (RAII device buffers).
//
//   cuda::DeviceRankMetadata rev(qkv.kv_rev.get_slice(rank), stream, "kv_rev");
//   kernel<<<..., stream>>>(rev.view(), ...);
//
// Plain C++ over the CUDA runtime API: compiles with the host compiler too.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch::cuda {

/// What kernels take (by value): device pointers and sizes of one slice.
struct DeviceRankMetadataView {
  const std::int32_t* dst_rank = nullptr;         ///< [entries * num_copies], -1 = no copy
  const std::uint64_t* dst_offset = nullptr;      ///< [entries * num_copies], tokens
  const std::uint64_t* seq_len = nullptr;         ///< [entries], tokens
  const std::uint64_t* num_recv_tokens = nullptr; ///< [world_size + 1]
  const std::uint8_t* seq_recv_mask = nullptr;    ///< [shards * mask_copies] (reverse KV) or null
  const std::uint64_t* recv_seq_lens = nullptr;   ///< [shards] (reverse KV) or null
  std::uint32_t num_entries = 0;
  std::uint32_t num_copies = 1;
  std::uint32_t num_shards = 0;
  std::uint32_t mask_copies = 0;
  std::int32_t rank = 0;
  std::int32_t world_size = 0;
};

class DeviceRankMetadata {
 public:
  /// Normalises `slice` (invalid_input names a value that does not fit the
  /// kernel dtypes, prefixed by `name`) and enqueues its upload on `stream`.
  DeviceRankMetadata(const RankMetadata& slice, cudaStream_t stream, std::string_view name = "metadata")
      : host_(normalize_slice(slice, name)) {
    if (host_.seq_len.size() > std::numeric_limits<std::uint32_t>::max()) cpdispatch::detail::fail("DeviceRankMetadata: ", name, " has too many entries for 32-bit indices");
    upload(dst_rank_, host_.dst_rank, stream);
    upload(dst_offset_, host_.dst_offset, stream);
    upload(seq_len_, host_.seq_len, stream);
    upload(num_recv_tokens_, host_.num_recv_tokens, stream);
    upload(seq_recv_mask_, host_.seq_recv_mask, stream);
    upload(recv_seq_lens_, host_.recv_seq_lens, stream);
  }

  /// The normalised slice (the host copy the upload reads from).
  const NormalizedRankMetadata& host() const noexcept { return host_; }

  DeviceRankMetadataView view() const noexcept {
    DeviceRankMetadataView v;
    v.dst_rank = dst_rank_.data();
    v.dst_offset = dst_offset_.data();
    v.seq_len = seq_len_.data();
    v.num_recv_tokens = num_recv_tokens_.data();
    v.seq_recv_mask = host_.has_mask ? seq_recv_mask_.data() : nullptr;
    v.recv_seq_lens = host_.has_mask ? recv_seq_lens_.data() : nullptr;
    v.num_entries = static_cast<std::uint32_t>(host_.seq_len.size());
    v.num_copies = host_.num_copies;
    v.num_shards = static_cast<std::uint32_t>(host_.recv_seq_lens.size());
    v.mask_copies = host_.mask_copies;
    v.rank = static_cast<std::int32_t>(host_.rank);
    v.world_size = static_cast<std::int32_t>(host_.world_size);
    return v;
  }

 private:
  template <class T>
  static void upload(DeviceBuffer<T>& device, const std::vector<T>& host, cudaStream_t stream) {
    device.allocate(host.size());
    device.upload(std::span<const T>(host), stream);
  }

  NormalizedRankMetadata host_;  // kept: the stream-ordered uploads read it
  DeviceBuffer<std::int32_t> dst_rank_;
  DeviceBuffer<std::uint64_t> dst_offset_;
  DeviceBuffer<std::uint64_t> seq_len_;
  DeviceBuffer<std::uint64_t> num_recv_tokens_;
  DeviceBuffer<std::uint8_t> seq_recv_mask_;
  DeviceBuffer<std::uint64_t> recv_seq_lens_;
};

}  // namespace cpdispatch::cuda
