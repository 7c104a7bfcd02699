#pragma once
// CRC32C (Castagnoli: polynomial 0x1EDC6F41, reflected, initial value and
// final xor 0xFFFFFFFF), the checksum of exchanged segments
// (adapters/checksummed.hpp; on the device, cuda/crc32c.hpp).
//
//   std::uint32_t c = cpdispatch::crc32c(data, bytes);            // one buffer
//   c = cpdispatch::crc32c(more, more_bytes, c);                  // continues it: crc32c(A) then B == crc32c(A||B)
//
// Where the CPU has SSE4.2 (checked once, at run time) the crc32 instruction
// runs three independent streams over 3 x 4 KiB blocks, whose registers are
// then combined by a table that appends 4 KiB of zeros in one step; elsewhere
// a byte-wise table (the portable reference). Both give the same values,
// which tests check against Boost.CRC.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace cpdispatch {

namespace detail::crc {

/// The reflected polynomial.
inline constexpr std::uint32_t polynomial = 0x82F63B78u;

inline constexpr std::array<std::uint32_t, 256> byte_table = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ polynomial : c >> 1;
    t[i] = c;
  }
  return t;
}();

/// The CRC register after `n` bytes, without the initial and final
/// inversions (what the crc32 instruction computes).
inline std::uint32_t portable_update(std::uint32_t reg, const unsigned char* p, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) reg = byte_table[(reg ^ p[i]) & 0xFFu] ^ (reg >> 8);
  return reg;
}

/// Bytes of each of the three streams of the interleaved path.
inline constexpr std::size_t stream_bytes = 4096;

/// Appending `stream_bytes` zeros to a register is linear in it: four
/// byte-indexed tables give the result in four lookups. Built from the 32
/// single-bit registers, each run through the zeros once.
struct ZeroAppender {
  std::array<std::array<std::uint32_t, 256>, 4> table{};

  ZeroAppender() {
    const std::array<unsigned char, stream_bytes> zeros{};
    std::array<std::uint32_t, 32> bit{};
    for (std::size_t b = 0; b < 32; ++b) bit[b] = portable_update(std::uint32_t{1} << b, zeros.data(), zeros.size());
    for (std::size_t k = 0; k < 4; ++k) {
      for (std::uint32_t v = 0; v < 256; ++v) {
        std::uint32_t out = 0;
        for (std::size_t j = 0; j < 8; ++j)
          if (v & (1u << j)) out ^= bit[8 * k + j];
        table[k][v] = out;
      }
    }
  }

  std::uint32_t operator()(std::uint32_t reg) const noexcept {
    return table[0][reg & 0xFFu] ^ table[1][(reg >> 8) & 0xFFu] ^ table[2][(reg >> 16) & 0xFFu] ^ table[3][reg >> 24];
  }
};

inline const ZeroAppender& zero_appender() {
  static const ZeroAppender appender;
  return appender;
}

#if defined(__x86_64__)

__attribute__((target("sse4.2"))) inline std::uint64_t crc_word(std::uint64_t reg, const unsigned char* p) noexcept {
  std::uint64_t word = 0;
  std::memcpy(&word, p, sizeof word);
  return _mm_crc32_u64(reg, word);
}

/// The register after `n` bytes, with the crc32 instruction.
__attribute__((target("sse4.2"))) inline std::uint32_t hardware_update(std::uint32_t reg, const unsigned char* p, std::size_t n) {
  std::uint64_t r0 = reg;
  if (n >= 3 * stream_bytes) {
    const ZeroAppender& append = zero_appender();
    do {
      // update(r, A||B||C) = append(append(update(r, A)) ^ update(0, B)) ^ update(0, C)
      std::uint64_t r1 = 0, r2 = 0;
      for (std::size_t i = 0; i < stream_bytes; i += 8) {
        r0 = crc_word(r0, p + i);
        r1 = crc_word(r1, p + stream_bytes + i);
        r2 = crc_word(r2, p + 2 * stream_bytes + i);
      }
      r0 = append(append(static_cast<std::uint32_t>(r0)) ^ static_cast<std::uint32_t>(r1)) ^ static_cast<std::uint32_t>(r2);
      p += 3 * stream_bytes;
      n -= 3 * stream_bytes;
    } while (n >= 3 * stream_bytes);
  }
  for (; n >= 8; n -= 8, p += 8) r0 = crc_word(r0, p);
  auto r = static_cast<std::uint32_t>(r0);
  for (; n > 0; --n, ++p) r = _mm_crc32_u8(r, *p);
  return r;
}

inline bool hardware_available() noexcept {
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
}

#else

inline std::uint32_t hardware_update(std::uint32_t reg, const unsigned char* p, std::size_t n) { return portable_update(reg, p, n); }
inline bool hardware_available() noexcept { return false; }

#endif

}  // namespace detail::crc

/// Whether crc32c() uses the CPU's crc32 instruction (SSE4.2).
inline bool crc32c_hardware() noexcept { return detail::crc::hardware_available(); }

/// CRC32C of `bytes` bytes at `data`, continuing `crc` (the CRC32C of what
/// came before; 0 for none).
inline std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::uint32_t reg = ~crc;
  return ~(detail::crc::hardware_available() ? detail::crc::hardware_update(reg, p, bytes)
                                               : detail::crc::portable_update(reg, p, bytes));
}

/// The same with the byte-wise table only (the reference the fast path is
/// tested against, and the path of CPUs without SSE4.2).
inline std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept {
  return ~detail::crc::portable_update(~crc, static_cast<const unsigned char*>(data), bytes);
}

}  // namespace cpdispatch
