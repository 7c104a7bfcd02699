#pragma once
// Which node each rank is on (docs/node-exchange.md).
//
// Links inside a node (NVLink) are an order of magnitude faster than links
// between nodes (InfiniBand), so the node-level exchange and its token counts
// need the node of every rank. Ranks of one node need not be consecutive.
//
//   const Topology t = Topology::uniform(16, 8);          // ranks 0-7 node 0, 8-15 node 1
//   const Topology u = Topology::from_nodes({0, 1, 0, 1}); // interleaved

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// The node of each rank. Nodes are numbered 0..num_nodes()-1 and every node
/// holds at least one rank.
class Topology {
 public:
  Topology() = default;

  /// `ranks_per_node` consecutive ranks a node: rank r is on node r / ranks_per_node
  /// (the last node holds fewer ranks when it does not divide world_size).
  static Topology uniform(std::int64_t world_size, std::int64_t ranks_per_node) {
    if (world_size < 1) detail::fail("Topology: world_size = ", world_size, " must be at least 1");
    if (ranks_per_node < 1) detail::fail("Topology: ranks_per_node = ", ranks_per_node, " must be at least 1");
    std::vector<std::int64_t> nodes(static_cast<std::size_t>(world_size));
    for (std::size_t r = 0; r < nodes.size(); ++r) nodes[r] = static_cast<std::int64_t>(r) / ranks_per_node;
    return Topology(std::move(nodes));
  }

  /// The node of each rank, explicitly: nodes[r] in [0, N) with every node of
  /// 0..N-1 used (N = the largest entry + 1).
  static Topology from_nodes(std::vector<std::int64_t> nodes) {
    if (nodes.empty()) detail::fail("Topology: nodes is empty (one entry per rank)");
    std::int64_t top = 0;
    for (std::size_t r = 0; r < nodes.size(); ++r) {
      if (nodes[r] < 0 || nodes[r] >= static_cast<std::int64_t>(nodes.size())) {
        detail::fail("Topology: nodes[", r, "] = ", nodes[r], " is outside [0, ", nodes.size(), ") (at most one node per rank)");
      }
      if (nodes[r] > top) top = nodes[r];
    }
    std::vector<bool> used(static_cast<std::size_t>(top) + 1, false);
    for (std::int64_t n : nodes) used[static_cast<std::size_t>(n)] = true;
    for (std::size_t n = 0; n < used.size(); ++n) {
      if (!used[n]) detail::fail("Topology: nodes names node ", top, " but no rank is on node ", n, " (nodes are numbered 0..N-1)");
    }
    return Topology(std::move(nodes));
  }

  /// Ranks with equal keys share a node (e.g. the smallest rank of each
  /// shared-memory group); nodes are numbered by their first rank.
  static Topology from_node_keys(const std::vector<std::int64_t>& keys) {
    if (keys.empty()) detail::fail("Topology: node keys are empty (one entry per rank)");
    std::vector<std::int64_t> nodes(keys.size());
    std::vector<std::int64_t> seen;  // keys in order of first appearance
    for (std::size_t r = 0; r < keys.size(); ++r) {
      std::size_t n = 0;
      while (n < seen.size() && seen[n] != keys[r]) ++n;
      if (n == seen.size()) seen.push_back(keys[r]);
      nodes[r] = static_cast<std::int64_t>(n);
    }
    return Topology(std::move(nodes));
  }

  std::int64_t world_size() const noexcept { return static_cast<std::int64_t>(node_.size()); }
  std::int64_t num_nodes() const noexcept { return num_nodes_; }
  std::int64_t node_of(std::int64_t rank) const { return node_[checked(rank)]; }
  bool same_node(std::int64_t a, std::int64_t b) const { return node_of(a) == node_of(b); }
  const std::vector<std::int64_t>& nodes() const noexcept { return node_; }

  /// Throws invalid_input unless the topology describes `world_size` ranks.
  void check_world_size(std::int64_t world_size, const char* who) const {
    if (this->world_size() != world_size) {
      detail::fail(who, ": the topology describes ", this->world_size(), " ranks, the plan has world_size = ", world_size);
    }
  }

  friend bool operator==(const Topology&, const Topology&) = default;

 private:
  explicit Topology(std::vector<std::int64_t> nodes) : node_(std::move(nodes)) {
    for (std::int64_t n : node_) num_nodes_ = n + 1 > num_nodes_ ? n + 1 : num_nodes_;
  }
  std::size_t checked(std::int64_t rank) const {
    if (rank < 0 || rank >= world_size()) detail::fail("Topology: rank ", rank, " is outside [0, ", world_size(), ")");
    return static_cast<std::size_t>(rank);
  }

  std::vector<std::int64_t> node_;
  std::int64_t num_nodes_ = 0;
};

}  // namespace cpdispatch
