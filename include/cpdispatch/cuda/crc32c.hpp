#pragma once
// CRC32C of byte segments in device memory, on the stream: the checksums of
// DeviceChecksummedTransport (cuda/checksummed.hpp). The same function as
// cpdispatch::crc32c (crc32c.hpp), bit for bit.
//
//   launch_segment_crc(base, ranges, count, chunks, tables.data(), sums, stream);
//   // sums[s].crc ^= the raw CRC register of segment s; its CRC32C is ~sums[s].crc
//
// How, in one pass over the bytes: each segment is cut into chunks of
// crc_chunk_bytes; one thread computes its chunk's CRC register (slicing by
// eight) and moves it to the segment's end by appending the zero bytes that
// follow the chunk (a linear map: one table of four lookups for each set bit
// of their count); the chunks' registers then XOR together (atomicXor) into
// the segment's register, as the CRC's linearity allows. The first chunk of
// a segment starts from the initial register (all ones), the others from
// zero; a segment without bytes starts its sum at all ones (set by the
// caller, see CrcRange).
//
// Requires nvcc (kernels), or the project's CUDA runtime double
// (CPDISPATCH_CUDA_HOST_HARNESS), whose launches run as host loops.

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/crc32c.hpp holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpdispatch/crc32c.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/cuda_runtime/grid.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"

namespace cpdispatch::cuda {

/// One segment of a buffer: `bytes` bytes at `offset`; its chunks are
/// numbered from `first_chunk` (the chunks of the segments before it).
struct CrcRange {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t first_chunk = 0;
};
static_assert(std::is_trivially_copyable_v<CrcRange> && sizeof(CrcRange) == 24);

/// A segment's checksum as it travels: its CRC register (crc32c() is its
/// complement) and its byte count.
struct SegmentCrc {
  std::uint32_t crc = 0;
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;
};
static_assert(std::is_trivially_copyable_v<SegmentCrc> && sizeof(SegmentCrc) == 16);

/// Where a pack fused with the checksum (launch_copy_crc) puts the sums of
/// what it writes: the destination's segments (a device array, by offset,
/// none overlapping) and their sums (device, each crc preset to
/// crc_start(bytes)); `tables`: the device copy of crc_tables().
struct CrcTarget {
  const CrcRange* segments = nullptr;
  std::uint32_t count = 0;
  const std::uint32_t* tables = nullptr;
  SegmentCrc* sums = nullptr;
};

/// Bytes one thread checksums.
inline constexpr std::uint64_t crc_chunk_bytes = 1024;
/// Segments up to 2^crc_shift_levels bytes (256 TiB).
inline constexpr unsigned crc_shift_levels = 48;
/// The tables' words: eight byte tables (slicing by eight), then per level k
/// four byte tables that append 2^k zero bytes to a register.
inline constexpr std::size_t crc_table_words = 8 * 256 + crc_shift_levels * 4 * 256;

/// Chunks of a segment of `bytes` bytes.
constexpr std::uint64_t crc_chunks(std::uint64_t bytes) noexcept { return (bytes + crc_chunk_bytes - 1) / crc_chunk_bytes; }

/// The register a segment's sum starts from: all ones for an empty segment
/// (no chunk runs, and the CRC32C of nothing is 0), zero otherwise.
constexpr std::uint32_t crc_start(std::uint64_t bytes) noexcept { return bytes == 0 ? 0xFFFFFFFFu : 0u; }

}  // namespace cpdispatch::cuda

namespace cpdispatch::detail::crc {

/// cuda::crc_tables().
inline const std::vector<std::uint32_t>& device_tables() {
  static const std::vector<std::uint32_t> tables = [] {
    std::vector<std::uint32_t> t(cuda::crc_table_words);
    for (std::size_t i = 0; i < 256; ++i) t[i] = byte_table[i];
    for (std::size_t k = 1; k < 8; ++k) {
      for (std::size_t i = 0; i < 256; ++i) {
        const std::uint32_t prev = t[(k - 1) * 256 + i];
        t[k * 256 + i] = (prev >> 8) ^ byte_table[prev & 0xFFu];
      }
    }
    // Columns of "append 2^k zero bytes": the images of the 32 single-bit registers.
    std::array<std::uint32_t, 32> column{};
    for (std::size_t b = 0; b < 32; ++b) {
      const std::uint32_t reg = std::uint32_t{1} << b;
      column[b] = byte_table[reg & 0xFFu] ^ (reg >> 8);  // one zero byte
    }
    const auto apply = [](const std::array<std::uint32_t, 32>& cols, std::uint32_t reg) {
      std::uint32_t out = 0;
      for (std::size_t b = 0; b < 32; ++b)
        if (reg & (std::uint32_t{1} << b)) out ^= cols[b];
      return out;
    };
    for (std::size_t level = 0; level < cuda::crc_shift_levels; ++level) {
      std::uint32_t* tab = t.data() + 8 * 256 + level * 4 * 256;
      for (std::size_t j = 0; j < 4; ++j) {
        for (std::uint32_t v = 0; v < 256; ++v) {
          std::uint32_t out = 0;
          for (std::size_t i = 0; i < 8; ++i)
            if (v & (1u << i)) out ^= column[8 * j + i];
          tab[j * 256 + v] = out;
        }
      }
      std::array<std::uint32_t, 32> twice{};  // 2^(k+1) zeros: the map applied twice
      for (std::size_t b = 0; b < 32; ++b) twice[b] = apply(column, column[b]);
      column = twice;
    }
    return t;
  }();
  return tables;
}

}  // namespace cpdispatch::detail::crc

namespace cpdispatch::cuda {

/// The tables for the device (see crc_table_words), built once on the host.
inline const std::vector<std::uint32_t>& crc_tables() { return ::cpdispatch::detail::crc::device_tables(); }

namespace kernels {

/// The register after one byte, and after eight (slicing by eight; little-endian: the first four bytes in w.x).
__host__ __device__ __forceinline__ std::uint32_t crc_byte(const std::uint32_t* __restrict__ t, std::uint32_t reg, unsigned char b) {
  return t[(reg ^ b) & 0xFFu] ^ (reg >> 8);
}
__host__ __device__ __forceinline__ std::uint32_t crc_word(const std::uint32_t* __restrict__ t, std::uint32_t reg, uint2 w) {
  const std::uint32_t lo = reg ^ w.x, hi = w.y;
  return t[7 * 256 + (lo & 0xFFu)] ^ t[6 * 256 + ((lo >> 8) & 0xFFu)] ^ t[5 * 256 + ((lo >> 16) & 0xFFu)] ^ t[4 * 256 + (lo >> 24)] ^
         t[3 * 256 + (hi & 0xFFu)] ^ t[2 * 256 + ((hi >> 8) & 0xFFu)] ^ t[1 * 256 + ((hi >> 16) & 0xFFu)] ^ t[hi >> 24];
}

/// The register after the n bytes at p (eight at a time on aligned words).
__host__ __device__ __forceinline__ std::uint32_t crc_update(const std::uint32_t* __restrict__ t, std::uint32_t reg,
                                                            const unsigned char* __restrict__ p, std::uint64_t n) {
  for (; n > 0 && reinterpret_cast<std::uintptr_t>(p) % 8 != 0; --n) reg = crc_byte(t, reg, *p++);
  for (; n >= 8; n -= 8, p += 8) reg = crc_word(t, reg, *reinterpret_cast<const uint2*>(p));
  for (; n > 0; --n) reg = crc_byte(t, reg, *p++);
  return reg;
}

/// crc_update over n bytes copied from s to d on the way: each byte read once.
__host__ __device__ __forceinline__ std::uint32_t crc_copy(const std::uint32_t* __restrict__ t, std::uint32_t reg, const unsigned char* __restrict__ s,
                                                          unsigned char* __restrict__ d, std::uint64_t n) {
  const bool words = (reinterpret_cast<std::uintptr_t>(s) - reinterpret_cast<std::uintptr_t>(d)) % 8 == 0;  // both reach 8-byte words together
  for (; n > 0 && (!words || reinterpret_cast<std::uintptr_t>(s) % 8 != 0); --n) reg = crc_byte(t, reg, *d++ = *s++);
  for (; n >= 8; n -= 8, s += 8, d += 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(s);
    *reinterpret_cast<uint2*>(d) = w;
    reg = crc_word(t, reg, w);
  }
  for (; n > 0; --n) reg = crc_byte(t, reg, *d++ = *s++);
  return reg;
}

/// The register with `zeros` zero bytes appended.
__host__ __device__ __forceinline__ std::uint32_t crc_append_zeros(const std::uint32_t* __restrict__ t, std::uint32_t reg, std::uint64_t zeros) {
  const std::uint32_t* level = t + 8 * 256;
  for (; zeros != 0 && reg != 0; zeros >>= 1, level += 4 * 256) {
    if (zeros & 1u) reg = level[reg & 0xFFu] ^ level[256 + ((reg >> 8) & 0xFFu)] ^ level[512 + ((reg >> 16) & 0xFFu)] ^ level[768 + (reg >> 24)];
  }
  return reg;
}

/// Thread t of the grid (striding) checksums chunk t of the segments. (A
/// template: defined once however many translation units include it.)
template <class = void>
__global__ void segment_crc_kernel(const unsigned char* base, const CrcRange* ranges, std::uint32_t count, std::uint64_t chunks,
                                   const std::uint32_t* tables, SegmentCrc* sums) {
  for (std::uint64_t t = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; t < chunks; t += std::uint64_t{gridDim.x} * blockDim.x) {
    std::uint32_t lo = 0, hi = count;  // the last segment whose first chunk is at or before t (empty segments are passed over)
    while (hi - lo > 1) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if (ranges[mid].first_chunk <= t) lo = mid; else hi = mid;
    }
    const CrcRange r = ranges[lo];
    const std::uint64_t start = (t - r.first_chunk) * crc_chunk_bytes;
    const std::uint64_t n = r.bytes - start < crc_chunk_bytes ? r.bytes - start : crc_chunk_bytes;
    std::uint32_t reg = crc_update(tables, start == 0 ? 0xFFFFFFFFu : 0u, base + r.offset + start, n);
    reg = crc_append_zeros(tables, reg, r.bytes - start - n);
    atomicXor(&sums[lo].crc, reg);
  }
}

/// The segment of `segments` (by offset, none overlapping) that holds byte `at`: the last that starts at or before it.
__host__ __device__ __forceinline__ std::uint32_t segment_at(const CrcRange* segments, std::uint32_t count, std::uint64_t at) {
  std::uint32_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (segments[mid].offset <= at) lo = mid; else hi = mid;
  }
  return lo;
}

/// The copy kernel's chunks (copy_chunks_kernel: warp w takes chunks w, w +
/// warps, ...), each lane copying a run of its warp's chunk and XORing the
/// CRC register of the run's part in each segment, moved to the segment's
/// end, into the segment's sum (a part that starts its segment starts from
/// all ones). A piece may run on from one segment into the next (a pack
/// merges adjacent pieces).
template <unsigned Warps>
__global__ void __launch_bounds__(Warps * 32) copy_crc_kernel(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                                             const CopyChunk* __restrict__ chunks, std::uint64_t count, CrcTarget target) {
  const unsigned lane = threadIdx.x % 32;
  for (std::uint64_t c = blockIdx.x * std::uint64_t{Warps} + threadIdx.x / 32; c < count; c += std::uint64_t{gridDim.x} * Warps) {
    const CopyChunk chunk = chunks[c];
    const std::uint64_t run = (chunk.bytes + 32 * 8 - 1) / (32 * 8) * 8, from = lane * run;  // runs of whole 8-byte words
    if (from >= chunk.bytes) continue;
    const std::uint64_t end = chunk.dst + from + (chunk.bytes - from < run ? chunk.bytes - from : run);
    for (std::uint64_t at = chunk.dst + from; at < end;) {  // a piece may run on into the next segment (merged pieces)
      const std::uint32_t s = segment_at(target.segments, target.count, at);
      const CrcRange seg = target.segments[s];
      const std::uint64_t seg_end = seg.offset + seg.bytes;
      if (at < seg.offset || at >= seg_end) {  // bytes that no segment sends: copied, not summed
        for (; at < end; ++at) dst[at] = src[chunk.src + (at - chunk.dst)];
        break;
      }
      const std::uint64_t n = (end < seg_end ? end : seg_end) - at;
      std::uint32_t reg = crc_copy(target.tables, at == seg.offset ? 0xFFFFFFFFu : 0u, src + chunk.src + (at - chunk.dst), dst + at, n);
      reg = crc_append_zeros(target.tables, reg, seg_end - at - n);
      atomicXor(&target.sums[s].crc, reg);
      at += n;
    }
  }
}

}  // namespace kernels

/// XORs the raw CRC register of each of the `count` segments `ranges` (a
/// device array; `chunks` in all) of `base` into `sums` (a device array,
/// each entry's crc set to crc_start(bytes) before). `tables`: the device
/// copy of crc_tables().
inline void launch_segment_crc(const std::byte* base, const CrcRange* ranges, std::uint32_t count, std::uint64_t chunks,
                               const std::uint32_t* tables, SegmentCrc* sums, cudaStream_t stream) {
  if (chunks == 0) return;
  constexpr unsigned threads = 256;
  const std::uint64_t wanted = (chunks + threads - 1) / threads;
  const auto blocks = static_cast<unsigned>(wanted < max_blocks ? wanted : max_blocks);
  launch_kernel("segment_crc_kernel", &kernels::segment_crc_kernel<>, blocks, threads, stream, reinterpret_cast<const unsigned char*>(base), ranges,
                count, chunks, tables, sums);
}

/// The copy kernel's chunks (launch_copy) with the checksum of what they
/// write XORed into `target`'s sums on the way: every byte of a segment must
/// be written by the chunks of the launches that share `target`, once.
inline void launch_copy_crc(const std::byte* src, std::byte* dst, const CopyChunk* chunks, std::size_t count, const CrcTarget& target,
                            cudaStream_t stream) {
  if (count == 0) return;
  launch_kernel("copy_crc_kernel", &kernels::copy_crc_kernel<warps_per_block>, static_cast<unsigned>(blocks_for(count)), block_threads, stream,
                reinterpret_cast<const unsigned char*>(src), reinterpret_cast<unsigned char*>(dst), chunks, std::uint64_t{count}, target);
}

}  // namespace cpdispatch::cuda
