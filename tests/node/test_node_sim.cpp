// NodeWireDispatcher on the sim transport, every rank a thread: the forward
// attention layout is byte-identical to the deduplicated exchange's
// (KvWireDispatcher), and the backward gradient equals its reverse_combine
// exactly for integers and for small integer values in bfloat16 / float32
// (every partial sum exact, so the node-level order cannot change them), on
// W = 1..12 ranks on 1 to 4 nodes, consecutive, interleaved and lopsided.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "../common/sim_world_fixture.hpp"
#include "../transports/dispatch_helpers.hpp"
#include "node_exec.hpp"

namespace {

template <class E>
void check_case(const node_test::Case& c) {
  const node_test::Planned p(c);
  std::vector<node_test::RankResult> res(static_cast<std::size_t>(c.plan.world_size));
  cpdispatch::SimWorld world(static_cast<int>(c.plan.world_size), cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& t) { res[static_cast<std::size_t>(t.rank())] = node_test::run_rank<E>(t, p); });
  for (std::size_t r = 0; r < res.size(); ++r) node_test::check_rank(r, res[r]);
}

TEST(NodeWireSim, EqualsTheDeduplicatedExchangeOnEveryNodeMap) {
  for (const node_test::Case& c : node_test::cases()) {
    SCOPED_TRACE(c.name);
    check_case<std::int32_t>(c);
    check_case<cpdispatch::bfloat16>(c);
  }
}

TEST(NodeWireSim, FloatSumsOfSmallIntegersAreExact) {
  for (const node_test::Case& c : node_test::cases(5, 8)) {
    SCOPED_TRACE(c.name);
    check_case<float>(c);
    check_case<std::int64_t>(c);
  }
}

TEST(NodeWireSim, RefusesAnotherRanksWireAndShortOverlappingOrMisalignedBuffers) {
  const node_test::Case c = node_test::cases(2, 2).front();
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(c.plan);
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(meta.kv_fwd, c.topology);
  cpdispatch::SimWorld world(2, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& t) {
    const auto other = static_cast<std::size_t>(1 - t.rank());
    using D = cpdispatch::NodeWireDispatcher<cpdispatch::SimTransport>;
    EXPECT_THROW(D(t, wire.fan[other], node.ranks[other], 4), cpdispatch::invalid_input);
    const auto me = static_cast<std::size_t>(t.rank());
    D nw(t, wire.fan[me], node.ranks[me], 4);
    const auto sizes = nw.required_bytes();
    std::vector<std::byte> mlp(sizes.mlp_bytes), attn(sizes.attention_bytes);
    // Every check comes before anything travels, and no call here passes them: no rank waits for another.
    const std::string who = "NodeWireDispatcher::forward (rank " + std::to_string(me) + " of 2): ";
    if (sizes.attention_bytes > 0) {
      EXPECT_EQ(cptest::message_of<cpdispatch::capacity_error>([&] { nw.forward(mlp, std::span<std::byte>(attn).first(sizes.attention_bytes - 1)); }),
                who + "attention holds " + std::to_string(sizes.attention_bytes - 1) + " bytes, the plan needs " + std::to_string(sizes.attention_bytes));
    }
    if (sizes.attention_bytes > 0 && sizes.mlp_bytes > 0) {  // one buffer for both, the attention layout over the MLP layout's tail
      std::vector<std::byte> both(sizes.mlp_bytes + sizes.attention_bytes);
      const std::span<std::byte> all(both);
      EXPECT_EQ(cptest::message_of<cpdispatch::invalid_input>([&] { nw.forward(all.first(sizes.mlp_bytes), all.subspan(sizes.mlp_bytes - 1, sizes.attention_bytes)); }),
                who + "mlp and attention overlap");
      EXPECT_EQ(cptest::message_of<cpdispatch::invalid_input>(
                    [&] { nw.reverse_combine(all.subspan(sizes.mlp_bytes - 4, sizes.attention_bytes), all.first(sizes.mlp_bytes), cpdispatch::ElementType::int32); }),
                "NodeWireDispatcher::reverse_combine (rank " + std::to_string(me) + " of 2): grad and attention_grad overlap");
      std::vector<std::int32_t> words(sizes.mlp_bytes / 4 + 1);
      const std::span<std::byte> odd = std::as_writable_bytes(std::span(words)).subspan(1, sizes.mlp_bytes);  // not 4-byte aligned
      EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { nw.reverse_combine(attn, odd, cpdispatch::ElementType::int32); }),
                  ::testing::HasSubstr("grad is not aligned to 4 bytes for int32"));
    }
  });
}

// Each phase is an all_to_all_v even over a PieceTransport (the fault wrapper
// of the sim has all_to_all_pieces), and a failed one is named with the call.
TEST(NodeWireSim, TransportFailuresNameTheCallAndTheCollective) {
  using cpdispatch::testing::FaultRule, cpdispatch::testing::TransportCall, cpdispatch::testing::Fault;
  using Faulty = cpdispatch::testing::FaultInjectingTransport<cpdispatch::SimTransport>;
  static_assert(cpdispatch::PieceTransport<Faulty>);
  const node_test::Case c = node_test::cases(2, 2).front();
  const node_test::Planned p(c);
  cpdispatch::SimWorld world(2, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& sim) {
    // Every rank fails the first and the fourth all_to_all_v: forward's first step, reverse_combine's first.
    Faulty t(sim, {FaultRule{TransportCall::all_to_all_v, 1, Fault::error, -1}, FaultRule{TransportCall::all_to_all_v, 4, Fault::error, -1}});
    const auto r = static_cast<std::size_t>(t.rank());
    cpdispatch::NodeWireDispatcher<Faulty> nw(t, p.wire.fan[r], p.node.ranks[r], 4);
    const auto sizes = nw.required_bytes();
    std::vector<std::byte> mlp(sizes.mlp_bytes), attn(sizes.attention_bytes), grad(sizes.mlp_bytes);
    const auto fails = [&](const char* call, auto&& run) {
      try {
        run();
        ADD_FAILURE() << call << " did not throw";
      } catch (const cpdispatch::backend_error& e) {
        const std::string want = std::string("NodeWireDispatcher::") + call + " (rank " + std::to_string(r) + " of 2): all_to_all_v failed: ";
        EXPECT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
      }
    };
    fails("forward", [&] { nw.forward(mlp, attn); });
    nw.forward(mlp, attn);  // the second and third all_to_all_v
    fails("reverse_combine", [&] { nw.reverse_combine(attn, grad, cpdispatch::ElementType::int32); });
  });
}

}  // namespace
