#pragma once
// Platform code of the execution layer: the cache size and non-temporal
// (streaming) stores that large host copies use.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace cpdispatch::detail {

/// Output size from which a simulation writes with non-temporal stores: the
/// size from which glibc's memcpy would stream a single copy (3/4 of the
/// last-level cache). The simulation issues one memcpy per shard, so glibc
/// never sees the total and would keep polluting the cache with output that
/// cannot stay there.
inline std::size_t streaming_threshold() {
  static const std::size_t threshold = [] {
    const long llc = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    return llc > 0 ? static_cast<std::size_t>(llc) / 4 * 3 : std::size_t{32} << 20;
  }();
  return threshold;
}

/// memcpy with streaming (cache-bypassing) stores where SSE2 exists; the
/// caller issues one store fence after the last copy.
inline void copy_streaming(std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__SSE2__)
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n & ~std::size_t{63};
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

inline void streaming_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace cpdispatch::detail
