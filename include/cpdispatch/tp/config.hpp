#pragma once
// The configuration utilities of the Python tensor-parallel module the layers
// follow (tp/linear.hpp): init_tensor_parallel(backend) and
// get_tensor_parallel_config().
//
// A rank's configuration (world size, rank, backend) comes from its transport
// and is recorded per THREAD (a thread_local, the one piece of hidden state
// here): simulated ranks are threads of one process, an MPI rank is a
// process, and both read their own configuration back with
// get_tensor_parallel_config(). Nothing else reads it: the layers take their
// transport explicitly, so the record is for the caller's convenience only.
//
//   cpdispatch::SimWorld world(4);                 // sim: inside each rank's function
//   world.run([](cpdispatch::SimTransport& t) {
//     auto config = tp::init_tensor_parallel("sim", t);
//   });
//   cpdispatch::MpiTransport t(MPI_COMM_WORLD);    // mpi: after MPI_Init
//   auto config = tp::init_tensor_parallel("mpi", t);
//
// "sim" and "mpi" take a host transport, "nccl" a device one
// (cpdispatch::NcclTransport, target cpdispatch::nccl).

#include <optional>
#include <string>
#include <string_view>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::tp {

enum class Backend { sim, mpi, nccl };

constexpr const char* backend_name(Backend b) noexcept {
  switch (b) {
    case Backend::sim: return "sim";
    case Backend::mpi: return "mpi";
    case Backend::nccl: return "nccl";
  }
  return "?";
}

/// "sim", "mpi" or "nccl".
inline Backend parse_backend(std::string_view name) {
  if (name == "sim") return Backend::sim;
  if (name == "mpi") return Backend::mpi;
  if (name == "nccl") return Backend::nccl;
  cpdispatch::detail::fail("init_tensor_parallel: unknown backend \"", name, "\"; expected \"sim\", \"mpi\" or \"nccl\"");
}

/// The Python module's config: what a rank knows about the tensor-parallel group.
struct TensorParallelConfig {
  int world_size = 1;
  int rank = 0;
  Backend backend = Backend::sim;
  friend bool operator==(const TensorParallelConfig&, const TensorParallelConfig&) = default;
};

namespace detail {

inline std::optional<TensorParallelConfig>& thread_config() {
  thread_local std::optional<TensorParallelConfig> config;
  return config;
}

/// The memory space a backend's transports work on.
constexpr MemorySpace memory_space_of(Backend b) noexcept { return b == Backend::nccl ? MemorySpace::device : MemorySpace::host; }

}  // namespace detail

/// Records and returns the calling thread's configuration, taken from its
/// transport. The backend must fit the transport's memory space (sim and mpi
/// are host transports, nccl a device one).
template <class Tr>
TensorParallelConfig init_tensor_parallel(Backend backend, const Tr& transport) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  if (Tr::memory_space != detail::memory_space_of(backend)) {
    const bool host = detail::memory_space_of(backend) == MemorySpace::host;
    cpdispatch::detail::fail("init_tensor_parallel(\"", backend_name(backend), "\"): this backend runs on ",
                             host ? "host" : "device", " memory but the transport works on ", host ? "device" : "host", " memory");
  }
  const TensorParallelConfig config{transport.world_size(), transport.rank(), backend};
  if (config.world_size < 1 || config.rank < 0 || config.rank >= config.world_size) {
    cpdispatch::detail::fail("init_tensor_parallel: the transport reports rank ", config.rank, " of ",
                             config.world_size, " ranks");
  }
  detail::thread_config() = config;
  return config;
}

template <class Tr>
TensorParallelConfig init_tensor_parallel(std::string_view backend, const Tr& transport) {
  return init_tensor_parallel(parse_backend(backend), transport);
}

/// The Python module's one-argument form. A rank's transport is the caller's (a
/// SimTransport from SimWorld::run, an MpiTransport or NcclTransport over a
/// communicator), so every backend asks for it.
inline TensorParallelConfig init_tensor_parallel(std::string_view backend) {
  (void)parse_backend(backend);  // an unknown name is reported as such
  cpdispatch::detail::fail("init_tensor_parallel(\"", backend, "\"): pass this rank's transport too: ",
                           "init_tensor_parallel(\"", backend, "\", transport)");
}

/// The configuration init_tensor_parallel recorded on this thread.
inline const TensorParallelConfig& get_tensor_parallel_config() {
  const auto& config = detail::thread_config();
  if (!config) {
    cpdispatch::detail::fail("get_tensor_parallel_config: init_tensor_parallel has not been called on this thread");
  }
  return *config;
}

/// Forgets this thread's configuration (tests, re-initialisation).
inline void reset_tensor_parallel_config() noexcept { detail::thread_config().reset(); }

}  // namespace cpdispatch::tp
