#pragma once
// The topology of an MPI communicator (docs/node-exchange.md): ranks that
// share memory (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED) are one node.
//
//   const Topology topology = mpi_topology(transport.comm());   // collective
//
// Every rank of the communicator calls it and gets the same topology: each
// rank's node key is the smallest rank of its shared-memory group, gathered
// to all; nodes are numbered by their first rank.

#include "cpdispatch/transports/detail/mpi_c_api.hpp"

#include <cstdint>
#include <vector>

#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/transports/mpi.hpp"

namespace cpdispatch {

inline Topology mpi_topology(MPI_Comm comm) {
  int rank = 0, size = 0;
  const auto where = [] { return "in mpi_topology"; };
  detail::mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", where);
  detail::mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size", where);
  MPI_Comm shared = MPI_COMM_NULL;
  detail::mpi_check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared), "MPI_Comm_split_type", where);
  long long key = rank;  // the smallest rank of this node
  const int reduced = MPI_Allreduce(MPI_IN_PLACE, &key, 1, MPI_LONG_LONG, MPI_MIN, shared);
  MPI_Comm_free(&shared);
  detail::mpi_check(reduced, "MPI_Allreduce", where);
  std::vector<long long> keys(static_cast<std::size_t>(size));
  detail::mpi_check(MPI_Allgather(&key, 1, MPI_LONG_LONG, keys.data(), 1, MPI_LONG_LONG, comm), "MPI_Allgather", where);
  return Topology::from_node_keys(std::vector<std::int64_t>(keys.begin(), keys.end()));
}

}  // namespace cpdispatch
