// Faults injected under the deduplicated KV exchange (KvWireDispatcher) over
// MPI (run with 4 processes), the transport with a timeout. A rank that
// stops (error, stall) throws, having written nothing into its outputs;
// every other rank throws within the timeout, naming it; nobody hangs. A corrupted or short payload goes unreported (MPI checks
// neither): the forward's reaches only the copies of the shard it hit, the
// backward's exactly one gradient value. A fault every rank sees before
// reaching MPI leaves the dispatcher usable. Each case runs on its own
// duplicate of MPI_COMM_WORLD (a collective abandoned at a timeout stays
// pending on the communicator it was started on).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/mpi.hpp"
#include "dedup_fault_cases.hpp"
#include "mpi_world.hpp"

namespace {

using namespace std::chrono_literals;
using cpdispatch::MpiTransport;
using cpdispatch::testing::FaultInjectingTransport;
using cpdispatch::testing::FaultOptions;
using cpdispatch::testing::FaultRule;
using dedup_fault_cases::DedupOutcome;
using dedup_fault_cases::Step;
using fault_cases::Fault;
using fault_cases::TransportCall;

constexpr auto mpi_timeout = 1000ms;  // generous: a loaded CI machine must not make a healthy step time out
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

using fault_mpi::max_over_ranks;
using fault_mpi::sum_over_ranks;
using fault_mpi::world_rank;
using fault_mpi::world_size;

/// `repeat` steps of a KvWireDispatcher over this rank's fault injector; the outcome of the last.
DedupOutcome step_with_fault(const std::vector<FaultRule>& rules, Step step, int repeat = 1) {
  const auto plan = dedup_fault_cases::shared_plan(world_size());
  const auto data = dedup_fault_cases::step_data(plan, step);
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport t(mpi, rules, fault_options);
  cpdispatch::KvWireDispatcher d(t, plan.wire, fault_cases::token_bytes);
  DedupOutcome o;
  for (int i = 0; i < repeat; ++i) {
    o = DedupOutcome{};
    dedup_fault_cases::run_step(d, step, data, static_cast<std::size_t>(world_rank()), o);
  }
  return o;
}

/// One row of the fault matrix (printed by rank 0).
void report(Step step, Fault fault, const DedupOutcome& o) {
  const long long threw = sum_over_ranks(o.threw ? 1 : 0);
  const bool faulty = world_rank() == world_size() - 1;
  const double faulty_ms = max_over_ranks(faulty ? o.ms : 0), others = max_over_ranks(faulty ? 0 : o.ms);
  if (world_rank() == 0) {
    std::printf("fault-matrix | KvWireDispatcher::%s | MPI (%d processes) | %s | %lld/%d ranks threw | faulty rank %.0f ms | others %.0f ms\n",
                dedup_fault_cases::step_name(step), world_size(), cpdispatch::testing::fault_name(fault), threw, world_size(), faulty_ms,
                others);
  }
}

class MpiDedupFaults : public testing::TestWithParam<std::tuple<Fault, Step>> {};

TEST_P(MpiDedupFaults, NoRankHangsOrReturnsWrongDataUnnoticed) {
  const auto [fault, step] = GetParam();
  const int faulty = world_size() - 1;
  const DedupOutcome o = step_with_fault({FaultRule{TransportCall::all_to_all_v, 1, fault, faulty}}, step);
  report(step, fault, o);
  EXPECT_TRUE(o.input_unchanged);
  const long long wrong = sum_over_ranks(static_cast<long long>(o.wrong_floats));
  if (fault == Fault::corrupt || fault == Fault::short_delivery) {
    EXPECT_FALSE(o.threw) << o.what;
    if (step == Step::forward) {
      EXPECT_GE(wrong, 1);
      EXPECT_LE(wrong, static_cast<long long>(dedup_fault_cases::most_copies(dedup_fault_cases::shared_plan(world_size()))));
    } else {
      EXPECT_EQ(wrong, 1);
    }
    return;
  }
  if (world_rank() == faulty) {
    EXPECT_TRUE(o.threw);
    EXPECT_TRUE(o.outputs_untouched) << "the faulty rank failed before its exchange but wrote into its outputs";
    if (fault == Fault::error) {
      EXPECT_EQ(o.code, 77);
      EXPECT_THAT(o.what, testing::HasSubstr(std::string("KvWireDispatcher::") + dedup_fault_cases::step_name(step)));
    }
    if (fault == Fault::stall) {
      EXPECT_TRUE(o.timeout) << o.what;
    }
  }
  if (o.threw) {
    EXPECT_TRUE(o.backend) << o.what;
  }
  EXPECT_EQ(wrong, 0);
  // The faulty rank's wire peers time out; the others learn of it from the transport's outcome agreement.
  EXPECT_EQ(sum_over_ranks(o.threw ? 1 : 0), world_size());
  if (world_rank() != faulty) {
    EXPECT_THAT(o.what, testing::HasSubstr("rank(s) " + std::to_string(faulty) + " reported no outcome in time"));
  }
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiDedupFaults,
                         testing::Combine(testing::Values(Fault::error, Fault::stall, Fault::short_delivery, Fault::corrupt),
                                          testing::Values(Step::forward, Step::reverse_combine, Step::reverse_combine_in_place)),
                         [](const testing::TestParamInfo<std::tuple<Fault, Step>>& info) {
                           return std::string(cpdispatch::testing::fault_name(std::get<0>(info.param))) + "_" +
                                  dedup_fault_cases::step_name(std::get<1>(info.param));
                         });

TEST(MpiDedupFaultsReuse, DispatcherWorksAgainAfterATransientFault) {
  for (Step step : {Step::forward, Step::reverse_combine, Step::reverse_combine_in_place}) {
    SCOPED_TRACE(dedup_fault_cases::step_name(step));
    const DedupOutcome again = step_with_fault({FaultRule{TransportCall::all_to_all_v, 1, Fault::error, -1}}, step, 2);
    EXPECT_FALSE(again.threw) << again.what;
    EXPECT_EQ(again.wrong_floats, 0u);
  }
}

}  // namespace
