// bench_cuda_attention: the device attention kernels against a cuBLAS bf16
// GEMM on the same GPU, side by side in one run: cuDNN's fused attention
// (cuda::CudnnAttentionKernel, when the cpdispatch::cudnn component is built)
// and the correctness-first cuda::CudaAttentionKernel.
//
// A case is a batch of documents, each attended as one entry (its queries
// against its own keys). For each (case, element type, kernel) it reports:
//   first_ms  the first forward and backward call on a new kernel object,
//             host wall time until the stream has run them (cuDNN builds its
//             execution plans there);
//   fwd_ms, bwd_ms  CUDA-event medians of --repeats calls after a warm-up;
//   fwd_tflops, bwd_tflops  FLOPs as flash-attention counts them: forward
//             4 * pairs * head_dim * heads_q over the (query, key) pairs the
//             mask lets through, backward 2.5 times that;
//   gemm_tflops  the peer, measured right before the case: cuBLAS GEMM
//             8192 x 8192 x 8192, bf16 in and out, fp32 accumulation
//             (cublasGemmEx, CUBLAS_COMPUTE_32F);
//   fwd_frac, bwd_frac  the kernel's rates over the peer's;
//   host_us   median host wall time of one forward + backward call pair in
//             the steady state, until the calls return (no synchronisation).
// The case "causal-8192" (bf16, heads 32/8, head_dim 128) carries targets:
// fwd_frac >= 0.50 and bwd_frac >= 0.35; a "target" line says met or missed.
// Without a CUDA device it says so and exits 0; a row that throws prints its
// error, the run goes on and exits 1.
//
//   bench_cuda_attention [--kernel cudnn|cuda|both] [--types bf16,fp16,float] [--cases targets|legacy|quick]
//                        [--repeats 5] [--deterministic 1|0|both] [--seed 1]
//
// --cases targets (default): causal 4096, 8192 and 16384 tokens with heads
// 32/8 of 128, and "prolong-64k-window4096": 65536 tokens of documents drawn
// from data/prolong.json (seeded by --seed, the last one cut to fit), window
// 4096, heads 64/8 of 128 (reported, no target). --cases legacy: the rows of
// benchmarks/RESULTS.md's 2026-11-26 GPU table (their own types). --kernel
// defaults to cudnn when the component is built, else cuda; cuDNN takes bf16
// and fp16 only (float rows are skipped for it). --deterministic picks
// cuDNN's backward (CudnnAttentionOptions::deterministic; "cudnn-nd" rows
// are the non-deterministic one). The document lengths are read from
// $CPDISPATCH_DOC_LENGTHS_DIR, else the source tree's data/, else ./data.
// The CudaAttentionKernel (a thread per query row and head) needs seconds
// per call at these sizes: use it with --cases legacy or quick.
#include <cublas_v2.h>
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
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_flops.hpp"
#include "device_bench.cuh"
#include "cpdispatch/cuda/attention.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/workload/workload.hpp"
#ifndef CPDISPATCH_BENCH_CUDNN  // set by CMake when cpdispatch::cudnn is linked
#define CPDISPATCH_BENCH_CUDNN 0
#endif
#if CPDISPATCH_BENCH_CUDNN
#include "cpdispatch/cudnn/attention.hpp"
#endif

namespace {

using bench::median;
using bench::random_device;
using bench::read_lengths;

using Clock = std::chrono::steady_clock;
using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::bfloat16;
using cpdispatch::float16;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::Event;

constexpr bool have_cudnn = CPDISPATCH_BENCH_CUDNN != 0;

struct Case {
  std::string name;                 // one word, for the parseable lines
  std::optional<std::string> type;  // set: this type only (legacy rows); unset: every --types
  std::vector<std::int64_t> docs;   // document lengths, packed in this order
  std::int64_t heads_q, heads_kv, head_dim;
  AttentionMask mask;
  bool target = false;  // carries the fwd >= 0.50, bwd >= 0.35 targets
};

/// `tokens` tokens of documents drawn from `sample` with `seed`, the last cut to fit.
std::vector<std::int64_t> packed_batch(const std::vector<std::int64_t>& sample, std::int64_t tokens, std::uint64_t seed) {
  std::vector<std::int64_t> docs;
  for (const auto& d : cpdispatch::draw_workload(sample, 1, tokens, seed)) {
    std::int64_t len = 0;
    for (const auto& piece : d.pieces) len += piece.len;
    docs.push_back(len);
  }
  return docs;
}

std::vector<Case> cases_named(const std::string& name, std::uint64_t seed) {
  const auto causal = AttentionMask::causal();
  if (name == "quick") {
    return {{"quick-1024-mha", "float", {1024}, 1, 1, 128, causal},
            {"quick-1024-gqa", "bf16", {1024}, 8, 2, 64, causal},
            {"quick-4x512-gqa", std::nullopt, {512, 512, 512, 512}, 32, 8, 128, causal}};
  }
  if (name == "legacy") {
    const auto w = AttentionMask::sliding_window(1024);
    return {{"causal-4096", "float", {4096}, 1, 1, 128, causal},     {"causal-8192", "float", {8192}, 1, 1, 128, causal},
            {"causal-16384", "float", {16384}, 1, 1, 128, causal},   {"causal-1024", "float", {1024}, 8, 2, 64, causal},
            {"causal-4096", "float", {4096}, 32, 8, 128, causal},    {"causal-4096", "bf16", {4096}, 32, 8, 128, causal},
            {"window1024-4096", "bf16", {4096}, 32, 8, 128, w}};
  }
  std::vector<Case> out{{"causal-8192", std::nullopt, {8192}, 32, 8, 128, causal, true},
                        {"causal-4096", std::nullopt, {4096}, 32, 8, 128, causal},
                        {"causal-16384", std::nullopt, {16384}, 32, 8, 128, causal}};
  const std::vector<std::int64_t> prolong = read_lengths("prolong");
  if (prolong.empty()) {
    std::printf("prolong-64k-window4096: data/prolong.json not found (set CPDISPATCH_DOC_LENGTHS_DIR); case left out\n");
  } else {
    out.push_back({"prolong-64k-window4096", std::nullopt, packed_batch(prolong, 65536, seed), 64, 8, 128,
                   AttentionMask::sliding_window(4096)});
  }
  return out;
}

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_cuda_attention: %s failed (cuBLAS status %d)\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

/// Median milliseconds of `repeats` runs of fn on `stream` (CUDA events), after `warmup` runs.
template <class Fn>
double median_ms(int repeats, cudaStream_t stream, Fn&& fn, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  const Event start(cudaEventDefault), stop(cudaEventDefault);
  for (int i = 0; i < repeats; ++i) {
    start.record(stream);
    fn();
    stop.record(stream);
    CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0;
    CPDISPATCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    t.push_back(ms);
  }
  return bench::median(t);
}

/// TFLOP/s of cuBLAS GEMM 8192 x 8192 x 8192: bf16 A, B and C, fp32 accumulation.
double gemm_tflops(cublasHandle_t handle, int repeats, cudaStream_t stream) {
  constexpr int n = 8192;
  const auto count = static_cast<std::size_t>(n) * n;
  const DeviceBuffer<bfloat16> a = random_device<bfloat16>(count, 11, stream), b = random_device<bfloat16>(count, 12, stream);
  DeviceBuffer<bfloat16> c(count);
  const float one = 1.0f, zero = 0.0f;
  const double ms = median_ms(
      std::max(repeats, 10), stream,
      [&] {
        check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n, b.data(), CUDA_R_16BF, n, &zero,
                                  c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx");
      },
      3);
  return 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) * 1e-12;
}

struct Timing {
  double first_forward_ms = 0, first_backward_ms = 0;
  double forward_ms = 0, backward_ms = 0;
  double host_us = 0;
};

/// Host milliseconds of fn() until the stream has run it.
template <class Fn>
double synchronised_ms(cudaStream_t stream, Fn&& fn) {
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto start = Clock::now();
  fn();
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

template <class E, class Kernel>
Timing time_kernel(Kernel& kernel, const Case& c, int repeats, cudaStream_t stream) {
  const AttentionShape shape{c.heads_q, c.heads_kv, c.head_dim, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  std::vector<std::int64_t> cu{0};  // the documents back to back, each one entry
  for (const std::int64_t len : c.docs) cu.push_back(cu.back() + len);
  const std::vector<AttentionEntry> entries = cpdispatch::layout_entries(cu, cu, c.mask);
  const std::int64_t tokens = cu.back();
  const auto nq = static_cast<std::size_t>(tokens * c.heads_q * c.head_dim), nk = static_cast<std::size_t>(tokens * c.heads_kv * c.head_dim);
  const DeviceBuffer<E> q = random_device<E>(nq, 1, stream), k = random_device<E>(nk, 2, stream), v = random_device<E>(nk, 3, stream),
                        dout = random_device<E>(nq, 4, stream);
  DeviceBuffer<E> out(nq), dq(nq), dk(nk), dv(nk);
  DeviceBuffer<float> lse(static_cast<std::size_t>(tokens * c.heads_q));
  const auto cs = [](const DeviceBuffer<E>& b, std::size_t n) { return std::span<const E>(b.data(), n); };
  const auto ms = [](DeviceBuffer<E>& b, std::size_t n) { return std::span<E>(b.data(), n); };
  const std::span<float> lse_out(lse.data(), lse.size());
  const auto forward = [&] { kernel.template forward<E>(shape, entries, cs(q, nq), cs(k, nk), cs(v, nk), ms(out, nq), lse_out); };
  const auto backward = [&] {
    kernel.template backward<E>(shape, entries, cs(q, nq), cs(k, nk), cs(v, nk), cs(out, nq), std::span<const float>(lse_out),
                                cs(dout, nq), ms(dq, nq), ms(dk, nk), ms(dv, nk));
  };
  Timing t;
  t.first_forward_ms = synchronised_ms(stream, forward);
  t.first_backward_ms = synchronised_ms(stream, backward);
  t.forward_ms = median_ms(repeats, stream, forward);
  t.backward_ms = median_ms(repeats, stream, backward);
  std::vector<double> host;
  for (int i = 0; i < repeats; ++i) {
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto start = Clock::now();
    forward();
    backward();
    host.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  t.host_us = median(host);
  return t;
}

/// One of the kernels a row runs.
struct KernelChoice {
  const char* label;  // cuda, cudnn, cudnn-nd
  bool cudnn;
  bool deterministic;
};

template <class E>
Timing time_choice(const KernelChoice& k, const Case& c, int repeats, cudaStream_t stream) {
  if (!k.cudnn) {
    cpdispatch::cuda::CudaAttentionKernel kernel(stream);
    return time_kernel<E>(kernel, c, repeats, stream);
  }
#if CPDISPATCH_BENCH_CUDNN
  if constexpr (cpdispatch::cuda::cudnn_attention_type<E>) {
    cpdispatch::cuda::CudnnAttentionKernel kernel(stream, {.deterministic = k.deterministic});
    return time_kernel<E>(kernel, c, repeats, stream);
  }
#endif
  std::fprintf(stderr, "bench_cuda_attention: unreachable: cuDNN row of an unsupported type\n");
  std::exit(1);
}

std::string mask_name(const AttentionMask& m) {
  if (m.type == cpdispatch::MaskType::sliding_window) return "window" + std::to_string(m.window);
  return m.type == cpdispatch::MaskType::full ? "full" : "causal";
}

/// "bf16,fp16" -> {"bf16", "fp16"} (bfloat16 / float16 / fp32 accepted too); empty on an unknown name.
std::vector<std::string> type_list(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string t = text.substr(at, comma - at);
    if (t == "bf16" || t == "bfloat16") out.push_back("bf16");
    else if (t == "fp16" || t == "float16" || t == "half") out.push_back("fp16");
    else if (t == "float" || t == "fp32" || t == "float32") out.push_back("float");
    else return {};
    at = comma + 1;
  }
  return out;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_cuda_attention [--kernel cudnn|cuda|both] [--types bf16,fp16,float] [--cases targets|legacy|quick]\n"
               "                            [--repeats 5] [--deterministic 1|0|both] [--seed 1]\n");
  return 2;
}

int run(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a line as soon as it is measured
  int repeats = 5;
  std::string cases = "targets", kernel = have_cudnn ? "cudnn" : "cuda", deterministic = "1";
  std::vector<std::string> types{"bf16"};
  std::uint64_t seed = 1;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc) return usage();
    const std::string v = argv[i + 1];
    if (a == "--repeats") repeats = std::max(1, std::atoi(v.c_str()));
    else if (a == "--cases") cases = v;
    else if (a == "--kernel") kernel = v;
    else if (a == "--types") types = type_list(v);
    else if (a == "--deterministic") deterministic = v;
    else if (a == "--seed") seed = std::strtoull(v.c_str(), nullptr, 10);
    else return usage();
  }
  if (cases != "targets" && cases != "legacy" && cases != "quick") return usage();
  if (kernel != "cudnn" && kernel != "cuda" && kernel != "both") return usage();
  if (deterministic != "1" && deterministic != "0" && deterministic != "both") return usage();
  if (types.empty()) return std::fprintf(stderr, "bench_cuda_attention: --types is a comma-separated list of bf16, fp16, float\n"), 2;
  if (kernel != "cuda" && !have_cudnn) {
    return std::fprintf(stderr, "bench_cuda_attention: --kernel %s: built without cuDNN (CPDISPATCH_WITH_CUDNN, cpdispatch::cudnn)\n", kernel.c_str()), 2;
  }
  std::vector<KernelChoice> kernels;
  if (kernel != "cudnn") kernels.push_back({"cuda", false, false});
  if (kernel != "cuda") {
    if (deterministic != "0") kernels.push_back({"cudnn", true, true});
    if (deterministic != "1") kernels.push_back({"cudnn-nd", true, false});
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, compute %d.%d; median of %d runs after a warm-up (CUDA events)", prop.name, prop.multiProcessorCount,
              prop.major, prop.minor, repeats);
#if CPDISPATCH_BENCH_CUDNN
  std::printf("; cuDNN %zu (built with %d)", cudnnGetVersion(), CUDNN_VERSION);
#endif
  std::printf("\n");
  const cpdispatch::cuda::Stream stream;
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  check_cublas(cublasSetStream(handle, stream.get()), "cublasSetStream");
  int failures = 0;
  for (const Case& c : cases_named(cases, seed)) {
    std::int64_t tokens = 0, longest = 0;
    for (const std::int64_t len : c.docs) tokens += len, longest = std::max(longest, len);
    double flop = 0;
    for (const std::int64_t len : c.docs) flop += bench::forward_flop(c.mask, len, c.heads_q, c.head_dim);
    for (const std::string& type : c.type ? std::vector<std::string>{*c.type} : types) {
      double peer = 0;
      for (const KernelChoice& k : kernels) {
        if (k.cudnn && type == "float") {
          std::printf("attn %s %s %s skipped: cuDNN's fused attention takes bf16 and fp16\n", k.label, type.c_str(), c.name.c_str());
          continue;
        }
        try {
          if (peer == 0) peer = gemm_tflops(handle, repeats, stream.get());  // once per (case, type), right before it
          const Timing t = type == "float"  ? time_choice<float>(k, c, repeats, stream.get())
                           : type == "fp16" ? time_choice<float16>(k, c, repeats, stream.get())
                                            : time_choice<bfloat16>(k, c, repeats, stream.get());
          const double fwd = flop / (t.forward_ms * 1e-3) * 1e-12, bwd = 2.5 * flop / (t.backward_ms * 1e-3) * 1e-12;
          std::printf("attn %s %s %s tokens %lld docs %zu longest %lld heads %lld/%lld dim %lld mask %s fwd_gflop %.1f first_ms %.1f/%.1f fwd_ms %.3f "
                      "fwd_tflops %.1f bwd_ms %.3f bwd_tflops %.1f gemm_tflops %.1f fwd_frac %.3f bwd_frac %.3f host_us %.1f\n",
                      k.label, type.c_str(), c.name.c_str(), static_cast<long long>(tokens), c.docs.size(), static_cast<long long>(longest),
                      static_cast<long long>(c.heads_q), static_cast<long long>(c.heads_kv), static_cast<long long>(c.head_dim),
                      mask_name(c.mask).c_str(), flop * 1e-9, t.first_forward_ms, t.first_backward_ms, t.forward_ms, fwd, t.backward_ms, bwd, peer, fwd / peer,
                      bwd / peer, t.host_us);
          if (c.target && k.cudnn && type == "bf16") {
            const bool met = fwd / peer >= 0.50 && bwd / peer >= 0.35;
            std::printf("target %s %s %s: fwd_frac %.3f (>= 0.50) bwd_frac %.3f (>= 0.35): %s\n", k.label, type.c_str(), c.name.c_str(),
                        fwd / peer, bwd / peer, met ? "met" : "MISSED");
          }
        } catch (const std::exception& e) {
          ++failures;
          std::printf("attn %s %s %s error: %s\n", k.label, type.c_str(), c.name.c_str(), e.what());
        }
      }
    }
  }
  cublasDestroy(handle);
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a failure outside a row (a sticky CUDA error, say): say what, not abort
    std::printf("bench_cuda_attention: error: %s\n", e.what());
    return 1;
  }
}
