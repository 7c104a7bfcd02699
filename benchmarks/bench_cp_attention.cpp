// bench_cp_attention: one attention layer's step (forward + backward) with
// ContextParallelAttention, W ranks as threads over SimulatedLinkTransport,
// on packed batches drawn from the ProLong and WLB-LLM length samples and
// balanced by plan_balanced; against ring attention with the zig-zag layout
// (Transformer Engine / Megatron p2p) and Ulysses (all-to-all from sequence
// to heads and back, DeepSpeed) over the same kernel and link.
//
// The link's bandwidth comes from the kernel's FLOP rate measured while all
// W ranks compute at once, so that FLOPs per byte match an H100 (400 TFLOP/s
// of attention) over 400 Gb/s InfiniBand (50 GB/s) or NVLink (450 GB/s).
// In the same run: compute = the step over an instant link, communication =
// the step with a kernel that does nothing; bound = max(compute,
// communication) + min(compute, communication) / stages (bench_overlap's).
// Per link also ours with the plan the step model picks for it
// (plan_for_cluster: as balanced as pays on that link), 2 stages.
// Per batch also: the most bytes a rank sends or receives in one step (forward and
// backward; counted by the link) and the attention work's max / mean over
// the ranks, for each method.
// Prints one line per (sample, batch, link, method) and the medians.
//   bench_cp_attention [--world 8] [--tokens 1024] [--batches 3] [--first-batch 0] [--sample prolong|wlbllm|both]
//                      [--heads 8] [--head-dim 64] [--dedup 1] [--links ib|nvlink|both] [--stages 1,2,4]
//                      [--peers ulysses|ring|both] [--bound 1] [--balanced 1]
// Ours runs the deduplicated key-value exchange (each shard once per destination rank) unless --dedup 0.
// Batch b is the packed batch drawn with seed b: --first-batch and --sample run part of a long
// measurement (at 8K tokens a rank, twenty minutes a batch on two cores) in separate runs; --links,
// --stages, --peers, --bound 0 (no communication-only run, so no step / bound) and --balanced 0 (ours with the
// step model's plan only, not with the balanced plan) leave out runs.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "stage_list.hpp"
#include "cpdispatch/attention.hpp"
#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/cost.hpp"
#include "cpdispatch/plan/step_model.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/plan/workload.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"

namespace {

using bench::stage_list;

using Clock = std::chrono::steady_clock;
using Link = cpdispatch::SimulatedLinkTransport<cpdispatch::SimTransport>;

struct Config {
  int world = 8;
  std::int64_t tokens = 1024, heads = 8, head_dim = 64;
  int batches = 3, first_batch = 0;
  std::string sample = "both", links = "both", peers = "both";
  std::vector<int> stages{1, 2, 4};
  bool dedup = true, bound = true, balanced = true;
};

/// A kernel that attends nothing: the step's communication alone.
struct NoKernel {
  template <class... A>
  void forward(A&&...) {}
  template <class... A>
  void backward(A&&...) {}
};

std::vector<std::int64_t> sample(const std::string& name) {
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "bench_cp_attention: cannot read %s\n", (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  return nlohmann::json::parse(in).get<std::vector<std::int64_t>>();
}

/// Causal token pairs of a batch (what every method attends in all).
double causal_pairs(const std::vector<cpdispatch::BalanceDocument>& docs) {
  double pairs = 0;
  for (const auto& d : docs) {
    double L = 0;
    for (const auto& p : d.pieces) L += static_cast<double>(p.len);
    pairs += L * (L + 1) / 2;
  }
  return pairs;
}

/// One method's step: the slowest rank's seconds and the most bytes a rank sent to, or received from, others.
struct Step {
  double seconds = 0;
  double bytes = 0;
};

/// Every rank's step, timed between two barriers.
template <class Body>
Step timed_world(int W, const cpdispatch::LinkModel& link, Body&& body) {
  cpdispatch::SimWorld world(W);
  std::vector<double> seconds(static_cast<std::size_t>(W)), bytes(seconds.size());
  world.run([&](cpdispatch::SimTransport& sim) {
    Link t(sim, link);
    body(t, [&](auto&& step) {
      sim.barrier();
      const auto start = Clock::now();
      const std::uint64_t sent = t.bytes_sent(), received = t.bytes_received();
      step();
      seconds[static_cast<std::size_t>(sim.rank())] = std::chrono::duration<double>(Clock::now() - start).count();
      bytes[static_cast<std::size_t>(sim.rank())] = static_cast<double>(std::max(t.bytes_sent() - sent, t.bytes_received() - received));
    });
  });
  return {*std::max_element(seconds.begin(), seconds.end()), *std::max_element(bytes.begin(), bytes.end())};
}

/// max / mean of per-rank work.
double imbalance(const std::vector<double>& work) {
  double max = 0, sum = 0;
  for (const double w : work) max = std::max(max, w), sum += w;
  return sum > 0 ? max * static_cast<double>(work.size()) / sum : 1.0;
}

/// Causal pairs per rank of the zig-zag layout: rank r holds chunks r and 2W-1-r of every document, padded to 2W chunks.
std::vector<double> zigzag_pairs(const std::vector<cpdispatch::BalanceDocument>& docs, int W) {
  std::vector<double> pairs(static_cast<std::size_t>(W));
  for (const auto& d : docs) {
    double L = 0;
    for (const auto& p : d.pieces) L += static_cast<double>(p.len);
    const double ch = std::ceil(L / (2.0 * W));
    for (int r = 0; r < W; ++r) {
      for (const int chunk : {r, 2 * W - 1 - r}) pairs[static_cast<std::size_t>(r)] += ch * ch * chunk + ch * (ch + 1) / 2;
    }
  }
  return pairs;
}

template <class Kernel>
Kernel make_kernel() {
  if constexpr (std::is_same_v<Kernel, cpdispatch::HostAttentionKernel>) {
    return cpdispatch::HostAttentionKernel(cpdispatch::HostAttentionOptions{1, 128, 256});
  } else {
    return Kernel{};
  }
}

/// Ours: the balanced plan through ContextParallelAttention with `stages`.
template <class Kernel>
Step ours_step(const Config& c, const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::LinkModel& link, int stages) {
  const cpdispatch::AttentionShape shape{c.heads, c.heads, c.head_dim, 0.125f};
  return timed_world(c.world, link, [&](Link& t, auto&& time) {
    const auto share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    cpdispatch::ContextParallelAttention<Link, float, Kernel> op(t, share, shape, {c.dedup, stages}, Kernel(make_kernel<Kernel>()));
    const auto n = static_cast<std::size_t>(op.mlp_tokens() * c.heads * c.head_dim);
    std::vector<float> q(n, 0.01f), k(n, 0.02f), v(n, 0.03f), out(n), dq(n), dk(n), dv(n);
    time([&] {
      op.forward(q, k, v, out);
      op.backward(out, dq, dk, dv);
    });
  });
}

/// Ulysses: all-to-all from sequence to heads (every rank gets every token of heads_q / W heads), attention
/// over whole documents, all-to-all back; backward the same with the gradients.
template <class Kernel>
Step ulysses_step(const Config& c, const std::vector<cpdispatch::BalanceDocument>& docs, const cpdispatch::LinkModel& link) {
  const auto W = static_cast<std::size_t>(c.world);
  const std::int64_t hg = c.heads / c.world, D = c.head_dim, T = c.tokens, total = T * c.world;
  std::vector<cpdispatch::AttentionEntry> entries;
  std::int64_t at = 0;
  for (const auto& d : docs) {
    std::int64_t L = 0;
    for (const auto& p : d.pieces) L += p.len;
    entries.push_back({at, L, at, L, cpdispatch::AttentionMask::causal().band()});  // a whole document, bottom-right
    at += L;
  }
  const cpdispatch::AttentionShape shape{hg, hg, D, 0.125f};
  return timed_world(c.world, link, [&](Link& t, auto&& time) {
    Kernel kernel = make_kernel<Kernel>();
    const std::size_t mine = static_cast<std::size_t>(T * c.heads * D), theirs = static_cast<std::size_t>(total * hg * D);
    std::vector<float> x(mine, 0.01f), send(mine), q(theirs), k(theirs), v(theirs), out(theirs), dout(theirs), dq(theirs), dk(theirs),
        dv(theirs), back(mine), y(mine);
    std::vector<float> lse(static_cast<std::size_t>(total * hg));
    const std::size_t block = static_cast<std::size_t>(T * hg * D) * sizeof(float);
    std::vector<std::size_t> counts(W, block), displs(W);
    for (std::size_t p = 0; p < W; ++p) displs[p] = p * block;
    // [T][heads][D] -> per peer p: [T][heads of p][D]; received blocks are [rank's tokens][hg][D] in rank order.
    const auto to_heads = [&](const std::vector<float>& from, std::vector<float>& to) {
      for (std::size_t p = 0; p < W; ++p)
        for (std::int64_t i = 0; i < T; ++i)
          std::memcpy(&send[(p * static_cast<std::size_t>(T) + static_cast<std::size_t>(i)) * static_cast<std::size_t>(hg * D)],
                      &from[(static_cast<std::size_t>(i * c.heads) + p * static_cast<std::size_t>(hg)) * static_cast<std::size_t>(D)],
                      static_cast<std::size_t>(hg * D) * sizeof(float));
      t.all_to_all_v(send.data(), counts, displs, to.data(), counts, displs);
    };
    const auto to_sequence = [&](const std::vector<float>& from, std::vector<float>& to) {
      t.all_to_all_v(from.data(), counts, displs, back.data(), counts, displs);
      for (std::size_t p = 0; p < W; ++p)
        for (std::int64_t i = 0; i < T; ++i)
          std::memcpy(&to[(static_cast<std::size_t>(i * c.heads) + p * static_cast<std::size_t>(hg)) * static_cast<std::size_t>(D)],
                      &back[(p * static_cast<std::size_t>(T) + static_cast<std::size_t>(i)) * static_cast<std::size_t>(hg * D)],
                      static_cast<std::size_t>(hg * D) * sizeof(float));
    };
    time([&] {
      to_heads(x, q), to_heads(x, k), to_heads(x, v);
      kernel.forward(shape, std::span<const cpdispatch::AttentionEntry>(entries), std::span<const float>(q),
                     std::span<const float>(k), std::span<const float>(v), std::span<float>(out), std::span<float>(lse));
      to_sequence(out, y);
      to_heads(y, dout);
      kernel.backward(shape, std::span<const cpdispatch::AttentionEntry>(entries), std::span<const float>(q),
                      std::span<const float>(k), std::span<const float>(v), std::span<const float>(out), std::span<const float>(lse),
                      std::span<const float>(dout), std::span<float>(dq), std::span<float>(dk), std::span<float>(dv));
      to_sequence(dq, y), to_sequence(dk, y), to_sequence(dv, y);
    });
  });
}

/// Ring attention with the zig-zag layout (Transformer Engine's and Megatron's p2p context parallelism): every
/// document padded to a multiple of 2W and cut into 2W chunks, rank r holding chunks r and 2W-1-r; W-1 ring steps
/// pass the key-value blocks on (isend / irecv, overlapped with the step's attention), partial outputs merged by
/// log-sum-exp; backward passes the key-values and their gradients around the ring once more.
template <class Kernel>
Step ring_step(const Config& c, const std::vector<cpdispatch::BalanceDocument>& docs, const cpdispatch::LinkModel& link) {
  const int W = c.world;
  const std::int64_t H = c.heads, D = c.head_dim;
  std::vector<std::int64_t> chunk;  // chunk length of each document
  std::int64_t local = 0;          // tokens per rank: two chunks of every document
  for (const auto& d : docs) {
    std::int64_t L = 0;
    for (const auto& p : d.pieces) L += p.len;
    chunk.push_back((L + 2 * W - 1) / (2 * W));
    local += 2 * chunk.back();
  }
  const cpdispatch::AttentionShape shape{H, H, D, 0.125f};
  return timed_world(W, link, [&](Link& t, auto&& time) {
    Kernel kernel = make_kernel<Kernel>();
    const int r = t.rank();
    const auto n = static_cast<std::size_t>(local * H * D);
    std::vector<float> q(n, 0.01f), kv_cur(2 * n, 0.02f), kv_next(2 * n), out(n), part(n), acc(n), dq(n), dkv_cur(2 * n), dkv_next(2 * n),
        scratch_dq(n);
    std::vector<float> lse(static_cast<std::size_t>(local * H)), lse_part(lse.size());
    // The block held now (its buffer changes at every swap).
    const auto k = [&] { return std::span<const float>(kv_cur.data(), n); };
    const auto v = [&] { return std::span<const float>(kv_cur.data() + n, n); };
    // The entries of Q chunk a (0: chunk r, 1: chunk 2W-1-r) against block chunk b of the rank `src`: causal
    // in document positions, where the query chunk starts (qa - kb) * ch after the key chunk, so the band on
    // buffer rows is t - j <= (qa - kb) * ch + (b - a) * ch.
    const auto entries_of = [&](int src, int a, int b, std::vector<cpdispatch::AttentionEntry>& e) {
      e.clear();
      std::int64_t at = 0;
      const int qa = a == 0 ? r : 2 * W - 1 - r, kb = b == 0 ? src : 2 * W - 1 - src;
      for (const std::int64_t ch : chunk) {
        if (kb <= qa) e.push_back({at + a * ch, ch, at + b * ch, ch, {cpdispatch::Band::unbounded_lo, (qa - kb + b - a) * ch}});
        at += 2 * ch;
      }
    };
    std::vector<cpdispatch::AttentionEntry> e;
    const auto ring_pass = [&](std::vector<float>& cur, std::vector<float>& next) {
      const int to = (r + 1) % W, from = (r + W - 1) % W;
      const std::size_t bytes = cur.size() * sizeof(float);
      const cpdispatch::Request s = t.isend(cur.data(), bytes, to, 0), rv = t.irecv(next.data(), bytes, from, 0);
      return std::pair{s, rv};
    };
    time([&] {
      for (int step = 0; step < W; ++step) {  // forward: attend the block of rank r - step while the next one travels
        const int src = (r - step + W) % W;
        std::pair<cpdispatch::Request, cpdispatch::Request> reqs{};
        if (step + 1 < W) reqs = ring_pass(kv_cur, kv_next);
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b) {
            entries_of(src, a, b, e);
            kernel.forward(shape, std::span<const cpdispatch::AttentionEntry>(e), std::span<const float>(q), k(), v(),
                           std::span<float>(part), std::span<float>(lse_part));
            for (const auto& x : e)
              cpdispatch::detail::merge_partial<float>(acc, lse, std::span<const float>(part), lse_part, local, H, D, x.q_start, x.q_start + x.q_len);
          }
        if (step + 1 < W) {
          t.wait(reqs.first), t.wait(reqs.second);
          std::swap(kv_cur, kv_next);
        }
      }
      out = acc;
      std::vector<float> dkv_in(2 * n), dkv_out(2 * n);
      cpdispatch::Request g_send{};
      const int to = (r + 1) % W, from = (r + W - 1) % W;
      for (int step = 0; step < W; ++step) {  // backward: each block's gradient accumulator travels with it
        const int src = (r - step + W) % W;
        cpdispatch::Request g_recv{};
        // The accumulator of this step's block comes from the previous rank (posted before the next block's
        // key-values, as the previous rank sends them: messages between two ranks match in posting order).
        if (step > 0) g_recv = t.irecv(dkv_in.data(), dkv_in.size() * sizeof(float), from, 1);
        std::pair<cpdispatch::Request, cpdispatch::Request> a_reqs{};
        if (step + 1 < W) a_reqs = ring_pass(kv_cur, kv_next);
        std::fill(dkv_cur.begin(), dkv_cur.end(), 0.0f);
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b) {
            entries_of(src, a, b, e);
            kernel.backward(shape, std::span<const cpdispatch::AttentionEntry>(e), std::span<const float>(q), k(), v(),
                            std::span<const float>(out), std::span<const float>(lse), std::span<const float>(q), std::span<float>(scratch_dq),
                            std::span<float>(dkv_next.data(), n), std::span<float>(dkv_next.data() + n, n));
            for (std::size_t i = 0; i < 2 * n; ++i) dkv_cur[i] += dkv_next[i];  // a ring adds each pair's share (timed as such)
          }
        if (step > 0) {
          t.wait(g_recv);
          for (std::size_t i = 0; i < 2 * n; ++i) dkv_cur[i] += dkv_in[i];
        }
        if (step > 0) t.wait(g_send);  // the previous accumulator has left: its buffer may be reused
        std::swap(dkv_cur, dkv_out);
        g_send = t.isend(dkv_out.data(), dkv_out.size() * sizeof(float), to, 1);  // the last one goes home
        if (step + 1 < W) t.wait(a_reqs.first), t.wait(a_reqs.second), std::swap(kv_cur, kv_next);
      }
      const cpdispatch::Request home = t.irecv(dkv_in.data(), dkv_in.size() * sizeof(float), from, 1);  // this rank's own block's gradients
      t.wait(g_send);
      t.wait(home);
    });
  });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a line as soon as it is measured
  Config c;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc) {
      return std::fprintf(stderr, "bench_cp_attention: %s: every option takes a value (the options: the top of bench_cp_attention.cpp)\n", a.c_str()), 2;
    }
    const long long v = std::atoll(argv[i + 1]);
    if (a == "--sample") c.sample = argv[i + 1];
    else if (a == "--first-batch") c.first_batch = static_cast<int>(v);
    else if (a == "--world") c.world = static_cast<int>(v);
    else if (a == "--tokens") c.tokens = v;
    else if (a == "--batches") c.batches = static_cast<int>(v);
    else if (a == "--heads") c.heads = v;
    else if (a == "--head-dim") c.head_dim = v;
    else if (a == "--dedup") c.dedup = v != 0;
    else if (a == "--links") c.links = argv[i + 1];
    else if (a == "--peers") c.peers = argv[i + 1];
    else if (a == "--stages") c.stages = stage_list(argv[i + 1]);
    else if (a == "--bound") c.bound = v != 0;
    else if (a == "--balanced") c.balanced = v != 0;
    else return std::fprintf(stderr, "bench_cp_attention: unknown option %s\n", a.c_str()), 2;
  }
  if (c.world < 1 || c.heads % c.world != 0) return std::fprintf(stderr, "bench_cp_attention: heads must divide by world\n"), 2;
  if (c.sample != "both" && c.sample != "prolong" && c.sample != "wlbllm") {
    return std::fprintf(stderr, "bench_cp_attention: --sample %s is not prolong, wlbllm or both\n", c.sample.c_str()), 2;
  }
  if (c.first_batch < 0 || c.batches < 1) return std::fprintf(stderr, "bench_cp_attention: --first-batch >= 0 and --batches >= 1\n"), 2;
  if (c.links != "ib" && c.links != "nvlink" && c.links != "both") return std::fprintf(stderr, "bench_cp_attention: --links is ib, nvlink or both\n"), 2;
  if (c.peers != "ulysses" && c.peers != "ring" && c.peers != "both") {
    return std::fprintf(stderr, "bench_cp_attention: --peers is ulysses, ring or both\n"), 2;
  }
  if (c.stages.empty()) return std::fprintf(stderr, "bench_cp_attention: --stages is a comma-separated list of stage counts >= 1\n"), 2;
  const cpdispatch::LinkModel instant{std::chrono::nanoseconds{0}, 1e15};
  struct Ratio {
    const char* name;
    const char* option;
    double bytes_per_flop;
  };
  const Ratio ratios[] = {{"IB 50 GB/s", "ib", 50e9 / 400e12}, {"NVLink 450 GB/s", "nvlink", 450e9 / 400e12}};
  const bool run_ulysses = c.peers != "ring", run_ring = c.peers != "ulysses";
  std::printf("bench_cp_attention: W = %d ranks x %lld tokens, %lld heads x %lld, float; %d batches per sample; ours %s dedup\n", c.world,
              static_cast<long long>(c.tokens), static_cast<long long>(c.heads), static_cast<long long>(c.head_dim), c.batches,
              c.dedup ? "with" : "without");
  std::map<std::string, std::vector<double>> ratios_of;  // "sample|link|what" -> per batch
  for (const char* name : {"prolong", "wlbllm"}) {
    if (c.sample != "both" && c.sample != name) continue;
    const std::vector<std::int64_t> lengths = sample(name);
    for (int b = c.first_batch; b < c.first_batch + c.batches; ++b) {
      cpdispatch::BalanceProblem p;
      p.world_size = c.world;
      p.documents = cpdispatch::draw_workload(lengths, c.world, c.tokens, static_cast<std::uint64_t>(b));
      // As many shards per document as the zig-zag layout's chunks: with only W, a document spanning all W ranks
      // could not be re-cut at all (a shard never leaves its piece), and the plan would keep the packing's imbalance.
      p.max_cp_degree = std::max<std::int64_t>(2 * c.world, static_cast<std::int64_t>(cpdispatch::widest_span(p.documents)));
      p.q_bytes = c.heads * c.head_dim * 4;
      p.kv_bytes = 2 * p.q_bytes;
      cpdispatch::BalanceOptions options;
      options.dedup = c.dedup;
      cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(p, options);
      plan.dedup = c.dedup;
      const double flops = 3.5 * 4.0 * causal_pairs(p.documents) * static_cast<double>(c.head_dim * c.heads);  // forward + 2.5x backward
      const double compute = ours_step<cpdispatch::HostAttentionKernel>(c, plan, instant, 1).seconds;
      const double rate = flops / compute / c.world;  // per rank, all ranks computing at once
      const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan);
      const double ours_imbalance = imbalance(std::vector<double>(cost.attention.begin(), cost.attention.end()));
      const double ring_imbalance = imbalance(zigzag_pairs(p.documents, c.world));
      bool bytes_printed = false;  // bytes and work do not depend on the link: printed once a batch
      for (const Ratio& r : ratios) {
        if (c.links != "both" && c.links != r.option) continue;
        const std::string key = std::string(name) + "|" + r.name + "|";
        const cpdispatch::LinkModel link{std::chrono::nanoseconds{0}, rate * r.bytes_per_flop};
        const Step comm = c.bound && c.balanced ? ours_step<NoKernel>(c, plan, link, 1) : Step{};  // the bound is the balanced plan's
        double best_ours = 1e300, one_stage = 0, ours_bytes = 0;
        for (const int stages : c.balanced ? c.stages : std::vector<int>{}) {
          const Step ours = ours_step<cpdispatch::HostAttentionKernel>(c, plan, link, stages);
          best_ours = std::min(best_ours, ours.seconds);
          ours_bytes = ours.bytes;
          std::printf("%s batch %d | %s | ours stages=%d | step %.1f ms | compute %.1f ms", name, b, r.name, stages, ours.seconds * 1e3, compute * 1e3);
          if (c.bound) {
            const double bound = std::max(compute, comm.seconds) + std::min(compute, comm.seconds) / stages;
            std::printf(" | comm %.1f ms | step/bound %.2f", comm.seconds * 1e3, ours.seconds / bound);
            ratios_of[key + "overlap s" + std::to_string(stages)].push_back(ours.seconds / bound);
          }
          std::printf("\n");
          if (stages == 1) one_stage = ours.seconds;
          if (one_stage > 0) ratios_of[key + "gain over stages=1, s" + std::to_string(stages)].push_back(one_stage / ours.seconds);
        }
        // The plan the step model picks for this link: as balanced as pays (plan_for_cluster), 2 stages.
        cpdispatch::ClusterModel cluster;
        cluster.intra = cluster.inter = {link.bandwidth, 0.0};
        cluster.attention_flops = rate;
        cluster.ranks_per_node = c.world;
        cpdispatch::BalanceOptions chosen_options;
        chosen_options.dedup = c.dedup;
        const cpdispatch::ClusterPlan chosen = cpdispatch::plan_for_cluster(
            p, cluster, cpdispatch::LayerShape{c.heads, c.head_dim, 4, 2}, cpdispatch::Topology::uniform(c.world, c.world), chosen_options);
        const Step modelled = ours_step<cpdispatch::HostAttentionKernel>(c, chosen.plan, link, 2);
        std::printf("%s batch %d | %s | ours, the step model's plan (cost slack %.2f), stages=2 | step %.1f ms | %.1f MiB\n", name, b, r.name,
                    chosen.cost_slack, modelled.seconds * 1e3, modelled.bytes / 1048576.0);
        const auto peer = [&](const char* what, const Step& s) {
          std::printf("%s batch %d | %s | %s | step %.1f ms", name, b, r.name, what, s.seconds * 1e3);
          if (c.balanced) std::printf(" | ours (best stages) / %s %.2f", what, best_ours / s.seconds);
          std::printf(" | the step model's plan / %s %.2f\n", what, modelled.seconds / s.seconds);
          if (c.balanced) ratios_of[key + "ours/" + what].push_back(best_ours / s.seconds);
          ratios_of[key + "ours (step model's plan)/" + what].push_back(modelled.seconds / s.seconds);
        };
        const Step ulysses = run_ulysses ? ulysses_step<cpdispatch::HostAttentionKernel>(c, p.documents, link) : Step{};
        if (run_ulysses) peer("ulysses", ulysses);
        const Step ring = run_ring ? ring_step<cpdispatch::HostAttentionKernel>(c, p.documents, link) : Step{};
        if (run_ring) peer("ring zig-zag", ring);
        if (run_ulysses && run_ring) {
          const double better = std::min(ulysses.seconds, ring.seconds);
          if (c.balanced) ratios_of[key + "ours/better peer"].push_back(best_ours / better);
          ratios_of[key + "ours (step model's plan)/better peer"].push_back(modelled.seconds / better);
        }
        if (!bytes_printed) {
          bytes_printed = true;
          std::printf("%s batch %d | most bytes a rank sends or receives per step (MiB):", name, b);
          if (c.balanced) std::printf(" ours %.1f,", ours_bytes / 1048576.0);
          std::printf(" the step model's plan (%s) %.1f", r.option, modelled.bytes / 1048576.0);
          if (run_ulysses) std::printf(", ulysses %.1f", ulysses.bytes / 1048576.0);
          if (run_ring) std::printf(", ring %.1f", ring.bytes / 1048576.0);
          std::printf(" | attention work max/mean: ours %.3f, ulysses 1.000, ring %.3f\n", ours_imbalance, ring_imbalance);
          if (run_ulysses && c.balanced) ratios_of[std::string(name) + "|bytes ours/ulysses"].push_back(ours_bytes / ulysses.bytes);
          if (run_ring && c.balanced) ratios_of[std::string(name) + "|bytes ours/ring"].push_back(ours_bytes / ring.bytes);
          ratios_of[std::string(name) + "|imbalance ours"].push_back(ours_imbalance);
          ratios_of[std::string(name) + "|imbalance ring zig-zag"].push_back(ring_imbalance);
        }
      }
      std::printf("%s batch %d | kernel %.2f GFLOP/s per rank with %d ranks computing\n", name, b, rate * 1e-9, c.world);
      std::fflush(stdout);
    }
  }
  std::printf("\nmedians over the batches:\n");
  for (const auto& [key, v] : ratios_of) {
    std::printf("  %s: %.3f\n", key.c_str(), median(v));
  }
  return 0;
}
