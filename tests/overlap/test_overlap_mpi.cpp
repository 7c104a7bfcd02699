// The overlapped GEMM on the MPI transport, one rank per process (run under
// mpiexec -n 1..4; label mpi). With the default HelperThread::communication
// the MPI calls come from the helper thread, which needs
// MPI_THREAD_SERIALIZED: the tests ask Open MPI for it through
// OMPI_MPI_THREAD_LEVEL=2 (tests/overlap/CMakeLists.txt), since the shared MPI
// test main calls plain MPI_Init. HelperThread::gemm keeps MPI on the main
// thread (MPI_THREAD_FUNNELED) and runs whatever level MPI gave.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>

#include "cpdispatch/transports/mpi.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"
#include "overlap_cases.hpp"

namespace ov = cpdispatch::overlap;
using cpdispatch::MpiTransport;
using cpdispatch::MpiTransportOptions;
using namespace std::chrono_literals;

namespace {

MpiTransport world_transport() {
  MpiTransportOptions options;
  options.timeout = 60s;  // a hang fails the test instead of blocking the run
  return MpiTransport::duplicate(MPI_COMM_WORLD, options);
}

int thread_level() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided;
}

}  // namespace

TEST(OverlapMpi, MpiGivesTheSerializedThreadLevelTheTestsAskFor) {
#ifdef OPEN_MPI
  EXPECT_GE(thread_level(), MPI_THREAD_SERIALIZED)
      << "OMPI_MPI_THREAD_LEVEL=2 did not reach MPI_Init (ctest sets it; set it by hand when running the program alone)";
#else
  GTEST_SKIP() << "OMPI_MPI_THREAD_LEVEL is Open MPI's; this MPI gave thread level " << thread_level();
#endif
}

TEST(OverlapMpi, EveryMethodMatchesTheUnoverlappedReferenceGemmOnHelper) {
  MpiTransport t = world_transport();
  overlap_cases::all_checks(t, ov::HelperThread::gemm);
}

TEST(OverlapMpi, EveryMethodMatchesTheUnoverlappedReferenceCommunicationOnHelper) {
  if (thread_level() < MPI_THREAD_SERIALIZED) {
    GTEST_SKIP() << "MPI provides thread level " << thread_level()
                 << "; transport calls on the helper thread need MPI_THREAD_SERIALIZED";
  }
  MpiTransport t = world_transport();
  overlap_cases::all_checks(t, ov::HelperThread::communication);
}

TEST(OverlapMpi, IndivisibleShapesAreRejected) {
  MpiTransport t = world_transport();
  cpdispatch::gemm::ReferenceGemm gemm;
  overlap_cases::indivisible_shapes_are_rejected(t, gemm);
}

TEST(OverlapMpi, OverTheSimulatedLinkTheResultsAreTheSame) {
  // The adapter wraps any transport; its timestamps are CLOCK_MONOTONIC, shared by the processes of one host.
  MpiTransport mpi = world_transport();
  cpdispatch::SimulatedLinkTransport link(mpi, cpdispatch::LinkModel{std::chrono::microseconds(20), 1e10});
  cpdispatch::gemm::ReferenceGemm gemm;
  overlap_cases::every_case_matches_reference<float>(link, gemm, ov::HelperThread::gemm);
}
