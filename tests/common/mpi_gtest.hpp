#pragma once
// GoogleTest under mpiexec: every rank runs the same tests, and every rank
// agrees on each test's outcome. A failure on rank 3 fails that test on every
// rank; rank 0 prints it with its file, line and rank; only rank 0 prints
// GoogleTest's output; every rank exits with the same code.
//
//   #include "../common/mpi_gtest.hpp"
//   int main(int argc, char** argv) { return cpdispatch::testing::mpi_gtest_main(argc, argv); }
//
// Part of the tests, not of the installed MPI transport: tests/transports/
// mpi_main.cpp is the main() of every program cpdispatch_add_mpi_test makes
// (tests/transports/mpi_tests.cmake). Needs cpdispatch::mpi and GTest::gtest. Tests must run the same collective
// calls in the same order on every rank; a rank that returns early from a
// test while the others wait in a collective hangs the run (give the
// transport a timeout, MpiTransportOptions::timeout, to turn that into a
// failure). --gtest_shuffle uses rank 0's seed on every rank.

#include "cpdispatch/transports/detail/mpi_c_api.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

namespace cpdispatch::testing {

/// After every test, gathers each rank's failures (over a private duplicate
/// of the communicator) and records the other ranks' on this one: rank 0
/// with their location and text, the others as a one-line note.
class MpiTestListener : public ::testing::EmptyTestEventListener {
 public:
  explicit MpiTestListener(MPI_Comm comm) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  MpiTestListener(const MpiTestListener&) = delete;
  MpiTestListener& operator=(const MpiTestListener&) = delete;
  /// Must run before MPI_Finalize (mpi_gtest_main releases it from GoogleTest first).
  ~MpiTestListener() override {
    int finalized = 1;
    if (comm_ != MPI_COMM_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Comm_free(&comm_);
  }

  void OnTestStart(const ::testing::TestInfo&) override { failures_.clear(); }

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (replaying_ || !result.failed()) return;
    // One record: file NUL line NUL message NUL.
    failures_ += result.file_name() ? result.file_name() : "";
    failures_ += '\0';
    failures_ += std::to_string(result.line_number());
    failures_ += '\0';
    failures_ += result.message();
    failures_ += '\0';
  }

  // OnTestEnd listeners run in reverse order of registration: appended after
  // the printer, this one runs first, so what it adds is printed and counted.
  void OnTestEnd(const ::testing::TestInfo&) override {
    const int mine = static_cast<int>(failures_.size());
    std::vector<int> lengths(static_cast<std::size_t>(size_));
    MPI_Allgather(&mine, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm_);
    std::vector<int> displs(lengths.size());
    int total = 0;
    for (std::size_t r = 0; r < lengths.size(); ++r) {
      displs[r] = total;
      total += lengths[r];
    }
    std::string all(rank_ == 0 ? static_cast<std::size_t>(total) : 0, '\0');
    MPI_Gatherv(failures_.data(), mine, MPI_CHAR, all.data(), lengths.data(), displs.data(), MPI_CHAR, 0, comm_);

    replaying_ = true;
    std::string failed_ranks;
    for (int r = 0; r < size_; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      if (r == rank_ || lengths[ru] == 0) continue;
      failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
      if (rank_ != 0) continue;
      std::size_t pos = static_cast<std::size_t>(displs[ru]);
      const std::size_t end = pos + static_cast<std::size_t>(lengths[ru]);
      while (pos < end) {
        const std::string file = next_field(all, pos);
        const int line = std::atoi(next_field(all, pos).c_str());
        const std::string message = next_field(all, pos);
        ADD_FAILURE_AT(file.empty() ? nullptr : file.c_str(), line) << "[rank " << r << "] " << message;
      }
    }
    if (rank_ != 0 && !failed_ranks.empty()) ADD_FAILURE() << "failed on rank(s) " << failed_ranks << " (rank 0 reports them)";
    replaying_ = false;
  }

 private:
  static std::string next_field(const std::string& s, std::size_t& pos) {
    const std::size_t nul = s.find('\0', pos);
    std::string field = s.substr(pos, nul - pos);
    pos = nul == std::string::npos ? s.size() : nul + 1;
    return field;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::string failures_;
  bool replaying_ = false;
};

/// The body of an MPI test program's main(): MPI_Init (unless already
/// initialised), GoogleTest with MpiTestListener, MPI_Finalize (if it
/// initialised MPI). Returns 0 when every test passed on every rank, 1
/// otherwise, the same on every rank.
inline int mpi_gtest_main(int argc, char** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);

  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // The same test order everywhere, even with --gtest_shuffle and no seed.
  int seed = GTEST_FLAG_GET(random_seed);
  if (rank == 0 && seed == 0) seed = static_cast<int>(std::time(nullptr) % 99999) + 1;
  MPI_Bcast(&seed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  GTEST_FLAG_SET(random_seed, seed);

  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    delete listeners.Release(listeners.default_xml_generator());
  }
  auto* listener = new MpiTestListener(MPI_COMM_WORLD);
  listeners.Append(listener);  // owned by GoogleTest until released below

  int rc = RUN_ALL_TESTS() == 0 ? 0 : 1;
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);  // e.g. a failure outside any test
  delete listeners.Release(listener);  // frees its communicator while MPI is up
  if (!initialized) MPI_Finalize();
  return any;
}

}  // namespace cpdispatch::testing
