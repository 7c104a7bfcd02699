// bench_tp_mpi: tensor-parallel communication and forward latency under MPI
// (a plain timed driver: Google Benchmark does not fit mpiexec).
//
//   mpiexec -n 4 bin/bench_tp_mpi allreduce [--reps 15]
//     all-reduce bus bandwidth, 2(n-1)/n x bytes / time, of the MPI transport
//     (tp::all_reduce_sum -> MpiTransport::all_reduce, in place) against raw
//     MPI_Allreduce(MPI_IN_PLACE) on the same buffers, interleaved in the same
//     run; also the transport with a timeout (MPI_Iallreduce + MPI_Test loop).
//   mpiexec -n W bin/bench_tp_mpi forward [--tokens 256 --hidden 512 --reps 15]
//     forward latency of DistributedModelWrapper over a 4-layer MLP
//     (hidden -> 4 hidden -> hidden, twice, GELU); with -n 1 also the
//     unsharded Sequential.
// Every time is the median over --reps rounds of the slowest rank's mean
// time per call. `ratio` (and `timeout`, the transport with a timeout) is the
// median over rounds of raw time / transport time in the same round, i.e. the
// transport's bus bandwidth as a fraction of raw MPI_Allreduce's; `control`
// is raw MPI_Allreduce timed a second time in the round (an A/A ratio: the
// spread it shows is the measurement's noise).

// First: it keeps the MPI-2 C++ bindings out of <mpi.h>.
#include "cpdispatch/transports/mpi.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cpdispatch/gemm/gemm_cblas.hpp"
#include "cpdispatch/tp/tensor_parallel.hpp"
#include "stats.hpp"

namespace tp = cpdispatch::tp;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode = "allreduce";
  int reps = 15;
  std::size_t tokens = 256;
  std::size_t hidden = 512;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_tp_mpi: %s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (s == "allreduce" || s == "forward") {
      a.mode = s;
    } else if (s == "--reps") {
      a.reps = std::max(1, std::atoi(next()));
    } else if (s == "--tokens") {
      a.tokens = static_cast<std::size_t>(std::max(1, std::atoi(next())));
    } else if (s == "--hidden") {
      a.hidden = static_cast<std::size_t>(std::max(1, std::atoi(next())));
    } else {
      std::fprintf(stderr, "usage: bench_tp_mpi allreduce|forward [--reps N] [--tokens N] [--hidden N]\n");
      std::exit(2);
    }
  }
  return a;
}

/// Mean seconds per call of `op` over `iters` calls, slowest rank.
double timed(MPI_Comm comm, int iters, const std::function<void()>& op) {
  MPI_Barrier(comm);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  double local = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  double slowest = 0;
  MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return slowest;
}

using bench::median;

void allreduce(const Args& args, MPI_Comm comm, int rank, int W) {
  cpdispatch::MpiTransport transport = cpdispatch::MpiTransport::duplicate(comm);
  cpdispatch::MpiTransportOptions with_timeout;
  with_timeout.timeout = std::chrono::seconds(60);
  cpdispatch::MpiTransport transport_timeout = cpdispatch::MpiTransport::duplicate(comm, with_timeout);
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(comm, &raw);
  if (rank == 0) {
    std::printf("# all-reduce (sum, float32, in place), %d ranks; bus bandwidth = 2(n-1)/n x bytes / time\n", W);
    std::printf("%12s %14s %14s %14s %16s %8s %8s %8s\n", "bytes", "raw MPI [us]", "transport [us]", "raw [GB/s]",
                "transport [GB/s]", "ratio", "timeout", "control");
  }
  for (std::size_t bytes = 4096; bytes <= (std::size_t{64} << 20); bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> buf(count, 1.0f);
    const int iters = static_cast<int>(std::clamp<std::size_t>((std::size_t{256} << 20) / bytes / 16, 2, 200));
    auto raw_op = [&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw); };
    auto tp_op = [&] { tp::all_reduce_sum(transport, buf.data(), count); };
    auto tp_timeout_op = [&] { tp::all_reduce_sum(transport_timeout, buf.data(), count); };
    for (int w = 0; w < 2; ++w) {  // warm-up
      raw_op();
      tp_op();
      tp_timeout_op();
    }
    std::vector<double> t_raw, t_tp, t_timeout, t_control;
    for (int r = 0; r < args.reps; ++r) {  // interleaved, alternating order
      if (r % 2 == 0) {
        t_raw.push_back(timed(comm, iters, raw_op));
        t_tp.push_back(timed(comm, iters, tp_op));
      } else {
        t_tp.push_back(timed(comm, iters, tp_op));
        t_raw.push_back(timed(comm, iters, raw_op));
      }
      t_timeout.push_back(timed(comm, iters, tp_timeout_op));
      t_control.push_back(timed(comm, iters, raw_op));  // A/A control: raw MPI again
      std::fill(buf.begin(), buf.end(), 1.0f);  // keep the values finite
    }
    // Bandwidth ratio to raw MPI per round (same round, same buffers), then
    // the median over rounds: drift of the machine's load cancels out.
    std::vector<double> ratio, ratio_timeout, ratio_control;
    for (std::size_t r = 0; r < t_raw.size(); ++r) {
      ratio.push_back(t_raw[r] / t_tp[r]);
      ratio_timeout.push_back(t_raw[r] / t_timeout[r]);
      ratio_control.push_back(t_raw[r] / t_control[r]);
    }
    const double factor = W > 1 ? 2.0 * (W - 1) / W : 1.0;
    const double raw_s = median(t_raw), tp_s = median(t_tp);
    const double bw_raw = factor * static_cast<double>(bytes) / raw_s / 1e9;
    const double bw_tp = factor * static_cast<double>(bytes) / tp_s / 1e9;
    if (rank == 0) {
      std::printf("%12zu %14.2f %14.2f %14.3f %16.3f %8.3f %8.3f %8.3f\n", bytes, raw_s * 1e6, tp_s * 1e6, bw_raw,
                  bw_tp, median(ratio), median(ratio_timeout), median(ratio_control));
    }
  }
  MPI_Comm_free(&raw);
}

void forward(const Args& args, MPI_Comm comm, int rank, int W) {
  cpdispatch::MpiTransport transport = cpdispatch::MpiTransport::duplicate(comm);
  cpdispatch::gemm::CblasGemm gemm;  // one BLAS thread per rank
  const std::size_t H = args.hidden, T = args.tokens;
  tp::Sequential<float, cpdispatch::gemm::CblasGemm> model;
  model.linear(H, 4 * H, true, 1).gelu().linear(4 * H, H, true, 2).gelu().linear(H, 4 * H, true, 3).gelu().linear(
      4 * H, H, true, 4);
  tp::DistributedModelWrapper wrapper(model, transport, gemm);
  cpdispatch::Tensor<float> x({T, H}, 0.5f);
  std::vector<float> y(T * H);
  for (int w = 0; w < 2; ++w) wrapper.forward(x.data(), T, y.data());
  std::vector<double> t_wrapper, t_model;
  for (int r = 0; r < args.reps; ++r) {
    t_wrapper.push_back(timed(comm, 3, [&] { wrapper.forward(x.data(), T, y.data()); }));
    if (W == 1) t_model.push_back(timed(comm, 3, [&] { (void)model.forward(x); }));
  }
  if (rank == 0) {
    std::printf("# forward, 4 linear layers (%zu -> %zu -> %zu, twice, GELU), %zu tokens, float32, CBLAS 1 thread/rank\n",
                H, 4 * H, H, T);
    std::printf("wrapper  ranks=%d  %10.3f ms  (2 all-reduces of %zu bytes)\n", W, median(t_wrapper) * 1e3,
                T * H * sizeof(float));
    if (W == 1) std::printf("unsharded Sequential  %10.3f ms\n", median(t_model) * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, W = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  const Args args = parse(argc, argv);
  int rc = 0;
  try {
    if (args.mode == "allreduce") {
      allreduce(args, MPI_COMM_WORLD, rank, W);
    } else {
      forward(args, MPI_COMM_WORLD, rank, W);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tp_mpi rank %d: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
