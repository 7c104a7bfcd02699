// overlap_gemm: the overlapped GEMM (comm_gemm) on sim ranks over a simulated
// link. For each supported method it runs comm_gemm and the unoverlapped
// computation (GEMM, then the collective; AG: the collective, then the GEMM),
// checks that they agree, and prints both times.
//
//   overlap_gemm [--tp 2] [--m 1024] [--n 1024] [--k 1024] [--bandwidth-mb 30] [--latency-us 50]
// Exits non-zero when a result differs from the reference by more than float32 rounding.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/overlap/overlap.hpp"
#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"

namespace ov = cpdispatch::overlap;
using ov::CommOverlapMethod;
using ov::CommOverlapType;
using cpdispatch::gemm::Transpose;
using Clock = std::chrono::steady_clock;

namespace {

double max_rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(double(got[i]) - double(want[i]));
    if (!(d <= diff)) diff = d;  // a NaN sticks (std::max would drop it)
    ref = std::max(ref, std::abs(double(want[i])));
  }
  return ref == 0 ? diff : diff / ref;
}

}  // namespace

int main(int argc, char** argv) {
  int tp = 2;
  std::size_t m = 1024, n = 1024, k = 1024;
  double bandwidth_mb = 30, latency_us = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view arg = argv[i];
    const char* v = argv[i + 1];
    if (arg == "--tp") tp = std::atoi(v);
    else if (arg == "--m") m = std::strtoull(v, nullptr, 10);
    else if (arg == "--n") n = std::strtoull(v, nullptr, 10);
    else if (arg == "--k") k = std::strtoull(v, nullptr, 10);
    else if (arg == "--bandwidth-mb") bandwidth_mb = std::atof(v);
    else if (arg == "--latency-us") latency_us = std::atof(v);
    else {
      std::fprintf(stderr, "overlap_gemm: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "overlap_gemm: option %s has no value\n", argv[argc - 1]);
    return 2;
  }
  const cpdispatch::LinkModel link_model{std::chrono::nanoseconds(static_cast<long long>(latency_us * 1e3)), bandwidth_mb * 1e6};
  struct Method {
    CommOverlapType type;
    CommOverlapMethod method;
  };
  const Method methods[] = {{CommOverlapType::RS, CommOverlapMethod::BULK},
                            {CommOverlapType::RS, CommOverlapMethod::PIPELINE},
                            {CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE},
                            {CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE}};
  std::printf("tp=%d, GEMM %zu x %zu x %zu float32, link %.0f MB/s + %.0f us per message\n", tp, m, n, k, bandwidth_mb,
              latency_us);
  bool ok = true;
  try {
    for (const Method& mt : methods) {
      const bool ag = mt.type == CommOverlapType::AG;
      double error = 0, serial_ms = 0, overlapped_ms = 0;
      cpdispatch::SimWorld world(tp);
      world.run([&](cpdispatch::SimTransport& sim) {
        cpdispatch::SimulatedLinkTransport t(sim, link_model);
        cpdispatch::gemm::CblasGemm gemm;  // one BLAS thread per rank
        const std::size_t ml = m / static_cast<std::size_t>(tp);
        const std::size_t a_rows = ag ? ml : m;  // AG: this rank's shard of A
        std::vector<float> a(a_rows * k), b(k * n), d(m * n), out(ml * n), gathered(m * k), ref_d(m * n), ref_out(ml * n);
        // Values in [0, 1): sums without cancellation, so float32 rounding stays relative to the result.
        const auto r = static_cast<std::size_t>(sim.rank());
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = float((i * 7919 + r * 104729) % 1000) / 1000.0f;
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = float((i * 6007) % 1000) / 1000.0f;
        const auto A = ov::matrix_view<const float>(a.data(), a_rows, k);
        const auto B = ov::matrix_view<const float>(b.data(), k, n);
        ov::CommOverlapOptions options;
        options.num_splits = 4;
        ov::CommOverlapBuffer buffer(mt.type, mt.method, {m, ag ? k : n}, cpdispatch::ElementType::float32, tp, options);
        if (mt.method == CommOverlapMethod::BULK) {  // BULK reduce-scatters the caller's data, independent of the GEMM
          std::vector<float> fill(m * n);
          for (std::size_t i = 0; i < fill.size(); ++i) fill[i] = float((i * 4111 + r * 7) % 1000) / 1000.0f;
          buffer.copy_into(std::span<const float>(fill));
        }

        auto unoverlapped = [&] {  // GEMM, then reduce-scatter (BULK: of the buffer); AG: all-gather, then GEMM
          if (ag) {
            t.all_gather(a.data(), gathered.data(), ml * k, cpdispatch::ElementType::float32);
            ov::comm_gemm(t, gemm, ov::matrix_view<const float>(gathered.data(), m, k), Transpose::no, B, Transpose::no,
                          ov::matrix_view(ref_d.data(), m, n));
          } else {
            ov::comm_gemm(t, gemm, A, Transpose::no, B, Transpose::no, ov::matrix_view(ref_d.data(), m, n));
            const float* send = mt.method == CommOverlapMethod::BULK ? buffer.view<float>().data() : ref_d.data();
            t.reduce_scatter(send, ref_out.data(), ml * n, cpdispatch::ElementType::float32, cpdispatch::ReduceOp::sum);
          }
        };
        auto overlapped = [&] {
          if (ag) {
            ov::comm_gemm(t, gemm, buffer, A, Transpose::no, B, Transpose::no, ov::matrix_view(d.data(), m, n));
          } else if (mt.method == CommOverlapMethod::BULK) {
            ov::comm_gemm(t, gemm, buffer, A, Transpose::no, B, Transpose::no, ov::matrix_view(d.data(), m, n),
                          ov::matrix_view(out.data(), ml, n));
          } else {
            ov::comm_gemm(t, gemm, buffer, A, Transpose::no, B, Transpose::no, {}, ov::matrix_view(out.data(), ml, n));
          }
        };
        // Best of three runs of each: the first ones also warm up caches and BLAS.
        auto best_ms = [&](auto&& body) {
          double best = 1e300;
          for (int run = 0; run < 3; ++run) {
            sim.barrier();
            const auto t0 = Clock::now();
            body();
            sim.barrier();
            best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          }
          return best;
        };
        const double serial = best_ms(unoverlapped);
        const double overlapped_time = best_ms(overlapped);

        double e = ag ? max_rel_error(d, ref_d) : max_rel_error(out, ref_out);
        if (mt.method == CommOverlapMethod::BULK) {
          const double e_d = max_rel_error(d, ref_d);
          if (!(e_d <= e)) e = e_d;
        }
        sim.all_reduce(&e, 1, cpdispatch::ElementType::float64, cpdispatch::ReduceOp::sum);  // any rank's error counts
        if (sim.rank() == 0) {
          error = e;
          serial_ms = serial;
          overlapped_ms = overlapped_time;
        }
      });
      const bool match = error < 1e-5;
      ok = ok && match;
      std::printf("%-2s %-13s  serial %7.2f ms  overlapped %7.2f ms  relative error %.1e %s\n", ov::to_string(mt.type).c_str(),
                  ov::to_string(mt.method).c_str(), serial_ms, overlapped_ms, error, match ? "" : "MISMATCH");
    }
  } catch (const cpdispatch::error& e) {
    std::fprintf(stderr, "overlap_gemm: %s\n", e.what());
    return 1;
  }
  std::printf(ok ? "OK: every method matches the unoverlapped reference\n" : "FAILED: a method differs from the reference\n");
  return ok ? 0 : 1;
}
