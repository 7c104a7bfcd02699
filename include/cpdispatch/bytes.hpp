#pragma once
// Byte spans: how host buffers are handed to planning-free execution code
// (the dispatcher, the simulation, the transports).

#include <cstddef>
#include <span>

namespace cpdispatch {

using ConstBytes = std::span<const std::byte>;
using MutableBytes = std::span<std::byte>;

}  // namespace cpdispatch
