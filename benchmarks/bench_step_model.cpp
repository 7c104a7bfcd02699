// The step-time model (docs/node-exchange.md, "Step-time model") on batches
// drawn from the ProLong and WLB-LLM samples: for W ranks, 8 a node, the
// modelled time of one layer's forward + backward (ms) for our balanced plan
// with the flat, deduplicated and node-level KV exchanges, and for the zig-zag
// ring, Ulysses, Transformer Engine's a2a+p2p and USP at its fastest group
// size (model_usp_best: Ulysses inside groups of u ranks, the ring across
// them; the u printed after the row) on the same batch.
// A plain driver (a model, nothing to time):
//   bench_step_model [h100|h200] [--svg FILE] [W ...]     (default: h100, W = 64 128 ... 4096)
//       --svg FILE also writes the table as a chart: step time against W, one
//       panel a sample, log-scale axes (docs/images/step_model.svg)
//   bench_step_model validate                (the model's exchange time against
//       the flat KV exchange measured over SimulatedLinkTransport on 8 sim
//       ranks: one tier, every rank its own node, the same bandwidth and latency)
//   bench_step_model head-parallel [--ranks-per-node N] [W ...]   (default W = 8
//       64 256, 8 ranks a node: plan_for_cluster with head-parallel documents
//       chosen (BalanceOptions::head_parallel auto) against the best of Ulysses,
//       the zig-zag ring and USP, per batch: the median and worst ratio over ten
//       seeded batches of 8K tokens a rank, for 8 + 8 heads and 32 : 8 heads of
//       64, and the bound no scheme passes: perfectly balanced attention over
//       free links against the same best peer; see head_parallel_table.
//       --ranks-per-node 1 puts every rank on its own node: InfiniBand only)
//   bench_step_model validate-tiers          (the model's KV exchange times against
//       the flat, dedup and node-level exchanges measured over a two-tier
//       SimulatedLinkTransport: W = 8 and 16, 4 ranks a node; see validate_tiers)
// One batch a sample and W (draw_workload, 32K tokens a rank, seed 0),
// balanced by plan_balanced with the smallest C of 8, 16, 32, 64 that
// can cut every document (long documents need more pieces at large W) without the topology; 32 heads of 128.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/error.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/model/step_model.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"
#include "step_chart.hpp"
#include "stats.hpp"

namespace {

using I = std::int64_t;

constexpr I kRanksPerNode = 8;
constexpr I kTokensPerRank = 32 * 1024;

std::vector<I> sample(const std::string& name) {
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::ifstream in(dir / (name + ".json"));
  if (!in) {
    std::fprintf(stderr, "bench_step_model: cannot read %s (set CPDISPATCH_DOC_LENGTHS_DIR)\n", (dir / (name + ".json")).c_str());
    std::exit(2);
  }
  return nlohmann::json::parse(in).get<std::vector<I>>();
}

/// plan_balanced with the smallest max_cp_degree of 8..64 that can cut every document.
cpdispatch::QkvDocumentsPlan balanced(cpdispatch::BalanceProblem p, I& C) {
  for (C = 8;; C *= 2) {
    p.max_cp_degree = C;
    try {
      return cpdispatch::plan_balanced(p);
    } catch (const cpdispatch::invalid_input&) {
      if (C >= 64) throw;
    }
  }
}

std::vector<cpdispatch::StepTime> row(const std::string& name, I W, const cpdispatch::ClusterModel& cluster, const std::vector<I>& lengths) {
  cpdispatch::BalanceProblem p;
  p.world_size = W;
  p.documents = cpdispatch::draw_workload(lengths, W, kTokensPerRank, 0);
  I C = 0;
  const cpdispatch::QkvDocumentsPlan plan = balanced(p, C);
  auto rows = cpdispatch::model_step(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), cpdispatch::document_lengths(plan),
                                     cpdispatch::Topology::uniform(W, kRanksPerNode), cluster, cpdispatch::LayerShape{});
  rows.back().scheme = "usp (best u)";  // model_step's last row: one series in the chart, whichever u wins at each W
  std::printf("%-8s %5lld %3lld", name.c_str(), static_cast<long long>(W), static_cast<long long>(C));
  for (const cpdispatch::StepTime& t : rows) {
    if (t.feasible) std::printf(" %12.2f", t.step * 1e3);
    else std::printf(" %12s", "n/a");
  }
  if (rows.back().feasible) std::printf(" (u=%lld)", static_cast<long long>(rows.back().group));  // the best USP's group size
  std::printf("\n");
  std::fflush(stdout);
  return rows;
}

/// Adds one W's rows to a sample's panel (one series a scheme, in the table's order).
void add_to_panel(step_chart::Panel& panel, I W, const std::vector<cpdispatch::StepTime>& rows) {
  if (panel.series.empty())
    for (const cpdispatch::StepTime& t : rows) panel.series.push_back({t.scheme, {}});
  for (std::size_t k = 0; k < rows.size() && k < panel.series.size(); ++k) {
    if (rows[k].feasible) panel.series[k].points.emplace_back(static_cast<double>(W), rows[k].step * 1e3);
  }
}

int write_chart(const std::string& path, const std::vector<step_chart::Panel>& panels, const cpdispatch::ClusterModel& cluster) {
  std::ofstream out(path);
  char title[200];
  std::snprintf(title, sizeof title, "Modelled step time of one layer, forward + backward (%.0f TFLOP/s, NVLink %.0f GB/s, InfiniBand %.0f GB/s a GPU)",
                cluster.attention_flops / 1e12, cluster.intra.bandwidth / 1e9, cluster.inter.bandwidth / 1e9);
  out << step_chart::chart_svg(panels, title);
  if (!out) {
    std::fprintf(stderr, "bench_step_model: cannot write %s\n", path.c_str());
    return 2;
  }
  std::printf("chart: %s\n", path.c_str());
  return 0;
}

/// Measured against modelled time of the flat KV forward exchange of one
/// balanced ProLong batch on 8 ranks, for a few bandwidths.
int validate() {
  using Clock = std::chrono::steady_clock;
  const I W = 8;
  cpdispatch::BalanceProblem p;
  p.world_size = W;
  p.documents = cpdispatch::draw_workload(sample("prolong"), W, 8192, 0);
  I C = 0;
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(balanced(p, C));
  const std::size_t token_bytes = 1024;
  std::printf("%14s %10s %12s %12s %8s\n", "bandwidth B/s", "latency", "modelled ms", "measured ms", "error");
  for (const double bandwidth : {2e8, 1e8, 5e7}) {
    const auto latency = std::chrono::microseconds(50);
    cpdispatch::ClusterModel c;
    c.intra = c.inter = {bandwidth, 50e-6};
    c.ranks_per_node = 1;
    const cpdispatch::Topology topo = cpdispatch::Topology::uniform(W, 1);
    const auto tokens = cpdispatch::detail::step_model::flat_tokens(m.kv_fwd);
    const double modelled = cpdispatch::detail::step_model::slowest(tokens, static_cast<std::size_t>(W), static_cast<double>(token_bytes), topo, c);
    std::vector<double> took(static_cast<std::size_t>(W), 0);
    cpdispatch::SimWorld world(static_cast<int>(W));
    world.run([&](cpdispatch::SimTransport& sim) {
      cpdispatch::SimulatedLinkTransport link(sim, cpdispatch::LinkModel{latency, bandwidth});
      cpdispatch::Dispatcher kv(link, m.kv_fwd, m.kv_rev, token_bytes);
      std::vector<std::byte> mlp(kv.required_bytes().mlp_bytes), attn(kv.required_bytes().attention_bytes);
      kv.forward(mlp, attn);  // the first call sets up the staging
      sim.barrier();
      const Clock::time_point start = Clock::now();
      kv.forward(mlp, attn);
      sim.barrier();
      took[static_cast<std::size_t>(sim.rank())] = std::chrono::duration<double>(Clock::now() - start).count();
    });
    const double measured = *std::max_element(took.begin(), took.end());
    std::printf("%14.3g %8lldus %12.3f %12.3f %7.1f%%\n", bandwidth, static_cast<long long>(latency.count()), modelled * 1e3,
                measured * 1e3, (measured / modelled - 1) * 100);
  }
  return 0;
}

// ---- validate-tiers: the communication part of the model against a two-tier simulated link.
//
// A plan's three KV exchanges run as W threads over SimWorld and a two-tier
// SimulatedLinkTransport (4 ranks a node) whose links have the H100 cluster's
// ratios (NVLink 450 GB/s and 3 us, InfiniBand 50 GB/s and 5 us), slowed by a
// factor chosen so that the flat forward exchange takes ~300 ms of modelled
// time: thread scheduling and the host's copies then cost a few percent at
// most. The sim moves kSimTokenBytes a KV token; its bandwidths are scaled by
// kSimTokenBytes / (2 * 32 heads * 128 * 2 bytes) too, so the time is the
// real cluster's (one layer's K and V) times the factor. The model gets the
// same link parameters and token bytes (detail::step_model::exchange_time, as
// model_plan uses it), and predicts the slowest rank's exchange; for the
// node-level exchange, the slowest rank's first phase plus the slowest
// rank's second (a relay forwards only what it has received), as model_plan
// counts it. "node per rank" is a rank's two phases added, the model's
// earlier count, which leaves out that wait.

constexpr std::size_t kSimTokenBytes = 64;
constexpr I kTierRanksPerNode = 4;

struct TierCase {
  std::string sample;
  I W = 0;
  cpdispatch::QkvMetadata meta;
};

/// Modelled time (s) of the slowest rank's exchange of `tokens`.
double modelled(const cpdispatch::detail::step_model::PairTokens& tokens, I W, const cpdispatch::Topology& topo, const cpdispatch::ClusterModel& c) {
  return cpdispatch::detail::step_model::slowest(tokens, static_cast<std::size_t>(W), static_cast<double>(kSimTokenBytes), topo, c);
}

/// The model's node-level time: the phases' slowest ranks added (model_plan),
/// and a rank's two phases added (no wait between them).
std::pair<double, double> modelled_node(const cpdispatch::Metadata& kv, const cpdispatch::Topology& topo, const cpdispatch::ClusterModel& c) {
  cpdispatch::detail::step_model::PairTokens between, inside;
  cpdispatch::detail::step_model::node_tokens(kv, topo, between, inside);
  const auto W = static_cast<std::size_t>(kv.world_size);
  double per_rank = 0;
  for (std::size_t r = 0; r < W; ++r) {
    const double b = static_cast<double>(kSimTokenBytes);
    per_rank = std::max(per_rank, cpdispatch::detail::step_model::exchange_time(between, W, r, b, topo, c) +
                                      cpdispatch::detail::step_model::exchange_time(inside, W, r, b, topo, c));
  }
  return {modelled(between, kv.world_size, topo, c) + modelled(inside, kv.world_size, topo, c), per_rank};
}

/// Wall time (s) from the first rank's start to the last rank's end of `step` run once on every rank (after a barrier).
template <class Step>
double timed(cpdispatch::SimTransport& sim, std::vector<double>& starts, std::vector<double>& ends, Step step) {
  using Clock = std::chrono::steady_clock;
  const auto me = static_cast<std::size_t>(sim.rank());
  sim.barrier();
  starts[me] = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  step();
  ends[me] = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  sim.barrier();
  return *std::max_element(ends.begin(), ends.end()) - *std::min_element(starts.begin(), starts.end());
}

/// Measured forward and reverse times (s) of the three exchanges: [flat fwd, flat rev, dedup fwd, ..., node rev].
std::vector<double> measure_tiers(const TierCase& tc, const cpdispatch::Topology& topo, cpdispatch::LinkModel intra, cpdispatch::LinkModel inter) {
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(tc.meta);
  std::vector<double> out(6, 0), starts(static_cast<std::size_t>(tc.W)), ends(starts.size());
  cpdispatch::SimWorld world(static_cast<int>(tc.W));
  world.run([&](cpdispatch::SimTransport& sim) {
    using Link = cpdispatch::SimulatedLinkTransport<cpdispatch::SimTransport>;
    Link link(sim, topo, intra, inter);
    const bool first = sim.rank() == 0;
    const auto record = [&](std::size_t k, double t) { if (first) out[k] = t; };
    {
      cpdispatch::Dispatcher<Link> kv(link, tc.meta.kv_fwd, tc.meta.kv_rev, kSimTokenBytes);
      std::vector<std::byte> mlp(kv.required_bytes().mlp_bytes), attn(kv.required_bytes().attention_bytes), rep(kv.required_bytes().replica_bytes);
      record(0, timed(sim, starts, ends, [&] { kv.forward(mlp, attn); }));
      record(1, timed(sim, starts, ends, [&] { kv.reverse(attn, rep); }));
    }
    {
      cpdispatch::KvWireDispatcher<Link> kv(link, wire, kSimTokenBytes);
      const auto& n = kv.required_bytes();
      std::vector<std::byte> mlp(n.mlp_bytes), attn(n.attention_bytes), w(n.wire_bytes), rep(n.replica_bytes), grad(n.mlp_bytes);
      record(2, timed(sim, starts, ends, [&] { kv.forward(mlp, attn); }));
      record(3, timed(sim, starts, ends, [&] { kv.reverse_combine(attn, w, rep, grad, cpdispatch::ElementType::float32); }));
    }
    {
      cpdispatch::NodeWireDispatcher<Link> kv(link, wire.fan[static_cast<std::size_t>(sim.rank())],
                                              cpdispatch::plan_node_wire_for_rank(tc.meta.kv_fwd, topo, sim.rank()), kSimTokenBytes);
      std::vector<std::byte> mlp(kv.required_bytes().mlp_bytes), attn(kv.required_bytes().attention_bytes), grad(mlp.size());
      record(4, timed(sim, starts, ends, [&] { kv.forward(mlp, attn); }));
      record(5, timed(sim, starts, ends, [&] { kv.reverse_combine(attn, grad, cpdispatch::ElementType::float32); }));
    }
  });
  return out;
}

void validate_case(const TierCase& tc) {
  const cpdispatch::Topology topo = cpdispatch::Topology::uniform(tc.W, kTierRanksPerNode);
  // The H100 cluster with its bandwidths per sim byte: a sim token stands for one real K and V token.
  const double real_kv_token_bytes = 2 * cpdispatch::LayerShape{}.kv_token_bytes();
  cpdispatch::ClusterModel c = cpdispatch::ClusterModel::h100_ib();
  c.ranks_per_node = kTierRanksPerNode;
  for (cpdispatch::LinkTier* t : {&c.intra, &c.inter}) t->bandwidth *= static_cast<double>(kSimTokenBytes) / real_kv_token_bytes;
  const double real_flat = modelled(cpdispatch::detail::step_model::flat_tokens(tc.meta.kv_fwd), tc.W, topo, c);
  const double slow = 0.3 / real_flat;  // the flat forward exchange: ~300 ms
  for (cpdispatch::LinkTier* t : {&c.intra, &c.inter}) t->bandwidth /= slow, t->latency *= slow;
  const auto link = [](const cpdispatch::LinkTier& t) {
    return cpdispatch::LinkModel{std::chrono::nanoseconds(static_cast<std::int64_t>(t.latency * 1e9)), t.bandwidth};
  };
  const auto [node_model, node_per_rank] = modelled_node(tc.meta.kv_fwd, topo, c);
  const double model[3] = {modelled(cpdispatch::detail::step_model::flat_tokens(tc.meta.kv_fwd), tc.W, topo, c),
                           modelled(cpdispatch::detail::step_model::dedup_tokens(tc.meta.kv_fwd), tc.W, topo, c), node_model};
  const std::vector<double> took = measure_tiers(tc, topo, link(c.intra), link(c.inter));
  const std::vector<double> host = measure_tiers(tc, topo, cpdispatch::LinkModel{std::chrono::nanoseconds(0), 1e15},
                                                 cpdispatch::LinkModel{std::chrono::nanoseconds(0), 1e15});
  const char* names[3] = {"flat", "dedup", "node-level"};
  for (int e = 0; e < 3; ++e) {
    for (int dir = 0; dir < 2; ++dir) {
      const auto k = static_cast<std::size_t>(2 * e + dir);
      std::printf("%-8s %3lld %6.0f %-10s %-7s %10.1f %10.1f %8.3f %9.1f", tc.sample.c_str(), static_cast<long long>(tc.W), slow, names[e],
                  dir == 0 ? "forward" : "reverse", model[e] * 1e3, took[k] * 1e3, took[k] / model[e], host[k] * 1e3);
      if (e == 2) std::printf("   node per rank %.1f ms (ratio %.3f)", node_per_rank * 1e3, took[k] / node_per_rank);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
}

/// The model's exchange times against the three KV exchanges measured over a two-tier simulated link.
int validate_tiers() {
  std::printf("KV exchanges over a two-tier simulated link (%lld ranks a node, H100 link ratios slowed by `slow`,\n"
              "%zu sim bytes a KV token): modelled vs measured ms of the slowest rank, and the host's own time (links free)\n",
              static_cast<long long>(kTierRanksPerNode), kSimTokenBytes);
  std::printf("%-8s %3s %6s %-10s %-7s %10s %10s %8s %9s\n", "sample", "W", "slow", "exchange", "dir", "model ms", "measured", "ratio", "host ms");
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> lengths = sample(name);
    for (const I W : {I{8}, I{16}}) {
      cpdispatch::BalanceProblem p;
      p.world_size = W;
      p.documents = cpdispatch::draw_workload(lengths, W, kTokensPerRank, 0);
      I C = 0;
      validate_case(TierCase{name, W, cpdispatch::plan_qkv(balanced(p, C))});
    }
  }
  return 0;
}

// ---- head-parallel: plan_for_cluster choosing head-parallel documents, against the peers

constexpr I kHeadParallelTokensPerRank = 8 * 1024;

/// plan_for_cluster with the smallest max_cp_degree of 8..64 that can cut every document.
cpdispatch::ClusterPlan for_cluster(cpdispatch::BalanceProblem p, const cpdispatch::ClusterModel& cluster, const cpdispatch::LayerShape& shape,
                                    const cpdispatch::Topology& topology, const cpdispatch::BalanceOptions& options) {
  for (p.max_cp_degree = 8;; p.max_cp_degree *= 2) {
    try {
      return cpdispatch::plan_for_cluster(p, cluster, shape, topology, options);
    } catch (const cpdispatch::invalid_input&) {
      if (p.max_cp_degree >= 64) throw;
    }
  }
}

/// Forward and backward attention of causal documents `docs` shared equally by W ranks at the
/// cluster's rate: no scheme's modelled step is shorter.
double balanced_attention_seconds(const std::vector<I>& docs, I W, const cpdispatch::ClusterModel& c, const cpdispatch::LayerShape& shape) {
  const double pairs = cpdispatch::detail::step_model::batch_totals(docs, cpdispatch::AttentionMask::causal(), 1, {}).pairs;
  return 3.5 * cpdispatch::detail::step_model::forward_flops(pairs / static_cast<double>(W), shape) / c.attention_flops;
}

/// The median and the largest of `v`.
std::pair<double, double> median_and_worst(const std::vector<double>& v) {
  return {bench::median(v), v.empty() ? 0 : *std::max_element(v.begin(), v.end())};
}

/// Per sample, layer and W: over ten batches (seeds 0..9), the modelled step of
/// plan_for_cluster with head-parallel auto, and without, over the best of
/// Ulysses, the zig-zag ring and USP on the same batch; the bound (every
/// rank's attention an equal share at the model's rate, no link time, over the
/// same best peer); how many batches got head-parallel documents, and how many
/// chose each u (0: none).
int head_parallel_table(std::vector<I> worlds, I ranks_per_node) {
  if (worlds.empty()) worlds = {8, 64, 256};
  cpdispatch::ClusterModel cluster = cpdispatch::ClusterModel::h100_ib();
  cluster.ranks_per_node = ranks_per_node;
  const std::pair<const char*, cpdispatch::LayerShape> shapes[] = {{"8+8x64", {8, 64, 2, 4, 8}}, {"32:8x64", {32, 64, 2, 4, 8}}};
  std::printf("plan_for_cluster (H100 links, %lld ranks a node, %lld tokens a rank, ten batches) over the best peer per batch:\n",
              static_cast<long long>(ranks_per_node), static_cast<long long>(kHeadParallelTokensPerRank));
  std::printf("%-8s %-8s %5s %12s %12s %12s %12s %12s %6s %s\n", "sample", "heads", "W", "auto median", "auto worst", "off median", "off worst",
              "bound median", "hp", "u chosen");
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> lengths = sample(name);
    for (const auto& [heads, shape] : shapes) {
      for (const I W : worlds) {
        const cpdispatch::Topology topology = cpdispatch::Topology::uniform(W, std::min(W, ranks_per_node));
        cpdispatch::BalanceProblem p;
        p.world_size = W;
        p.q_bytes = shape.heads_q;  // bytes in proportion to the layer's
        p.kv_bytes = 2 * shape.kv_heads();
        cpdispatch::BalanceOptions automatic;
        automatic.head_parallel = cpdispatch::HeadParallel::automatic;
        std::vector<double> with, without, bound;
        std::map<I, int> degrees;
        for (std::uint64_t seed = 0; seed < 10; ++seed) {
          p.documents = cpdispatch::draw_workload(lengths, W, kHeadParallelTokensPerRank, seed);
          const cpdispatch::ClusterPlan hp = for_cluster(p, cluster, shape, topology, automatic);
          const cpdispatch::ClusterPlan off = for_cluster(p, cluster, shape, topology, {});
          const std::vector<I> docs = cpdispatch::document_lengths(off.plan);
          double peer = 0;
          for (const cpdispatch::StepTime& t : {cpdispatch::model_ulysses(docs, {}, W, cluster, shape), cpdispatch::model_zigzag_ring(docs, {}, W, cluster, shape),
                                                cpdispatch::model_usp_best(docs, {}, W, cluster, shape)}) {
            if (t.feasible && (peer == 0 || t.step < peer)) peer = t.step;
          }
          bound.push_back(balanced_attention_seconds(docs, W, cluster, shape) / peer);
          with.push_back(hp.modelled.step / peer);
          without.push_back(off.modelled.step / peer);
          ++degrees[hp.plan.head_parallel_degree];
        }
        const auto [m_with, w_with] = median_and_worst(with);
        const auto [m_without, w_without] = median_and_worst(without);
        std::printf("%-8s %-8s %5lld %12.3f %12.3f %12.3f %12.3f %12.3f %6d", name, heads, static_cast<long long>(W), m_with, w_with, m_without,
                    w_without, median_and_worst(bound).first, 10 - degrees[0]);
        for (const auto& [u, n] : degrees) std::printf(" u=%lld:%d", static_cast<long long>(u), n);
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cpdispatch::ClusterModel cluster = cpdispatch::ClusterModel::h100_ib();
  std::vector<I> worlds;
  std::string svg;
  if (argc == 2 && std::string(argv[1]) == "validate") return validate();
  if (argc == 2 && std::string(argv[1]) == "validate-tiers") return validate_tiers();
  if (argc >= 2 && std::string(argv[1]) == "head-parallel") {
    std::vector<I> hp_worlds;
    I ranks_per_node = kRanksPerNode;
    for (int i = 2; i < argc; ++i) {
      if (std::string(argv[i]) == "--ranks-per-node" && i + 1 < argc) {
        ranks_per_node = std::max<I>(1, std::atoll(argv[++i]));
      } else {
        hp_worlds.push_back(std::atoll(argv[i]));
      }
    }
    return head_parallel_table(hp_worlds, ranks_per_node);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--svg" && i + 1 < argc) svg = argv[++i];
    else if (a == "h200") cluster = cpdispatch::ClusterModel::h200_ib();
    else if (a != "h100") worlds.push_back(std::atoll(argv[i]));
  }
  if (worlds.empty()) worlds = {64, 128, 256, 512, 1024, 2048, 4096};
  for (I W : worlds) {
    if (W < 1) {
      std::fprintf(stderr, "bench_step_model: W must be at least 1\n");
      return 2;
    }
  }
  std::printf("step time of one layer, forward + backward (ms), %lld ranks a node, %lld tokens a rank\n",
              static_cast<long long>(kRanksPerNode), static_cast<long long>(kTokensPerRank));
  std::printf("%-8s %5s %3s %12s %12s %12s %12s %12s %12s %12s\n", "sample", "W", "C", "flat", "dedup", "node-level", "zig-zag", "ulysses",
              "a2a+p2p", "usp (best u)");
  std::vector<step_chart::Panel> panels;
  const std::map<std::string, std::string> titles = {{"prolong", "ProLong sample"}, {"wlbllm", "WLB-LLM sample"}};
  for (const char* name : {"prolong", "wlbllm"}) {
    const std::vector<I> lengths = sample(name);
    panels.push_back({titles.at(name), {}});
    for (I W : worlds) {
      try {
        add_to_panel(panels.back(), W, row(name, W, cluster, lengths));
      } catch (const cpdispatch::invalid_input& e) {
        std::printf("%-8s %5lld  cannot plan: %s\n", name, static_cast<long long>(W), e.what());
      }
    }
  }
  return svg.empty() ? 0 : write_chart(svg, panels, cluster);
}
