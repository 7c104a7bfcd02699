// The per-rank program (per_rank_dispatch.hpp) on the MPI transport: one
// process per rank.  mpiexec -n 4 build/bin/per_rank_mpi [--tokens 2048] ...
// The world size is mpiexec's (--world-size is for the sim build only).
// Exit status: 0 when every rank's checks pass, 1 when one fails, 2 on an error.

#include <cstdio>
#include <exception>

#include <mpi.h>

#include "cpdispatch/transports/mpi.hpp"
#include "per_rank_dispatch.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 0;
  cpdispatch_example::Options opt;
  if (!cpdispatch_example::parse_options(argc, argv, opt)) {
    status = 2;
  } else {
    try {
      cpdispatch::MpiTransport transport(MPI_COMM_WORLD);
      const auto mismatches = cpdispatch_example::run_rank(transport, opt);  // the same total on every rank
      if (transport.rank() == 0) {
        std::printf("%s: %lld mismatches over %d ranks\n", mismatches == 0 ? "PASS" : "FAIL",
                    static_cast<long long>(mismatches), transport.world_size());
      }
      status = mismatches == 0 ? 0 : 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "per_rank_mpi: %s\n", e.what());
      // Other ranks may be waiting in a collective: end them all.
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  MPI_Finalize();
  return status;
}
