// bench_mpi_dispatch: raw MPI_Alltoallv against MpiTransport::all_to_all_v
// (both of its algorithms) and the full Dispatcher::forward, moving exactly
// the same bytes: every rank sends `size` bytes to every rank (itself
// included; the dispatcher copies its own share locally). The transport and
// the dispatcher also run without the outcome agreement
// (MpiTransportOptions::agree = false), which prices the agreement.
//
//   mpiexec -n 4 bin/bench_mpi_dispatch [rounds_scale]
//
// A plain timed driver (Google Benchmark does not fit mpiexec): per size,
// warm-up rounds, then timed rounds; in each round every method runs once,
// the order rotating from round to round so that drifting machine load hits
// all methods alike. One sample = the slowest rank's time for one call
// (MPI_Wtime after a barrier, MPI_MAX over ranks); reported: the median
// time, GB/s = bytes one rank sends to OTHER ranks / median time, and
// raw / method = the median over rounds of (raw time / method time) within
// the same round, which cancels most of a loaded machine's drift.
// Results: benchmarks/RESULTS.md.

#include <cpdispatch/execute/dispatcher.hpp>
#include <cpdispatch/plan/plan.hpp>
#include <cpdispatch/transports/mpi.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>
#include "stats.hpp"

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::MpiAllToAll;
using cpdispatch::MpiTransport;
using cpdispatch::MpiTransportOptions;

struct Method {
  std::string name;
  std::function<void()> run;
  std::vector<double> samples;
};

using bench::median;

std::byte pattern(int src, int dst, std::size_t i) {
  return static_cast<std::byte>((src * 31 + dst * 17 + static_cast<int>(i % 251)) & 0xff);
}

/// Every rank's `size`-byte segment for rank d at d * size; the receive side likewise.
struct Buffers {
  std::vector<std::byte> send, recv;
  std::vector<std::size_t> counts, displs;
  std::vector<int> icounts, idispls;
};

Buffers make_buffers(int me, int W, std::size_t size) {
  Buffers b;
  const auto Wu = static_cast<std::size_t>(W);
  b.send.resize(Wu * size);
  b.recv.assign(Wu * size, std::byte{0});
  for (int d = 0; d < W; ++d) {
    for (std::size_t i = 0; i < size; ++i) b.send[static_cast<std::size_t>(d) * size + i] = pattern(me, d, i);
    b.counts.push_back(size);
    b.displs.push_back(static_cast<std::size_t>(d) * size);
    b.icounts.push_back(static_cast<int>(size));
    b.idispls.push_back(static_cast<int>(static_cast<std::size_t>(d) * size));
  }
  return b;
}

/// Whether recv holds what every rank sent this one.
bool received_all(const std::vector<std::byte>& recv, int me, int W, std::size_t size) {
  for (int s = 0; s < W; ++s)
    for (std::size_t i = 0; i < size; ++i)
      if (recv[static_cast<std::size_t>(s) * size + i] != pattern(s, me, i)) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    const double scale = argc > 1 ? std::max(0.05, std::atof(argv[1])) : 1.0;
    MPI_Comm raw_comm = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);
    MpiTransportOptions p2p_options;
    p2p_options.all_to_all = MpiAllToAll::point_to_point;
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
    MpiTransport t_p2p = MpiTransport::duplicate(MPI_COMM_WORLD, p2p_options);
    MpiTransportOptions no_agreement;
    no_agreement.agree = false;
    MpiTransport t_plain = MpiTransport::duplicate(MPI_COMM_WORLD, no_agreement);
    const int me = t.rank(), W = t.world_size();
    if (me == 0) {
      char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
      int len = 0;
      MPI_Get_library_version(version, &len);
      std::string v(version, static_cast<std::size_t>(len));
      v = v.substr(0, v.find_first_of("\n,"));
      std::printf("bench_mpi_dispatch: %d ranks, %s; median of timed rounds, slowest rank per round\n", W, v.c_str());
      std::printf("%-9s %-38s %6s %12s %10s %14s\n", "per-peer", "method", "rounds", "median us", "GB/s", "raw / method");
    }

    struct Size {
      std::size_t bytes;
      const char* label;
      int warmup, rounds;
    };
    for (const Size& s : {Size{4096, "4 KiB", 50, 400}, Size{std::size_t{1} << 20, "1 MiB", 5, 60},
                          Size{std::size_t{4} << 20, "4 MiB", 3, 30}}) {
      const int rounds = std::max(5, static_cast<int>(s.rounds * scale));
      Buffers raw = make_buffers(me, W, s.bytes), ours = make_buffers(me, W, s.bytes), p2p = make_buffers(me, W, s.bytes);

      // The dispatcher's plan: rank r's shard j (size bytes) attends on rank j.
      const std::size_t token_bytes = 256;
      const auto Wu = static_cast<std::size_t>(W);
      cpdispatch::Tensor<std::int64_t> seq_len({Wu, Wu}, static_cast<std::int64_t>(s.bytes / token_bytes));
      cpdispatch::Tensor<std::int64_t> dispatch({Wu, Wu});
      for (std::size_t r = 0; r < Wu; ++r)
        for (std::size_t j = 0; j < Wu; ++j) dispatch(r, j) = static_cast<std::int64_t>(j);
      const cpdispatch::QueryMetadata plan = cpdispatch::plan_query(seq_len, dispatch);
      Dispatcher<MpiTransport> dispatcher(t, plan.fwd, plan.rev, token_bytes);
      Dispatcher<MpiTransport> dispatcher_plain(t_plain, plan.fwd, plan.rev, token_bytes);
      Buffers disp = make_buffers(me, W, s.bytes), plain = make_buffers(me, W, s.bytes), disp_plain = make_buffers(me, W, s.bytes);

      std::vector<Method> methods;
      methods.push_back({"raw MPI_Alltoallv", [&] {
                           MPI_Alltoallv(raw.send.data(), raw.icounts.data(), raw.idispls.data(), MPI_BYTE, raw.recv.data(),
                                         raw.icounts.data(), raw.idispls.data(), MPI_BYTE, raw_comm);
                         }, {}});
      methods.push_back({"MpiTransport (alltoallv, default)", [&] {
                           t.all_to_all_v(ours.send.data(), ours.counts, ours.displs, ours.recv.data(), ours.counts, ours.displs);
                         }, {}});
      methods.push_back({"MpiTransport (point_to_point)", [&] {
                           t_p2p.all_to_all_v(p2p.send.data(), p2p.counts, p2p.displs, p2p.recv.data(), p2p.counts, p2p.displs);
                         }, {}});
      methods.push_back({"Dispatcher::forward (alltoallv)", [&] {
                           dispatcher.forward(disp.send, disp.recv);
                         }, {}});
      methods.push_back({"MpiTransport (alltoallv, no agreement)", [&] {
                           t_plain.all_to_all_v(plain.send.data(), plain.counts, plain.displs, plain.recv.data(), plain.counts,
                                                plain.displs);
                         }, {}});
      methods.push_back({"Dispatcher::forward (no agreement)", [&] {
                           dispatcher_plain.forward(disp_plain.send, disp_plain.recv);
                         }, {}});

      for (int i = 0; i < s.warmup; ++i)
        for (Method& m : methods) m.run();
      for (auto* b : {&raw, &ours, &p2p, &disp, &plain, &disp_plain}) {
        int ok = received_all(b->recv, me, W, s.bytes) ? 1 : 0, all_ok = 0;
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (!all_ok) throw std::runtime_error("a method delivered wrong bytes");
      }
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t k = 0; k < methods.size(); ++k) {
          Method& m = methods[(k + static_cast<std::size_t>(round)) % methods.size()];
          MPI_Barrier(MPI_COMM_WORLD);
          const double start = MPI_Wtime();
          m.run();
          double local = MPI_Wtime() - start, slowest = 0;
          MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          m.samples.push_back(slowest);
        }
      }
      if (me == 0) {
        const double off_rank_bytes = static_cast<double>(s.bytes) * (W - 1);
        for (const Method& m : methods) {
          // The ratio pairs each round's raw call with this method's call in
          // the same round (adjacent in time), then takes the median.
          std::vector<double> ratios;
          for (std::size_t i = 0; i < m.samples.size(); ++i) ratios.push_back(methods[0].samples[i] / m.samples[i]);
          const double t_med = median(m.samples);
          std::printf("%-9s %-38s %6d %12.1f %10.3f %13.3fx\n", s.label, m.name.c_str(), rounds, t_med * 1e6,
                      W > 1 ? off_rank_bytes / t_med / 1e9 : 0.0, median(ratios));
        }
      }
    }
    MPI_Comm_free(&raw_comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mpi_dispatch: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
