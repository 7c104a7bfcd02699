#pragma once
// The launch grid's cap, shared by every kernel launcher (the device data
// path's and the device transports' reductions). Plain C++.

#include <cstddef>

namespace cpdispatch::cuda {

/// Cap on blocks per launch; kernels loop over the work beyond it.
inline constexpr std::size_t max_blocks = std::size_t{1} << 20;

}  // namespace cpdispatch::cuda
