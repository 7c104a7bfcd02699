// bench_cuda_dedup: the deduplicated KV exchange (KvWireDispatcher) against
// the section 2 KV path (Dispatcher over kv_fwd / kv_rev) on the single-GPU
// simulation (W virtual ranks on one GPU), side by side in one run.
//
//   bin/bench_cuda_dedup [world_size=8] [tokens_per_rank=16384] [iterations=20]
//   bin/bench_cuda_dedup --check [world_size=4] [tokens_per_rank=64]
//
// Plan: zig-zag causal balancing (Megatron-LM / TransformerEngine): 2
// documents per rank, each cut into 2W chunks, chunk i attended on rank
// min(i, 2W-1-i), so every rank holds two query shards of every document.
// One step = the KV forward and backward of every rank, bf16 gradients:
//   section 2: Dispatcher::forward + Dispatcher::reverse_combine
//   dedup:     KvWireDispatcher::forward + KvWireDispatcher::reverse_combine
// Each is captured once as a CUDA graph (all ranks) and replayed; the two
// alternate, a sample is one replay timed with CUDA events, the median is
// reported. Columns: KV bytes crossing between ranks per step (both
// directions, all ranks), milliseconds, and speedup = section 2 / dedup.
//
// --check: no timing; the dedup step's attention layout is byte-identical to
// the section 2 step's and its gradient bit-identical to the host
// KvWireDispatcher's over the host sim. Exits 1 on any difference.
// Results: benchmarks/RESULTS.md.

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "stats.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::KvWireDispatcher;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::DeviceConstBytes;
using cpdispatch::DeviceSimGraph;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::Event;
using cpdispatch::cuda::Stream;
using Bytes = DeviceBuffer<std::byte>;
using HostBytes = std::vector<std::byte>;
using I = std::int64_t;

/// Zig-zag causal balancing: two documents of `tokens_per_rank / 2` tokens
/// per rank, each cut into 2W chunks, chunk i attended on min(i, 2W-1-i).
cpdispatch::QkvPlan zigzag(I W, I tokens_per_rank) {
  cpdispatch::QkvPlan plan;
  plan.world_size = W;
  plan.ranks.resize(static_cast<std::size_t>(W));
  const I chunk = std::max<I>(1, tokens_per_rank / (4 * W));
  for (auto& rank : plan.ranks) {
    for (int k = 0; k < 2; ++k) {
      cpdispatch::Document d;
      for (I i = 0; i < 2 * W; ++i) {
        d.shard_len.push_back(chunk);
        d.dst.push_back(std::min(i, 2 * W - 1 - i));
      }
      rank.docs.push_back(d);
    }
  }
  return plan;
}

/// KV bytes that cross between ranks in one forward + backward.
double off_rank_bytes(const cpdispatch::Metadata& fwd, std::size_t tb) {
  double tokens = 0;
  for (I d = 0; d < fwd.world_size; ++d) {
    for (I s = 0; s < fwd.world_size; ++s) {
      if (s != d) tokens += static_cast<double>(fwd.num_recv_tokens(d, s));
    }
  }
  return 2 * tokens * static_cast<double>(tb);
}

/// n bfloat16 values in [-1, 1] that depend on `salt`.
HostBytes gradients(std::size_t bytes, std::size_t salt) {
  HostBytes out(bytes);
  for (std::size_t i = 0; i + 1 < bytes; i += 2) {
    const float v = static_cast<float>(static_cast<int>((i * 2654435761u + salt * 97) % 2001) - 1000) / 1000.0f;
    const cpdispatch::bfloat16 b(v);
    std::memcpy(out.data() + i, &b, 2);
  }
  return out;
}

/// One rank's buffers of both paths.
struct RankState {
  std::unique_ptr<Dispatcher<DeviceSimTransport>> plain;
  std::unique_ptr<KvWireDispatcher<DeviceSimTransport>> dedup;
  Bytes mlp, dattn, attention, dedup_attention, replica, wire, grad, dedup_grad;
};

void build(DeviceSimTransport& t, const cpdispatch::QkvMetadata& meta, const cpdispatch::KvWireMetadata& wire, std::size_t tb, RankState& s) {
  s.plain = std::make_unique<Dispatcher<DeviceSimTransport>>(t, meta.kv_fwd, meta.kv_rev, tb);
  s.dedup = std::make_unique<KvWireDispatcher<DeviceSimTransport>>(t, wire, tb);
  const auto& n = s.dedup->required_bytes();
  const HostBytes mlp = gradients(n.mlp_bytes, static_cast<std::size_t>(t.rank())),
                  dattn = gradients(n.attention_bytes, 100 + static_cast<std::size_t>(t.rank()));
  s.mlp.allocate(mlp.size());
  s.dattn.allocate(dattn.size());
  s.mlp.upload(std::span<const std::byte>(mlp), t.stream());
  s.dattn.upload(std::span<const std::byte>(dattn), t.stream());
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));  // the uploads read the host vectors
  s.attention.allocate(n.attention_bytes);
  s.dedup_attention.allocate(n.attention_bytes);
  s.replica.allocate(n.replica_bytes);
  s.wire.allocate(n.wire_bytes);
  s.grad.allocate(n.mlp_bytes);
  s.dedup_grad.allocate(n.mlp_bytes);
}

void plain_step(RankState& s) {
  s.plain->forward(DeviceConstBytes(s.mlp.span()), s.attention.span());
  s.plain->reverse_combine(DeviceConstBytes(s.dattn.span()), s.replica.span(), s.grad.span(), ElementType::bfloat16);
}
void dedup_step(RankState& s) {
  s.dedup->forward(DeviceConstBytes(s.mlp.span()), s.dedup_attention.span());
  s.dedup->reverse_combine(DeviceConstBytes(s.dattn.span()), s.wire.span(), s.replica.span(), s.dedup_grad.span(), ElementType::bfloat16);
}

using bench::median;

double replay_ms(const DeviceSimGraph& graph, const Stream& stream) {
  Event start(cudaEventDefault), stop(cudaEventDefault);
  start.record(stream.get());
  graph.launch(stream.get());
  stop.record(stream.get());
  CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(stop.get()));
  float ms = 0;
  CPDISPATCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return ms;
}

/// One row: medians of alternating replays of both steps.
void run(DeviceSimWorld& world, const cpdispatch::QkvMetadata& meta, const cpdispatch::KvWireMetadata& wire, std::size_t tb, int iterations) {
  std::vector<RankState> state(static_cast<std::size_t>(world.world_size()));
  world.run([&](DeviceSimTransport& t) {
    RankState& s = state[static_cast<std::size_t>(t.rank())];
    build(t, meta, wire, tb, s);
    plain_step(s);  // warm-up, outside the captures
    dedup_step(s);
  });
  world.synchronize();
  const DeviceSimGraph plain = world.capture([&](DeviceSimTransport& t) { plain_step(state[static_cast<std::size_t>(t.rank())]); });
  const DeviceSimGraph dedup = world.capture([&](DeviceSimTransport& t) { dedup_step(state[static_cast<std::size_t>(t.rank())]); });
  const Stream stream;
  std::vector<double> p_ms, d_ms;
  for (int i = 0; i < 3 + iterations; ++i) {  // alternate, so that drift hits both; 3 warm-up replays
    const double p = replay_ms(plain, stream), d = replay_ms(dedup, stream);
    if (i >= 3) {
      p_ms.push_back(p);
      d_ms.push_back(d);
    }
  }
  const double p = median(p_ms), d = median(d_ms);
  std::printf("| %zu | %.1f | %.1f | %.3f | %.3f | %.2f |\n", tb, off_rank_bytes(meta.kv_fwd, tb) / 1e6, off_rank_bytes(wire.fwd, tb) / 1e6, p,
              d, p / d);
  std::fflush(stdout);
  world.synchronize();
}

/// The host KvWireDispatcher's gradient and the section 2 attention layout, per rank.
void host_reference(int W, const cpdispatch::QkvMetadata& meta, const cpdispatch::KvWireMetadata& wire, std::size_t tb,
                    std::vector<HostBytes>& attention, std::vector<HostBytes>& grad) {
  cpdispatch::SimWorld host(W);
  host.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    Dispatcher kv(t, meta.kv_fwd, meta.kv_rev, tb);
    KvWireDispatcher dd(t, wire, tb);
    const auto& n = dd.required_bytes();
    const HostBytes mlp = gradients(n.mlp_bytes, r), dattn = gradients(n.attention_bytes, 100 + r);
    HostBytes w(n.wire_bytes), replica(n.replica_bytes);
    attention[r].resize(n.attention_bytes);
    grad[r].resize(n.mlp_bytes);
    kv.forward(mlp, attention[r]);
    dd.reverse_combine(dattn, w, replica, grad[r], ElementType::bfloat16);
  });
}

HostBytes to_host(const Bytes& b) {
  HostBytes out(b.size());
  if (!out.empty()) CPDISPATCH_CUDA_CHECK(cudaMemcpy(out.data(), b.data(), b.size(), cudaMemcpyDeviceToHost));
  return out;
}

/// --check [W] [tokens]: correctness only (any machine with the CUDA runtime, or the cuda-cpu harness).
int run_check(int argc, char** argv) {
  const int W = argc > 2 ? std::atoi(argv[2]) : 4;
  const I tokens = argc > 3 ? std::atoll(argv[3]) : 64;
  if (W < 1 || tokens < 1) {
    std::fprintf(stderr, "usage: %s --check [world_size>=1] [tokens_per_rank>=1]\n", argv[0]);
    return 2;
  }
  const auto meta = cpdispatch::plan_qkv(zigzag(W, tokens));
  const auto wire = cpdispatch::plan_kv_wire(meta);
  bool ok = true;
  for (std::size_t tb : {std::size_t{16}, std::size_t{1000}}) {
    const auto U = static_cast<std::size_t>(W);
    std::vector<HostBytes> attention(U), grad(U);
    host_reference(W, meta, wire, tb, attention, grad);
    std::vector<RankState> state(U);
    DeviceSimWorld world(W);
    world.run([&](DeviceSimTransport& t) {
      RankState& s = state[static_cast<std::size_t>(t.rank())];
      build(t, meta, wire, tb, s);
      dedup_step(s);
    });
    world.synchronize();
    for (std::size_t r = 0; r < U; ++r) {
      if (to_host(state[r].dedup_attention) != attention[r] || to_host(state[r].dedup_grad) != grad[r]) {
        std::fprintf(stderr, "bench_cuda_dedup --check: rank %zu differs from the host (token bytes %zu)\n", r, tb);
        ok = false;
      }
    }
  }
  std::printf("bench_cuda_dedup --check: W %d: %s\n", W, ok ? "identical to the host paths" : "DIFFERENT");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--check") {
    try {
      return run_check(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_cuda_dedup --check: %s\n", e.what());
      return 1;
    }
  }
  const int W = argc > 1 ? std::atoi(argv[1]) : 8;
  const I tokens = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("bench_cuda_dedup: no CUDA device; nothing measured\n");
    return 0;
  }
  if (W < 1 || tokens < 1 || iterations < 1) {
    std::fprintf(stderr, "usage: %s [world_size>=1] [tokens_per_rank>=1] [iterations>=1]\n", argv[0]);
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const auto meta = cpdispatch::plan_qkv(zigzag(W, tokens));
    const auto wire = cpdispatch::plan_kv_wire(meta);
    std::printf("bench_cuda_dedup on %s: %d virtual ranks, %lld tokens per rank, zig-zag, KV forward + backward (bf16), "
                "median of %d graph replays\n\n",
                prop.name, W, static_cast<long long>(tokens), iterations);
    std::printf("| token bytes | section 2 MB off-rank | dedup MB off-rank | section 2 ms | dedup ms | speedup |\n"
                "|---:|---:|---:|---:|---:|---:|\n");
    DeviceSimWorld world(W);
    for (std::size_t tb : {std::size_t{256}, std::size_t{1024}, std::size_t{4096}}) run(world, meta, wire, tb, iterations);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_dedup: %s\n", e.what());
    return 1;
  }
  return 0;
}
