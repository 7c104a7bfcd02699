#pragma once
// Where a buffer lives. Transports, GEMM backends and attention kernels each
// declare theirs (`static constexpr MemorySpace memory_space`), and the
// layers above pick the matching data path from it; a header that needs only
// this tag includes this file, not the transport concepts.

namespace cpdispatch {

/// Where a transport's, backend's or kernel's buffers live.
enum class MemorySpace { host, device };

}  // namespace cpdispatch
