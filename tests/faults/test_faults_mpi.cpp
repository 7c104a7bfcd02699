// Faults injected under MPI (run with 4 processes): the dispatcher over a
// FaultInjectingTransport<MpiTransport> with a timeout. A rank that stops
// (error, stall) leaves every rank with an exception within the timeout
// naming it; a corrupted or short payload changes exactly
// one float, unreported (MPI checks neither); a fault every rank sees before
// reaching MPI leaves the transport and the dispatcher usable. Each case runs on its own duplicate of
// MPI_COMM_WORLD, since a collective abandoned at a timeout stays pending on
// the communicator it was started on.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/mpi.hpp"
#include "fault_cases.hpp"
#include "mpi_world.hpp"
#include "overlap_cases.hpp"
#include "tp_cases.hpp"

namespace {

using namespace std::chrono_literals;
using namespace fault_cases;
using cpdispatch::MpiTransport;

constexpr auto mpi_timeout = 1000ms;  // generous: a loaded CI machine must not make a healthy step time out
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

using fault_mpi::max_over_ranks;
using fault_mpi::sum_over_ranks;
using fault_mpi::world_rank;
using fault_mpi::world_size;

Outcome dispatch_with_fault(const std::vector<FaultRule>& rules, Step step, int repeat = 1) {
  const int W = world_size();
  const auto meta = fault_cases::ring_plan(W);
  const auto data = fault_cases::step_data(meta, step);
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport t(mpi, rules, fault_options);
  cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
  Outcome o;
  for (int i = 0; i < repeat; ++i) fault_cases::run_step(d, step, data, static_cast<std::size_t>(world_rank()), o);
  return o;
}

/// One row of the fault matrix (printed by rank 0): how many ranks threw,
/// the faulty rank's (the last) time to error and the slowest of the others'.
void report_component(const std::string& component, Fault fault, const Outcome& o) {
  const long long threw = sum_over_ranks(o.threw ? 1 : 0);
  const bool faulty = world_rank() == world_size() - 1;
  const double faulty_ms = max_over_ranks(faulty ? o.ms : 0), others = max_over_ranks(faulty ? 0 : o.ms);
  if (world_rank() == 0) {
    std::printf("fault-matrix | %s | MPI (%d processes) | %s | %lld/%d ranks threw | faulty rank %.0f ms | others %.0f ms\n",
                component.c_str(), world_size(), cpdispatch::testing::fault_name(fault), threw, world_size(), faulty_ms, others);
  }
}

void report(const char* step, Fault fault, const Outcome& o) { report_component(std::string("Dispatcher::") + step, fault, o); }

class MpiFaults : public testing::TestWithParam<std::tuple<Fault, Step>> {};

// A rank that stops (error, stall) is named on every rank within the
// timeout: the faulty rank's peers time out, and the ranks that exchange no
// bytes with it learn of it from the outcome agreement after the exchange.
TEST_P(MpiFaults, NoRankHangsOrReturnsWrongData) {
  const auto [fault, step] = GetParam();
  const int faulty = world_size() - 1;
  const Outcome o = dispatch_with_fault({FaultRule{TransportCall::all_to_all_v, 1, fault, faulty}}, step);
  report(fault_cases::step_name(step), fault, o);
  EXPECT_TRUE(o.input_unchanged);
  const long long wrong = sum_over_ranks(static_cast<long long>(o.wrong_floats));
  if (fault == Fault::corrupt || fault == Fault::short_delivery) {
    // MPI_Alltoallv checks neither payloads nor that the counts agree: exactly
    // the float hit (corrupt) or withheld (4 bytes short) is wrong, silently.
    EXPECT_FALSE(o.threw) << o.what;
    EXPECT_EQ(wrong, 1);
    return;
  }
  if (world_rank() == faulty) {
    EXPECT_TRUE(o.threw);
    if (fault == Fault::error) {
      EXPECT_EQ(o.code, 77);
    }
    if (fault == Fault::stall) {
      EXPECT_TRUE(o.timeout) << o.what;
    }
  }
  if (o.threw) {
    EXPECT_TRUE(o.backend) << o.what;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(sum_over_ranks(o.threw ? 1 : 0), world_size());
  if (world_rank() != faulty) {
    EXPECT_TRUE(o.timeout) << o.what;
    EXPECT_THAT(o.what, testing::HasSubstr("rank(s) " + std::to_string(faulty) + " reported no outcome in time"));
  }
}

// Without the agreement, a rank whose exchange never involves the faulty
// rank completes its all-to-all with right output; only the faulty rank's
// peers (it sends to ranks faulty+1 and faulty+2) time out.
TEST(MpiFaultsWithoutAgreement, OnlyTheFaultyRanksPeersThrow) {
  const int W = world_size();
  const int faulty = W - 1;
  const auto meta = fault_cases::ring_plan(W);
  const auto data = fault_cases::step_data(meta, Step::forward);
  // Point-to-point, so that a rank waits only for the ranks that send it bytes.
  MpiTransport mpi = MpiTransport::duplicate(
      MPI_COMM_WORLD, {.all_to_all = cpdispatch::MpiAllToAll::point_to_point, .timeout = mpi_timeout, .agree = false});
  FaultInjectingTransport t(mpi, {FaultRule{TransportCall::all_to_all_v, 1, Fault::error, faulty}}, fault_options);
  cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
  Outcome o;
  fault_cases::run_step(d, Step::forward, data, static_cast<std::size_t>(world_rank()), o);
  EXPECT_EQ(sum_over_ranks(static_cast<long long>(o.wrong_floats)), 0);
  const long long threw = sum_over_ranks(o.threw ? 1 : 0);
  EXPECT_GE(threw, 2);
  if (W >= 4) {
    EXPECT_LT(threw, W);
  }
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiFaults,
                         testing::Combine(testing::Values(Fault::error, Fault::stall, Fault::short_delivery, Fault::corrupt),
                                          testing::Values(Step::forward, Step::reverse, Step::reverse_combine)),
                         [](const testing::TestParamInfo<std::tuple<Fault, Step>>& info) {
                           return std::string(cpdispatch::testing::fault_name(std::get<0>(info.param))) + "_" +
                                  fault_cases::step_name(std::get<1>(info.param));
                         });

TEST(MpiFaultsReuse, DispatcherWorksAgainAfterATransientFault) {
  const int W = world_size();
  const auto meta = fault_cases::ring_plan(W);
  const auto data = fault_cases::step_data(meta, Step::forward);
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport t(mpi, {FaultRule{TransportCall::all_to_all_v, 1, Fault::error, -1}}, fault_options);
  cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
  Outcome first, again;
  fault_cases::run_step(d, Step::forward, data, static_cast<std::size_t>(world_rank()), first);
  fault_cases::run_step(d, Step::forward, data, static_cast<std::size_t>(world_rank()), again);
  EXPECT_TRUE(first.threw);
  EXPECT_FALSE(again.threw) << again.what;
  EXPECT_EQ(again.wrong_floats, 0u);
}

// ---- the tensor-parallel layer and the overlap --------------------------------

template <class F>
Outcome component_with_fault(const FaultRule& rule, F&& body) {
  MpiTransport mpi = MpiTransport::duplicate(MPI_COMM_WORLD, {.timeout = mpi_timeout});
  FaultInjectingTransport t(mpi, {rule}, fault_options);
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  try {
    body(t);
  } catch (...) {
    fault_cases::record_exception(o, start);
  }
  return o;
}

class MpiLayerFaults : public testing::TestWithParam<Fault> {};

// The row-parallel layer's all-reduce needs every rank: all of them time out.
TEST_P(MpiLayerFaults, RowParallelLinearFaultSurfacesOnEveryRank) {
  const Fault fault = GetParam();
  const Outcome o = component_with_fault(FaultRule{TransportCall::all_reduce, 1, fault, world_size() - 1},
                                         [](auto& t) { tp_cases::row_layer_matches_unsharded<float>(t); });
  report_component("RowParallelLinear", fault, o);
  EXPECT_TRUE(o.threw);
  EXPECT_TRUE(o.backend) << o.what;
}

// The ring exchange waits on its neighbour each step: the stop travels round the ring.
// The faulty rank's own receive, posted before its send failed, is left
// pending in MPI; under AddressSanitizer this case caught it landing in the
// freed overlap buffer later, until MpiTransport cancelled such requests.
TEST_P(MpiLayerFaults, OverlapRingExchangeFaultSurfacesOnEveryRank) {
  const Fault fault = GetParam();
  const overlap_cases::Case c{cpdispatch::overlap::CommOverlapType::AG, cpdispatch::overlap::CommOverlapMethod::RING_EXCHANGE,
                              cpdispatch::gemm::Transpose::no, cpdispatch::gemm::Transpose::no, 1,
                              cpdispatch::overlap::HelperThread::gemm};  // MPI stays on the main thread
  const Outcome o = component_with_fault(FaultRule{TransportCall::isend, 1, fault, world_size() - 1}, [&](auto& t) {
    cpdispatch::gemm::ReferenceGemm gemm;
    const auto buffer = overlap_cases::buffer_for<float>(c, t.world_size());
    overlap_cases::run_case<float>(t, gemm, c, buffer.get(), 0);
  });
  report_component("comm_gemm AG RING_EXCHANGE", fault, o);
  EXPECT_TRUE(o.threw);
  EXPECT_TRUE(o.backend) << o.what;
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiLayerFaults, testing::Values(Fault::error, Fault::stall),
                         [](const testing::TestParamInfo<Fault>& info) { return cpdispatch::testing::fault_name(info.param); });

}  // namespace
