// bench_cuda_dispatch: the dispatcher's device data path on the single-GPU
// simulation (W virtual ranks on one GPU) against cudaMemcpyAsync moving the
// same bytes, in the same run.
//
//   bin/bench_cuda_dispatch [world_size=8] [tokens_per_rank=8192] [iterations=20]
//   bin/bench_cuda_dispatch --check [world_size=4] [tokens_per_rank=256]
//
// Plan: create_qkv_dispatch(W, tokens_per_rank, 16 documents per rank,
// max_cp_degree = the largest power of two <= min(W, 8)) -> plan_qkv. One step = Q forward, KV forward
// (every copy), Q reverse, KV reverse into the [C][T] replica buffer, on
// every rank: per rank and exchange, the pack kernel, one all_to_all_v
// (device-to-device copies between the ranks' buffers), the copy to itself
// and the unpack kernel, with the ranks' streams ordered by events.
//
// Baseline, "same bytes": the same step with every stage replaced by ONE
// cudaMemcpyAsync (device to device) of that stage's byte count on the
// same rank's stream (pack bytes, exchanged bytes, bytes to itself, unpack
// bytes): what moving those bytes costs when nothing is scattered. Each
// stage copies its own region of a buffer as large as the whole step moves,
// as the dispatcher's stages do, so small stages do not stay in L2.
//
// --check: no timing; the step's results (Q and KV forward, Q and KV
// reverse) compared byte for byte with the host dispatcher over the host sim
// transport, and the baseline's regions checked to be disjoint. Exits 1 on
// any difference.
//
// Both are captured once as CUDA graphs (DeviceSimWorld::capture: all ranks
// in one graph) and replayed; a sample is one replay timed with CUDA events
// on one stream; dispatch and baseline alternate, the median is reported.
// GB/s = bytes moved (the sum over ranks and stages of the bytes each stage
// copies) / median time; ratio = baseline time / dispatch time (1 = as fast
// as memcpy; target >= 0.7 for tokens of 1 KiB and more). Also: the pack
// kernel alone (rank 0's forward Q pack) against one cudaMemcpyAsync of its
// bytes. Results: benchmarks/RESULTS.md.

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "stats.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::DeviceBytes;
using cpdispatch::cuda::DeviceConstBytes;
using cpdispatch::DeviceSimGraph;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::Event;
using cpdispatch::cuda::Stream;
using Bytes = DeviceBuffer<std::byte>;

using bench::median;

/// The bytes each stage of one exchange copies, for one rank.
struct StageBytes {
  std::size_t pack = 0, exchange = 0, self = 0, unpack = 0;
  std::size_t total() const { return pack + exchange + self + unpack; }
};

std::size_t sum_of(const std::vector<cpdispatch::detail::CopyPiece>& pieces) {
  std::size_t n = 0;
  for (const auto& p : pieces) n += p.bytes;
  return n;
}

StageBytes stage_bytes(const cpdispatch::detail::ExchangePlan& ex) {
  StageBytes b;
  b.pack = ex.send.direct ? 0 : sum_of(ex.send.copies);
  for (std::size_t c : ex.recv.counts) b.exchange += c;
  b.self = sum_of(ex.self);
  b.unpack = ex.recv.direct ? 0 : sum_of(ex.recv.copies);
  return b;
}

/// The baseline's buffer: one region per stage, back to back.
std::size_t baseline_bytes(const std::vector<std::size_t>& stages) {
  std::size_t n = 0;
  for (std::size_t s : stages) n += s;
  return n;
}

/// Median milliseconds of `launch()` on `stream`, timed with events.
template <class Launch>
double time_ms(cudaStream_t stream, int iterations, Launch&& launch) {
  Event start(cudaEventDefault), stop(cudaEventDefault);
  std::vector<double> samples;
  for (int i = 0; i < iterations; ++i) {
    start.record(stream);
    launch();
    stop.record(stream);
    CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0;
    CPDISPATCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    samples.push_back(ms);
  }
  return median(samples);
}

struct Row {
  std::size_t token_bytes;
  double moved_gb, dispatch_ms, baseline_ms, pack_gbs, pack_memcpy_gbs;
};

Row run(DeviceSimWorld& world, const cpdispatch::QkvMetadata& qkv, std::size_t tb, int iterations) {
  const int W = world.world_size();
  const auto U = static_cast<std::size_t>(W);
  std::vector<std::unique_ptr<Dispatcher<DeviceSimTransport>>> q(U), kv(U);
  std::vector<Bytes> q_mlp(U), q_attn(U), q_back(U), kv_mlp(U), kv_attn(U), kv_replica(U), scratch_in(U), scratch_out(U);
  std::vector<std::vector<std::size_t>> stages(U);  // the baseline's memcpy sizes, in step order
  double moved = 0;
  for (int r = 0; r < W; ++r) {
    for (const auto* pair : {&qkv.q_fwd, &qkv.kv_fwd}) {
      const auto& rev = pair == &qkv.q_fwd ? qkv.q_rev : qkv.kv_rev;
      const auto plan = cpdispatch::detail::plan_dispatch(pair->get_slice(r), rev.get_slice(r), tb, r, W);
      for (const auto* ex : {&plan.forward, &plan.reverse}) {
        const StageBytes b = stage_bytes(*ex);
        for (std::size_t n : {b.pack, b.exchange, b.self, b.unpack}) {
          if (n) stages[static_cast<std::size_t>(r)].push_back(n);
        }
        moved += static_cast<double>(b.total());
      }
    }
  }
  // Dispatchers and buffers (contents do not matter for timing), then graphs.
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    q[r] = std::make_unique<Dispatcher<DeviceSimTransport>>(t, qkv.q_fwd, qkv.q_rev, tb);
    kv[r] = std::make_unique<Dispatcher<DeviceSimTransport>>(t, qkv.kv_fwd, qkv.kv_rev, tb);
    q_mlp[r].allocate(q[r]->required_bytes().mlp_bytes);
    q_attn[r].allocate(q[r]->required_bytes().attention_bytes);
    q_back[r].allocate(q[r]->required_bytes().replica_bytes);
    kv_mlp[r].allocate(kv[r]->required_bytes().mlp_bytes);
    kv_attn[r].allocate(kv[r]->required_bytes().attention_bytes);
    kv_replica[r].allocate(kv[r]->required_bytes().replica_bytes);
    const std::size_t total = baseline_bytes(stages[r]);
    scratch_in[r].allocate(total);
    scratch_out[r].allocate(total);
    for (Bytes* b : {&q_mlp[r], &kv_mlp[r], &scratch_in[r]}) {
      if (b->size()) CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(b->data(), 0x3c, b->size(), t.stream()));
    }
  });
  world.synchronize();
  auto step = [&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    q[r]->forward(DeviceConstBytes(q_mlp[r].span()), q_attn[r].span());
    kv[r]->forward(DeviceConstBytes(kv_mlp[r].span()), kv_attn[r].span());
    q[r]->reverse(DeviceConstBytes(q_attn[r].span()), q_back[r].span());
    kv[r]->reverse(DeviceConstBytes(kv_attn[r].span()), kv_replica[r].span());
  };
  auto baseline = [&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    std::size_t at = 0;
    for (std::size_t n : stages[r]) {  // each stage its own region: nothing is read twice in one step
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(scratch_out[r].data() + at, scratch_in[r].data() + at, n, cudaMemcpyDeviceToDevice, t.stream()));
      at += n;
    }
  };
  world.run(step);  // warm-up (first-touch of everything)
  world.synchronize();
  const DeviceSimGraph dispatch_graph = world.capture(step);
  const DeviceSimGraph baseline_graph = world.capture(baseline);
  const Stream stream;
  std::vector<double> d_ms, b_ms;
  for (int i = 0; i < 3; ++i) {
    dispatch_graph.launch(stream.get());
    baseline_graph.launch(stream.get());
  }
  for (int i = 0; i < iterations; ++i) {  // alternate, so that drift hits both
    d_ms.push_back(time_ms(stream.get(), 1, [&] { dispatch_graph.launch(stream.get()); }));
    b_ms.push_back(time_ms(stream.get(), 1, [&] { baseline_graph.launch(stream.get()); }));
  }

  // The pack kernel alone: rank 0's forward Q pack against one memcpy of its bytes.
  Row row{tb, moved / 1e9, median(d_ms), median(b_ms), 0, 0};
  const auto plan0 = cpdispatch::detail::plan_dispatch(qkv.q_fwd.get_slice(0), qkv.q_rev.get_slice(0), tb, 0, W);
  const auto& pack = plan0.forward.send.copies;
  const std::size_t pack_bytes = sum_of(pack);
  if (pack_bytes) {
    const auto chunks = cpdispatch::cuda::plan_copy_chunks(pack);
    DeviceBuffer<cpdispatch::cuda::CopyChunk> d_chunks(chunks.size());
    d_chunks.upload(chunks, stream.get());
    Bytes staging(plan0.forward.send.staging);
    const double k_ms = time_ms(stream.get(), iterations, [&] {
      cpdispatch::cuda::launch_copy(q_mlp[0].data(), staging.data(), d_chunks.data(), chunks.size(), stream.get());
    });
    const double m_ms = time_ms(stream.get(), iterations, [&] {
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(staging.data(), q_mlp[0].data(), pack_bytes, cudaMemcpyDeviceToDevice, stream.get()));
    });
    row.pack_gbs = static_cast<double>(pack_bytes) / (k_ms * 1e6);
    row.pack_memcpy_gbs = static_cast<double>(pack_bytes) / (m_ms * 1e6);
  }
  world.synchronize();
  return row;
}

/// The step on the device sim against the host dispatcher over the host sim, byte for byte.
bool check(int W, const cpdispatch::QkvMetadata& qkv, std::size_t tb) {
  const auto U = static_cast<std::size_t>(W);
  using HostBytes = std::vector<std::byte>;
  std::vector<HostBytes> q_in(U), kv_in(U), host_out(U * 4), device_out(U * 4);
  auto pattern = [](std::size_t n, std::size_t salt) {
    HostBytes b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 131 + salt * 7 + (i >> 9)) & 0xff);
    return b;
  };
  cpdispatch::SimWorld host(W);
  host.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    Dispatcher q(t, qkv.q_fwd, qkv.q_rev, tb), kv(t, qkv.kv_fwd, qkv.kv_rev, tb);
    q_in[r] = pattern(q.required_bytes().mlp_bytes, r);
    kv_in[r] = pattern(kv.required_bytes().mlp_bytes, r + 100);
    HostBytes q_attn(q.required_bytes().attention_bytes), kv_attn(kv.required_bytes().attention_bytes);
    HostBytes q_back(q.required_bytes().replica_bytes), kv_replica(kv.required_bytes().replica_bytes);
    q.forward(q_in[r], q_attn);
    kv.forward(kv_in[r], kv_attn);
    q.reverse(q_attn, q_back);
    kv.reverse(kv_attn, kv_replica);
    host_out[r * 4] = q_attn;
    host_out[r * 4 + 1] = kv_attn;
    host_out[r * 4 + 2] = q_back;
    host_out[r * 4 + 3] = kv_replica;
  });
  DeviceSimWorld world(W);
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    Dispatcher q(t, qkv.q_fwd, qkv.q_rev, tb), kv(t, qkv.kv_fwd, qkv.kv_rev, tb);
    Bytes q_mlp(q_in[r].size()), kv_mlp(kv_in[r].size()), q_attn(q.required_bytes().attention_bytes),
        kv_attn(kv.required_bytes().attention_bytes), q_back(q.required_bytes().replica_bytes), kv_replica(kv.required_bytes().replica_bytes);
    q_mlp.upload(std::span<const std::byte>(q_in[r]), t.stream());
    kv_mlp.upload(std::span<const std::byte>(kv_in[r]), t.stream());
    for (Bytes* b : {&q_attn, &kv_attn, &q_back, &kv_replica}) {  // as the host's zeroed vectors: slots no copy fills stay 0
      if (b->size()) CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, b->size(), t.stream()));
    }
    q.forward(DeviceConstBytes(q_mlp.span()), q_attn.span());
    kv.forward(DeviceConstBytes(kv_mlp.span()), kv_attn.span());
    q.reverse(DeviceConstBytes(q_attn.span()), q_back.span());
    kv.reverse(DeviceConstBytes(kv_attn.span()), kv_replica.span());
    t.barrier();  // no rank frees its buffers while another still reads them
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
    const Bytes* outs[4] = {&q_attn, &kv_attn, &q_back, &kv_replica};
    for (std::size_t k = 0; k < 4; ++k) {
      device_out[r * 4 + k].resize(outs[k]->size());
      if (outs[k]->size()) {
        CPDISPATCH_CUDA_CHECK(cudaMemcpy(device_out[r * 4 + k].data(), outs[k]->data(), outs[k]->size(), cudaMemcpyDeviceToHost));
      }
    }
    t.barrier();
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  });
  bool same = true;
  const char* names[4] = {"Q forward", "KV forward", "Q reverse", "KV reverse"};
  for (std::size_t i = 0; i < host_out.size(); ++i) {
    if (host_out[i] != device_out[i]) {
      std::fprintf(stderr, "bench_cuda_dispatch --check: %s of rank %zu differs from the host dispatcher (token bytes %zu)\n", names[i % 4], i / 4, tb);
      same = false;
    }
  }
  return same;
}

/// The baseline copies every stage from its own region (no stage reads bytes another already brought into cache).
bool check_baseline(int W, const cpdispatch::QkvMetadata& qkv, std::size_t tb) {
  for (int r = 0; r < W; ++r) {
    std::size_t moved = 0;
    std::vector<std::size_t> stages;
    for (const auto* pair : {&qkv.q_fwd, &qkv.kv_fwd}) {
      const auto& rev = pair == &qkv.q_fwd ? qkv.q_rev : qkv.kv_rev;
      const auto plan = cpdispatch::detail::plan_dispatch(pair->get_slice(r), rev.get_slice(r), tb, r, W);
      for (const auto* ex : {&plan.forward, &plan.reverse}) {
        const StageBytes b = stage_bytes(*ex);
        for (std::size_t n : {b.pack, b.exchange, b.self, b.unpack}) {
          if (n) stages.push_back(n);
        }
        moved += b.total();
      }
    }
    if (baseline_bytes(stages) != moved) {
      std::fprintf(stderr, "bench_cuda_dispatch --check: the baseline of rank %d covers %zu bytes, the step moves %zu\n", r, baseline_bytes(stages), moved);
      return false;
    }
  }
  return true;
}

/// --check [W] [tokens]: correctness only (any machine with the CUDA runtime, or the cuda-cpu harness).
int run_check(int argc, char** argv) {
  const int W = argc > 2 ? std::atoi(argv[2]) : 4;
  const std::int64_t tokens = argc > 3 ? std::atoll(argv[3]) : 256;
  if (W < 1 || tokens < 1) {
    std::fprintf(stderr, "usage: %s --check [world_size>=1] [tokens_per_rank>=1]\n", argv[0]);
    return 2;
  }
  std::int64_t cp = 1;
  while (cp * 2 <= std::min(W, 8)) cp *= 2;
  const std::int64_t T = std::max<std::int64_t>(tokens / cp * cp, cp);
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(W, T, 4, cp, 2024));
  bool ok = true;
  for (std::size_t tb : {std::size_t{16}, std::size_t{1000}}) ok = check(W, qkv, tb) && check_baseline(W, qkv, tb) && ok;
  std::printf("bench_cuda_dispatch --check: W %d, %lld tokens per rank: %s\n", W, static_cast<long long>(T), ok ? "identical to the host dispatcher" : "DIFFERENT");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--check") {
    try {
      return run_check(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_cuda_dispatch --check: %s\n", e.what());
      return 1;
    }
  }
  const int W = argc > 1 ? std::atoi(argv[1]) : 8;
  const std::int64_t tokens = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("bench_cuda_dispatch: no CUDA device; nothing measured\n");
    return 0;
  }
  if (W < 1 || tokens < 1 || iterations < 1) {
    std::fprintf(stderr, "usage: %s [world_size>=1] [tokens_per_rank>=1] [iterations>=1]\n", argv[0]);
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::int64_t cp = 1;
    while (cp * 2 <= std::min(W, 8)) cp *= 2;
    const std::int64_t T = tokens / cp * cp;
    const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(W, T, 16, cp, 2024));
    std::printf("bench_cuda_dispatch on %s: %d virtual ranks, %lld tokens per rank, 16 documents per rank, max CP degree %lld, "
                "median of %d graph replays\n\n",
                prop.name, W, static_cast<long long>(T), static_cast<long long>(cp), iterations);
    std::printf("| token bytes | moved GB | dispatch ms | dispatch GB/s | memcpy ms | memcpy GB/s | ratio | pack kernel GB/s | "
                "pack memcpy GB/s | pack ratio |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    DeviceSimWorld world(W);
    for (std::size_t tb : {std::size_t{128}, std::size_t{1024}, std::size_t{4096}, std::size_t{8192}}) {
      const Row r = run(world, qkv, tb, iterations);
      std::printf("| %zu | %.3f | %.3f | %.0f | %.3f | %.0f | %.2f | %.0f | %.0f | %.2f |\n", r.token_bytes, r.moved_gb, r.dispatch_ms,
                  r.moved_gb / (r.dispatch_ms * 1e-3), r.baseline_ms, r.moved_gb / (r.baseline_ms * 1e-3), r.baseline_ms / r.dispatch_ms,
                  r.pack_gbs, r.pack_memcpy_gbs, r.pack_memcpy_gbs > 0 ? r.pack_gbs / r.pack_memcpy_gbs : 0.0);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_dispatch: %s\n", e.what());
    return 1;
  }
  return 0;
}
