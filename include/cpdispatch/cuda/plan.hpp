#pragma once
// Host-side planning of the device data path: how the copy and combine
// kernels split their work, and the per-rank metadata in the dtypes kernels
// consume. Pure C++ (no CUDA), computed once per plan, testable on any CPU.
//
// Work split: one warp per chunk. A copy piece longer than copy_chunk_bytes
// becomes several chunks (both offsets advance by the same amount, so a
// piece's chunks keep its alignment); a shard of the combine longer than
// combine_chunk_bytes likewise. Short pieces stay one chunk each, so many
// small pieces (narrow tokens, short documents) still spread over the GPU.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpdispatch/cuda_runtime/grid.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch::cuda {

/// Bytes one warp copies per chunk: 16 KiB is 8 rounds of 32 lanes x 4
/// loads in flight x 16 bytes.
inline constexpr std::size_t copy_chunk_bytes = 16 * 1024;
/// Bytes (of grad) one warp combines per chunk; a multiple of 16, so chunk
/// boundaries keep 16-byte alignment and fall on element boundaries.
inline constexpr std::size_t combine_chunk_bytes = 8 * 1024;
/// Threads per block of every kernel here (8 warps: 8 chunks per block).
inline constexpr unsigned block_threads = 256;
inline constexpr unsigned warps_per_block = block_threads / 32;

/// One warp's share of a copy: `bytes` bytes from `src` to `dst` (offsets
/// from the kernel's source and destination base pointers).
struct CopyChunk {
  std::uint64_t src = 0;
  std::uint64_t dst = 0;
  std::uint64_t bytes = 0;
  friend bool operator==(const CopyChunk&, const CopyChunk&) = default;
};
static_assert(std::is_trivially_copyable_v<CopyChunk> && sizeof(CopyChunk) == 24);

/// One warp's share of the combine: `bytes` bytes of shard `shard`, starting
/// `start` bytes into grad (and into each copy's slab of the replica buffer).
/// In bytes, not elements, so that one plan serves every element type: a
/// token is a whole number of elements, so every start is one too.
struct CombineChunk {
  std::uint64_t start = 0;
  std::uint32_t bytes = 0;
  std::uint32_t shard = 0;
  friend bool operator==(const CombineChunk&, const CombineChunk&) = default;
};
static_assert(std::is_trivially_copyable_v<CombineChunk> && sizeof(CombineChunk) == 16);

/// Splits pieces into chunks of at most `max_bytes` (> 0), in order.
inline std::vector<CopyChunk> plan_copy_chunks(std::span<const cpdispatch::detail::CopyPiece> pieces, std::size_t max_bytes = copy_chunk_bytes) {
  if (max_bytes == 0) cpdispatch::detail::fail("plan_copy_chunks: max_bytes must be positive");
  std::vector<CopyChunk> chunks;
  std::size_t n = 0;
  for (const cpdispatch::detail::CopyPiece& p : pieces) n += p.bytes / max_bytes + 1;
  chunks.reserve(n);
  for (const cpdispatch::detail::CopyPiece& p : pieces) {
    for (std::size_t done = 0; done < p.bytes; done += max_bytes) {
      chunks.push_back({p.src + done, p.dst + done, std::min(max_bytes, p.bytes - done)});
    }
  }
  return chunks;
}

/// Blocks for a launch over `chunks` chunks (0: no launch).
constexpr std::size_t blocks_for(std::size_t chunks) noexcept {
  const std::size_t blocks = chunks / warps_per_block + (chunks % warps_per_block != 0);
  return blocks < max_blocks ? blocks : max_blocks;
}

/// This rank's metadata in the device dtypes (int32 ranks, 64-bit offsets,
/// lengths and counts, so that the device accepts every plan the host does,
/// uint8 masks), flattened as in RankMetadata.
struct NormalizedRankMetadata {
  std::int64_t rank = 0;
  std::int64_t world_size = 0;
  std::uint32_t num_copies = 1;
  std::vector<std::int32_t> dst_rank;           ///< [entries * num_copies]
  std::vector<std::uint64_t> dst_offset;        ///< [entries * num_copies]
  std::vector<std::uint64_t> seq_len;           ///< [entries]
  std::vector<std::uint64_t> num_recv_tokens;   ///< [W + 1]
  std::vector<std::uint8_t> seq_recv_mask;      ///< [shards * mask_copies] (reverse KV), else empty
  std::vector<std::uint64_t> recv_seq_lens;     ///< [shards] (reverse KV), else empty
  std::uint32_t mask_copies = 0;
  bool has_mask = false;
};

}  // namespace cpdispatch::cuda

namespace cpdispatch::detail {

template <class To>
To narrow_slice_value(std::int64_t v, std::int64_t lo, std::int64_t hi, std::string_view name, std::string_view field, std::size_t i) {
  if (v < lo || v > hi) {
    cpdispatch::detail::fail("normalize_slice: ", name, ".", field, "[", i, "] = ", v, " does not fit the kernel dtype (range [", lo, ", ", hi, "])");
  }
  return static_cast<To>(v);
}

template <class To>
std::vector<To> narrow_slice_vector(const std::vector<std::int64_t>& in, std::int64_t lo, std::int64_t hi, std::string_view name,
                              std::string_view field) {
  std::vector<To> out(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = narrow_slice_value<To>(in[i], lo, hi, name, field, i);
  return out;
}

}  // namespace cpdispatch::detail

namespace cpdispatch::cuda {

/// Converts a slice to the kernel dtypes; throws invalid_input naming the
/// first value that does not fit (`name` prefixes the field, e.g. "rev").
inline NormalizedRankMetadata normalize_slice(const RankMetadata& m, std::string_view name = "metadata") {
  constexpr std::int64_t u32 = std::numeric_limits<std::uint32_t>::max();
  constexpr std::int64_t i64 = std::numeric_limits<std::int64_t>::max();
  NormalizedRankMetadata n;
  n.rank = m.rank;
  n.world_size = m.world_size;
  if (m.world_size <= 0 || m.world_size > std::numeric_limits<std::int32_t>::max()) {
    cpdispatch::detail::fail("normalize_slice: ", name, ".world_size = ", m.world_size, " is outside [1, 2^31)");
  }
  if (m.num_copies == 0 || m.num_copies > static_cast<std::size_t>(u32)) {
    cpdispatch::detail::fail("normalize_slice: ", name, ".num_copies = ", m.num_copies, " is outside [1, 2^32)");
  }
  n.num_copies = static_cast<std::uint32_t>(m.num_copies);
  n.dst_rank = detail::narrow_slice_vector<std::int32_t>(m.dst_rank, -1, m.world_size - 1, name, "dst_rank");
  n.dst_offset = detail::narrow_slice_vector<std::uint64_t>(m.dst_offset, 0, i64, name, "dst_offset");
  n.seq_len = detail::narrow_slice_vector<std::uint64_t>(m.seq_len, 0, i64, name, "seq_len");
  n.num_recv_tokens = detail::narrow_slice_vector<std::uint64_t>(m.num_recv_tokens, 0, i64, name, "num_recv_tokens");
  if (m.seq_recv_mask.has_value() != m.recv_seq_lens.has_value()) {
    cpdispatch::detail::fail("normalize_slice: ", name, ".seq_recv_mask and recv_seq_lens must be both present or both absent");
  }
  if (m.seq_recv_mask) {
    if (m.mask_copies > static_cast<std::size_t>(u32)) cpdispatch::detail::fail("normalize_slice: ", name, ".mask_copies = ", m.mask_copies, " does not fit 32 bits");
    if (m.seq_recv_mask->size() != m.recv_seq_lens->size() * m.mask_copies) {
      cpdispatch::detail::fail("normalize_slice: ", name, ".seq_recv_mask has ", m.seq_recv_mask->size(), " values, expected ",
                               m.recv_seq_lens->size(), " shards x ", m.mask_copies, " copies");
    }
    n.has_mask = true;
    n.mask_copies = static_cast<std::uint32_t>(m.mask_copies);
    n.seq_recv_mask = detail::narrow_slice_vector<std::uint8_t>(*m.seq_recv_mask, 0, 1, name, "seq_recv_mask");
    n.recv_seq_lens = detail::narrow_slice_vector<std::uint64_t>(*m.recv_seq_lens, 0, i64, name, "recv_seq_lens");
  }
  return n;
}

/// The combine's chunks for reverse KV metadata `rev` (normalised) with
/// tokens of `token_bytes` bytes: shard g covers bytes [start_g, start_g +
/// len_g * token_bytes) of grad, start_g the sum before it, and the same
/// bytes of each copy's slab of the replica buffer (copy c's slab starts at
/// c * slab_bytes). Zero-length shards have no chunk. `max_bytes` must be a
/// positive multiple of 16 below 2^32.
struct CombinePlan {
  std::vector<CombineChunk> chunks;
  std::uint64_t slab_bytes = 0;  ///< bytes per copy: the sum of all shards
};

inline CombinePlan plan_combine_chunks(const NormalizedRankMetadata& rev, std::size_t token_bytes,
                                       std::size_t max_bytes = combine_chunk_bytes) {
  if (!rev.has_mask) cpdispatch::detail::fail("plan_combine_chunks: the metadata has no seq_recv_mask (it is not reverse KV metadata)");
  if (token_bytes == 0) cpdispatch::detail::fail("plan_combine_chunks: token_bytes must be positive");
  if (max_bytes == 0 || max_bytes % 16 != 0 || max_bytes > std::numeric_limits<std::uint32_t>::max()) {
    cpdispatch::detail::fail("plan_combine_chunks: max_bytes = ", max_bytes, " must be a positive multiple of 16 below 2^32");
  }
  if (rev.recv_seq_lens.size() > std::numeric_limits<std::uint32_t>::max()) {
    cpdispatch::detail::fail("plan_combine_chunks: ", rev.recv_seq_lens.size(), " shards do not fit 32-bit indices");
  }
  CombinePlan plan;
  std::uint64_t start = 0;
  for (std::size_t g = 0; g < rev.recv_seq_lens.size(); ++g) {
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(rev.recv_seq_lens[g]), static_cast<std::uint64_t>(token_bytes), &bytes) ||
        start + bytes < start) {
      cpdispatch::detail::fail("plan_combine_chunks: the replica buffer's size overflows 64 bits at shard ", g);
    }
    for (std::uint64_t done = 0; done < bytes; done += max_bytes) {
      const std::uint64_t n = std::min<std::uint64_t>(max_bytes, bytes - done);
      plan.chunks.push_back({start + done, static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(g)});
    }
    start += bytes;
  }
  plan.slab_bytes = start;
  return plan;
}

}  // namespace cpdispatch::cuda
