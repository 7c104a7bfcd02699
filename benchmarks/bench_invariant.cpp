// bench_invariant: what the invariant mode (docs/invariant-attention.md)
// costs against the default mode on the same work, the two alternated in one
// run (the machine may be shared: compare the ratios, not the seconds).
//
//  1. The host kernel alone: one causal document of L tokens, 8 + 8 heads of
//     64, float, forward and backward: default (HostAttentionKernel::forward,
//     backward) against forward_invariant, backward_invariant.
//  2. The op's step (forward and backward) on the sim transport: W ranks (as
//     threads, one kernel thread each) x T tokens of a ProLong batch
//     (draw_workload, cut at rank boundaries, which lie on the grid), each
//     document's pieces attended at home or balanced (plan_balanced with
//     BalanceOptions::grid), at each stage count; invariant against default,
//     the slowest rank's step, medians over --repeats alternations.
//
//   bench_invariant [--threads 2] [--lengths 2048,4096] [--world 4,8] [--tokens 2048] [--batches 1]
//                   [--stages 1,2] [--repeats 3] [--plan home|balanced] [--grid 64] [--kernel 1] [--op 1]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using cpdispatch::AttentionShape;
using cpdispatch::HostAttentionKernel;
using cpdispatch::HostAttentionOptions;

struct Config {
  int threads = 2;
  std::vector<std::int64_t> lengths{2048, 4096};
  std::vector<std::int64_t> worlds{4, 8};
  std::vector<std::int64_t> stages{1, 2};
  std::int64_t tokens = 2048, grid = 64;
  int batches = 1, repeats = 3;
  std::string plan = "home";
  bool kernel = true, op = true;
};

std::vector<std::int64_t> list_of(const std::string& text) {
  std::vector<std::int64_t> v;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::atoll(item.c_str()));
  return v;
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--threads") c.threads = std::atoi(v.c_str());
    else if (a == "--lengths") c.lengths = list_of(v);
    else if (a == "--world") c.worlds = list_of(v);
    else if (a == "--stages") c.stages = list_of(v);
    else if (a == "--tokens") c.tokens = std::atoll(v.c_str());
    else if (a == "--grid") c.grid = std::atoll(v.c_str());
    else if (a == "--batches") c.batches = std::atoi(v.c_str());
    else if (a == "--repeats") c.repeats = std::atoi(v.c_str());
    else if (a == "--plan") c.plan = v;
    else if (a == "--kernel") c.kernel = v != "0";
    else if (a == "--op") c.op = v != "0";
    else {
      std::fprintf(stderr, "bench_invariant: unknown option %s (see the file's comment)\n", a.c_str());
      std::exit(2);
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "bench_invariant: options come in pairs (see the file's comment)\n");
    std::exit(2);
  }
  return c;
}

using bench::median;

template <class Fn>
double seconds_of(Fn&& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = d(rng);
  return x;
}

/// Part 1: the kernel alone on one causal document.
void kernel_alone(const Config& c) {
  const AttentionShape s{8, 8, 64, 0.125f};
  std::printf("the host kernel alone: one causal document, 8 + 8 heads of 64, float, %d threads\n", c.threads);
  std::printf("  %8s | %12s %12s %6s | %12s %12s %6s\n", "tokens", "fwd default", "invariant", "ratio", "bwd default", "invariant", "ratio");
  for (std::int64_t L : c.lengths) {
    std::mt19937 rng(1);
    const auto n = static_cast<std::size_t>(L * s.heads_q * s.head_dim);
    const std::vector<float> q = random_floats(n, rng), k = random_floats(n, rng), v = random_floats(n, rng), dout = random_floats(n, rng);
    std::vector<float> out(n), dq(n), dk(n), dv(n), lse(static_cast<std::size_t>(L * s.heads_q));
    std::vector<std::int64_t> ek(n), ev(n);
    const std::vector<std::int64_t> cu{0, L};
    const auto entries = cpdispatch::layout_entries(cu, cu, cpdispatch::AttentionMask::causal());
    const cpdispatch::KvGradientExponents ex = cpdispatch::kv_gradient_exponents(s, {1.0, 1.0, 1.0, L});
    HostAttentionKernel kernel(HostAttentionOptions{c.threads});
    const cpdispatch::InvariantGrid grid{c.grid, {}};
    std::vector<double> f0, f1, b0, b1;
    for (int r = 0; r < c.repeats; ++r) {
      f0.push_back(seconds_of([&] { kernel.forward<float>(s, entries, q, k, v, out, lse); }));
      b0.push_back(seconds_of([&] { kernel.backward<float>(s, entries, q, k, v, out, lse, dout, dq, dk, dv); }));
      f1.push_back(seconds_of([&] { kernel.forward_invariant<float>(s, grid, entries, q, k, v, out, lse); }));
      std::fill(ek.begin(), ek.end(), 0);
      std::fill(ev.begin(), ev.end(), 0);
      b1.push_back(seconds_of([&] { kernel.backward_invariant<float>(s, grid, entries, q, k, v, out, lse, dout, dq, {ek, ev, ex.dk, ex.dv}); }));
    }
    std::printf("  %8lld | %11.3fs %11.3fs %5.2fx | %11.3fs %11.3fs %5.2fx\n", static_cast<long long>(L), median(f0), median(f1),
                median(f1) / median(f0), median(b0), median(b1), median(b1) / median(b0));
    std::fflush(stdout);
  }
}

std::vector<std::int64_t> prolong() {
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / "prolong.json");
  if (!in) {
    std::fprintf(stderr, "bench_invariant: cannot read %s\n", (dir / "prolong.json").c_str());
    std::exit(2);
  }
  return nlohmann::json::parse(in).get<std::vector<std::int64_t>>();
}

/// The batch's plan: every piece attended at home, or balanced on the grid.
cpdispatch::QkvDocumentsPlan plan_of(const Config& c, const cpdispatch::BalanceProblem& p) {
  if (c.plan == "balanced") {
    cpdispatch::BalanceOptions o;
    o.grid = c.grid;
    return cpdispatch::plan_balanced(p, o);
  }
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = p.world_size;
  for (const auto& d : p.documents) {
    cpdispatch::PackedDocument doc;
    for (const auto& piece : d.pieces) doc.shards.push_back({piece.rank, piece.len, piece.rank});
    plan.documents.push_back(doc);
  }
  return plan;
}

/// The slowest rank's seconds of one step (forward and backward) of every rank's op.
double step_seconds(const cpdispatch::QkvDocumentsPlan& plan, const AttentionShape& s, cpdispatch::CpAttentionOptions o) {
  const int W = static_cast<int>(plan.world_size);
  std::vector<double> seconds(static_cast<std::size_t>(W));
  cpdispatch::SimWorld world(W);
  world.run([&](cpdispatch::SimTransport& t) {
    const auto share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float> op(t, share, s, o, HostAttentionKernel(HostAttentionOptions{1}));
    const auto T = static_cast<std::size_t>(op.mlp_tokens());
    std::mt19937 rng(static_cast<unsigned>(t.rank()) + 1);
    const auto q = random_floats(T * static_cast<std::size_t>(s.heads_q * s.head_dim), rng), k = random_floats(T * static_cast<std::size_t>(s.heads_kv * s.head_dim), rng);
    const auto v = random_floats(k.size(), rng), dout = random_floats(q.size(), rng);
    std::vector<float> out(q.size()), dq(q.size()), dk(k.size()), dv(k.size());
    t.barrier();
    seconds[static_cast<std::size_t>(t.rank())] = seconds_of([&] {
      op.forward(q, k, v, out);
      op.backward(dout, dq, dk, dv);
    });
  });
  return *std::max_element(seconds.begin(), seconds.end());
}

/// Part 2: the op's step, invariant against default, alternated.
void op_step(const Config& c) {
  const AttentionShape s{8, 8, 64, 0.125f};
  const std::vector<std::int64_t> sample = prolong();
  std::printf("\nthe op's step (forward + backward) on the sim transport: ProLong, %lld tokens a rank, 8 + 8 heads of 64, float, plan %s, grid %lld\n",
              static_cast<long long>(c.tokens), c.plan.c_str(), static_cast<long long>(c.grid));
  std::printf("  %4s %5s %6s | %12s %12s %6s\n", "W", "batch", "stages", "default", "invariant", "ratio");
  for (std::int64_t W : c.worlds) {
    for (int b = 0; b < c.batches; ++b) {
      cpdispatch::BalanceProblem p;
      p.world_size = W;
      p.documents = cpdispatch::draw_workload(sample, W, c.tokens, static_cast<std::uint64_t>(b));
      const cpdispatch::QkvDocumentsPlan plan = plan_of(c, p);
      for (std::int64_t stages : c.stages) {
        cpdispatch::CpAttentionOptions o;
        o.stages = static_cast<int>(stages);
        cpdispatch::CpAttentionOptions inv = o;
        inv.invariant = true;
        inv.grid = c.grid;
        std::vector<double> t0, t1;
        for (int r = 0; r < c.repeats; ++r) {
          t0.push_back(step_seconds(plan, s, o));
          t1.push_back(step_seconds(plan, s, inv));
        }
        std::printf("  %4lld %5d %6lld | %11.3fs %11.3fs %5.2fx\n", static_cast<long long>(W), b, static_cast<long long>(stages), median(t0), median(t1),
                    median(t1) / median(t0));
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = parse(argc, argv);
  if (c.kernel) kernel_alone(c);
  if (c.op) op_step(c);
  return 0;
}
