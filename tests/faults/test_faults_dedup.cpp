// Faults injected under the deduplicated KV exchange (KvWireDispatcher) on
// the in-process transport (ranks as threads, W = 2..8), through
// all_to_all_pieces and through the staging path (SimPackingTransport):
// an error, a stall or a short delivery surfaces as an exception on EVERY
// rank (no hang: the sim's timeout and abort); the faulty rank, which failed
// before its exchange, wrote nothing into its outputs; inputs stay
// unchanged; a corrupted byte of the forward reaches only the copies of the
// one shard it hit (the fan-out copies it on), of the backward exactly one
// gradient value (the fan-in sums it in once); and a dispatcher whose
// transport survived a fault works again. Time to error is printed as rows
// of docs/reliability.md's fault matrix.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "../common/sim_world_fixture.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "dedup_fault_cases.hpp"

namespace {

using namespace std::chrono_literals;
using cpdispatch::SimOptions;
using cpdispatch::SimPackingTransport;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using cpdispatch::testing::FaultInjectingTransport;
using cpdispatch::testing::FaultOptions;
using cpdispatch::testing::FaultRule;
using dedup_fault_cases::DedupOutcome;
using dedup_fault_cases::Step;
using fault_cases::Fault;
using fault_cases::TransportCall;
using testing::HasSubstr;

constexpr auto sim_timeout = 1000ms;  // generous: a loaded CI machine must not make a healthy step time out
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

using sim_test::Packing;
using sim_test::Pieces;

/// One step of KvWireDispatcher on every rank of a world of W, each over its
/// fault injector with `rules`; `after(dispatcher, rank)` runs next on each rank.
template <class Wrap, class After>
std::vector<DedupOutcome> run_world(int W, Step step, const std::vector<FaultRule>& rules, After&& after) {
  const auto plan = dedup_fault_cases::shared_plan(W);
  const auto data = dedup_fault_cases::step_data(plan, step);
  std::vector<DedupOutcome> outcomes(static_cast<std::size_t>(W));
  SimWorld world(W, SimOptions{sim_timeout});
  try {
    world.run([&](SimTransport& sim) {
      Wrap inner(sim);
      FaultInjectingTransport t(inner.get(), rules, fault_options);
      cpdispatch::KvWireDispatcher d(t, plan.wire, fault_cases::token_bytes);
      const auto r = static_cast<std::size_t>(sim.rank());
      dedup_fault_cases::run_step(d, step, data, r, outcomes[r]);
      after(d, r);
    });
  } catch (const cpdispatch::error&) {
    // A rank that returned early (it caught its fault) while others waited fails the run: expected here.
  }
  return outcomes;
}

template <class Wrap>
std::vector<DedupOutcome> step_with_fault(int W, Fault fault, Step step, int faulty) {
  const TransportCall call = std::is_same_v<Wrap, Pieces> ? TransportCall::all_to_all_pieces : TransportCall::all_to_all_v;
  return run_world<Wrap>(W, step, {FaultRule{call, 1, fault, faulty}}, [](auto&, std::size_t) {});
}

void report(Step step, bool packing, Fault fault, int W, const std::vector<DedupOutcome>& out) {
  double others = 0;
  int threw = 0;
  for (std::size_t r = 0; r < out.size(); ++r) {
    threw += out[r].threw;
    if (r + 1 < out.size()) others = std::max(others, out[r].ms);
  }
  std::printf("fault-matrix | KvWireDispatcher::%s | %s | %s | W=%d | %d/%d ranks threw | faulty rank %.0f ms | others %.0f ms\n",
              dedup_fault_cases::step_name(step), packing ? "sim (all_to_all_v)" : "sim (pieces)", cpdispatch::testing::fault_name(fault),
              W, threw, W, out.back().ms, others);
}

using Param = std::tuple<int, Fault, Step, bool>;  // W, fault, step, packing path

class DedupFaults : public testing::TestWithParam<Param> {};

TEST_P(DedupFaults, SurfacesOnEveryRankOrChangesOnlyWhatWasHit) {
  const auto [W, fault, step, packing] = GetParam();
  const int faulty = W - 1;
  const auto out = packing ? step_with_fault<Packing>(W, fault, step, faulty) : step_with_fault<Pieces>(W, fault, step, faulty);
  report(step, packing, fault, W, out);
  std::size_t wrong = 0;
  for (std::size_t r = 0; r < out.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(out[r].input_unchanged);
    EXPECT_EQ(out[r].threw, fault != Fault::corrupt) << out[r].what << " after " << out[r].ms << " ms";
    wrong += out[r].wrong_floats;
  }
  const DedupOutcome& f = out[static_cast<std::size_t>(faulty)];
  if (fault == Fault::error || fault == Fault::stall) {
    EXPECT_TRUE(f.outputs_untouched) << "the faulty rank failed before its exchange but wrote into its outputs";
  }
  if (fault == Fault::error) {
    EXPECT_EQ(f.code, 77);
    EXPECT_THAT(f.what, HasSubstr("injected error"));
    EXPECT_THAT(f.what, HasSubstr(std::string("KvWireDispatcher::") + dedup_fault_cases::step_name(step)));
  }
  if (fault == Fault::stall) {
    EXPECT_TRUE(f.timeout) << f.what;
  }
  if (fault == Fault::corrupt) {  // nothing checksums payloads: the run completes
    if (step == Step::forward) {
      EXPECT_GE(wrong, 1u);
      EXPECT_LE(wrong, dedup_fault_cases::most_copies(dedup_fault_cases::shared_plan(W)));
    } else {
      EXPECT_EQ(wrong, 1u);
    }
  }
}

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return "W" + std::to_string(std::get<0>(info.param)) + "_" + cpdispatch::testing::fault_name(std::get<1>(info.param)) + "_" +
         dedup_fault_cases::step_name(std::get<2>(info.param)) + (std::get<3>(info.param) ? "_packing" : "_pieces");
}

INSTANTIATE_TEST_SUITE_P(Sim, DedupFaults,
                         testing::Combine(testing::Values(2, 3, 5, 8), testing::Values(Fault::error, Fault::short_delivery, Fault::corrupt),
                                          testing::Values(Step::forward, Step::reverse_combine, Step::reverse_combine_in_place),
                                          testing::Bool()),
                         param_name);

// A stall costs its full length (1.5 s): a few worlds, every step and both paths once.
INSTANTIATE_TEST_SUITE_P(SimStall, DedupFaults,
                         testing::Values(Param{2, Fault::stall, Step::forward, false}, Param{8, Fault::stall, Step::forward, true},
                                         Param{3, Fault::stall, Step::reverse_combine, true},
                                         Param{5, Fault::stall, Step::reverse_combine_in_place, false}),
                         param_name);

// A fault every rank sees before reaching the transport (a transient failure
// the transport survives): the same dispatchers then run correctly.
TEST(DedupFaultsReuse, DispatcherWorksAgainAfterATransientFault) {
  for (int W = 2; W <= 8; W += 3) {
    for (Step step : {Step::forward, Step::reverse_combine, Step::reverse_combine_in_place}) {
      SCOPED_TRACE(std::string("W ") + std::to_string(W) + ", " + dedup_fault_cases::step_name(step));
      const auto data = dedup_fault_cases::step_data(dedup_fault_cases::shared_plan(W), step);
      const auto out = run_world<Pieces>(W, step, {FaultRule{TransportCall::all_to_all_pieces, 1, Fault::error, -1}}, [&](auto& d, std::size_t r) {
        DedupOutcome again;
        dedup_fault_cases::run_step(d, step, data, r, again);
        EXPECT_FALSE(again.threw) << again.what;
        EXPECT_EQ(again.wrong_floats, 0u) << "rank " << r;
      });
      for (const DedupOutcome& o : out) {
        EXPECT_THAT(o.what, HasSubstr("injected error"));
        EXPECT_TRUE(o.outputs_untouched);
      }
    }
  }
}

// Buffers too small: capacity_error on the rank that passed them, before any
// write and before the exchange (the others are released by the sim's abort).
TEST(DedupFaultsCapacity, ShortBufferIsRefusedBeforeAnyWrite) {
  const auto plan = dedup_fault_cases::shared_plan(3);
  SimWorld world(3, SimOptions{sim_timeout});
  world.run([&](SimTransport& sim) {
    cpdispatch::KvWireDispatcher d(sim, plan.wire, fault_cases::token_bytes);
    const auto& need = d.required_bytes();
    std::vector<std::byte> attention(need.attention_bytes, std::byte{0x5A}), wire(need.wire_bytes, std::byte{0x5A}),
        replica(need.replica_bytes, std::byte{0x5A}), grad(need.mlp_bytes - 1, std::byte{0x5A});
    EXPECT_THROW(d.reverse_combine(attention, wire, replica, grad, cpdispatch::ElementType::float32), cpdispatch::capacity_error);
    EXPECT_THROW(d.reverse_combine_in_place(attention, replica, grad, cpdispatch::ElementType::float32), cpdispatch::capacity_error);
    for (const auto* b : {&attention, &wire, &replica, &grad}) {
      EXPECT_TRUE(std::all_of(b->begin(), b->end(), [](std::byte x) { return x == std::byte{0x5A}; }));
    }
  });
}

}  // namespace
