// bench_cuda_cp_attention: one attention layer's step (forward + backward) of
// ContextParallelAttention<DeviceSimTransport, bfloat16, cuda::CudnnAttentionKernel>
// on the single-GPU simulation: W virtual ranks on one GPU, each a host
// thread with its own stream, exchanging by device-to-device copies.
//
// The batch: W x --tokens tokens of documents drawn from data/prolong.json
// with --seed (draw_workload: packed rank after rank, a long document
// continuing on the next ranks), balanced by plan_balanced (up to 2W shards a
// document, as bench_cp_attention), causal, bf16, heads 32/8 of 128.
// Reported per stage count:
//   first_step_ms  host wall time of the first step until every stream has
//                  run it (cuDNN builds its execution plans there);
//   step_ms        median over --repeats steps (after a warm-up) from the
//                  first rank's start to the last rank's end, CUDA events on
//                  the ranks' streams;
//   step_tflops    the batch's attention FLOPs (flash-attention's count:
//                  forward 4 * causal pairs * head_dim * heads_q, backward
//                  2.5x) over step_ms: all W ranks share this one GPU;
//   host_ms        median host wall time of a rank's forward + backward
//                  calls until they return (no synchronisation; the slowest
//                  rank's);
//   exchange_ms    the same step with a kernel that does nothing: the
//                  exchanges and the op's own work alone;
//   kernel_share   kernel_alone_ms / step_ms, where kernel_alone_ms (its own
//                  "kernel_alone" line, measured first) is every rank's
//                  forward + backward kernel calls on the entries of its
//                  share's attention layout, one rank after another on one
//                  stream; exchange_free_share = 1 - exchange_ms / step_ms.
// A stage count the device op refuses is reported as "refused" with its
// message, and the run goes on. Without a CUDA device it says so and exits 0.
//
//   bench_cuda_cp_attention [--world 8] [--tokens 8192] [--stages 1,2,4] [--repeats 5] [--seed 0]
//                           [--heads-q 32] [--heads-kv 8] [--head-dim 128] [--dedup 1] [--deterministic 1]
//
// The document lengths are read from $CPDISPATCH_DOC_LENGTHS_DIR, else the
// source tree's data/, else ./data.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "device_bench.cuh"
#include "stage_list.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/cuda/context_parallel.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/cudnn/attention.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/model/cost.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/transports/device_sim.hpp"

namespace {

using bench::stage_list;

using bench::median;
using bench::random_device;
using bench::read_lengths;

using Clock = std::chrono::steady_clock;
using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::bfloat16;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::CudnnAttentionKernel;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::DeviceSpan;
using cpdispatch::cuda::Event;

struct Config {
  int world = 8;
  std::int64_t tokens = 8192, heads_q = 32, heads_kv = 8, head_dim = 128;
  std::vector<int> stages{1, 2, 4};
  int repeats = 5;
  std::uint64_t seed = 0;
  bool dedup = true, deterministic = true;
};

/// A kernel that attends nothing: the step's exchanges alone. (Plain
/// signatures: nvcc flags the unused instantiations of variadic ones.)
struct NoKernel {
  using In = std::span<const bfloat16>;
  using Out = std::span<bfloat16>;
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::device;
  void forward(const AttentionShape&, std::span<const AttentionEntry>, In, In, In, Out, std::span<float>) {}
  void backward(const AttentionShape&, std::span<const AttentionEntry>, In, In, In, In, std::span<const float>, In, Out, Out, Out) {}
};

using CudnnOp = cpdispatch::ContextParallelAttention<DeviceSimTransport, bfloat16, CudnnAttentionKernel>;
using ExchangeOp = cpdispatch::ContextParallelAttention<DeviceSimTransport, bfloat16, NoKernel>;

/// One rank's tensors in the MLP layout: q, out, dout, dq [T][heads_q][D]; k, v, dk, dv [T][heads_kv][D].
struct RankTensors {
  std::size_t nq = 0, nk = 0;
  DeviceBuffer<bfloat16> q, k, v, dout, out, dq, dk, dv;
};

/// What a rank's attention layout asks of the kernel: its entries and token counts.
struct RankLayout {
  std::vector<AttentionEntry> entries;
  std::int64_t q_tokens = 0, kv_tokens = 0;
};

/// Milliseconds between two events.
double elapsed_ms(const Event& from, const Event& to) {
  float ms = 0;
  CPDISPATCH_CUDA_CHECK(cudaEventElapsedTime(&ms, from.get(), to.get()));
  return ms;
}

struct StepTimes {
  double first_ms = 0, step_ms = 0, host_ms = 0;
};

/// Builds one op per rank with `make`, runs a first step (timed on the host
/// until the streams are done), a warm-up, then `repeats` timed steps.
template <class Op, class Make>
StepTimes time_steps(DeviceSimWorld& world, const Config& c, std::vector<RankTensors>& tensors, Make&& make) {
  const auto W = static_cast<std::size_t>(c.world);
  std::vector<std::unique_ptr<Op>> ops(W);
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    ops[r] = make(t);
  });
  std::vector<Event> start, stop;
  for (std::size_t r = 0; r < W; ++r) start.emplace_back(cudaEventDefault), stop.emplace_back(cudaEventDefault);
  std::vector<double> host(W);
  const auto step = [&](bool record) {
    world.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      RankTensors& x = tensors[r];
      const auto in = [](const DeviceBuffer<bfloat16>& b, std::size_t n) { return DeviceSpan<const bfloat16>(b.data(), n); };
      const auto out = [](DeviceBuffer<bfloat16>& b, std::size_t n) { return DeviceSpan<bfloat16>(b.data(), n); };
      if (record) start[r].record(t.stream());
      const auto begin = Clock::now();
      ops[r]->forward(in(x.q, x.nq), in(x.k, x.nk), in(x.v, x.nk), out(x.out, x.nq));
      ops[r]->backward(in(x.dout, x.nq), out(x.dq, x.nq), out(x.dk, x.nk), out(x.dv, x.nk));
      host[r] = std::chrono::duration<double, std::milli>(Clock::now() - begin).count();
      if (record) stop[r].record(t.stream());
    });
  };
  StepTimes s;
  world.synchronize();
  const auto first = Clock::now();
  step(false);
  world.synchronize();
  s.first_ms = std::chrono::duration<double, std::milli>(Clock::now() - first).count();
  step(false);  // warm-up: every buffer and plan is in place from here on
  world.synchronize();
  std::vector<double> steps, hosts;
  for (int i = 0; i < c.repeats; ++i) {
    step(true);
    world.synchronize();
    // first rank's start to last rank's end, all on the one device's clock
    std::size_t first_rank = 0;
    for (std::size_t r = 1; r < W; ++r) {
      if (elapsed_ms(start[first_rank], start[r]) < 0) first_rank = r;
    }
    double end = 0;
    for (std::size_t r = 0; r < W; ++r) end = std::max(end, elapsed_ms(start[first_rank], stop[r]));
    steps.push_back(end);
    hosts.push_back(*std::max_element(host.begin(), host.end()));
  }
  s.step_ms = median(steps);
  s.host_ms = median(hosts);
  return s;
}

struct KernelAlone {
  double forward_ms = 0, backward_ms = 0;
};

/// Every rank's forward and backward kernel calls on its own entries, one rank
/// after another on one stream: medians per rank, summed over the ranks.
KernelAlone time_kernel_alone(const Config& c, const std::vector<RankLayout>& layouts) {
  const AttentionShape shape{c.heads_q, c.heads_kv, c.head_dim, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  std::int64_t most_q = 1, most_kv = 1;
  for (const RankLayout& l : layouts) most_q = std::max(most_q, l.q_tokens), most_kv = std::max(most_kv, l.kv_tokens);
  const auto nq = static_cast<std::size_t>(most_q * c.heads_q * c.head_dim), nk = static_cast<std::size_t>(most_kv * c.heads_kv * c.head_dim);
  const DeviceBuffer<bfloat16> q = random_device<bfloat16>(nq, 101), k = random_device<bfloat16>(nk, 102), v = random_device<bfloat16>(nk, 103), dout = random_device<bfloat16>(nq, 104);
  DeviceBuffer<bfloat16> out(nq), dq(nq), dk(nk), dv(nk);
  DeviceBuffer<float> lse(static_cast<std::size_t>(most_q * c.heads_q));
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  const cpdispatch::cuda::Stream stream;
  CudnnAttentionKernel kernel(stream.get(), {.deterministic = c.deterministic});
  const Event start(cudaEventDefault), mid(cudaEventDefault), stop(cudaEventDefault);
  KernelAlone total;
  for (const RankLayout& l : layouts) {
    const auto q_n = static_cast<std::size_t>(l.q_tokens * c.heads_q * c.head_dim), kv_n = static_cast<std::size_t>(l.kv_tokens * c.heads_kv * c.head_dim);
    const auto lse_n = static_cast<std::size_t>(l.q_tokens * c.heads_q);
    const auto in = [](const DeviceBuffer<bfloat16>& b, std::size_t n) { return std::span<const bfloat16>(b.data(), n); };
    const auto io = [](DeviceBuffer<bfloat16>& b, std::size_t n) { return std::span<bfloat16>(b.data(), n); };
    const auto call = [&] {
      kernel.forward<bfloat16>(shape, l.entries, in(q, q_n), in(k, kv_n), in(v, kv_n), io(out, q_n),
                               std::span<float>(lse.data(), lse_n));
      mid.record(stream.get());
      kernel.backward<bfloat16>(shape, l.entries, in(q, q_n), in(k, kv_n), in(v, kv_n), in(out, q_n),
                                std::span<const float>(lse.data(), lse_n), in(dout, q_n), io(dq, q_n), io(dk, kv_n), io(dv, kv_n));
    };
    call();  // builds the plans this rank's groups need
    std::vector<double> fwd, bwd;
    for (int i = 0; i < c.repeats; ++i) {
      start.record(stream.get());
      call();
      stop.record(stream.get());
      CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(stop.get()));
      fwd.push_back(elapsed_ms(start, mid));
      bwd.push_back(elapsed_ms(mid, stop));
    }
    total.forward_ms += median(fwd);
    total.backward_ms += median(bwd);
  }
  return total;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_cuda_cp_attention [--world 8] [--tokens 8192] [--stages 1,2,4] [--repeats 5] [--seed 0]\n"
               "                               [--heads-q 32] [--heads-kv 8] [--head-dim 128] [--dedup 1] [--deterministic 1]\n");
  return 2;
}

int run(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a line as soon as it is measured
  Config c;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc) return usage();
    const std::string v = argv[i + 1];
    const long long n = std::atoll(v.c_str());
    if (a == "--world") c.world = static_cast<int>(n);
    else if (a == "--tokens") c.tokens = n;
    else if (a == "--stages") c.stages = stage_list(v);
    else if (a == "--repeats") c.repeats = static_cast<int>(n);
    else if (a == "--seed") c.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--heads-q") c.heads_q = n;
    else if (a == "--heads-kv") c.heads_kv = n;
    else if (a == "--head-dim") c.head_dim = n;
    else if (a == "--dedup") c.dedup = n != 0;
    else if (a == "--deterministic") c.deterministic = n != 0;
    else return usage();
  }
  if (c.world < 1 || c.tokens < 1 || c.repeats < 1 || c.stages.empty() || c.heads_q < 1 || c.heads_kv < 1 || c.heads_q % c.heads_kv != 0 ||
      c.head_dim < 1) {
    return usage();
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("no CUDA device; nothing measured\n");
    return 0;
  }
  const std::vector<std::int64_t> lengths = read_lengths("prolong");
  if (lengths.empty()) {
    std::fprintf(stderr, "bench_cuda_cp_attention: data/prolong.json not found (set CPDISPATCH_DOC_LENGTHS_DIR)\n");
    return 2;
  }
  const auto W = static_cast<std::size_t>(c.world);
  const std::int64_t Hq = c.heads_q, Hk = c.heads_kv, D = c.head_dim;

  // The batch and its balanced plan, as bench_cp_attention plans them.
  cpdispatch::BalanceProblem problem;
  problem.world_size = c.world;
  problem.documents = cpdispatch::draw_workload(lengths, c.world, c.tokens, c.seed);
  problem.max_cp_degree = std::max<std::int64_t>(2 * c.world, static_cast<std::int64_t>(cpdispatch::widest_span(problem.documents)));
  problem.q_bytes = Hq * D * static_cast<std::int64_t>(sizeof(bfloat16));
  problem.kv_bytes = 2 * Hk * D * static_cast<std::int64_t>(sizeof(bfloat16));
  cpdispatch::BalanceOptions balance;
  balance.dedup = c.dedup;
  cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(problem, balance);
  plan.dedup = c.dedup;
  double pairs = 0;
  std::int64_t longest = 0;
  for (const auto& doc : problem.documents) {
    std::int64_t L = 0;
    for (const auto& piece : doc.pieces) L += piece.len;
    longest = std::max(longest, L);
    pairs += static_cast<double>(L) * static_cast<double>(L + 1) / 2;
  }
  const double step_flop = 3.5 * 4.0 * pairs * static_cast<double>(D * Hq);  // forward + 2.5x backward
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan);
  double most = 0, sum = 0;
  for (const auto w : cost.attention) most = std::max(most, static_cast<double>(w)), sum += static_cast<double>(w);

  cudaDeviceProp prop{};
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; cuDNN %zu (built with %d)\n", prop.name, prop.multiProcessorCount, cudnnGetVersion(), CUDNN_VERSION);
  std::printf("cp W %d tokens_per_rank %lld heads %lld/%lld dim %lld bf16 causal prolong seed %llu docs %zu longest %lld dedup %d "
              "deterministic %d repeats %d work_max_over_mean %.3f step_gflop %.1f\n",
              c.world, static_cast<long long>(c.tokens), static_cast<long long>(Hq), static_cast<long long>(Hk), static_cast<long long>(D),
              static_cast<unsigned long long>(c.seed), problem.documents.size(), static_cast<long long>(longest), c.dedup ? 1 : 0,
              c.deterministic ? 1 : 0, c.repeats, sum > 0 ? most * static_cast<double>(W) / sum : 1.0, step_flop * 1e-9);

  std::vector<cpdispatch::RankQkvMetadata> shares;
  for (int r = 0; r < c.world; ++r) shares.push_back(cpdispatch::plan_qkv_for_rank(plan, r));
  const AttentionShape shape{Hq, Hk, D, 1.0f / std::sqrt(static_cast<float>(D))};
  std::vector<RankTensors> tensors(W);
  for (std::size_t r = 0; r < W; ++r) {
    RankTensors& x = tensors[r];
    x.nq = static_cast<std::size_t>(c.tokens * Hq * D);
    x.nk = static_cast<std::size_t>(c.tokens * Hk * D);
    const std::uint64_t s = 16 * r;
    x.q = random_device<bfloat16>(x.nq, s + 1), x.k = random_device<bfloat16>(x.nk, s + 2), x.v = random_device<bfloat16>(x.nk, s + 3), x.dout = random_device<bfloat16>(x.nq, s + 4);
    x.out.allocate(x.nq), x.dq.allocate(x.nq), x.dk.allocate(x.nk), x.dv.allocate(x.nk);
  }
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());

  // The kernel alone on every rank's layout (the share's, which the op attends as is with one stage).
  std::vector<RankLayout> layouts(W);
  std::int64_t most_q = 0, most_kv = 0;
  for (std::size_t r = 0; r < W; ++r) {
    const cpdispatch::RankAttentionLayout& a = shares[r].attn;
    cpdispatch::layout_entries(a.cu_seqlens_q, a.cu_seqlens_kv, a.mask, layouts[r].entries);
    layouts[r].q_tokens = a.q_tokens();
    layouts[r].kv_tokens = a.kv_tokens();
    most_q = std::max(most_q, a.q_tokens()), most_kv = std::max(most_kv, a.kv_tokens());
  }
  int failures = 0;
  double kernel_ms = 0;
  try {
    const KernelAlone k = time_kernel_alone(c, layouts);
    kernel_ms = k.forward_ms + k.backward_ms;
    std::printf("cp kernel_alone fwd_ms %.3f bwd_ms %.3f total_ms %.3f tflops %.1f q_tokens_max %lld kv_tokens_max %lld\n", k.forward_ms,
                k.backward_ms, kernel_ms, step_flop / (kernel_ms * 1e-3) * 1e-12, static_cast<long long>(most_q), static_cast<long long>(most_kv));
  } catch (const std::exception& e) {
    ++failures;
    std::printf("cp kernel_alone error: %s\n", e.what());
  }

  // A hung collective ends the run with an error instead of the lease.
  DeviceSimWorld world(c.world, cpdispatch::DeviceSimOptions{.timeout = std::chrono::milliseconds(120000)});
  for (const int stages : c.stages) {
    const cpdispatch::CpAttentionOptions options{.dedup = c.dedup, .stages = stages};
    StepTimes cudnn, exchange;
    try {
      cudnn = time_steps<CudnnOp>(world, c, tensors, [&](DeviceSimTransport& t) {
        return std::make_unique<CudnnOp>(t, shares[static_cast<std::size_t>(t.rank())], shape, options,
                                         CudnnAttentionKernel(t.stream(), {.deterministic = c.deterministic}));
      });
    } catch (const std::exception& e) {
      world.synchronize();
      const std::string what = e.what();
      const bool refused = what.find("stages") != std::string::npos;  // the op's refusal names the option
      if (!refused) ++failures;
      std::printf("cp stages %d %s: %s\n", stages, refused ? "refused" : "error", e.what());
      continue;
    }
    try {
      exchange = time_steps<ExchangeOp>(world, c, tensors, [&](DeviceSimTransport& t) {
        return std::make_unique<ExchangeOp>(t, shares[static_cast<std::size_t>(t.rank())], shape, options);
      });
    } catch (const std::exception& e) {
      world.synchronize();
      ++failures;
      std::printf("cp stages %d exchange-only run error: %s\n", stages, e.what());
    }
    std::printf("cp stages %d first_step_ms %.1f step_ms %.3f step_tflops %.1f host_ms %.3f exchange_ms %.3f exchange_host_ms %.3f "
                "kernel_share %.3f exchange_free_share %.3f\n",
                stages, cudnn.first_ms, cudnn.step_ms, step_flop / (cudnn.step_ms * 1e-3) * 1e-12, cudnn.host_ms, exchange.step_ms,
                exchange.host_ms, kernel_ms / cudnn.step_ms, exchange.step_ms > 0 ? 1.0 - exchange.step_ms / cudnn.step_ms : 0.0);
  }
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a failure outside a row (a sticky CUDA error, say): say what, not abort
    std::printf("bench_cuda_cp_attention: error: %s\n", e.what());
    return 1;
  }
}
