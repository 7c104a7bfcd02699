// The deduplicated KV exchange (KvWireDispatcher) on the device transports:
// the device sim at W = 1..8 and NcclTransport at W = 1 (and at W = number
// of GPUs, up to 8; the cuda-cpu harness's NCCL double has 8). On random
// plans (repeated destinations, zig-zag, both plan forms) the forward
// attention layout is byte-identical to the section 2 Dispatcher's on the
// host sim; the backward gradient is bit-identical to the host
// KvWireDispatcher's, run to run and in place, and equals the section 2
// combine exactly for integers, within fp32 reassociation for floats. A
// whole step is captured in a CUDA graph and replayed; each call is one
// wire exchange (a strict mock watches the device sim's all_to_all_v); short
// buffers are refused before anything is written. Without a CUDA device
// every test skips ("no CUDA device").

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"
#include "nccl_world.hpp"
#include "../dedup/dedup_exec.hpp"

// A named namespace: nvcc reports static members of classes in an unnamed
// one that only constant expressions read as never referenced.
namespace dedup_device_test {

using Counts = std::vector<std::size_t>;
using Watcher = ::testing::StrictMock<::testing::MockFunction<void(Counts send_counts, Counts recv_counts)>>;

/// The device sim's transport, reporting each all_to_all_v to a mock first.
class WatchedTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::device;
  using data_path = cpdispatch::cuda::DeviceDataPath;

  WatchedTransport(cpdispatch::DeviceSimTransport& sim, Watcher& watcher) : sim_(sim), watcher_(watcher) {}
  int rank() const noexcept { return sim_.rank(); }
  int world_size() const noexcept { return sim_.world_size(); }
  cudaStream_t stream() const noexcept { return sim_.stream(); }
  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    watcher_.Call(Counts(send_counts.begin(), send_counts.end()), Counts(recv_counts.begin(), recv_counts.end()));
    sim_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }

 private:
  cpdispatch::DeviceSimTransport& sim_;
  Watcher& watcher_;
};

}  // namespace dedup_device_test

namespace {

using cpdispatch::ElementType;
using cpdispatch::KvWireDispatcher;
using cpdispatch::NcclTransport;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::DeviceSimOptions;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cptest::cbytes;
using cptest::mbytes;
using cptest::to_device;
using cptest::to_host;
using dedup_test::Bytes;
using dedup_test::Case;
using ::testing::HasSubstr;

using DeviceBytesBuffer = DeviceBuffer<std::byte>;

DeviceSimOptions guarded() { return DeviceSimOptions{std::chrono::milliseconds(60000), -1}; }

/// One element type and token width of a run.
struct Kind {
  ElementType type;
  std::size_t elems;  // per token
  bool exact;         // small integer values: every sum exact
  std::size_t token_bytes() const { return elems * cpdispatch::element_size(type); }
  std::string name() const {
    return std::string(cpdispatch::element_name(type)) + " x" + std::to_string(elems) + (exact ? " exact" : "");
  }
};

/// Rank r's inputs: its KV shards (MLP layout) and its attention-layout gradients.
struct Inputs {
  Bytes mlp, dattn;
};

Inputs inputs_of(const Case& c, std::size_t r, const Kind& k) {
  const std::size_t mlp_elems = static_cast<std::size_t>(c.meta.kv_fwd.send_tokens(static_cast<std::int64_t>(r))) * k.elems;
  const std::size_t attn_elems = static_cast<std::size_t>(c.wire.fan[r].attention_tokens) * k.elems;
  Inputs in;
  cpdispatch::detail::with_element_type(k.type, [&]<class E>(E*) {
    in.mlp = dedup_test::bytes_of(dedup_test::values<E>(mlp_elems, 100 + r, k.exact));
    in.dattn = dedup_test::bytes_of(dedup_test::values<E>(attn_elems, 200 + r, k.exact));
  });
  return in;
}

/// What the host computes for rank r: the section 2 forward and combine,
/// and the host KvWireDispatcher's gradient.
struct Reference {
  Bytes attention, grad_section2, grad_dedup;
};

std::vector<Reference> host_reference(int W, const Case& c, const Kind& k) {
  std::vector<Reference> ref(static_cast<std::size_t>(W));
  cpdispatch::SimWorld world(W);
  world.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const Inputs in = inputs_of(c, r, k);
    cpdispatch::Dispatcher<cpdispatch::SimTransport> kv(t, c.meta.kv_fwd, c.meta.kv_rev, k.token_bytes());
    KvWireDispatcher<cpdispatch::SimTransport> dd(t, c.wire, k.token_bytes());
    const auto& s = dd.required_bytes();
    Bytes replica(s.replica_bytes), wire(s.wire_bytes);
    ref[r].attention.resize(s.attention_bytes);
    ref[r].grad_section2.resize(s.mlp_bytes);
    ref[r].grad_dedup.resize(s.mlp_bytes);
    kv.forward(in.mlp, ref[r].attention);
    kv.reverse_combine(in.dattn, replica, ref[r].grad_section2, k.type);
    dd.reverse_combine(in.dattn, wire, replica, ref[r].grad_dedup, k.type);
  });
  return ref;
}

/// One rank's device buffers: inputs uploaded, outputs poisoned.
struct RankBuffers {
  DeviceBytesBuffer mlp, dattn, consumed, attention, wire, replica, grad, grad_again, grad_in_place;
};

RankBuffers buffers_for(const Case& c, std::size_t r, const Kind& k) {
  const Inputs in = inputs_of(c, r, k);
  const std::size_t tb = k.token_bytes(), C = c.meta.kv_fwd.num_copies();
  RankBuffers b;
  b.mlp = to_device(in.mlp);
  b.dattn = to_device(in.dattn);
  b.consumed = to_device(in.dattn);
  b.attention = to_device(Bytes(in.dattn.size(), std::byte{0xA5}));
  b.wire = to_device(Bytes(static_cast<std::size_t>(c.wire.fan[r].wire_tokens) * tb, std::byte{0x5A}));
  b.replica = to_device(Bytes(C * in.mlp.size(), std::byte{0x33}));
  for (DeviceBytesBuffer* g : {&b.grad, &b.grad_again, &b.grad_in_place}) *g = to_device(Bytes(in.mlp.size(), std::byte{0x77}));
  return b;
}

/// The device step of one rank: forward, reverse_combine twice (the replica
/// buffer refilled in between), reverse_combine_in_place.
template <class Transport>
void run_rank(Transport& t, const Case& c, const Kind& k, RankBuffers& b) {
  KvWireDispatcher<Transport> dd(t, c.wire, k.token_bytes());
  const auto& s = dd.required_bytes();
  EXPECT_EQ(s.attention_bytes, b.attention.size());
  EXPECT_EQ(s.wire_bytes, b.wire.size());
  EXPECT_EQ(s.replica_bytes, b.replica.size());
  EXPECT_EQ(s.mlp_bytes, b.grad.size());
  dd.forward(cbytes(b.mlp), mbytes(b.attention));
  dd.reverse_combine(cbytes(b.dattn), mbytes(b.wire), mbytes(b.replica), mbytes(b.grad), k.type);
  CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(b.replica.data(), 0x11, b.replica.size(), t.stream()));
  dd.reverse_combine(cbytes(b.dattn), mbytes(b.wire), mbytes(b.replica), mbytes(b.grad_again), k.type);
  CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(b.replica.data(), 0x22, b.replica.size(), t.stream()));
  dd.reverse_combine_in_place(mbytes(b.consumed), mbytes(b.replica), mbytes(b.grad_in_place), k.type);
}

/// The device's results of one rank, on the host.
struct DeviceResult {
  Bytes attention, grad, grad_again, grad_in_place;
};

DeviceResult results_of(const RankBuffers& b) {
  return {to_host(b.attention.data(), b.attention.size()), to_host(b.grad.data(), b.grad.size()),
          to_host(b.grad_again.data(), b.grad_again.size()), to_host(b.grad_in_place.data(), b.grad_in_place.size())};
}

/// Fan-in sums round once per destination: at most C roundings apart from
/// the section 2 combine (values in [-1, 1]; see tests/dedup/test_dedup_sim.cpp).
double rounding_bound(ElementType type, std::size_t C) {
  const int mantissa = type == ElementType::float64 ? 52 : type == ElementType::float32 ? 23 : type == ElementType::float16 ? 10 : 7;
  return 2 * static_cast<double>(C) * std::ldexp(1.0, -mantissa);
}

void expect_matches_host(const Case& c, const Kind& k, const std::vector<Reference>& ref, const std::vector<DeviceResult>& dev) {
  for (std::size_t r = 0; r < ref.size(); ++r) {
    EXPECT_EQ(dev[r].attention, ref[r].attention) << "forward attention layout of rank " << r << " (section 2 Dispatcher)";
    EXPECT_EQ(dev[r].grad, ref[r].grad_dedup) << "gradient of rank " << r << " (host KvWireDispatcher)";
    EXPECT_EQ(dev[r].grad_again, dev[r].grad) << "gradient of rank " << r << " changed between runs";
    EXPECT_EQ(dev[r].grad_in_place, dev[r].grad) << "reverse_combine_in_place differs on rank " << r;
    cpdispatch::detail::with_element_type(k.type, [&]<class E>(E*) {
      const double worst = dedup_test::largest_difference<E>(dev[r].grad, ref[r].grad_section2, r);
      if (k.exact) {
        EXPECT_EQ(worst, 0.0) << "rank " << r;
      }
      EXPECT_LE(worst, rounding_bound(k.type, c.meta.kv_fwd.num_copies())) << "rank " << r << " (section 2 combine)";
    });
  }
}

/// Token widths 16-byte multiples (vector paths) and not (scalar paths).
std::vector<Kind> kinds() {
  return {{ElementType::int32, 3, false},    {ElementType::int8, 5, false},     {ElementType::int64, 2, false},
          {ElementType::float32, 4, false},  {ElementType::float64, 3, false},  {ElementType::bfloat16, 8, false},
          {ElementType::bfloat16, 3, true},  {ElementType::float16, 3, false},  {ElementType::float16, 8, true}};
}

/// The kinds one case runs with: rotating over kinds(), so that every kind
/// meets several plans while each test stays short (two per case up to
/// W = 4, one beyond).
std::vector<Kind> kinds_for(std::size_t case_index, int W) {
  const std::vector<Kind> all = kinds();
  std::vector<Kind> out{all[case_index % all.size()]};
  if (W <= 4) out.push_back(all[(case_index + all.size() / 2) % all.size()]);
  return out;
}

// ---- the fan-in kernel's per-warp logic, lane by lane on the host -------------
// (the lanes of a warp share nothing: lanes 0..31 in turn do what the warp does)

TEST(FanInWarpLogicOnTheHost, MatchesTheHostFanInForEveryTypeAndAlignment) {
  // Elements per copy (heads, 16-byte vectors and tails), from a runtime list.
  const std::vector<std::size_t> lengths = {75, 40};
  // Copy offsets in elements: all congruent modulo 16 bytes (vector path once
  // `out` is too), and not (scalar path); two and three copies.
  const std::vector<std::vector<std::int64_t>> copy_sets = {{0, 160}, {16, 320, 480}, {3, 200, 517}, {161, 7}};
  for (ElementType type : {ElementType::int8, ElementType::uint8, ElementType::int32, ElementType::int64, ElementType::float32,
                           ElementType::float64, ElementType::bfloat16, ElementType::float16}) {
    cpdispatch::detail::with_element_type(type, [&]<class E>(E*) {
      constexpr ElementType kind = cpdispatch::element_type_of<E>();
      using Storage = typename cpdispatch::cuda::kernels::combine_element<kind>::storage;
      const std::vector<E> attention = dedup_test::values<E>(1200, 7, false);
      for (const auto& copies : copy_sets) {
        for (std::size_t k = 0; k < 32; ++k) {  // out's misalignment (k % 16 elements) and length
          const std::size_t shift = k % 16, n = lengths[k / 16];
          SCOPED_TRACE(std::string(cpdispatch::element_name(type)) + ", " + std::to_string(copies.size()) + " copies from " +
                       std::to_string(copies[0]) + ", out shifted by " + std::to_string(shift) + ", " + std::to_string(n) + " elements");
          std::vector<E> expect(n + 16, E{}), got(n + 16, E{});
          cpdispatch::detail::fan_in_entry<E>(attention.data(), copies, n, 1, expect.data() + shift);
          std::vector<std::uint64_t> at;
          for (std::int64_t c : copies) at.push_back(static_cast<std::uint64_t>(c) * sizeof(E));
          for (unsigned lane = 0; lane < 32; ++lane) {
            const cpdispatch::cuda::kernels::ListedCopies<Storage> from{reinterpret_cast<const unsigned char*>(attention.data()), at.data(),
                                                                         at.size(), 0};
            cpdispatch::cuda::kernels::sum_copies<kind>(from, reinterpret_cast<Storage*>(got.data() + shift), n, lane);
          }
          EXPECT_EQ(dedup_test::bytes_of(got), dedup_test::bytes_of(expect));
        }
      }
    });
  }
}

// ---- the device sim, every rank ------------------------------------------------

class DedupDeviceSim : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, DedupDeviceSim, ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

TEST_P(DedupDeviceSim, MatchesTheHostPathsOnRandomPlans) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  DeviceSimWorld world(W, guarded());
  const std::vector<Case> cases = dedup_test::cases_for(W);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    for (const Kind& k : kinds_for(i, W)) {
      SCOPED_TRACE(c.name + ", " + k.name());
      const std::vector<Reference> ref = host_reference(W, c, k);
      std::vector<RankBuffers> b;
      for (std::size_t r = 0; r < U; ++r) b.push_back(buffers_for(c, r, k));
      world.run([&](DeviceSimTransport& t) { run_rank(t, c, k, b[static_cast<std::size_t>(t.rank())]); });
      world.synchronize();
      std::vector<DeviceResult> dev;
      for (const RankBuffers& rb : b) dev.push_back(results_of(rb));
      expect_matches_host(c, k, ref, dev);
    }
  }
}

// ---- NcclTransport -------------------------------------------------------------

/// Each case with one of three kinds in turn (the device sim covers them all).
void expect_nccl_matches_host(int W) {
  const auto U = static_cast<std::size_t>(W);
  const std::vector<Case> cases = dedup_test::cases_for(W);
  const Kind nccl_kinds[] = {{ElementType::int32, 3, false}, {ElementType::bfloat16, 8, false}, {ElementType::float32, 3, false}};
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Kind& k = nccl_kinds[i % 3];
    SCOPED_TRACE(c.name + ", " + k.name());
    const std::vector<Reference> ref = host_reference(W, c, k);
    std::vector<DeviceResult> dev(U);
    cptest::run_nccl(W, [&](NcclTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      RankBuffers b = buffers_for(c, r, k);
      run_rank(t, c, k, b);
      dev[r] = results_of(b);
    });
    expect_matches_host(c, k, ref, dev);
  }
}

TEST(DedupNccl, OneRankMatchesTheHostPaths) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_nccl_matches_host(1);
}

class DedupNcclWorlds : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Gpus, DedupNcclWorlds, ::testing::Values(2, 3, 4, 5, 6, 7, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

TEST_P(DedupNcclWorlds, MatchesTheHostPathsOnRandomPlans) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < W) GTEST_SKIP() << "needs " << W << " CUDA devices (this machine has " << count << ")";
  expect_nccl_matches_host(W);
}

// ---- a whole step in one CUDA graph ----------------------------------------------

TEST(DedupDeviceGraph, CapturedStepReplaysTheHostResults) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 4;
  const auto U = static_cast<std::size_t>(W);
  const Kind k{ElementType::bfloat16, 8, false};
  const auto meta = cpdispatch::plan_qkv(dedup_test::zigzag_plan(W, 2, 8 * W));
  const Case c{"zigzag", meta, cpdispatch::plan_kv_wire(meta)};
  DeviceSimWorld world(W, guarded());
  std::vector<std::unique_ptr<KvWireDispatcher<DeviceSimTransport>>> dd(U);
  std::vector<RankBuffers> b;
  for (std::size_t r = 0; r < U; ++r) b.push_back(buffers_for(c, r, k));
  auto step = [&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    dd[r]->forward(cbytes(b[r].mlp), mbytes(b[r].attention));
    dd[r]->reverse_combine(cbytes(b[r].dattn), mbytes(b[r].wire), mbytes(b[r].replica), mbytes(b[r].grad), k.type);
  };
  auto check = [&](const char* what) {
    const std::vector<Reference> ref = host_reference(W, c, k);
    for (std::size_t r = 0; r < U; ++r) {
      EXPECT_EQ(to_host(b[r].attention.data(), b[r].attention.size()), ref[r].attention) << what << ": attention, rank " << r;
      EXPECT_EQ(to_host(b[r].grad.data(), b[r].grad.size()), ref[r].grad_dedup) << what << ": grad, rank " << r;
    }
  };
  world.run([&](DeviceSimTransport& t) {
    dd[static_cast<std::size_t>(t.rank())] = std::make_unique<KvWireDispatcher<DeviceSimTransport>>(t, c.wire, k.token_bytes());
    step(t);  // warm-up: a step outside the capture
  });
  world.synchronize();
  check("run");
  for (RankBuffers& rb : b) {
    CPDISPATCH_CUDA_CHECK(cudaMemset(rb.attention.data(), 0xEE, rb.attention.size()));
    CPDISPATCH_CUDA_CHECK(cudaMemset(rb.grad.data(), 0xEE, rb.grad.size()));
  }
  cptest::device_sync();
  const cpdispatch::DeviceSimGraph graph = world.capture(step);
  world.synchronize();
  EXPECT_EQ(to_host(b[0].grad.data(), 1)[0], std::byte{0xEE}) << "the capture ran the step";
  const cpdispatch::cuda::Stream stream;
  graph.launch(stream.get());
  graph.launch(stream.get());  // twice in a row: the second overwrites what the first wrote
  stream.synchronize();
  check("replay");
}

// ---- one wire exchange per call, watched by a strict mock ----------------------

using dedup_device_test::Counts;
using dedup_device_test::Watcher;

using dedup_device_test::WatchedTransport;

/// Bytes rank `me` sends to (sending) or receives from each peer on the wire; 0 to itself.
Counts wire_counts(const cpdispatch::Metadata& wire_fwd, std::size_t me, bool sending, std::size_t tb) {
  const auto W = static_cast<std::size_t>(wire_fwd.world_size);
  Counts c(W, 0);
  for (std::size_t p = 0; p < W; ++p) {
    if (p != me) c[p] = static_cast<std::size_t>(sending ? wire_fwd.num_recv_tokens(p, me) : wire_fwd.num_recv_tokens(me, p)) * tb;
  }
  return c;
}

TEST(DedupDeviceMock, EachCallIsOneWireExchange) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 3;
  const auto U = static_cast<std::size_t>(W);
  const Kind k{ElementType::float16, 3, true};
  for (const Case& c : dedup_test::cases_for(W)) {
    SCOPED_TRACE(c.name);
    std::vector<std::unique_ptr<Watcher>> watchers;
    for (std::size_t me = 0; me < U; ++me) {
      watchers.push_back(std::make_unique<Watcher>());
      const Counts send = wire_counts(c.wire.fwd, me, true, k.token_bytes()), recv = wire_counts(c.wire.fwd, me, false, k.token_bytes());
      ::testing::InSequence in_order;
      EXPECT_CALL(*watchers[me], Call(send, recv));
      EXPECT_CALL(*watchers[me], Call(recv, send)).Times(3);  // the mirror image: reverse_combine twice, then in place
    }
    const std::vector<Reference> ref = host_reference(W, c, k);
    std::vector<RankBuffers> b;
    for (std::size_t r = 0; r < U; ++r) b.push_back(buffers_for(c, r, k));
    DeviceSimWorld world(W, guarded());
    world.run([&](DeviceSimTransport& sim) {
      const auto r = static_cast<std::size_t>(sim.rank());
      WatchedTransport t(sim, *watchers[r]);
      run_rank(t, c, k, b[r]);
    });
    world.synchronize();
    std::vector<DeviceResult> dev;
    for (const RankBuffers& rb : b) dev.push_back(results_of(rb));
    expect_matches_host(c, k, ref, dev);
  }
}

// ---- bad input: named errors, no exchange, nothing written ---------------------

TEST(DedupDeviceMock, ShortBuffersNameTheBufferAndSizesAndWriteNothing) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 2;
  const Kind k{ElementType::int32, 3, false};  // 12-byte tokens: no whole float64
  const auto meta = cpdispatch::plan_qkv(dedup_test::zigzag_plan(W, 1, 8));
  const Case c{"zigzag", meta, cpdispatch::plan_kv_wire(meta)};
  std::vector<Watcher> watchers(2);  // no expectations: any exchange fails the test
  std::vector<RankBuffers> b;
  for (std::size_t r = 0; r < 2; ++r) b.push_back(buffers_for(c, r, k));
  std::vector<std::vector<std::string>> messages(2);
  DeviceSimWorld world(W, guarded());
  world.run([&](DeviceSimTransport& sim) {
    const auto r = static_cast<std::size_t>(sim.rank());
    WatchedTransport t(sim, watchers[r]);
    KvWireDispatcher<WatchedTransport> dd(t, c.wire, k.token_bytes());
    RankBuffers& x = b[r];
    const auto short_of = [](const DeviceBytesBuffer& buf) { return cpdispatch::cuda::DeviceBytes(buf.data(), buf.size() - 4); };
    auto& m = messages[r];
    m.push_back(cptest::message_of<cpdispatch::capacity_error>([&] { dd.forward(short_of(x.mlp), mbytes(x.attention)); }));
    m.push_back(cptest::message_of<cpdispatch::capacity_error>([&] { dd.forward(cbytes(x.mlp), short_of(x.attention)); }));
    m.push_back(cptest::message_of<cpdispatch::capacity_error>(
        [&] { dd.reverse_combine(cbytes(x.dattn), short_of(x.wire), mbytes(x.replica), mbytes(x.grad), k.type); }));
    m.push_back(cptest::message_of<cpdispatch::capacity_error>(
        [&] { dd.reverse_combine_in_place(mbytes(x.consumed), short_of(x.replica), mbytes(x.grad), k.type); }));
    m.push_back(cptest::message_of<cpdispatch::invalid_input>(
        [&] { dd.reverse_combine(cbytes(x.dattn), mbytes(x.wire), mbytes(x.replica), mbytes(x.grad), ElementType::float64); }));
  });
  world.synchronize();
  for (std::size_t r = 0; r < 2; ++r) {
    const RankBuffers& x = b[r];
    const std::string who = "KvWireDispatcher::forward (rank " + std::to_string(r) + " of 2): ";
    EXPECT_THAT(messages[r][0], HasSubstr(who + "mlp holds " + std::to_string(x.mlp.size() - 4) + " bytes, the plan needs " +
                                          std::to_string(x.mlp.size())));
    EXPECT_THAT(messages[r][1], HasSubstr(who + "attention holds " + std::to_string(x.attention.size() - 4) + " bytes, the plan needs " +
                                          std::to_string(x.attention.size())));
    EXPECT_THAT(messages[r][2], HasSubstr("KvWireDispatcher::reverse_combine (rank " + std::to_string(r) + " of 2): wire holds " +
                                          std::to_string(x.wire.size() - 4) + " bytes, the plan needs " + std::to_string(x.wire.size())));
    EXPECT_THAT(messages[r][3], HasSubstr("KvWireDispatcher::reverse_combine_in_place (rank " + std::to_string(r) + " of 2): replica holds " +
                                          std::to_string(x.replica.size() - 4) + " bytes, the plan needs " + std::to_string(x.replica.size())));
    EXPECT_THAT(messages[r][4], HasSubstr("KvWireDispatcher::reverse_combine (rank " + std::to_string(r) +
                                          " of 2): token_bytes = 12 is not a multiple of the 8-byte float64 element"));
    EXPECT_EQ(to_host(x.attention.data(), x.attention.size()), Bytes(x.attention.size(), std::byte{0xA5}));
    EXPECT_EQ(to_host(x.wire.data(), x.wire.size()), Bytes(x.wire.size(), std::byte{0x5A})) << "the fan-in ran before the checks";
    EXPECT_EQ(to_host(x.replica.data(), x.replica.size()), Bytes(x.replica.size(), std::byte{0x33}));
    EXPECT_EQ(to_host(x.grad.data(), x.grad.size()), Bytes(x.grad.size(), std::byte{0x77}));
    EXPECT_EQ(to_host(x.consumed.data(), x.consumed.size()), to_host(x.dattn.data(), x.dattn.size())) << "the in-place fan-in ran";
  }
}

}  // namespace
