// The tensor-parallel layers, wrapper and utilities on the MPI transport,
// one rank per process (run under mpiexec -n 1..4; label mpi).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "cpdispatch/transports/mpi.hpp"
#include "tp_cases.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::MpiTransport;
using cpdispatch::MpiTransportOptions;
using namespace std::chrono_literals;

namespace {

MpiTransport world_transport() {
  MpiTransportOptions options;
  options.timeout = 60s;  // a hang fails the test instead of blocking the run
  return MpiTransport::duplicate(MPI_COMM_WORLD, options);
}

}  // namespace

TEST(TpMpi, RowParallelLinearMatchesUnsharded) {
  MpiTransport t = world_transport();
  tp_cases::row_layer_matches_unsharded<float>(t);
  tp_cases::row_layer_matches_unsharded<double>(t);
}

TEST(TpMpi, ColumnParallelLinearMatchesUnsharded) {
  MpiTransport t = world_transport();
  tp_cases::column_layer_matches_unsharded<float>(t);
  tp_cases::column_layer_matches_unsharded<double>(t);
}

TEST(TpMpi, WrapperMatchesUnsharded) {
  MpiTransport t = world_transport();
  for (const char* name : {"mlp2", "mlp4", "odd3", "back_to_back"}) {
    tp_cases::wrapper_matches_unsharded<float>(t, name);
    tp_cases::wrapper_matches_unsharded<double>(t, name);
  }
}

TEST(TpMpi, TrainingMatchesUnsharded) {
  MpiTransport t = world_transport();
  tp_cases::training_matches_unsharded<float>(t);
}

TEST(TpMpi, Divisibility) {
  MpiTransport t = world_transport();
  tp_cases::divisibility(t);
}

TEST(TpMpi, WorldSizeMustMatchAcrossAllRanks) {
  MpiTransport t = world_transport();
  if (t.world_size() == 1) GTEST_SKIP() << "needs two ranks to disagree";
  tp_cases::world_size_mismatch(t);
}

TEST(TpMpi, Utilities) {
  MpiTransport t = world_transport();
  tp_cases::utilities(t, tp::Backend::mpi);
}

TEST(TpMpi, ColumnForwardRaisesAllReduceTimeoutWhenARankNeverJoins) {
  MpiTransport t = world_transport();
  MpiTransport side(MPI_COMM_WORLD);  // t breaks on the ranks that time out
  const int W = t.world_size();
  if (W < 2) GTEST_SKIP() << "needs a second rank to be late";
  tp_cases::HostGemm gemm;
  tp::ColumnParallelLinear layer(t, gemm, 4 * static_cast<std::size_t>(W), 3);
  std::vector<float> x(2 * 4, 1.0f), y(2 * 3);
  if (t.rank() != W - 1) {
    t.set_timeout(200ms);
    try {
      layer.forward(x.data(), 2, y.data());
      FAIL() << "no timeout";
    } catch (const cpdispatch::timeout_error& e) {
      EXPECT_EQ(std::string(e.what()), "All-reduce timeout on rank " + std::to_string(t.rank()) +
                                           " in all_reduce(6 float32 elements): not complete after 200 ms "
                                           "(MpiTransportOptions::timeout)");
    }
    EXPECT_TRUE(t.broken());  // the abandoned all-reduce may still write: no more calls on t
    EXPECT_THROW(layer.forward(x.data(), 2, y.data()), cpdispatch::timeout_error);
  } else {
    // The last rank joins only after the others gave up, so that MPI can
    // complete (and release) their abandoned all-reduce before the next test.
    std::this_thread::sleep_for(1s);
    layer.forward(x.data(), 2, y.data());
  }
  side.barrier();
}
