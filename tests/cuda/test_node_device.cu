// NodeWireDispatcher on the device sim and on NcclTransport: the forward
// attention layout and the backward gradient equal, byte for byte, what the
// host NodeWireDispatcher computes on the host sim from the same plan and
// values (random bfloat16 and float values, int32), on W = 1..8 ranks on 1
// to 4 nodes, consecutive, interleaved and lopsided (NCCL: at W = 2 and 4,
// one GPU a rank), and a second backward gives the same bytes. Without a
// CUDA device every test skips.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../node/node_cases.hpp"
#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cuda_test_util.hpp"
#include "nccl_world.hpp"

namespace {

using Bytes = std::vector<std::byte>;
using cpdispatch::cuda::DeviceBuffer;

/// A case planned: the section 2c wire (for the fan lists) and the node-level wire.
struct Planned {
  cpdispatch::QkvMetadata meta;
  cpdispatch::KvWireMetadata wire;
  cpdispatch::NodeWireMetadata node;
  explicit Planned(const node_test::Case& c)
      : meta(cpdispatch::plan_qkv(c.plan)), wire(cpdispatch::plan_kv_wire(meta)), node(cpdispatch::plan_node_wire(meta.kv_fwd, c.topology)) {}
};

template <class E>
Bytes random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<E> v(n);
  if constexpr (std::is_integral_v<E>) {
    std::uniform_int_distribution<E> u(-1000, 1000);
    for (E& x : v) x = u(rng);
  } else {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (E& x : v) x = E(u(rng));
  }
  Bytes b(n * sizeof(E));
  if (n) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

struct RankBytes {
  Bytes mlp, dattn;         // inputs
  Bytes attn, grad, again;  // outputs: forward, backward, a second backward
};

constexpr std::size_t token_elems = 4;

/// Every rank's inputs, and the host dispatcher's outputs on the host sim.
template <class E>
std::vector<RankBytes> on_the_host(const Planned& p, int W) {
  std::vector<RankBytes> out(static_cast<std::size_t>(W));
  cpdispatch::SimWorld world(W);
  world.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    cpdispatch::NodeWireDispatcher<cpdispatch::SimTransport> nw(t, p.wire.fan[r], p.node.ranks[r], token_elems * sizeof(E));
    RankBytes& b = out[r];
    const auto sizes = nw.required_bytes();
    b.mlp = random_values<E>(sizes.mlp_bytes / sizeof(E), 100 + r);
    b.dattn = random_values<E>(sizes.attention_bytes / sizeof(E), 200 + r);
    b.attn.assign(sizes.attention_bytes, std::byte{0x5A});
    b.grad.assign(sizes.mlp_bytes, std::byte{0x33});
    nw.forward(b.mlp, b.attn);
    nw.reverse_combine(b.dattn, b.grad, cpdispatch::element_type_of<E>());
  });
  return out;
}

DeviceBuffer<std::byte> to_device(const Bytes& host, std::byte fill) {
  DeviceBuffer<std::byte> d(host.size() + 16);  // never empty: a rank without tokens still gets a valid pointer
  const Bytes filled = host.empty() ? Bytes(16, fill) : host;
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d.data(), filled.data(), filled.size(), cudaMemcpyHostToDevice));
  return d;
}

Bytes to_host(const DeviceBuffer<std::byte>& d, std::size_t n) {
  Bytes host(n);
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  if (n) CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), n, cudaMemcpyDeviceToHost));
  return host;
}

/// Runs f on every rank of a device sim world of W ranks.
struct OnDeviceSim {
  template <class F>
  void operator()(int W, F&& f) const {
    cpdispatch::DeviceSimWorld world(W);
    world.run(f);
  }
};

/// Runs f on W GPUs, one NcclTransport each.
struct OnNccl {
  template <class F>
  void operator()(int W, F&& f) const {
    cptest::run_nccl(W, f);
  }
};

template <class E, class Run>
void check_case(const node_test::Case& c, Run run) {
  const Planned p(c);
  const int W = static_cast<int>(c.plan.world_size);
  const std::vector<RankBytes> host = on_the_host<E>(p, W);
  std::vector<RankBytes> dev(host.size());
  run(W, [&](auto& t) {
    using T = std::remove_reference_t<decltype(t)>;
    const auto r = static_cast<std::size_t>(t.rank());
    cpdispatch::NodeWireDispatcher<T> nw(t, p.wire.fan[r], p.node.ranks[r], token_elems * sizeof(E));
    const auto sizes = nw.required_bytes();
    const DeviceBuffer<std::byte> mlp = to_device(host[r].mlp, std::byte{}), dattn = to_device(host[r].dattn, std::byte{});
    const DeviceBuffer<std::byte> attn = to_device(Bytes(sizes.attention_bytes, std::byte{0x5A}), std::byte{0x5A});
    const DeviceBuffer<std::byte> grad = to_device(Bytes(sizes.mlp_bytes, std::byte{0x77}), std::byte{0x77});
    const DeviceBuffer<std::byte> again = to_device(Bytes(sizes.mlp_bytes, std::byte{0x66}), std::byte{0x66});
    using cpdispatch::cuda::DeviceBytes, cpdispatch::cuda::DeviceConstBytes;
    nw.forward(DeviceConstBytes(mlp.data(), sizes.mlp_bytes), DeviceBytes(attn.data(), sizes.attention_bytes));
    const cpdispatch::ElementType type = cpdispatch::element_type_of<E>();
    nw.reverse_combine(DeviceConstBytes(dattn.data(), sizes.attention_bytes), DeviceBytes(grad.data(), sizes.mlp_bytes), type);
    nw.reverse_combine(DeviceConstBytes(dattn.data(), sizes.attention_bytes), DeviceBytes(again.data(), sizes.mlp_bytes), type);
    dev[r] = {{}, {}, to_host(attn, sizes.attention_bytes), to_host(grad, sizes.mlp_bytes), to_host(again, sizes.mlp_bytes)};
  });
  for (std::size_t r = 0; r < host.size(); ++r) {
    EXPECT_EQ(dev[r].attn, host[r].attn) << "forward attention layout of rank " << r;
    EXPECT_EQ(dev[r].grad, host[r].grad) << "gradient of rank " << r;
    EXPECT_EQ(dev[r].again, dev[r].grad) << "the gradient of rank " << r << " changed between runs";
  }
}

TEST(NodeWireDeviceSim, EqualsTheHostDispatcherOnEveryNodeMap) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const std::vector<node_test::Case> all = node_test::cases(1, 8);
  for (std::size_t i = 0; i < all.size(); ++i) {
    SCOPED_TRACE(all[i].name);
    check_case<cpdispatch::bfloat16>(all[i], OnDeviceSim{});
    if (i % 3 == 0) check_case<float>(all[i], OnDeviceSim{});
    if (i % 3 == 1) check_case<std::int32_t>(all[i], OnDeviceSim{});
  }
}

class NodeWireNccl : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Gpus, NodeWireNccl, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

TEST_P(NodeWireNccl, EqualsTheHostDispatcherOnEveryNodeMap) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < W) GTEST_SKIP() << "needs " << W << " CUDA devices (this machine has " << count << ")";
  for (const node_test::Case& c : node_test::cases(W, W)) {
    SCOPED_TRACE(c.name);
    check_case<cpdispatch::bfloat16>(c, OnNccl{});
    check_case<float>(c, OnNccl{});
  }
}

}  // namespace
