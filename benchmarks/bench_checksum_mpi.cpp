// bench_checksum_mpi: the all-to-all with and without ChecksummedTransport
// (CRC32C of every remote segment, checked on receipt) under MPI, the same
// bytes either way: every rank sends `size` bytes to every rank.
//
//   mpiexec -n 4 bin/bench_checksum_mpi [rounds]
//
// A plain timed driver like bench_mpi_dispatch: per size, warm-up, then
// rounds in which both methods run once, alternating which goes first. One
// sample = the slowest rank's time for one call (MPI_Wtime after a barrier,
// MPI_MAX over ranks). Reported: median times and the median over rounds of
// (checked / plain) within a round, the overhead.

#include <cpdispatch/crc32c.hpp>
#include <cpdispatch/adapters/checksummed.hpp>
#include <cpdispatch/transports/mpi.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "stats.hpp"

namespace {

using bench::median;

template <class T>
double timed(T& transport, const std::vector<std::byte>& send, std::vector<std::byte>& recv, const std::vector<std::size_t>& counts,
             const std::vector<std::size_t>& displs) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  transport.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
  double t = MPI_Wtime() - start, slowest = 0;
  MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, W = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 40;
  {
    cpdispatch::MpiTransport plain = cpdispatch::MpiTransport::duplicate(MPI_COMM_WORLD);
    cpdispatch::ChecksummedTransport checked(plain);  // with agreement (the default)
    cpdispatch::ChecksummedTransport alone(plain, {.agree = false});
    if (rank == 0) {
      std::printf("ranks %d, crc32 instruction %s; medians over rounds, ratios within a round\n", W, cpdispatch::crc32c_hardware() ? "yes" : "no");
    }
    for (const std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
      const auto n = static_cast<std::size_t>(W);
      std::vector<std::byte> send(n * size), recv(n * size);
      for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(rank)) & 0xff);
      std::vector<std::size_t> counts(n, size), displs(n);
      for (std::size_t p = 0; p < n; ++p) displs[p] = p * size;
      auto run = [&](int method) {
        if (method == 0) return timed(plain, send, recv, counts, displs);
        if (method == 1) return timed(checked, send, recv, counts, displs);
        return timed(alone, send, recv, counts, displs);
      };
      for (int i = 0; i < 3; ++i)
        for (int m = 0; m < 3; ++m) run(m);
      std::vector<double> t[3], agree_ratio, alone_ratio;
      for (int i = 0; i < rounds; ++i) {
        double round[3];
        for (int k = 0; k < 3; ++k) {
          const int m = (i + k) % 3;  // the order rotates from round to round
          round[m] = run(m);
        }
        for (int m = 0; m < 3; ++m) t[m].push_back(round[m]);
        agree_ratio.push_back(round[1] / round[0]);
        alone_ratio.push_back(round[2] / round[0]);
      }
      if (rank == 0) {
        std::printf("%6zu KiB per peer: plain %.3f ms; checked %.3f ms (x%.3f, %+.1f %%); checked without agreement %.3f ms (x%.3f, %+.1f %%)\n",
                    size >> 10, 1e3 * median(t[0]), 1e3 * median(t[1]), median(agree_ratio), 100 * (median(agree_ratio) - 1), 1e3 * median(t[2]),
                    median(alone_ratio), 100 * (median(alone_ratio) - 1));
      }
    }
  }
  MPI_Finalize();
  return 0;
}
