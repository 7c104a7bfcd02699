// The step-time model (docs/node-exchange.md, "Step-time model") on batches
// drawn from the ProLong and WLB-LLM samples: for W ranks, 8 a node, the
// modelled time of one layer's forward + backward (ms) for our balanced plan
// with the flat, deduplicated and node-level KV exchanges, and for the zig-zag
// ring, Ulysses and Transformer Engine's a2a+p2p on the same batch.
// A plain driver (a model, nothing to time):
//   bench_step_model [h100|h200] [--svg FILE] [W ...]     (default: h100, W = 64 128 ... 4096)
//       --svg FILE also writes the table as a chart: step time against W, one
//       panel a sample, log-scale axes (docs/images/step_model.svg)
//   bench_step_model validate                (the model's exchange time against
//       the flat KV exchange measured over SimulatedLinkTransport on 8 sim
//       ranks: one tier, every rank its own node, the same bandwidth and latency)
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
#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/step_model.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/plan/workload.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/transports/simulated_link.hpp"
#include "step_chart.hpp"

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
  const auto rows = cpdispatch::model_step(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), cpdispatch::document_lengths(plan),
                                           cpdispatch::Topology::uniform(W, kRanksPerNode), cluster, cpdispatch::LayerShape{});
  std::printf("%-8s %5lld %3lld", name.c_str(), static_cast<long long>(W), static_cast<long long>(C));
  for (const cpdispatch::StepTime& t : rows) {
    if (t.feasible) std::printf(" %12.2f", t.step * 1e3);
    else std::printf(" %12s", "n/a");
  }
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
    const auto tokens = cpdispatch::step_detail::flat_tokens(m.kv_fwd);
    double modelled = 0;
    for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
      modelled = std::max(modelled, cpdispatch::step_detail::exchange_time(tokens, static_cast<std::size_t>(W), r,
                                                                            static_cast<double>(token_bytes), topo, c));
    }
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

}  // namespace

int main(int argc, char** argv) {
  cpdispatch::ClusterModel cluster = cpdispatch::ClusterModel::h100_ib();
  std::vector<I> worlds;
  std::string svg;
  if (argc == 2 && std::string(argv[1]) == "validate") return validate();
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
  std::printf("%-8s %5s %3s %12s %12s %12s %12s %12s %12s\n", "sample", "W", "C", "flat", "dedup", "node-level", "zig-zag", "ulysses", "a2a+p2p");
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
