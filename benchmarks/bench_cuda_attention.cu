// bench_cuda_attention: the device attention kernel (cuda::CudaAttentionKernel)
// against cuBLAS SGEMM on the same GPU, side by side in one run.
//
// For each case (one document of L tokens, attended as one entry) it times
// forward and backward with CUDA events (median of --repeats after one warm-up)
// and reports their FLOP rates as flash-attention counts them (forward
// 4 * pairs * head_dim * heads_q over the pairs the mask lets through,
// backward 2.5 times that). Right before each case the peer is timed: cuBLAS
// SGEMM of an [L x 128] x [128 x L] product in full fp32 (no TF32); the
// ratios are kernel rate / peer rate. The kernel is the correctness-first one
// (a thread per query row and head, no tiling): flash-attention's kernels are
// the fast path on a GPU. Without a CUDA device it says so and exits 0.
//
//   bench_cuda_attention [--repeats 3] [--cases default|quick]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attention_flops.hpp"
#include "cpdispatch/cuda/attention.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/float16.hpp"

namespace {

using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::Event;

struct Case {
  const char* type;  // float, bfloat16
  std::int64_t tokens, heads_q, heads_kv, head_dim;
  AttentionMask mask;
};

std::vector<Case> cases_named(const std::string& name) {
  const auto causal = AttentionMask::causal();
  if (name == "quick") return {{"float", 1024, 1, 1, 128, causal}, {"bfloat16", 1024, 8, 2, 64, causal}};
  // The host benchmark's cases (one head), then 32 query heads over 8 key-value heads, where the
  // kernel's thread per (row, head) has enough threads to fill the GPU.
  return {{"float", 4096, 1, 1, 128, causal},     {"float", 8192, 1, 1, 128, causal},
          {"float", 16384, 1, 1, 128, causal},    {"float", 1024, 8, 2, 64, causal},
          {"float", 4096, 32, 8, 128, causal},    {"bfloat16", 4096, 32, 8, 128, causal},
          {"bfloat16", 4096, 32, 8, 128, AttentionMask::sliding_window(1024)}};
}

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_cuda_attention: %s failed (cuBLAS status %d)\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

/// Median milliseconds of `repeats` runs of fn on `stream`, after one warm-up.
template <class Fn>
double median_ms(int repeats, cudaStream_t stream, Fn&& fn) {
  fn();
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
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class E>
DeviceBuffer<E> random_device(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<E> host(n);
  for (E& e : host) {
    if constexpr (std::is_same_v<E, float>) {
      e = u(rng);
    } else {
      e.bits = E::from_float(u(rng));
    }
  }
  DeviceBuffer<E> b(n);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), n * sizeof(E), cudaMemcpyHostToDevice));
  return b;
}

/// GFLOP/s of cuBLAS SGEMM [L x 128] x [128 x L] (fp32 math, no TF32).
double sgemm_rate(cublasHandle_t handle, std::int64_t L, int repeats, cudaStream_t stream) {
  std::mt19937 rng(1);
  const auto K = 128;
  const DeviceBuffer<float> a = random_device<float>(static_cast<std::size_t>(L * K), rng), b = random_device<float>(static_cast<std::size_t>(L * K), rng);
  DeviceBuffer<float> c(static_cast<std::size_t>(L * L));
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(L);
  const double ms = median_ms(repeats, stream, [&] {
    check_cublas(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, K, &one, a.data(), n, b.data(), K, &zero, c.data(), n), "cublasSgemm");
  });
  return 2.0 * static_cast<double>(L) * static_cast<double>(L) * K / (ms * 1e-3) * 1e-9;
}

struct Timing {
  double forward_ms, backward_ms;
};

template <class E>
Timing time_kernel(const Case& c, int repeats, cudaStream_t stream) {
  const AttentionShape shape{c.heads_q, c.heads_kv, c.head_dim, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  const auto nq = static_cast<std::size_t>(c.tokens * c.heads_q * c.head_dim), nk = static_cast<std::size_t>(c.tokens * c.heads_kv * c.head_dim);
  std::mt19937 rng(2);
  const DeviceBuffer<E> q = random_device<E>(nq, rng), k = random_device<E>(nk, rng), v = random_device<E>(nk, rng), dout = random_device<E>(nq, rng);
  DeviceBuffer<E> out(nq), dq(nq), dk(nk), dv(nk);
  DeviceBuffer<float> lse(static_cast<std::size_t>(c.tokens * c.heads_q));
  const cpdispatch::AttentionEntry entry{0, c.tokens, 0, c.tokens, 0};
  const std::span<const cpdispatch::AttentionEntry> entries(&entry, 1);
  cpdispatch::cuda::CudaAttentionKernel kernel(stream);
  const auto cs = [](const DeviceBuffer<E>& b) { return std::span<const E>(b.data(), b.size()); };
  const auto ms = [](const DeviceBuffer<E>& b) { return std::span<E>(b.data(), b.size()); };
  const std::span<float> lse_out(lse.data(), lse.size());
  Timing t{};
  t.forward_ms = median_ms(repeats, stream, [&] { kernel.forward<E>(shape, c.mask, entries, cs(q), cs(k), cs(v), ms(out), lse_out); });
  t.backward_ms = median_ms(repeats, stream, [&] {
    kernel.backward<E>(shape, c.mask, entries, cs(q), cs(k), cs(v), cs(out), std::span<const float>(lse_out), cs(dout), ms(dq), ms(dk), ms(dv));
  });
  return t;
}

std::string mask_name(const AttentionMask& m) {
  if (m.type == cpdispatch::MaskType::sliding_window) return "window " + std::to_string(m.window);
  return m.type == cpdispatch::MaskType::full ? "full" : "causal";
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 3;
  std::string cases = "default";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--repeats") repeats = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--cases") cases = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: bench_cuda_attention [--repeats 3] [--cases default|quick]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; median of %d runs after a warm-up (CUDA events)\n", prop.name, prop.multiProcessorCount, repeats);
  const cpdispatch::cuda::Stream stream;
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  check_cublas(cublasSetStream(handle, stream.get()), "cublasSetStream");
  check_cublas(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  std::printf("%-9s %6s %6s %4s %-12s %9s %9s %9s %9s %10s %7s %7s\n", "type", "L", "heads", "dim", "mask", "fwd ms", "fwd GF/s",
              "bwd ms", "bwd GF/s", "SGEMM GF/s", "fwd/pr", "bwd/pr");
  for (const Case& c : cases_named(cases)) {
    const double peer = sgemm_rate(handle, c.tokens, repeats, stream.get());
    const Timing t = std::string(c.type) == "float" ? time_kernel<float>(c, repeats, stream.get())
                                                    : time_kernel<cpdispatch::bfloat16>(c, repeats, stream.get());
    const double flop = bench::forward_flop(c.mask, c.tokens, c.heads_q, c.head_dim);
    const double fwd = flop / (t.forward_ms * 1e-3) * 1e-9, bwd = 2.5 * flop / (t.backward_ms * 1e-3) * 1e-9;
    const std::string heads = std::to_string(c.heads_q) + "/" + std::to_string(c.heads_kv);
    std::printf("%-9s %6lld %6s %4lld %-12s %9.2f %9.1f %9.2f %9.1f %10.1f %7.3f %7.3f\n", c.type, static_cast<long long>(c.tokens),
                heads.c_str(), static_cast<long long>(c.head_dim), mask_name(c.mask).c_str(), t.forward_ms, fwd, t.backward_ms, bwd, peer,
                fwd / peer, bwd / peer);
    std::fflush(stdout);
  }
  cublasDestroy(handle);
  return 0;
}
