// NodeWireDispatcher on the sim transport, every rank a thread: the forward
// attention layout is byte-identical to the deduplicated exchange's
// (KvWireDispatcher), and the backward gradient equals its reverse_combine
// exactly for integers and for small integer values in bfloat16 / float32
// (every partial sum exact, so the node-level order cannot change them), on
// W = 1..12 ranks on 1 to 4 nodes, consecutive, interleaved and lopsided.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpdispatch/execute/dedup.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/dedup.hpp"
#include "cpdispatch/plan/generate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "../common/sim_world_fixture.hpp"
#include "node_cases.hpp"

namespace {

using Bytes = std::vector<std::byte>;

/// Small integers in every element type: all sums of a few of them are exact.
template <class E>
Bytes small_values(std::size_t n, std::uint64_t seed) {
  cpdispatch::Rng rng(seed);
  std::vector<E> v(n);
  for (E& x : v) x = E(static_cast<float>(rng.between(-4, 4)));
  Bytes b(n * sizeof(E));
  if (n) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class E>
void check_case(const node_test::Case& c) {
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(c.plan);
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(meta.kv_fwd, c.topology);
  const auto W = static_cast<int>(c.plan.world_size);
  const std::size_t tb = 2 * sizeof(E);
  const cpdispatch::ElementType type = cpdispatch::element_type_of<E>();
  std::vector<Bytes> attn_ref(static_cast<std::size_t>(W)), attn(attn_ref.size()), grad_ref(attn_ref.size()), grad(attn_ref.size()),
      grad_again(attn_ref.size());
  cpdispatch::SimWorld world(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    cpdispatch::KvWireDispatcher<cpdispatch::SimTransport> flat(t, wire, tb);
    cpdispatch::NodeWireDispatcher<cpdispatch::SimTransport> nw(t, wire.fan[r], node.ranks[r], tb);
    const auto sizes = flat.required_bytes();
    ASSERT_EQ(nw.required_bytes(), (cpdispatch::NodeWireBufferSizes{sizes.mlp_bytes, sizes.attention_bytes}));
    const Bytes mlp = small_values<E>(sizes.mlp_bytes / sizeof(E), 10 + r);
    const Bytes dattn = small_values<E>(sizes.attention_bytes / sizeof(E), 20 + r);
    attn_ref[r].assign(sizes.attention_bytes, std::byte{0x5A});
    attn[r].assign(sizes.attention_bytes, std::byte{0x5A});
    flat.forward(mlp, attn_ref[r]);
    nw.forward(mlp, attn[r]);
    Bytes wire_buf(sizes.wire_bytes), replica(sizes.replica_bytes);
    grad_ref[r].assign(sizes.mlp_bytes, std::byte{});
    grad[r].assign(sizes.mlp_bytes, std::byte{0x33});
    grad_again[r].assign(sizes.mlp_bytes, std::byte{0x44});
    flat.reverse_combine(dattn, wire_buf, replica, grad_ref[r], type);
    nw.reverse_combine(dattn, grad[r], type);
    nw.reverse_combine(dattn, grad_again[r], type);
  });
  for (std::size_t r = 0; r < attn.size(); ++r) {
    EXPECT_EQ(attn[r], attn_ref[r]) << "forward attention layout of rank " << r;
    EXPECT_EQ(grad[r], grad_ref[r]) << "gradient of rank " << r;
    EXPECT_EQ(grad_again[r], grad[r]) << "the gradient of rank " << r << " changed between runs";
  }
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

TEST(NodeWireSim, RefusesAnotherRanksWire) {
  const node_test::Case c = node_test::cases(2, 2).front();
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(c.plan);
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  const cpdispatch::NodeWireMetadata node = cpdispatch::plan_node_wire(meta.kv_fwd, c.topology);
  cpdispatch::SimWorld world(2, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](cpdispatch::SimTransport& t) {
    const auto other = static_cast<std::size_t>(1 - t.rank());
    using D = cpdispatch::NodeWireDispatcher<cpdispatch::SimTransport>;
    EXPECT_THROW(D(t, wire.fan[other], node.ranks[other], 4), cpdispatch::invalid_input);
  });
}

}  // namespace
