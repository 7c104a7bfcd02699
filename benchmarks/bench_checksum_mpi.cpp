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
#include <cpdispatch/execute/checksummed_transport.hpp>
#include <cpdispatch/transports/mpi.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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
    cpdispatch::ChecksummedTransport checked(plain);
    if (rank == 0) {
      std::printf("ranks %d, crc32 instruction %s; per size: median plain / checked (ms), median of per-round checked/plain\n", W,
                  cpdispatch::crc32c_hardware() ? "yes" : "no");
    }
    for (const std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
      const auto n = static_cast<std::size_t>(W);
      std::vector<std::byte> send(n * size), recv(n * size);
      for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(rank)) & 0xff);
      std::vector<std::size_t> counts(n, size), displs(n);
      for (std::size_t p = 0; p < n; ++p) displs[p] = p * size;
      for (int i = 0; i < 3; ++i) {
        timed(plain, send, recv, counts, displs);
        timed(checked, send, recv, counts, displs);
      }
      std::vector<double> a, b, ratio;
      for (int i = 0; i < rounds; ++i) {
        const bool plain_first = i % 2 == 0;
        const double first = plain_first ? timed(plain, send, recv, counts, displs) : timed(checked, send, recv, counts, displs);
        const double second = plain_first ? timed(checked, send, recv, counts, displs) : timed(plain, send, recv, counts, displs);
        a.push_back(plain_first ? first : second);
        b.push_back(plain_first ? second : first);
        ratio.push_back(b.back() / a.back());
      }
      if (rank == 0) {
        std::printf("%8zu KiB per peer: plain %.3f ms, checked %.3f ms, checked/plain %.3f (overhead %+.1f %%)\n", size >> 10,
                    1e3 * median(a), 1e3 * median(b), median(ratio), 100 * (median(ratio) - 1));
      }
    }
  }
  MPI_Finalize();
  return 0;
}
