// CudnnAttentionKernel on a real GPU against HostAttentionKernel (same
// entries, same bf16/fp16 inputs): forward out and lse, backward dq, dk, dv,
// for causal, window and full masks, MHA and GQA, whole KV groups and parts
// of documents with their own diagonals; deterministic backward bitwise
// repeatable. Skips where there is no CUDA device (CI); run on a GPU by
// tools/gpu-check.sh (`ctest -L cudnn`).

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/cudnn/attention.hpp"

namespace {

using namespace cpdispatch;

bool have_gpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { (void)cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  std::span<T> span() { return {p, n}; }
  std::span<const T> cspan() const { return {p, n}; }
};

template <class E>
std::vector<E> random(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<E> v(n);
  for (auto& x : v) x = E(d(rng));
  return v;
}

template <class E>
double max_abs(const std::vector<E>& v) {
  double m = 0;
  for (const E& x : v) m = std::max(m, std::abs(static_cast<double>(static_cast<float>(x))));
  return m;
}

template <class E>
void expect_close(const std::vector<E>& got, const std::vector<E>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  const double scale = std::max(max_abs(want), 1e-6);
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double a = static_cast<float>(got[i]), b = static_cast<float>(want[i]);
    if (std::isinf(b)) {
      EXPECT_EQ(a, b) << what << "[" << i << "]";
      continue;
    }
    worst = std::max(worst, std::abs(a - b));
  }
  EXPECT_LE(worst, rel * scale) << what << ": max error " << worst << " of max " << scale;
}

template <class E>
void run_case(const AttentionShape& shape, const AttentionMask& mask, const std::vector<AttentionEntry>& entries,
              std::int64_t tokens_q, std::int64_t tokens_kv) {  // `mask`: what the entries' bands came from, for messages
  SCOPED_TRACE(::testing::Message() << to_string(mask) << " heads " << shape.heads_q << "/" << shape.heads_kv
                                    << " d " << shape.head_dim);
  std::mt19937 rng(11);
  const auto nq = static_cast<std::size_t>(tokens_q * shape.heads_q * shape.head_dim);
  const auto nk = static_cast<std::size_t>(tokens_kv * shape.heads_kv * shape.head_dim);
  const auto q = random<E>(nq, rng), k = random<E>(nk, rng), v = random<E>(nk, rng), dout = random<E>(nq, rng);
  // the host kernel: the reference
  HostAttentionKernel host(HostAttentionOptions{.threads = 2});
  std::vector<E> out(nq, E(0.0f)), dq(nq, E(0.0f)), dk(nk, E(0.0f)), dv(nk, E(0.0f));
  std::vector<float> lse(static_cast<std::size_t>(shape.heads_q * tokens_q), 0.0f);
  host.forward<E>(shape, entries, q, k, v, out, lse);
  host.backward<E>(shape, entries, q, k, v, out, lse, dout, dq, dk, dv);

  Dev<E> dq_in(q), dk_in(k), dv_in(v), d_dout(dout), d_out(std::vector<E>(nq, E(0.0f)));
  Dev<float> d_lse(std::vector<float>(lse.size(), 0.0f));
  cuda::CudnnAttentionKernel kernel(nullptr);
  kernel.forward<E>(shape, entries, dq_in.cspan(), dk_in.cspan(), dv_in.cspan(), d_out.span(), d_lse.span());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_close(d_out.get(), out, 2e-2, "out");
  expect_close(d_lse.get(), lse, 2e-3, "lse");

  // backward from the host's out and lse (the whole attention's)
  Dev<E> h_out(out), g_dq(std::vector<E>(nq, E(9.0f))), g_dk(std::vector<E>(nk, E(9.0f))), g_dv(std::vector<E>(nk, E(9.0f)));
  Dev<float> h_lse(lse);
  auto backward = [&] {
    kernel.backward<E>(shape, entries, dq_in.cspan(), dk_in.cspan(), dv_in.cspan(), h_out.cspan(), h_lse.cspan(),
                       d_dout.cspan(), g_dq.span(), g_dk.span(), g_dv.span());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };
  backward();
  const auto dq1 = g_dq.get(), dk1 = g_dk.get(), dv1 = g_dv.get();
  expect_close(dq1, dq, 3e-2, "dq");
  expect_close(dk1, dk, 3e-2, "dk");
  expect_close(dv1, dv, 3e-2, "dv");
  backward();  // deterministic: bitwise the same
  const auto dq2 = g_dq.get();
  for (std::size_t i = 0; i < dq1.size(); ++i) ASSERT_EQ(dq1[i].bits, dq2[i].bits) << "dq[" << i << "] not reproducible";
  EXPECT_GE(kernel.plan_count(), 2u);
}

TEST(CudnnAttentionGpu, WholeKvGroupsEveryMask) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::int64_t> cu_q{0, 100, 137, 437}, cu_kv{0, 100, 137, 437};
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(64)}) {
    const auto entries = layout_entries(cu_q, cu_kv, mask);
    run_case<bfloat16>({8, 2, 64, 0.125f}, mask, entries, 437, 437);
    run_case<float16>({4, 4, 128, 0.088f}, mask, entries, 437, 437);
  }
}

TEST(CudnnAttentionGpu, PartsOfDocumentsWithTheirOwnBands) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // a document of 300 tokens: queries 200..299 against key parts 0..99
  // (seen whole), 100..199 and 200..299 (the diagonal), plus queries placed
  // before their keys (nothing seen) and a short KV group; each part's band
  // is the mask's moved to its rows (query row 0 at document position d of its keys)
  auto part = [](const AttentionMask& mask, std::int64_t q0, std::int64_t lq, std::int64_t k0, std::int64_t lk, std::int64_t d) {
    return AttentionEntry{q0, lq, k0, lk, mask.band().shifted(d + k0 - q0)};
  };
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(150), AttentionMask::full()}) {
    const std::vector<AttentionEntry> entries{part(mask, 0, 100, 0, 100, 200), part(mask, 100, 100, 100, 100, 100),
                                              part(mask, 200, 100, 200, 100, 0), part(mask, 300, 50, 300, 60, -20),
                                              part(mask, 350, 70, 360, 90, 20)};
    run_case<bfloat16>({8, 2, 64, 0.125f}, mask, entries, 420, 450);
  }
  // an inverse causal and a bi-causal band (slices' shapes)
  const std::vector<AttentionEntry> slices{{0, 128, 0, 192, {0, Band::unbounded_hi}}, {128, 128, 192, 128, {40, 100}}};
  run_case<bfloat16>({8, 2, 64, 0.125f}, AttentionMask::full(), slices, 256, 320);
}

}  // namespace
