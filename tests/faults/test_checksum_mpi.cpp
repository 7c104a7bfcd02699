// ChecksummedTransport under MPI (run with 4 processes): the corrupted and
// short payloads that MPI_Alltoallv delivers silently are caught. The rank
// that received the bad segment finds it; with agreement (the default)
// every rank throws corruption_error naming the source and the receiving
// rank; without, only the receiver throws and every other rank completes
// with right output. A healthy step is unchanged. A corrupted all-gather
// block or broadcast is an error on every rank too. Each case runs on its own
// duplicate of MPI_COMM_WORLD.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/adapters/checksummed.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/mpi.hpp"
#include "fault_cases.hpp"
#include "mpi_world.hpp"

namespace {

using namespace std::chrono_literals;
using namespace fault_cases;
using cpdispatch::ChecksummedTransport;
using cpdispatch::MpiTransport;
using fault_mpi::max_over_ranks;
using fault_mpi::sum_over_ranks;
using fault_mpi::world_rank;
using fault_mpi::world_size;
using testing::HasSubstr;

constexpr auto mpi_timeout = 1000ms;
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

struct Checked {
  Outcome outcome;
  int source = -1;  // the corruption_error's source rank, -1 when none
  bool detecting = false;  // this rank found the bad checksum
};

Checked checked_step(const std::vector<FaultRule>& rules, Step step, cpdispatch::ChecksumOptions options = {}) {
  const auto meta = ring_plan(world_size());
  const auto data = step_data(meta, step);
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport faulty(mpi, rules, fault_options);
  ChecksummedTransport t(faulty, options);
  cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, token_bytes);
  Checked c;
  // run_step keeps only the message; the source rank comes from a second look at it.
  run_step(d, step, data, static_cast<std::size_t>(world_rank()), c.outcome);
  if (const auto at = c.outcome.what.find("from rank "); at != std::string::npos) c.source = std::stoi(c.outcome.what.substr(at + 10));
  c.detecting = c.outcome.what.find("fails its CRC32C check") != std::string::npos;
  return c;
}

using Param = std::tuple<Fault, Step>;
class MpiChecksum : public testing::TestWithParam<Param> {};

TEST_P(MpiChecksum, BadSegmentIsAnErrorOnEveryRankNamingTheSource) {
  const auto [fault, step] = GetParam();
  const int faulty = world_size() - 1;
  const Checked c = checked_step({FaultRule{TransportCall::all_to_all_v, 1, fault, faulty}}, step);
  const long long detecting = sum_over_ranks(c.detecting ? 1 : 0), threw = sum_over_ranks(c.outcome.threw ? 1 : 0);
  const double detect_ms = max_over_ranks(c.detecting ? c.outcome.ms : 0), others_ms = max_over_ranks(c.detecting ? 0 : c.outcome.ms);
  if (world_rank() == 0) {
    std::printf("fault-matrix | Dispatcher::%s + ChecksummedTransport | MPI (%d processes) | %s | %lld/%d ranks threw | detecting rank %.0f ms | others %.0f ms\n",
                step_name(step), world_size(), cpdispatch::testing::fault_name(fault), threw, world_size(), detect_ms, others_ms);
  }
  EXPECT_EQ(detecting, 1);
  EXPECT_EQ(threw, world_size());
  EXPECT_TRUE(c.outcome.input_unchanged);
  EXPECT_EQ(c.source, faulty) << c.outcome.what;
  EXPECT_THAT(c.outcome.what, HasSubstr("corrupted or short"));
  if (!c.detecting) {
    EXPECT_THAT(c.outcome.what, HasSubstr("reported by rank"));
  }
}

TEST_P(MpiChecksum, WithoutAgreementOnlyTheReceiverThrows) {
  const auto [fault, step] = GetParam();
  const int faulty = world_size() - 1;
  const Checked c = checked_step({FaultRule{TransportCall::all_to_all_v, 1, fault, faulty}}, step, {.agree = false});
  EXPECT_EQ(sum_over_ranks(c.detecting ? 1 : 0), 1);
  EXPECT_EQ(sum_over_ranks(c.outcome.threw ? 1 : 0), 1);
  if (c.detecting) {
    EXPECT_EQ(c.source, faulty);
  } else {
    EXPECT_FALSE(c.outcome.threw) << c.outcome.what;
    EXPECT_EQ(c.outcome.wrong_floats, 0u);
  }
}

TEST_P(MpiChecksum, HealthyStepIsUnchanged) {
  const auto [fault, step] = GetParam();
  if (fault != Fault::corrupt) GTEST_SKIP() << "one healthy run per step";
  const Checked c = checked_step({}, step);
  EXPECT_FALSE(c.outcome.threw) << c.outcome.what;
  EXPECT_EQ(c.outcome.wrong_floats, 0u);
}

// Point-to-point: each rank sends 64 bytes to the next rank; the last
// rank's message is corrupted or cut short under the checksums, and the
// rank that receives it (rank 0) names it in the irecv's wait.
class MpiChecksumPointToPoint : public testing::TestWithParam<Fault> {};

TEST_P(MpiChecksumPointToPoint, BadMessageIsAnErrorOnItsReceiverNamingTheSource) {
  const int W = world_size(), me = world_rank(), faulty = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport faulty_t(mpi, {FaultRule{TransportCall::isend, 1, GetParam(), faulty}}, fault_options);
  ChecksummedTransport t(faulty_t);
  std::vector<unsigned char> send(64, static_cast<unsigned char>(me + 1)), recv(64, 0);
  std::string what;
  int source = -1;
  try {
    const cpdispatch::Request in = t.irecv(recv.data(), recv.size(), (me + W - 1) % W, 9);
    const cpdispatch::Request out = t.isend(send.data(), send.size(), (me + 1) % W, 9);
    t.wait(out);
    t.wait(in);
  } catch (const cpdispatch::corruption_error& e) {
    what = e.what();
    source = e.source_rank();
  }
  EXPECT_EQ(source, me == 0 ? faulty : -1) << what;
  if (me == 0) {
    EXPECT_THAT(what, HasSubstr("rank 0 of " + std::to_string(W) + ": the message from rank " + std::to_string(faulty) + " (tag 9, 64 bytes)"));
  } else {
    EXPECT_EQ(recv, std::vector<unsigned char>(64, static_cast<unsigned char>((me + W - 1) % W + 1)));
    EXPECT_EQ(t.checked_segments(), 1u);
  }
}

// Collectives: the last rank's all-gather block, or its broadcast as the
// root, is corrupted under the checksums: every rank throws naming it.
TEST(MpiChecksumCollectives, CorruptedAllGatherBlockAndBroadcastAreErrorsOnEveryRank) {
  const int W = world_size(), me = world_rank(), faulty = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  for (const bool broadcast : {false, true}) {
    MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
    const TransportCall call = broadcast ? TransportCall::broadcast : TransportCall::all_gather;
    FaultInjectingTransport faulty_t(mpi, {FaultRule{call, 1, Fault::corrupt, faulty}}, fault_options);
    ChecksummedTransport t(faulty_t);
    std::vector<float> mine(16, static_cast<float>(me + 1)), all(16 * static_cast<std::size_t>(W));
    int source = -1;
    std::string what;
    try {
      if (broadcast) {
        t.broadcast(mine.data(), mine.size() * sizeof(float), faulty);
      } else {
        t.all_gather(mine.data(), all.data(), mine.size(), cpdispatch::ElementType::float32);
      }
    } catch (const cpdispatch::corruption_error& e) {
      source = e.source_rank();
      what = e.what();
    }
    EXPECT_EQ(source, faulty) << (broadcast ? "broadcast: " : "all_gather: ") << what;
    EXPECT_EQ(sum_over_ranks(source == faulty ? 1 : 0), W);
  }
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiChecksumPointToPoint, testing::Values(Fault::corrupt, Fault::short_delivery),
                         [](const testing::TestParamInfo<Fault>& info) { return std::string(cpdispatch::testing::fault_name(info.param)); });

INSTANTIATE_TEST_SUITE_P(Mpi, MpiChecksum,
                         testing::Combine(testing::Values(Fault::corrupt, Fault::short_delivery),
                                          testing::Values(Step::forward, Step::reverse, Step::reverse_combine)),
                         [](const testing::TestParamInfo<Param>& info) {
                           return std::string(cpdispatch::testing::fault_name(std::get<0>(info.param))) + "_" + step_name(std::get<1>(info.param));
                         });

}  // namespace
