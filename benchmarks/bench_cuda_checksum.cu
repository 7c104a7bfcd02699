// bench_cuda_checksum: what DeviceChecksummedTransport adds to the exchange
// it checks, in the same run: W virtual ranks of the device sim on one GPU,
// every rank sending `bytes_per_peer` to every other rank.
//
//   bin/bench_cuda_checksum [world_size=8] [bytes_per_peer=1048576] [iterations=20]
//   bin/bench_cuda_checksum --check [world_size=4] [bytes_per_peer=65536]
//   bin/bench_cuda_checksum --count plain|checked|packed|fused [world_size=4] [bytes_per_peer=1048576] [exchanges=1]
//
// Timing: per iteration, every rank meets the others at a barrier, then
// runs the exchange (posted, then waited for) and synchronises its stream;
// rank 0's wall time is the sample. "plain" is the bare transport, "checked"
// the same exchange through DeviceChecksummedTransport followed by its
// check() (once per exchange: the most often a step would check); the two
// alternate, and the medians are reported with their ratio. Where
// bytes_per_peer is a multiple of 4 KiB, two more alternate with them: the
// send buffer packed into staging first (as the exchange engine packs),
// then the checked exchange, its sent sums in a pass of their own or
// computed by the pack (DeviceChecksummedTransport::pack_sums). Also the CRC
// kernel alone over rank 0's send segments against one cudaMemcpyAsync of
// the same bytes (CUDA events, median).
//
// --check: no timing; the checked exchange delivers what the plain one
// does, byte for byte, and check() counts every segment (W - 1 a rank and
// exchange). Exits 1 on any difference.
//
// --count: runs `exchanges` exchanges in one mode and nothing else, for an
// instruction count of each mode on the cuda-cpu harness (valgrind
// --tool=callgrind; see benchmarks/RESULTS.md). "packed" and "fused" pack
// the send buffer into staging first, as the exchange engine does, then
// run the checked exchange: "packed" checksums what it sends in a pass of
// its own, "fused" in the pack (DeviceChecksummedTransport::pack_sums).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpdispatch/cuda/checksummed.hpp"
#include "cpdispatch/cuda/crc32c.hpp"
#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "device_bench.cuh"

namespace {

using cpdispatch::DeviceChecksummedTransport;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::DeviceBuffer;
using Bytes = DeviceBuffer<std::byte>;
using bench::median;

/// Every rank's send and receive buffers and the exchange's counts.
struct Exchange {
  int W;
  std::size_t per_peer;
  std::vector<std::size_t> counts, displs;
  std::vector<Bytes> send, recv;

  Exchange(int w, std::size_t bytes) : W(w), per_peer(bytes) {
    for (int p = 0; p < W; ++p) {
      counts.push_back(per_peer);
      displs.push_back(static_cast<std::size_t>(p) * per_peer);
    }
    for (int r = 0; r < W; ++r) {
      send.emplace_back(total());
      recv.emplace_back(total());
      std::vector<std::byte> pattern(total());
      for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(r) * 17 + i / 251) & 0xFF);
      CPDISPATCH_CUDA_CHECK(cudaMemcpy(send.back().data(), pattern.data(), pattern.size(), cudaMemcpyHostToDevice));
    }
  }
  std::size_t total() const { return static_cast<std::size_t>(W) * per_peer; }
  /// Packs rank r's send buffer into its staging as the exchange engine
  /// does (4 KiB tokens, each peer's in reverse order, so no two pieces
  /// merge), its checksums computed by the pack where `fused` (pack_sums),
  /// then posts the staging and waits.
  void run_packed(DeviceChecksummedTransport<DeviceSimTransport>& t, bool fused) {
    const auto r = static_cast<std::size_t>(t.rank());
    if (chunks.size() == 0) {
      std::vector<cpdispatch::detail::CopyPiece> pieces;
      for (std::size_t at = 0; at < total(); at += token) pieces.push_back({at, at / per_peer * per_peer + (per_peer - token - at % per_peer), token});
      const auto host = cpdispatch::cuda::plan_copy_chunks(pieces);
      chunks.allocate(host.size());
      CPDISPATCH_CUDA_CHECK(cudaMemcpy(chunks.data(), host.data(), host.size() * sizeof(host[0]), cudaMemcpyHostToDevice));
      chunk_count = host.size();
    }
    while (staging.size() < send.size()) staging.emplace_back(total());
    const cpdispatch::cuda::CrcTarget* sums = fused ? t.pack_sums(staging[r].data(), counts, displs, counts, displs) : nullptr;
    if (sums) cpdispatch::cuda::launch_copy_crc(send[r].data(), staging[r].data(), chunks.data(), chunk_count, *sums, t.stream());
    else cpdispatch::cuda::launch_copy(send[r].data(), staging[r].data(), chunks.data(), chunk_count, t.stream());
    t.wait(t.post_all_to_all_v(staging[r].data(), counts, displs, recv[r].data(), counts, displs));
  }
  static constexpr std::size_t token = 4096;
  std::vector<Bytes> staging;
  DeviceBuffer<cpdispatch::cuda::CopyChunk> chunks;
  std::size_t chunk_count = 0;
  /// Posts rank r's share on `t` and waits for it.
  template <class Transport>
  void run(Transport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    t.wait(t.post_all_to_all_v(send[r].data(), counts, displs, recv[r].data(), counts, displs));
  }
  std::vector<std::byte> received(int r) const {
    std::vector<std::byte> out(total());
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(out.data(), recv[static_cast<std::size_t>(r)].data(), out.size(), cudaMemcpyDeviceToHost));
    return out;
  }
};

int run_check(int W, std::size_t per_peer) {
  DeviceSimWorld world(W);
  Exchange plain(W, per_peer), checked(W, per_peer);
  std::vector<std::uint64_t> counted(static_cast<std::size_t>(W));
  world.run([&](DeviceSimTransport& t) {
    plain.run(t);
    DeviceChecksummedTransport c(t);
    checked.run(c);
    checked.run(c);
    counted[static_cast<std::size_t>(t.rank())] = c.check();
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  });
  int bad = 0;
  for (int r = 0; r < W; ++r) {
    if (plain.received(r) != checked.received(r)) {
      std::printf("rank %d: the checked exchange delivered other bytes than the plain one\n", r);
      ++bad;
    }
    if (counted[static_cast<std::size_t>(r)] != 2 * static_cast<std::uint64_t>(W - 1)) {
      std::printf("rank %d: check() counted %llu segments, expected %d\n", r, static_cast<unsigned long long>(counted[static_cast<std::size_t>(r)]),
                  2 * (W - 1));
      ++bad;
    }
  }
  if (bad) return 1;
  std::printf("bench_cuda_checksum --check: W = %d, %zu bytes per peer: checked exchanges equal the plain one, every segment counted\n", W, per_peer);
  return 0;
}

int run_count(const std::string& mode, int W, std::size_t per_peer, int exchanges) {
  if (per_peer % Exchange::token != 0) {
    std::fprintf(stderr, "--count: bytes_per_peer = %zu must be a multiple of %zu (the packed modes' tokens)\n", per_peer, Exchange::token);
    return 2;
  }
  DeviceSimWorld world(W);
  Exchange ex(W, per_peer);
  world.run([&](DeviceSimTransport& t) {
    if (mode == "plain") {
      for (int i = 0; i < exchanges; ++i) ex.run(t);
    } else {
      DeviceChecksummedTransport c(t);
      for (int i = 0; i < exchanges; ++i) {
        if (mode == "checked") ex.run(c); else ex.run_packed(c, mode == "fused");
      }
      (void)c.check();
      if (mode == "fused" && c.summed_by_packs() != static_cast<std::uint64_t>(exchanges)) throw std::runtime_error("the pack did not checksum");
    }
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  });
  std::printf("bench_cuda_checksum --count %s: W = %d, %zu bytes per peer, %d exchange(s)\n", mode.c_str(), W, per_peer, exchanges);
  return 0;
}

/// Median milliseconds of the CRC kernel over rank 0's send segments, and of one cudaMemcpyAsync of their bytes.
std::pair<double, double> kernel_times(const Exchange& ex, int iterations) {
  const auto W = static_cast<std::size_t>(ex.W);
  std::vector<cpdispatch::cuda::CrcRange> ranges;
  std::vector<cpdispatch::cuda::SegmentCrc> start;
  std::uint64_t chunks = 0;
  for (std::size_t p = 1; p < W; ++p) {  // every segment but the rank's own
    ranges.push_back({ex.displs[p], ex.counts[p], chunks});
    start.push_back({cpdispatch::cuda::crc_start(ex.counts[p]), 0, ex.counts[p]});
    chunks += cpdispatch::cuda::crc_chunks(ex.counts[p]);
  }
  DeviceBuffer<cpdispatch::cuda::CrcRange> d_ranges(ranges.size());
  DeviceBuffer<cpdispatch::cuda::SegmentCrc> d_sums(start.size());
  DeviceBuffer<std::uint32_t> tables(cpdispatch::cuda::crc_table_words);
  const auto& host_tables = cpdispatch::cuda::crc_tables();
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_ranges.data(), ranges.data(), ranges.size() * sizeof(ranges[0]), cudaMemcpyHostToDevice));
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(tables.data(), host_tables.data(), host_tables.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
  const std::size_t bytes = (W - 1) * ex.per_peer;
  Bytes copy(bytes);
  cpdispatch::cuda::Stream stream;
  cpdispatch::cuda::Event a(cudaEventDefault), b(cudaEventDefault);
  std::vector<double> crc_ms, copy_ms;
  const auto timed = [&](auto&& work) {
    a.record(stream.get());
    work();
    b.record(stream.get());
    CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(b.get()));
    float ms = 0;
    CPDISPATCH_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
    return static_cast<double>(ms);
  };
  for (int i = 0; i < iterations; ++i) {
    crc_ms.push_back(timed([&] {
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(d_sums.data(), start.data(), start.size() * sizeof(start[0]), cudaMemcpyHostToDevice, stream.get()));
      cpdispatch::cuda::launch_segment_crc(ex.send[0].data(), d_ranges.data(), static_cast<std::uint32_t>(ranges.size()), chunks, tables.data(),
                                           d_sums.data(), stream.get());
    }));
    copy_ms.push_back(timed([&] {
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(copy.data(), ex.send[0].data() + ex.per_peer, bytes, cudaMemcpyDeviceToDevice, stream.get()));
    }));
  }
  return {median(crc_ms), median(copy_ms)};
}

int run_timing(int W, std::size_t per_peer, int iterations) {
  cudaDeviceProp prop{};
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  DeviceSimWorld world(W);
  Exchange ex(W, per_peer);
  std::vector<double> plain_ms, checked_ms, packed_ms, fused_ms;
  const bool packs = per_peer % Exchange::token == 0;
  world.run([&](DeviceSimTransport& t) {
    DeviceChecksummedTransport c(t);
    const auto sample = [&](auto&& work) {
      t.barrier();
      CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
      const auto start = std::chrono::steady_clock::now();
      work();
      CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    for (int i = -2; i < iterations; ++i) {  // two warm-up rounds
      const double p = sample([&] { ex.run(t); });
      const double k = sample([&] {
        ex.run(c);
        (void)c.check();
      });
      for (const bool fused : {false, true}) {
        if (!packs) break;
        const double f = sample([&] {
          ex.run_packed(c, fused);
          (void)c.check();
        });
        if (t.rank() == 0 && i >= 0) (fused ? fused_ms : packed_ms).push_back(f);
      }
      if (t.rank() == 0 && i >= 0) {
        plain_ms.push_back(p);
        checked_ms.push_back(k);
      }
    }
  });
  const auto [crc, copy] = kernel_times(ex, iterations);
  const double moved = static_cast<double>(W) * static_cast<double>(W - 1) * static_cast<double>(per_peer);
  std::printf("bench_cuda_checksum on %s: %d virtual ranks, %zu bytes per peer, median of %d alternated samples (rank 0's wall time)\n\n", prop.name, W,
              per_peer, iterations);
  std::printf("| exchange | plain ms | checked ms | checked / plain | CRC kernel ms (rank 0's sends) | memcpy of those bytes ms | CRC GB/s |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %.1f MiB in all | %.3f | %.3f | %.3f | %.4f | %.4f | %.0f |\n", moved / 1048576.0, median(plain_ms), median(checked_ms),
              median(checked_ms) / median(plain_ms), crc, copy, static_cast<double>(W - 1) * static_cast<double>(per_peer) / (crc * 1e6));
  if (packs) {
    std::printf("\n| packed first (4 KiB tokens), then checked | sums in a pass of their own ms | sums in the pack ms | in the pack / own pass |\n");
    std::printf("|---|---:|---:|---:|\n");
    std::printf("| %.1f MiB in all | %.3f | %.3f | %.3f |\n", moved / 1048576.0, median(packed_ms), median(fused_ms), median(fused_ms) / median(packed_ms));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "--check") return run_check(argc > 2 ? std::atoi(argv[2]) : 4, argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 65536);
    if (mode == "--count") {
      const std::string which = argc > 2 ? argv[2] : "";
      if (which != "plain" && which != "checked" && which != "packed" && which != "fused") {
        std::fprintf(stderr, "usage: %s --count plain|checked|packed|fused [world_size] [bytes_per_peer] [exchanges]\n", argv[0]);
        return 2;
      }
      return run_count(which, argc > 3 ? std::atoi(argv[3]) : 4, argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 1048576,
                       argc > 5 ? std::atoi(argv[5]) : 1);
    }
    const int W = argc > 1 ? std::atoi(argv[1]) : 8;
    const std::size_t per_peer = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1048576;
    const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
    if (W < 2 || per_peer < 1 || iterations < 1) {
      std::fprintf(stderr, "usage: %s [world_size>=2] [bytes_per_peer>=1] [iterations>=1]\n", argv[0]);
      return 2;
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      std::printf("bench_cuda_checksum: no CUDA device; nothing measured\n");
      return 0;
    }
    return run_timing(W, per_peer, iterations);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_checksum: %s\n", e.what());
    return 1;
  }
}
