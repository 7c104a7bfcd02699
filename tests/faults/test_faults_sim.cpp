// Faults injected into the in-process transport (ranks as threads, W = 2..8)
// under the Dispatcher, the tensor-parallel layers and the comm-GEMM overlap:
// every fault that stops a rank surfaces as an exception on EVERY rank (no
// hang: the sim's timeout and abort), inputs stay unchanged, a corrupted
// payload changes exactly the bytes it hit, and a dispatcher whose transport
// survived a fault works again. Time to error is printed for
// docs/reliability.md ("fault matrix").

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../common/sim_world_fixture.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "fault_cases.hpp"
#include "overlap_cases.hpp"
#include "tp_cases.hpp"

namespace {

using namespace std::chrono_literals;
using namespace fault_cases;
using cpdispatch::SimOptions;
using cpdispatch::SimPackingTransport;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using testing::HasSubstr;

constexpr auto sim_timeout = 1000ms;  // generous: a loaded CI machine must not make a healthy step time out
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

/// Prints one row of the fault matrix: how many ranks threw, the faulty
/// rank's (the last) time to error and the slowest of the others'.
void report(const char* component, const char* transport, Fault fault, int W, const std::vector<Outcome>& out) {
  double others = 0;
  int threw = 0;
  for (std::size_t r = 0; r < out.size(); ++r) {
    threw += out[r].threw;
    if (r + 1 < out.size()) others = std::max(others, out[r].ms);
  }
  std::printf("fault-matrix | %s | %s | %s | W=%d | %d/%d ranks threw | faulty rank %.0f ms | others %.0f ms\n", component,
              transport, cpdispatch::testing::fault_name(fault), W, threw, W, out.back().ms, others);
}

/// Runs `per_rank(transport, rank, outcome)` on every rank of a world of W, each over its fault injector.
template <class Wrap, class F>
std::vector<Outcome> run_world(int W, const std::vector<FaultRule>& rules, F&& per_rank) {
  SimWorld world(W, SimOptions{sim_timeout});
  std::vector<Outcome> outcomes(static_cast<std::size_t>(W));
  try {
    world.run([&](SimTransport& sim) {
      Wrap inner(sim);
      FaultInjectingTransport t(inner.get(), rules, fault_options);
      per_rank(t, static_cast<std::size_t>(sim.rank()), outcomes[static_cast<std::size_t>(sim.rank())]);
    });
  } catch (const cpdispatch::error&) {
    // A rank that returned early (it caught its fault) while others waited fails the run: expected here.
  }
  return outcomes;
}

using sim_test::Packing;
using sim_test::Pieces;

/// Every rank threw; the faulty one the injected kind.
void expect_every_rank_threw(const std::vector<Outcome>& out, int faulty, Fault fault) {
  for (std::size_t r = 0; r < out.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(out[r].threw) << "returned normally after " << out[r].ms << " ms";
    EXPECT_TRUE(out[r].input_unchanged);
  }
  const Outcome& f = out[static_cast<std::size_t>(faulty)];
  if (fault == Fault::error) {
    EXPECT_EQ(f.code, 77);
    EXPECT_THAT(f.what, HasSubstr("injected error"));
  }
  if (fault == Fault::stall) {
    EXPECT_TRUE(f.timeout) << f.what;
  }
}

// ---- the dispatcher ---------------------------------------------------------

using DispatchParam = std::tuple<int, Fault, Step, bool>;  // W, fault, step, packing path

class DispatcherFaults : public testing::TestWithParam<DispatchParam> {};

template <class Wrap>
std::vector<Outcome> dispatch_with_fault(int W, Fault fault, Step step, int faulty) {
  const auto meta = fault_cases::ring_plan(W);
  const auto data = fault_cases::step_data(meta, step);
  const TransportCall call = std::is_same_v<Wrap, Pieces> ? TransportCall::all_to_all_pieces : TransportCall::all_to_all_v;
  return run_world<Wrap>(W, {FaultRule{call, 1, fault, faulty}}, [&](auto& t, std::size_t r, Outcome& o) {
    cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
    fault_cases::run_step(d, step, data, r, o);
  });
}

TEST_P(DispatcherFaults, SurfacesOnEveryRankOrChangesOnlyTheHitBytes) {
  const auto [W, fault, step, packing] = GetParam();
  const int faulty = W - 1;
  const auto out = packing ? dispatch_with_fault<Packing>(W, fault, step, faulty) : dispatch_with_fault<Pieces>(W, fault, step, faulty);
  report((std::string("Dispatcher::") + fault_cases::step_name(step)).c_str(), packing ? "sim (all_to_all_v)" : "sim (pieces)",
         fault, W, out);
  if (fault != Fault::corrupt) return expect_every_rank_threw(out, faulty, fault);
  // No transport checksums payloads: the run completes and exactly one float somewhere is wrong.
  std::size_t wrong = 0;
  for (const Outcome& o : out) {
    EXPECT_FALSE(o.threw) << o.what;
    EXPECT_TRUE(o.input_unchanged);
    wrong += o.wrong_floats;
  }
  EXPECT_EQ(wrong, 1u);
}

INSTANTIATE_TEST_SUITE_P(Sim, DispatcherFaults,
                         testing::Combine(testing::Range(2, 9),
                                          testing::Values(Fault::error, Fault::stall, Fault::short_delivery, Fault::corrupt),
                                          testing::Values(Step::forward, Step::reverse, Step::reverse_combine),
                                          testing::Bool()),
                         [](const testing::TestParamInfo<DispatchParam>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" +
                                  cpdispatch::testing::fault_name(std::get<1>(info.param)) + "_" +
                                  fault_cases::step_name(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_packing" : "_pieces");
                         });

// A fault every rank sees before reaching the transport (a transient failure
// the transport survives): the same dispatchers then run correctly.
TEST(DispatcherFaultsReuse, DispatcherWorksAgainAfterATransientFault) {
  for (int W = 2; W <= 8; ++W) {
    const auto meta = fault_cases::ring_plan(W);
    const auto data = fault_cases::step_data(meta, Step::forward);
    const auto out = run_world<Pieces>(W, {FaultRule{TransportCall::all_to_all_pieces, 1, Fault::error, -1}},
                                       [&](auto& t, std::size_t r, Outcome& o) {
                                         cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
                                         fault_cases::run_step(d, Step::forward, data, r, o);
                                         EXPECT_TRUE(o.threw) << "rank " << r;
                                         Outcome again;
                                         fault_cases::run_step(d, Step::forward, data, r, again);
                                         EXPECT_FALSE(again.threw) << again.what;
                                         EXPECT_EQ(again.wrong_floats, 0u) << "rank " << r;
                                       });
    for (const Outcome& o : out) EXPECT_THAT(o.what, HasSubstr("injected error"));
  }
}

// ---- the tensor-parallel layers and the overlap -------------------------------

using LayerParam = std::tuple<int, Fault>;
class LayerFaults : public testing::TestWithParam<LayerParam> {};

TEST_P(LayerFaults, RowParallelLinearFaultSurfacesOnEveryRank) {
  const auto [W, fault] = GetParam();
  // The row-parallel forward's one all-reduce.
  const auto out = run_world<Pieces>(W, {FaultRule{TransportCall::all_reduce, 1, fault, W - 1}}, [&](auto& t, std::size_t, Outcome& o) {
    const auto start = std::chrono::steady_clock::now();
    try {
      tp_cases::row_layer_matches_unsharded<float>(t);
    } catch (...) {
      fault_cases::record_exception(o, start);
    }
  });
  report("RowParallelLinear", "sim", fault, W, out);
  expect_every_rank_threw(out, W - 1, fault);
}

TEST_P(LayerFaults, OverlapRingExchangeFaultSurfacesOnEveryRank) {
  const auto [W, fault] = GetParam();
  // AG RING_EXCHANGE: isend/irecv/wait per step; the fault hits rank W-1's first isend.
  const overlap_cases::Case c{cpdispatch::overlap::CommOverlapType::AG, cpdispatch::overlap::CommOverlapMethod::RING_EXCHANGE,
                              cpdispatch::gemm::Transpose::no, cpdispatch::gemm::Transpose::no};
  const auto out = run_world<Pieces>(W, {FaultRule{TransportCall::isend, 1, fault, W - 1}}, [&](auto& t, std::size_t, Outcome& o) {
    const auto start = std::chrono::steady_clock::now();
    try {
      cpdispatch::gemm::ReferenceGemm gemm;
      const auto buffer = overlap_cases::buffer_for<float>(c, t.world_size());
      overlap_cases::run_case<float>(t, gemm, c, buffer.get(), 0);
    } catch (...) {
      fault_cases::record_exception(o, start);
    }
  });
  report("comm_gemm AG RING_EXCHANGE", "sim", fault, W, out);
  expect_every_rank_threw(out, W - 1, fault);
}

// A ring step that fails after posting its receive still waits for that
// receive before the exception leaves comm_gemm: the peer's late send must not
// land in a buffer whose owner already saw the failure (and may have freed it).
TEST(OverlapFaults, AFailedRingStepLeavesNoTransferIntoTheBuffer) {
  namespace ov = cpdispatch::overlap;
  const overlap_cases::Case c{ov::CommOverlapType::AG, ov::CommOverlapMethod::RING_EXCHANGE, cpdispatch::gemm::Transpose::no,
                              cpdispatch::gemm::Transpose::no};
  constexpr std::size_t ml = 3, k = 5, n = 4, W = 2;
  const std::vector<float> late(ml * k, 2.5f);  // what rank 0 sends rank 1, after rank 1's failure
  bool threw = false;
  std::vector<float> after_throw, later;
  SimWorld world(2, SimOptions{sim_timeout});
  world.run([&](SimTransport& sim) {
    if (sim.rank() == 0) {
      std::this_thread::sleep_for(150ms);
      sim.wait(sim.isend(late.data(), late.size() * sizeof(float), 1, 0));
      return;
    }
    FaultInjectingTransport t(sim, {FaultRule{TransportCall::isend, 1, Fault::error, 1}}, fault_options);
    const auto buffer = overlap_cases::buffer_for<float>(c, 2);
    const std::vector<float> shard(ml * k, 1.0f), b(k * n, 1.0f);
    std::vector<float> d(W * ml * n);
    cpdispatch::gemm::ReferenceGemm gemm;
    try {
      ov::comm_gemm(t, gemm, *buffer, ov::matrix_view(shard.data(), ml, k), c.ta, ov::matrix_view(b.data(), k, n), c.tb,
                    ov::matrix_view(d.data(), W * ml, n), ov::MatrixView<float>{});
    } catch (const cpdispatch::backend_error&) {
      threw = true;
    }
    after_throw.resize(buffer->size());
    buffer->copy_out(std::span<float>(after_throw));
    std::this_thread::sleep_for(400ms);  // well past rank 0's send
    later.resize(buffer->size());
    buffer->copy_out(std::span<float>(later));
  });
  EXPECT_TRUE(threw);
  EXPECT_EQ(later, after_throw) << "a transfer landed in the buffer after comm_gemm had thrown";
}

INSTANTIATE_TEST_SUITE_P(Sim, LayerFaults,
                         // World sizes that divide the layers' 12 features.
                         testing::Combine(testing::Values(2, 3, 4, 6), testing::Values(Fault::error, Fault::stall, Fault::short_delivery)),
                         [](const testing::TestParamInfo<LayerParam>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" +
                                  cpdispatch::testing::fault_name(std::get<1>(info.param));
                         });

// ---- the injector itself ------------------------------------------------------

TEST(FaultInjector, SeededRulesRepeatAndRecordWhatWasDone) {
  const std::vector<TransportCall> calls = {TransportCall::all_to_all_pieces};
  const std::vector<Fault> faults = {Fault::error, Fault::short_delivery};
  const auto a = cpdispatch::testing::seeded_fault_rules(42, 4, 3, calls, faults);
  const auto b = cpdispatch::testing::seeded_fault_rules(42, 4, 3, calls, faults);
  ASSERT_EQ(a.size(), 3u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].rank, b[i].rank);
    EXPECT_EQ(a[i].nth, b[i].nth);
    EXPECT_EQ(a[i].fault, b[i].fault);
  }
  std::vector<std::vector<cpdispatch::testing::FaultRecord>> records(4);
  const auto meta = fault_cases::ring_plan(4);
  const auto data = fault_cases::step_data(meta, Step::forward);
  std::mutex m;
  run_world<Pieces>(4, {FaultRule{TransportCall::all_to_all_pieces, 2, Fault::corrupt, 1}}, [&](auto& t, std::size_t r, Outcome& o) {
    cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, fault_cases::token_bytes);
    fault_cases::run_step(d, Step::forward, data, r, o);
    fault_cases::run_step(d, Step::forward, data, r, o);
    EXPECT_EQ(t.calls(TransportCall::all_to_all_pieces), 2u);
    std::lock_guard lock(m);
    records[r] = t.records();
  });
  for (std::size_t r = 0; r < 4; ++r) EXPECT_EQ(records[r].size(), r == 1 ? 1u : 0u) << "rank " << r;
  EXPECT_EQ(records[1][0].nth, 2u);
  EXPECT_THAT(records[1][0].what, HasSubstr("flipped byte"));
}

TEST(FaultInjector, RefusesPayloadFaultsOnCallsWithoutPayload) {
  SimWorld world(1);
  world.run([](SimTransport& sim) {
    EXPECT_THROW(FaultInjectingTransport(sim, {FaultRule{TransportCall::barrier, 1, Fault::corrupt, -1}}), cpdispatch::invalid_input);
    EXPECT_THROW(FaultInjectingTransport(sim, {FaultRule{TransportCall::barrier, 0, Fault::error, -1}}), cpdispatch::invalid_input);
  });
}

/// A transport with the all-to-all alone (no collectives, no point-to-point).
struct AllToAllOnly {
  [[maybe_unused]] static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, std::span<const std::size_t>, std::span<const std::size_t>, void*, std::span<const std::size_t>,
                    std::span<const std::size_t>) {}
};

TEST(FaultInjector, HasExactlyTheMembersOfItsInnerTransport) {
  static_assert(cpdispatch::AllToAllTransport<FaultInjectingTransport<AllToAllOnly>>);
  static_assert(!cpdispatch::CollectiveTransport<FaultInjectingTransport<AllToAllOnly>>);
  static_assert(!cpdispatch::PointToPointTransport<FaultInjectingTransport<AllToAllOnly>>);
  static_assert(cpdispatch::PieceTransport<FaultInjectingTransport<SimTransport>>);
  static_assert(cpdispatch::Transport<FaultInjectingTransport<SimPackingTransport>>);
  static_assert(!cpdispatch::PieceTransport<FaultInjectingTransport<SimPackingTransport>>);
}

}  // namespace
