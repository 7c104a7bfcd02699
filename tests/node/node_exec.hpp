#pragma once
// The node-level-vs-deduplicated comparison every transport test runs: the
// same plan through KvWireDispatcher and NodeWireDispatcher on one rank.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "node_cases.hpp"

namespace node_test {

using Bytes = std::vector<std::byte>;

/// A case planned: its metadata, section 2c wire and node-level wire.
struct Planned {
  cpdispatch::QkvMetadata meta;
  cpdispatch::KvWireMetadata wire;
  cpdispatch::NodeWireMetadata node;
  explicit Planned(const Case& c)
      : meta(cpdispatch::plan_qkv(c.plan)), wire(cpdispatch::plan_kv_wire(meta)), node(cpdispatch::plan_node_wire(meta.kv_fwd, c.topology)) {}
};

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

struct RankResult {
  Bytes attn_ref, attn, grad_ref, grad, grad_again;
};

/// Both exchanges on one rank; every rank of the world calls it.
template <class E, class Transport>
RankResult run_rank(Transport& t, const Planned& p) {
  const auto r = static_cast<std::size_t>(t.rank());
  const std::size_t tb = 2 * sizeof(E);
  const cpdispatch::ElementType type = cpdispatch::element_type_of<E>();
  cpdispatch::KvWireDispatcher<Transport> flat(t, p.wire, tb);
  cpdispatch::NodeWireDispatcher<Transport> nw(t, p.wire.fan[r], p.node.ranks[r], tb);
  const auto sizes = flat.required_bytes();
  EXPECT_EQ(nw.required_bytes(), (cpdispatch::NodeWireBufferSizes{sizes.mlp_bytes, sizes.attention_bytes}));
  const Bytes mlp = small_values<E>(sizes.mlp_bytes / sizeof(E), 10 + r);
  const Bytes dattn = small_values<E>(sizes.attention_bytes / sizeof(E), 20 + r);
  RankResult out;
  out.attn_ref.assign(sizes.attention_bytes, std::byte{0x5A});
  out.attn.assign(sizes.attention_bytes, std::byte{0x5A});
  flat.forward(mlp, out.attn_ref);
  nw.forward(mlp, out.attn);
  Bytes wire_buf(sizes.wire_bytes), replica(sizes.replica_bytes);
  out.grad_ref.assign(sizes.mlp_bytes, std::byte{});
  out.grad.assign(sizes.mlp_bytes, std::byte{0x33});
  out.grad_again.assign(sizes.mlp_bytes, std::byte{0x44});
  flat.reverse_combine(dattn, wire_buf, replica, out.grad_ref, type);
  nw.reverse_combine(dattn, out.grad, type);
  nw.reverse_combine(dattn, out.grad_again, type);
  return out;
}

inline void check_rank(std::size_t r, const RankResult& res) {
  EXPECT_EQ(res.attn, res.attn_ref) << "forward attention layout of rank " << r;
  EXPECT_EQ(res.grad, res.grad_ref) << "gradient of rank " << r;
  EXPECT_EQ(res.grad_again, res.grad) << "the gradient of rank " << r << " changed between runs";
}

}  // namespace node_test
