#pragma once
// Small plans on small topologies for the node-level exchange's tests: every
// world size 1..12 on 1 to 4 nodes, consecutive, uneven and interleaved node maps.

#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/topology.hpp"

namespace node_test {

struct Case {
  std::string name;
  cpdispatch::QkvDocumentsPlan plan;
  cpdispatch::Topology topology;
};

/// Node maps of W ranks on `nodes` nodes: consecutive blocks (uneven when
/// nodes does not divide W), round-robin (interleaved), and all but one rank on node 0.
inline std::vector<std::pair<std::string, std::vector<std::int64_t>>> node_maps(std::int64_t W, std::int64_t nodes) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  if (nodes > W) return out;
  std::vector<std::int64_t> block(static_cast<std::size_t>(W)), round(block.size()), lopsided(block.size(), 0);
  for (std::int64_t r = 0; r < W; ++r) {
    block[static_cast<std::size_t>(r)] = r * nodes / W;
    round[static_cast<std::size_t>(r)] = r % nodes;
    lopsided[static_cast<std::size_t>(r)] = r < W - nodes + 1 ? 0 : r - (W - nodes);
  }
  out.emplace_back("block", block);
  if (nodes > 1) out.emplace_back("interleaved", round);
  if (nodes > 1 && nodes < W) out.emplace_back("lopsided", lopsided);
  return out;
}

inline std::vector<Case> cases(std::int64_t min_w = 1, std::int64_t max_w = 12) {
  std::vector<Case> out;
  for (std::int64_t W = min_w; W <= max_w; ++W) {
    for (std::int64_t nodes = 1; nodes <= 4; ++nodes) {
      for (auto& [map_name, map] : node_maps(W, nodes)) {
        cpdispatch::RandomDocumentsOptions o;
        o.world_size = W;
        o.num_documents = 2 + W / 2;
        o.max_shards = 5;
        o.max_len = 4;
        const auto seed = static_cast<std::uint64_t>(W * 31 + nodes);
        std::string name = "W";
        name.append(std::to_string(W)).append("_").append(std::to_string(nodes)).append("nodes_").append(map_name);
        out.push_back({name, cpdispatch::random_documents_plan(o, seed), cpdispatch::Topology::from_nodes(map)});
      }
    }
  }
  return out;
}

}  // namespace node_test
