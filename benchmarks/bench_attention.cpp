// bench_attention: the host attention kernel (HostAttentionKernel on CBLAS
// block products) against OpenBLAS SGEMM, side by side in one run, with the
// same number of threads.
//
// For each case (one document of L tokens, attended as one entry) it times
// forward and backward (median over repetitions that fit --seconds, at least
// one) and reports their FLOP rates as flash-attention counts them: forward
// 4 * pairs * head_dim over the (query, key) pairs the mask lets through,
// backward 2.5 times that. Right before each case the peer is timed: SGEMM of
// an [L x 128] x [128 x L] product (L capped at --peer-cap), OpenBLAS with
// the same thread count; the ratios are kernel rate / peer rate.
//
//   bench_attention [--threads N] [--seconds 1.5] [--peer-cap 16384] [--cases default|all|quick]
//                   [--block-q 128] [--block-kv 256] [--sweep]
//
// --sweep measures the kernel's rate against the entry's length instead (one
// document of L = 128 .. 8192 tokens; heads 1 x 128, 8 : 2 x 64, 8 : 8 x 64;
// causal and full; the fastest of the repetitions, the run a shared machine
// disturbed least), fits the step model's kernel rate to it
// (cpdispatch/model/kernel_rate.hpp, fit_kernel_rate) and prints per case the
// measured rate, its fraction of SGEMM (of an [L x 128] x [128 x L] product),
// the model's rate and its error, then the fitted parameters of forward and
// backward, as bench_cp_attention's --kernel-rate reads them.
//
// The machine may be shared: compare the ratios of one run, not absolute rates across runs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention_flops.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/model/kernel_rate.hpp"
#include "stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;

struct Case {
  const char* type;  // float, bfloat16, float16
  std::int64_t tokens, heads_q, heads_kv, head_dim;
  AttentionMask mask;
  bool target;  // one of the cases with a target ratio
};

struct Options {
  int threads = 0;
  double seconds = 1.5;
  std::int64_t peer_cap = 16384;
  std::string cases = "default";
  std::int64_t block_q = 128, block_kv = 256;
  bool sweep = false;
};

std::vector<Case> cases_named(const std::string& name) {
  const auto causal = AttentionMask::causal();
  std::vector<Case> c{{"float", 4096, 1, 1, 128, causal, true},
                      {"float", 8192, 1, 1, 128, causal, true},
                      {"float", 16384, 1, 1, 128, causal, true},
                      {"float", 1024, 8, 2, 64, causal, false},
                      {"bfloat16", 4096, 1, 1, 128, causal, false},
                      {"float16", 4096, 1, 1, 128, causal, false},
                      {"float", 16384, 1, 1, 128, AttentionMask::sliding_window(1024), false},
                      {"float", 16384, 1, 1, 128, AttentionMask::sliding_window(4096), false}};
  if (name == "quick") return {{"float", 2048, 1, 1, 128, causal, true}, {"float", 1024, 8, 2, 64, causal, false}};
  if (name == "all") {
    c.push_back({"float", 4096, 1, 1, 128, AttentionMask::full(), false});
    c.push_back({"bfloat16", 1024, 8, 2, 64, causal, false});
  }
  return c;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--threads" && next) {
      o.threads = std::atoi(argv[++i]);
    } else if (a == "--seconds" && next) {
      o.seconds = std::atof(argv[++i]);
    } else if (a == "--peer-cap" && next) {
      o.peer_cap = std::atoll(argv[++i]);
    } else if (a == "--block-q" && next) {
      o.block_q = std::atoll(argv[++i]);
    } else if (a == "--block-kv" && next) {
      o.block_kv = std::atoll(argv[++i]);
    } else if (a == "--cases" && next) {
      o.cases = argv[++i];
    } else if (a == "--sweep") {
      o.sweep = true;
    } else {
      std::fprintf(stderr, "usage: bench_attention [--threads N] [--seconds S] [--peer-cap L] [--cases default|all|quick] [--block-q 128] [--block-kv 256] [--sweep]\n");
      std::exit(2);
    }
  }
  if (o.threads <= 0) o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

/// Median seconds of fn over repetitions fitting `budget` seconds (at least one, at most 9); with `least`
/// the fastest of them (the run a shared machine disturbed least).
template <class Fn>
double median_seconds(double budget, Fn&& fn, bool least = false) {
  std::vector<double> t;
  const auto start = Clock::now();
  do {
    const auto a = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  } while (t.size() < 9 && std::chrono::duration<double>(Clock::now() - start).count() + t.back() < budget);
  return least ? *std::min_element(t.begin(), t.end()) : bench::median(t);
}

/// GFLOP/s of SGEMM [L x 128] x [128 x L] with OpenBLAS on `threads` threads.
double sgemm_rate(std::int64_t L, int threads, double budget) {
  const std::int64_t K = 128;
  std::vector<float> a(static_cast<std::size_t>(L * K)), b(a.size()), c(static_cast<std::size_t>(L * L));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto& x : a) x = dist(rng);
  for (auto& x : b) x = dist(rng);
  cpdispatch::gemm::CblasGemm::set_blas_threads(threads);
  const int n = static_cast<int>(L);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, K, 1.0f, a.data(), K, b.data(), K, 0.0f, c.data(), n);
  const double s = median_seconds(budget, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, K, 1.0f, a.data(), K, b.data(), K, 0.0f, c.data(), n);
  });
  cpdispatch::gemm::CblasGemm::set_blas_threads(1);  // the kernel's threads each call BLAS single-threaded
  return 2.0 * static_cast<double>(L) * static_cast<double>(L) * K / s * 1e-9;
}

struct Timing {
  double forward_s, backward_s;
};

template <class E>
Timing time_case(const Case& c, cpdispatch::HostAttentionKernel& kernel, double budget, bool least = false) {
  const AttentionShape shape{c.heads_q, c.heads_kv, c.head_dim, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  const auto nq = static_cast<std::size_t>(c.tokens * c.heads_q * c.head_dim);
  const auto nk = static_cast<std::size_t>(c.tokens * c.heads_kv * c.head_dim);
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto fill = [&](std::size_t n) {
    std::vector<E> x(n);
    for (auto& e : x) e = E(dist(rng));
    return x;
  };
  const auto q = fill(nq), k = fill(nk), v = fill(nk), dout = fill(nq);
  std::vector<E> out(nq), dq(nq), dk(nk), dv(nk);
  std::vector<float> lse(static_cast<std::size_t>(c.tokens * c.heads_q));
  const std::int64_t cu[] = {0, c.tokens};
  const std::vector<cpdispatch::AttentionEntry> entries = cpdispatch::layout_entries(cu, cu, c.mask);
  auto forward = [&] { kernel.forward<E>(shape, entries, q, k, v, out, lse); };
  auto backward = [&] { kernel.backward<E>(shape, entries, q, k, v, out, lse, dout, dq, dk, dv); };
  const double f = median_seconds(budget / 2, forward, least);  // also leaves out and lse for backward
  const double b = median_seconds(budget / 2, backward, least);
  return {f, b};
}

/// One case of the sweep as measured: its entry, the seconds of each pass and SGEMM's GFLOP/s beside it.
struct Measured {
  Case c;
  cpdispatch::KernelEntry entry;
  Timing t;
  double peer;
};

/// Every length, head shape and mask of --sweep, measured.
std::vector<Measured> measure_sweep(const Options& o, cpdispatch::HostAttentionKernel& kernel) {
  struct Heads {
    std::int64_t q, kv, dim;
  };
  const Heads shapes[] = {{1, 1, 128}, {8, 2, 64}, {8, 8, 64}};
  std::vector<Measured> out;
  for (std::int64_t L = 128; L <= 8192; L *= 2) {
    const double peer = sgemm_rate(std::min(L, o.peer_cap), o.threads, o.seconds / 3);
    for (const Heads& h : shapes)
      for (const AttentionMask mask : {AttentionMask::causal(), AttentionMask::full()}) {
        const Case c{"float", L, h.q, h.kv, h.dim, mask, false};
        out.push_back({c, cpdispatch::group_entry(L, L, mask, h.q, h.dim), time_case<float>(c, kernel, o.seconds, true), peer});
        std::fprintf(stderr, ".");
      }
  }
  std::fprintf(stderr, "\n");
  return out;
}

/// --sweep: the measured rates, the fitted model's and its errors, the fitted parameters.
void run_sweep(const Options& o, cpdispatch::HostAttentionKernel& kernel) {
  const std::vector<Measured> cases = measure_sweep(o, kernel);
  std::vector<cpdispatch::KernelSample> forward, backward;
  for (const Measured& m : cases) {
    forward.push_back({m.entry, m.t.forward_s});
    backward.push_back({m.entry, m.t.backward_s});
  }
  cpdispatch::KernelRates model{cpdispatch::fit_kernel_rate(forward, 1.0), cpdispatch::fit_kernel_rate(backward, 2.5)};
  std::printf("%6s %5s %4s %-7s %8s %7s %8s %7s %8s %7s %8s %7s %9s\n", "L", "heads", "dim", "mask", "fwd GF/s", "/GEMM", "model", "err %",
              "bwd GF/s", "/GEMM", "model", "err %", "GEMM GF/s");
  std::vector<double> errors[2];
  for (const Measured& m : cases) {
    const double flop = m.entry.forward_flops();
    const double fwd = flop / m.t.forward_s * 1e-9, bwd = 2.5 * flop / m.t.backward_s * 1e-9;
    const double fwd_model = flop / model.forward_seconds(m.entry) * 1e-9, bwd_model = 2.5 * flop / model.backward_seconds(m.entry) * 1e-9;
    errors[0].push_back(std::abs(fwd_model / fwd - 1));
    errors[1].push_back(std::abs(bwd_model / bwd - 1));
    const std::string heads = std::to_string(m.c.heads_q) + ":" + std::to_string(m.c.heads_kv);
    std::printf("%6lld %5s %4lld %-7s %8.2f %7.2f %8.2f %+7.1f %8.2f %7.2f %8.2f %+7.1f %9.2f\n", static_cast<long long>(m.c.tokens),
                heads.c_str(), static_cast<long long>(m.c.head_dim), to_string(m.c.mask).c_str(), fwd, fwd / m.peer, fwd_model,
                100 * (fwd_model / fwd - 1), bwd, bwd / m.peer, bwd_model, 100 * (bwd_model / bwd - 1), m.peer);
  }
  for (auto& e : errors) std::sort(e.begin(), e.end());
  std::printf("model error |model / measured - 1|: forward median %.1f %%, max %.1f %%; backward median %.1f %%, max %.1f %%\n",
              100 * errors[0][errors[0].size() / 2], 100 * errors[0].back(), 100 * errors[1][errors[1].size() / 2], 100 * errors[1].back());
  std::printf("--kernel-rate forward:%s/backward:%s\n", to_string(model.forward).c_str(), to_string(model.backward).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  cpdispatch::HostAttentionKernel kernel({o.threads, o.block_q, o.block_kv});
  if (o.sweep) {
    std::printf("bench_attention --sweep: HostAttentionKernel (%s block products, blocks %lld x %lld), float, %d threads; "
                "rates as flash-attention counts FLOPs\n",
                cpdispatch::detail::attention::uses_cblas ? "CBLAS" : "portable", static_cast<long long>(kernel.options().block_q),
                static_cast<long long>(kernel.options().block_kv), o.threads);
    run_sweep(o, kernel);
    return 0;
  }
  std::printf("bench_attention: HostAttentionKernel (%s block products, blocks %lld x %lld) vs OpenBLAS SGEMM, "
              "%d threads each; %u hardware threads\n",
              cpdispatch::detail::attention::uses_cblas ? "CBLAS" : "portable",
              static_cast<long long>(kernel.options().block_q), static_cast<long long>(kernel.options().block_kv), o.threads, std::thread::hardware_concurrency());
  std::printf("%-9s %6s %5s %4s %-22s %9s %8s %9s %8s %9s %7s %7s %s\n", "type", "L", "heads", "dim", "mask", "fwd ms",
              "fwd GF/s", "bwd ms", "bwd GF/s", "SGEMM GF/s", "fwd/GEMM", "bwd/GEMM", "target");
  for (const Case& c : cases_named(o.cases)) {
    const double peer = sgemm_rate(std::min(c.tokens, o.peer_cap), o.threads, o.seconds / 3);
    Timing t{};
    if (std::strcmp(c.type, "float") == 0) t = time_case<float>(c, kernel, o.seconds);
    if (std::strcmp(c.type, "bfloat16") == 0) t = time_case<cpdispatch::bfloat16>(c, kernel, o.seconds);
    if (std::strcmp(c.type, "float16") == 0) t = time_case<cpdispatch::float16>(c, kernel, o.seconds);
    const double fwd_flop = bench::forward_flop(c.mask, c.tokens, c.heads_q, c.head_dim);
    const double fwd = fwd_flop / t.forward_s * 1e-9, bwd = 2.5 * fwd_flop / t.backward_s * 1e-9;
    const std::string heads = std::to_string(c.heads_q) + "/" + std::to_string(c.heads_kv);
    std::printf("%-9s %6lld %5s %4lld %-22s %9.1f %8.1f %9.1f %8.1f %9.1f %7.2f %7.2f %s\n", c.type,
                static_cast<long long>(c.tokens), heads.c_str(), static_cast<long long>(c.head_dim),
                to_string(c.mask).c_str(), t.forward_s * 1e3, fwd, t.backward_s * 1e3, bwd, peer, fwd / peer,
                bwd / peer, c.target ? "fwd >= 0.50, bwd >= 0.35" : "-");
    std::fflush(stdout);
  }
  return 0;
}
