#pragma once
// MPI_COMM_WORLD queries shared by the MPI fault suites. No fault case breaks
// MPI_COMM_WORLD, so these work after any injected failure.

#include <mpi.h>

namespace fault_mpi {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

/// The sum over ranks of `v`.
inline long long sum_over_ranks(long long v) {
  long long s = 0;
  MPI_Allreduce(&v, &s, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return s;
}

/// The largest `v` over ranks.
inline double max_over_ranks(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

}  // namespace fault_mpi
