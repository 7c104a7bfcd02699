// bench_overlap: communication-GEMM overlap on the simulated link.
//
// tp_size ranks run as threads (SimWorld); their transport is a
// SimulatedLinkTransport, whose messages take latency + bytes / bandwidth of
// wall time while sleeping, so the GEMM (CBLAS, one BLAS thread per rank) and
// the communication really run side by side even on two cores. The link's
// bandwidth is set from a first measurement of the GEMM, so that the
// communication takes about --comm-ratio times as long as the GEMM.
//
// For each method it measures, as medians over --reps repetitions (rank 0's
// wall time between two barriers; the barriers are the sim's own, free):
//   gemm        the method's GEMM alone (all ranks at once)
//   comm        the method's collective alone, on the link
//   serial      the unoverlapped computation: GEMM, then the collective (AG: the collective, then the GEMM)
//   overlapped  comm_gemm
//   bound       max(gemm, comm) + one chunk, the exposed part of a pipeline of `chunks` steps:
//               min(gemm, comm) / chunks (BULK has no dependency, so its bound is max(gemm, comm))
//   ratio       overlapped / bound of each repetition (its own gemm, comm and overlapped, measured
//               back to back, so a burst of load elsewhere on the machine affects all of them):
//               the median and the range over the repetitions
//
//   bench_overlap [--tp 2] [--m 1024] [--n 1024] [--k 1024] [--splits 4] [--latency-us 20]
//                 [--comm-ratio 1.0] [--reps 7] [--helper communication|gemm] [--methods bulk,pipeline,ring_rs,ring_ag]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/overlap/overlap.hpp"
#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"
#include "stats.hpp"

namespace ov = cpdispatch::overlap;
using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using Clock = std::chrono::steady_clock;
using ov::CommOverlapMethod;
using ov::CommOverlapType;
using cpdispatch::gemm::Transpose;

namespace {

struct Options {
  int tp = 2;
  std::size_t m = 1024, n = 1024, k = 1024;
  int splits = 4;
  double latency_us = 20;
  double comm_ratio = 1.0;
  int reps = 7;
  ov::HelperThread helper = ov::HelperThread::communication;
  std::vector<std::string> methods{"bulk", "pipeline", "ring_rs", "ring_ag"};
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_overlap: %s\nusage: bench_overlap [--tp N] [--m M] [--n N] [--k K] [--splits S] [--latency-us L]\n"
               "                     [--comm-ratio R] [--reps R] [--helper communication|gemm]\n"
               "                     [--methods bulk,pipeline,ring_rs,ring_ag]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + std::string(arg)).c_str());
    const char* v = argv[++i];
    if (arg == "--tp") o.tp = std::atoi(v);
    else if (arg == "--m") o.m = std::strtoull(v, nullptr, 10);
    else if (arg == "--n") o.n = std::strtoull(v, nullptr, 10);
    else if (arg == "--k") o.k = std::strtoull(v, nullptr, 10);
    else if (arg == "--splits") o.splits = std::atoi(v);
    else if (arg == "--latency-us") o.latency_us = std::atof(v);
    else if (arg == "--comm-ratio") o.comm_ratio = std::atof(v);
    else if (arg == "--reps") o.reps = std::atoi(v);
    else if (arg == "--helper") {
      if (std::string_view(v) == "communication") o.helper = ov::HelperThread::communication;
      else if (std::string_view(v) == "gemm") o.helper = ov::HelperThread::gemm;
      else usage("--helper takes communication or gemm");
    } else if (arg == "--methods") {
      o.methods.clear();
      std::string list = v;
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        o.methods.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      usage(("unknown option " + std::string(arg)).c_str());
    }
  }
  if (o.tp < 1 || o.splits < 1 || o.reps < 1 || o.comm_ratio <= 0 || o.latency_us < 0) usage("a value is out of range");
  if (o.m % static_cast<std::size_t>(o.tp * o.splits) != 0) usage("--m must be divisible by tp * splits");
  return o;
}

using bench::median;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

/// One method's measurements (rank 0's, in ms).
struct Row {
  std::string method;
  int chunks = 1;
  double gemm = 0, comm = 0, serial = 0, overlapped = 0;
  double bandwidth = 0;
  std::vector<double> ratios;  // overlapped / bound, per repetition
};

/// max(gemm, comm) + the exposed chunk (none for BULK, whose two sides are independent).
double bound_of(double gemm, double comm, int chunks, bool bulk) {
  const double hi = std::max(gemm, comm), lo = std::min(gemm, comm);
  return bulk ? hi : hi + lo / chunks;
}

/// Runs one method on tp ranks and returns rank 0's medians.
Row run_method(const Options& o, const std::string& name) {
  const auto tp = static_cast<std::size_t>(o.tp);
  const bool ag = name == "ring_ag";
  const CommOverlapMethod method = name == "bulk"       ? CommOverlapMethod::BULK
                                   : name == "pipeline" ? CommOverlapMethod::PIPELINE
                                                        : CommOverlapMethod::RING_EXCHANGE;
  Row row;
  row.method = (ag ? "AG " : "RS ") + ov::to_string(method);
  row.chunks = method == CommOverlapMethod::BULK ? 1 : method == CommOverlapMethod::PIPELINE ? o.splits : o.tp;

  SimWorld world(o.tp);
  world.run([&](SimTransport& sim) {
    cpdispatch::gemm::CblasGemm gemm(1);  // one BLAS thread per rank
    const std::size_t m = o.m, n = o.n, k = o.k, ml = m / tp;
    // RS: this rank's A (m x k) and B (k x n); AG: its shard (m/tp x k) and B.
    std::vector<float> a((ag ? ml : m) * k), b(k * n), d(m * n), out(ml * n), gathered(m * k);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(sim.rank())) % 13) / 13.0f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 5) % 11) / 11.0f;
    const auto A = ov::matrix_view<const float>(a.data(), ag ? ml : m, k);
    const auto B = ov::matrix_view<const float>(b.data(), k, n);
    const auto D = ov::matrix_view(d.data(), m, n);
    const auto full_a = ov::matrix_view<const float>(gathered.data(), m, k);

    auto timed = [&](const std::function<void()>& body) {
      sim.barrier();
      const auto t0 = Clock::now();
      body();
      sim.barrier();
      return ms_since(t0);
    };
    auto gemm_alone = [&] { ov::comm_gemm(sim, gemm, ag ? full_a : A, Transpose::no, B, Transpose::no, D); };

    // The link: as fast as needed for the collective to take comm_ratio x the GEMM.
    std::vector<double> warm;
    for (int i = 0; i < 5; ++i) warm.push_back(timed(gemm_alone));  // the first ones also fault pages in
    double g0 = median(warm);
    sim.broadcast(&g0, sizeof g0, 0);
    const std::size_t block_bytes = ag ? ml * k * sizeof(float) : ml * n * sizeof(float);
    const double target_s = g0 * o.comm_ratio / 1e3 - static_cast<double>(tp - 1) * o.latency_us * 1e-6;
    const double bandwidth =
        tp == 1 ? 1e12 : static_cast<double>((tp - 1) * block_bytes) / std::max(target_s, 1e-4);
    cpdispatch::SimulatedLinkTransport link(
        sim, cpdispatch::LinkModel{std::chrono::nanoseconds(static_cast<long long>(o.latency_us * 1e3)), bandwidth});

    ov::CommOverlapOptions options;
    options.num_splits = o.splits;
    options.helper_thread = o.helper;
    const std::size_t buffer_rows = m;
    const std::size_t buffer_cols = ag ? k : n;
    ov::CommOverlapBuffer buffer(ag ? CommOverlapType::AG : CommOverlapType::RS, method, {buffer_rows, buffer_cols},
                                 ElementType::float32, o.tp, options);
    if (method == CommOverlapMethod::BULK) buffer.copy_into(std::span<const float>(d.data(), d.size()));

    auto collective = [&] {
      if (ag) {
        link.all_gather(a.data(), gathered.data(), ml * k, ElementType::float32);
      } else {
        link.reduce_scatter(method == CommOverlapMethod::BULK ? static_cast<const float*>(buffer.data()) : d.data(),
                            out.data(), ml * n, ElementType::float32, ReduceOp::sum);
      }
    };
    auto serial = [&] {
      if (ag) {
        collective();
        gemm_alone();
      } else {
        gemm_alone();
        collective();
      }
    };
    auto overlapped = [&] {
      if (ag) {
        ov::comm_gemm(link, gemm, buffer, A, Transpose::no, B, Transpose::no, D);
      } else if (method == CommOverlapMethod::BULK) {
        ov::comm_gemm(link, gemm, buffer, A, Transpose::no, B, Transpose::no, D, ov::matrix_view(out.data(), ml, n));
      } else {
        ov::comm_gemm(link, gemm, buffer, A, Transpose::no, B, Transpose::no, ov::MatrixView<float>{},
                      ov::matrix_view(out.data(), ml, n));
      }
    };
    // Interleaved repetitions: a burst of load elsewhere on the machine hits every measurement alike.
    // Repetition -1 is a warm-up (first touches of the buffers), not recorded.
    std::vector<double> tg, tc, ts, to;
    for (int rep = -1; rep < o.reps; ++rep) {
      tg.push_back(timed(gemm_alone));
      tc.push_back(timed(collective));
      ts.push_back(timed(serial));
      to.push_back(timed(overlapped));
      if (rep < 0) tg.clear(), tc.clear(), ts.clear(), to.clear();
    }
    if (sim.rank() == 0) {
      for (std::size_t i = 0; i < to.size(); ++i) {
        row.ratios.push_back(to[i] / bound_of(tg[i], tc[i], row.chunks, method == CommOverlapMethod::BULK));
      }
      row.gemm = median(tg);
      row.comm = median(tc);
      row.serial = median(ts);
      row.overlapped = median(to);
      row.bandwidth = bandwidth;
    }
  });
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf("bench_overlap: tp=%d, GEMM %zu x %zu x %zu (float32, CBLAS, 1 BLAS thread per rank), splits=%d, latency %.0f us, "
              "comm/GEMM target %.2f, helper thread: %s, %d reps (medians)\n\n",
              o.tp, o.m, o.n, o.k, o.splits, o.latency_us, o.comm_ratio,
              o.helper == ov::HelperThread::communication ? "communication" : "gemm", o.reps);
  std::printf("| method | chunks | link MB/s | GEMM (ms) | comm (ms) | serial (ms) | overlapped (ms) | bound (ms) | overlapped / bound | per-rep ratio: median (range) | serial / overlapped |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& name : o.methods) {
    if (name != "bulk" && name != "pipeline" && name != "ring_rs" && name != "ring_ag") usage(("unknown method " + name).c_str());
    const Row r = run_method(o, name);
    const double bound = bound_of(r.gemm, r.comm, r.chunks, r.method == "RS BULK");
    const auto [lo, hi] = std::minmax_element(r.ratios.begin(), r.ratios.end());
    std::printf("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.3f | %.3f (%.2f-%.2f) | %.2f |\n", r.method.c_str(),
                r.chunks, r.bandwidth / 1e6, r.gemm, r.comm, r.serial, r.overlapped, bound, r.overlapped / bound,
                median(r.ratios), *lo, *hi, r.serial / r.overlapped);
    std::fflush(stdout);
  }
  return 0;
}
