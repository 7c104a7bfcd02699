// bench_checksum_sim: CRC32C throughput (the crc32 instruction, the
// portable table, memcpy for scale) and the sim transport's all-to-all with
// and without ChecksummedTransport, W ranks as threads, `size` bytes to
// every peer.
//
//   bin/bench_checksum_sim [W=4] [rounds=40]
//
// A plain timed driver: rounds alternate which method goes first; one
// sample = the slowest rank's time for one call. Reported: median times and
// the median over rounds of (checked / plain).

#include <cpdispatch/crc32c.hpp>
#include <cpdispatch/adapters/checksummed.hpp>
#include <cpdispatch/transports/sim.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>
#include "stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using bench::median;

template <class F>
double gbps(std::size_t bytes, int reps, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
  }
  return static_cast<double>(bytes) / median(t) / 1e9;
}

void throughput() {
  std::vector<unsigned char> buf(std::size_t{4} << 20), copy(buf.size());
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131);
  volatile std::uint32_t sink = 0;
  const double hw = gbps(buf.size(), 21, [&] { sink = sink + cpdispatch::crc32c(buf.data(), buf.size()); });
  const double sw = gbps(buf.size(), 3, [&] { sink = sink + cpdispatch::crc32c_portable(buf.data(), buf.size()); });
  const double mc = gbps(buf.size(), 21, [&] { std::memcpy(copy.data(), buf.data(), buf.size()); });
  std::printf("CRC32C over 4 MiB: crc32 instruction (%s) %.2f GB/s, portable table %.2f GB/s; memcpy %.2f GB/s\n",
              cpdispatch::crc32c_hardware() ? "used" : "absent", hw, sw, mc);
}

}  // namespace

int main(int argc, char** argv) {
  const int W = argc > 1 ? std::atoi(argv[1]) : 4;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 40;
  throughput();
  for (const std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20}) {
    std::vector<std::vector<double>> plain(static_cast<std::size_t>(W)), checked(static_cast<std::size_t>(W));
    cpdispatch::SimWorld world(W);
    world.run([&](cpdispatch::SimTransport& sim) {
      const auto n = static_cast<std::size_t>(W), r = static_cast<std::size_t>(sim.rank());
      cpdispatch::ChecksummedTransport with(sim);
      std::vector<std::byte> send(n * size, std::byte{1}), recv(n * size);
      std::vector<std::size_t> counts(n, size), displs(n);
      for (std::size_t p = 0; p < n; ++p) displs[p] = p * size;
      auto time = [&](auto& t) {
        sim.barrier();
        const auto start = clock_type::now();
        t.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
        return std::chrono::duration<double>(clock_type::now() - start).count();
      };
      for (int i = 0; i < 3; ++i) time(sim), time(with);
      for (int i = 0; i < rounds; ++i) {
        if (i % 2 == 0) {
          plain[r].push_back(time(sim));
          checked[r].push_back(time(with));
        } else {
          checked[r].push_back(time(with));
          plain[r].push_back(time(sim));
        }
      }
    });
    std::vector<double> a, b, ratio;
    for (int i = 0; i < rounds; ++i) {
      double pa = 0, pb = 0;
      for (int r = 0; r < W; ++r) {
        pa = std::max(pa, plain[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]);
        pb = std::max(pb, checked[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]);
      }
      a.push_back(pa);
      b.push_back(pb);
      ratio.push_back(pb / pa);
    }
    std::printf("sim W=%d, %zu KiB per peer: plain %.3f ms, checked %.3f ms, checked/plain %.3f\n", W, size >> 10, 1e3 * median(a),
                1e3 * median(b), median(ratio));
  }
  return 0;
}
