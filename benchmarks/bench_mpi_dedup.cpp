// bench_mpi_dedup: the deduplicated KV exchange (KvWireDispatcher) against
// the section 2 one (Dispatcher over kv_fwd / kv_rev) under MPI, on the same
// zig-zag plan, with raw MPI_Alltoallv of exactly the bytes each one puts on
// the wire as its limit, all in one run.
//
//   mpiexec -n 4 bin/bench_mpi_dedup [tokens_per_rank=1024] [token_bytes=4096] [rounds=20]
//
// Plan: Megatron-LM's causal load balancing (zig-zag): one document of
// `tokens_per_rank` tokens per rank, cut into 2W chunks, chunk i attended on
// rank min(i, 2W-1-i). KV gradients are bfloat16.
// Methods, each rank running each once per round, the order rotating from
// round to round (drifting machine load hits all alike): raw MPI_Alltoallv
// of the section 2 forward's off-rank bytes and of its reverse's, the same
// for the deduplicated wire, Dispatcher::forward, KvWireDispatcher::forward,
// Dispatcher::reverse_combine, KvWireDispatcher::reverse_combine and
// reverse_combine_in_place. One sample = the slowest rank's time for one call
// (MPI_Wtime after a barrier, MPI_MAX over ranks). Reported: the median per
// method, and section 2 / deduplicated as the median over rounds of the ratio
// within a round (forward, backward, forward + backward).
// Results: benchmarks/RESULTS.md.

#include <cpdispatch/execute/kv_wire.hpp>
#include <cpdispatch/execute/dispatcher.hpp>
#include <cpdispatch/plan/kv_wire.hpp>
#include <cpdispatch/plan/plan.hpp>
#include <cpdispatch/transports/mpi.hpp>

#include "zigzag_plan.hpp"
#include "stats.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using I = std::int64_t;
using Bytes = std::vector<std::byte>;
using cpdispatch::MpiTransport;

using bench::median;

/// Raw MPI_Alltoallv of the off-rank bytes an exchange moves: this rank
/// sends `m.num_recv_tokens(p, me)` tokens to each peer p (or receives them,
/// `reverse`), back to back.
struct RawExchange {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  Bytes send, recv;
  std::size_t off_rank_bytes = 0;  // what this rank sends to others

  RawExchange(const cpdispatch::Metadata& m, int me, int W, std::size_t token_bytes, bool reverse) {
    int sent = 0, received = 0;
    for (int p = 0; p < W; ++p) {
      const I out = p == me ? 0 : m.num_recv_tokens(p, me), in = p == me ? 0 : m.num_recv_tokens(me, p);
      const auto s = static_cast<int>(static_cast<std::size_t>(reverse ? in : out) * token_bytes);
      const auto r = static_cast<int>(static_cast<std::size_t>(reverse ? out : in) * token_bytes);
      send_counts.push_back(s);
      send_displs.push_back(sent);
      recv_counts.push_back(r);
      recv_displs.push_back(received);
      sent += s;
      received += r;
    }
    send.assign(static_cast<std::size_t>(sent), std::byte{1});
    recv.assign(static_cast<std::size_t>(received), std::byte{0});
    off_rank_bytes = static_cast<std::size_t>(sent);
  }

  void run(MPI_Comm comm) {
    MPI_Alltoallv(send.data(), send_counts.data(), send_displs.data(), MPI_BYTE, recv.data(), recv_counts.data(), recv_displs.data(),
                  MPI_BYTE, comm);
  }
};

struct Method {
  std::string name;
  std::function<void()> run;
  std::vector<double> samples;
};

/// Section 2 time / deduplicated time, per round, median over rounds.
double paired_ratio(const std::vector<const Method*>& plain, const std::vector<const Method*>& dedup) {
  std::vector<double> ratios;
  for (std::size_t i = 0; i < plain[0]->samples.size(); ++i) {
    double a = 0, b = 0;
    for (const Method* m : plain) a += m->samples[i];
    for (const Method* m : dedup) b += m->samples[i];
    ratios.push_back(a / b);
  }
  return median(ratios);
}

/// Every rank's forward attention layout agrees between the two paths, and
/// both backward forms of the deduplicated path give the same gradient.
void check_agreement(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) throw std::runtime_error("the deduplicated path disagrees with the section 2 path");
}

void run(int argc, char** argv) {
  const I tokens_per_rank = argc > 1 ? std::atoll(argv[1]) : 1024;
  const std::size_t tb = argc > 2 ? static_cast<std::size_t>(std::atoll(argv[2])) : 4096;
  const int rounds = argc > 3 ? std::max(3, std::atoi(argv[3])) : 20;
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  MPI_Comm raw_comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);
  const int me = t.rank(), W = t.world_size();
  const auto meta = cpdispatch::plan_qkv(bench::zigzag_plan(W, 1, tokens_per_rank));
  const auto wire = cpdispatch::plan_kv_wire(meta);
  cpdispatch::Dispatcher<MpiTransport> plain(t, meta.kv_fwd, meta.kv_rev, tb);
  cpdispatch::KvWireDispatcher<MpiTransport> dedup(t, wire, tb);
  const auto& s = dedup.required_bytes();
  const auto type = cpdispatch::ElementType::bfloat16;
  Bytes mlp(s.mlp_bytes, std::byte{1}), attn(s.attention_bytes), attn_dedup(s.attention_bytes), wire_buf(s.wire_bytes),
      replica(s.replica_bytes), grad(s.mlp_bytes), grad_in_place(s.mlp_bytes), grad_attn(s.attention_bytes, std::byte{1});
  RawExchange raw_fwd(meta.kv_fwd, me, W, tb, false), raw_rev(meta.kv_fwd, me, W, tb, true);
  RawExchange raw_wire_fwd(wire.fwd, me, W, tb, false), raw_wire_rev(wire.fwd, me, W, tb, true);
  Bytes scratch_grad = grad_attn;  // consumed by the in-place backward, refilled before each call
  std::vector<Method> methods;
  methods.push_back({"raw MPI_Alltoallv, section 2 fwd bytes", [&] { raw_fwd.run(raw_comm); }, {}});
  methods.push_back({"raw MPI_Alltoallv, section 2 rev bytes", [&] { raw_rev.run(raw_comm); }, {}});
  methods.push_back({"raw MPI_Alltoallv, dedup fwd bytes", [&] { raw_wire_fwd.run(raw_comm); }, {}});
  methods.push_back({"raw MPI_Alltoallv, dedup rev bytes", [&] { raw_wire_rev.run(raw_comm); }, {}});
  methods.push_back({"section 2 forward", [&] { plain.forward(mlp, attn); }, {}});
  methods.push_back({"dedup forward", [&] { dedup.forward(mlp, attn_dedup); }, {}});
  methods.push_back({"section 2 reverse_combine", [&] { plain.reverse_combine(grad_attn, replica, grad, type); }, {}});
  methods.push_back({"dedup reverse_combine", [&] { dedup.reverse_combine(grad_attn, wire_buf, replica, grad, type); }, {}});
  methods.push_back({"dedup reverse_combine_in_place", [&] { dedup.reverse_combine_in_place(scratch_grad, replica, grad_in_place, type); }, {}});
  const auto untimed = [&](Method& m) {  // the in-place backward's input is refilled outside the timed region
    if (m.name == "dedup reverse_combine_in_place") std::copy(grad_attn.begin(), grad_attn.end(), scratch_grad.begin());
  };
  for (int i = 0; i < 3; ++i) {
    for (Method& m : methods) {
      untimed(m);
      m.run();
    }
  }
  check_agreement(attn == attn_dedup && grad == grad_in_place);
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t k = 0; k < methods.size(); ++k) {
      Method& m = methods[(k + static_cast<std::size_t>(round)) % methods.size()];
      untimed(m);
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      m.run();
      double local = MPI_Wtime() - start, slowest = 0;
      MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      m.samples.push_back(slowest);
    }
  }
  std::uint64_t off[4] = {raw_fwd.off_rank_bytes, raw_rev.off_rank_bytes, raw_wire_fwd.off_rank_bytes, raw_wire_rev.off_rank_bytes};
  std::uint64_t total[4] = {};
  MPI_Allreduce(off, total, 4, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  MPI_Comm_free(&raw_comm);
  if (me != 0) return;
  std::printf("bench_mpi_dedup: %d ranks, zig-zag, %lld tokens per rank, %zu-byte tokens, bfloat16 gradients, %d rounds\n", W,
              static_cast<long long>(tokens_per_rank), tb, rounds);
  std::printf("off-rank bytes, all ranks: section 2 %llu (fwd) %llu (rev), deduplicated %llu / %llu (ratio %.3f)\n",
              static_cast<unsigned long long>(total[0]), static_cast<unsigned long long>(total[1]), static_cast<unsigned long long>(total[2]),
              static_cast<unsigned long long>(total[3]), static_cast<double>(total[2]) / static_cast<double>(total[0]));
  std::printf("%-40s %12s\n", "method", "median ms");
  for (const Method& m : methods) std::printf("%-40s %12.3f\n", m.name.c_str(), median(m.samples) * 1e3);
  const auto at = [&](std::size_t i) { return &methods[i]; };
  std::printf("section 2 / dedup, paired per round: raw fwd %.3f, raw rev %.3f, forward %.3f, backward %.3f, backward in place %.3f, "
              "forward + backward %.3f, forward + backward in place %.3f\n",
              paired_ratio({at(0)}, {at(2)}), paired_ratio({at(1)}, {at(3)}), paired_ratio({at(4)}, {at(5)}), paired_ratio({at(6)}, {at(7)}),
              paired_ratio({at(6)}, {at(8)}), paired_ratio({at(4), at(6)}, {at(5), at(7)}), paired_ratio({at(4), at(6)}, {at(5), at(8)}));
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mpi_dedup: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
