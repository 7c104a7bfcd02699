// A rank that dies mid-step under MPI: every rank builds its dispatcher over
// an MpiTransport with a timeout, then rank `victim` (argv[1], default 2)
// exits without a word just before the forward exchange. The survivors must
// not hang: each either gets an exception from the dispatcher within the
// timeout and aborts the job (MPI_Abort), or is ended by the launcher when it
// sees the dead process. tests/faults/check_rank_death.cmake runs this under
// mpiexec and checks that the job ends, with an error, in bounded time.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/mpi.hpp"
#include "fault_cases.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int victim = argc > 1 ? std::atoi(argv[1]) : 2;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto meta = fault_cases::ring_plan(size);
  const auto data = fault_cases::step_data(meta, fault_cases::Step::forward);
  cpdispatch::MpiTransport t = cpdispatch::MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = std::chrono::milliseconds(2000)});
  cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == victim) {
    std::printf("rank %d exits mid-step\n", rank);
    std::fflush(stdout);
    std::_Exit(3);
  }
  fault_cases::Outcome o;
  fault_cases::run_step(d, fault_cases::Step::forward, data, static_cast<std::size_t>(rank), o);
  if (o.threw) {
    std::printf("rank %d: exception after %.0f ms: %s\n", rank, o.ms, o.what.c_str());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  // A rank whose exchange never involves the victim completes: its output must be right.
  std::printf("rank %d: forward returned (it exchanges nothing with rank %d), output %s\n", rank, victim,
              o.wrong_floats == 0 ? "right" : "WRONG");
  MPI_Finalize();
  return 0;
}
