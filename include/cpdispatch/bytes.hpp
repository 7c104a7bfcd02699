#pragma once
// Byte spans: how host buffers are handed to planning-free execution code
// (the dispatcher, the simulation, the transports).

#include <cstddef>
#include <functional>
#include <span>

namespace cpdispatch {

using ConstBytes = std::span<const std::byte>;
using MutableBytes = std::span<std::byte>;

namespace detail {

/// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte. Empty or null
/// regions share nothing. Compared with std::less, which orders any two
/// pointers (the buffers usually belong to different allocations).
inline bool regions_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  if (a_bytes == 0 || b_bytes == 0 || a == nullptr || b == nullptr) return false;
  const auto* x = static_cast<const std::byte*>(a);
  const auto* y = static_cast<const std::byte*>(b);
  const std::less<const std::byte*> before;
  return before(x, y + b_bytes) && before(y, x + a_bytes);
}

}  // namespace detail

}  // namespace cpdispatch
