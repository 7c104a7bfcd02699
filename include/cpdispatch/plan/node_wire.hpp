#pragma once
// Node-level KV exchange planning (docs/node-exchange.md).
//
// The deduplicated exchange (docs/plan-format.md, section 2c) sends a KV shard
// once per destination *rank*; when several ranks of one remote node need it,
// it crosses the slow link between nodes several times. The node-level
// exchange sends it once per destination *node*, to a relay there, which
// forwards it inside its node; backward, the node's gradients are summed at
// the relay and cross back once.
//
//   const QkvMetadata meta = plan_qkv(plan);
//   const NodeWireMetadata node = plan_node_wire(meta.kv_fwd, Topology::uniform(W, 8));
//   const RankNodeWire mine = plan_node_wire_for_rank(meta.kv_fwd, topology, rank);  // == node.ranks[rank]
//
// Both make one pass over kv_fwd's [W][S][C] entries; the per-rank form keeps
// only its rank's lists: O(entries + W) time, O(its entries + W) memory.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// One run of tokens a rank sends to (or receives from) `peer` in one phase.
/// Forward, the sender reads at fwd_offset and the receiver writes at its
/// fwd_offset; reverse, the same piece travels back: the forward receiver
/// reads at its rev_offset and the forward sender writes at its rev_offset
/// (-1: nothing travels back, the relay's own copy).
struct NodePiece {
  std::int64_t peer = 0;
  std::int64_t len = 0;
  std::int64_t fwd_offset = 0;
  std::int64_t rev_offset = 0;
  bool from_relay = false;  ///< inside phase, sender side: forward reads the relay buffer (else the MLP layout)
  friend bool operator==(const NodePiece&, const NodePiece&) = default;
};

/// One phase's pieces on one rank, grouped by peer (peer p's pieces are
/// [splits[p], splits[p+1])), each peer's in global order over (home rank,
/// shard, wire slot).
struct NodePhase {
  std::vector<NodePiece> send;
  std::vector<std::size_t> send_splits;  ///< [W + 1]
  std::vector<NodePiece> recv;
  std::vector<std::size_t> recv_splits;  ///< [W + 1]
  friend bool operator==(const NodePhase&, const NodePhase&) = default;
};

/// One rank's part of the node-level exchange.
struct RankNodeWire {
  std::int64_t rank = 0;
  NodePhase between;  ///< forward: home MLP layout -> relay buffers of other nodes
  NodePhase inside;   ///< forward: home MLP layout or relay buffer -> wire buffers of the same node
  /// Relay entries (the shards this rank relays, in global order, back to back
  /// in its relay buffer): the relay sum of entry e is its own wire gradient at
  /// relay_wire_offset[e] plus the gather buffer's pieces
  /// gather_offset[gather_splits[e] .. gather_splits[e+1]) (wire slot ascending).
  std::vector<std::int64_t> relay_offset;
  std::vector<std::int64_t> relay_len;
  std::vector<std::int64_t> relay_wire_offset;
  std::vector<std::size_t> gather_splits;  ///< [relay entries + 1]
  std::vector<std::int64_t> gather_offset;
  /// Home combine: replica_mask[g * C + u] = 1 when slot u of local shard g receives a gradient.
  std::vector<std::uint8_t> replica_mask;
  std::vector<std::int64_t> shard_len;  ///< [S]: this rank's kv_fwd.seq_len row (0 = padding)
  std::int64_t num_copies = 0;      ///< C: slots of the [C][T] replica buffer
  std::int64_t mlp_tokens = 0;      ///< T
  std::int64_t relay_tokens = 0;    ///< the relay buffer
  std::int64_t gather_tokens = 0;   ///< the gather buffer (backward)
  std::int64_t wire_tokens = 0;     ///< the section 2c wire buffer
  friend bool operator==(const RankNodeWire&, const RankNodeWire&) = default;
};

/// The node-level exchange of a plan.
struct NodeWireMetadata {
  Topology topology;
  /// [W][S][C]: for wire slot u of KV shard (r, g) (section 2c's wire
  /// dispatch), the rank that hands the shard to that destination inside its
  /// node: the home r when the destination is on r's node, else the relay of
  /// the destination's node (the destination itself when it is the relay); -1 padding.
  Tensor<std::int64_t> source;
  std::vector<RankNodeWire> ranks;  ///< [W]
};

/// Tokens that cross between nodes, per exchange.
struct NodeTokenCounts {
  std::int64_t flat = 0;        ///< section 2's kv_fwd (one copy per query shard)
  std::int64_t dedup = 0;       ///< section 2c's wire (one copy per destination rank)
  std::int64_t node_level = 0;  ///< the node-level exchange (one copy per destination node)
  std::int64_t inside = 0;      ///< the node-level exchange's tokens between ranks of one node
  friend bool operator==(const NodeTokenCounts&, const NodeTokenCounts&) = default;
};

namespace detail {

/// One pass over kv_fwd in global order, building the lists of every rank in
/// [first, last).
class NodeWirePlanner {
 public:
  NodeWirePlanner(const Metadata& kv_fwd, const Topology& topology, std::int64_t first, std::int64_t last)
      : kv_(kv_fwd), topo_(topology), first_(first), last_(last) {
    check_shapes(kv_fwd, "plan_node_wire: kv_fwd");
    if (!kv_fwd.has_copies()) fail("plan_node_wire: kv_fwd.dst_rank has shape ", shape_str(kv_fwd.dst_rank.shape()), "; expected KV metadata [W][S][C]");
    topology.check_world_size(kv_fwd.world_size, "plan_node_wire");
    W_ = static_cast<std::size_t>(kv_fwd.world_size);
    S_ = kv_fwd.max_seqs();
    C_ = kv_fwd.num_copies();
    out_.resize(static_cast<std::size_t>(last - first));
    wire_at_.assign(W_, 0);
    relay_at_.assign(W_, 0);
    gather_at_.assign(W_, 0);
    seen_.assign(W_, 0);
    relay_of_node_.assign(static_cast<std::size_t>(topology.num_nodes()), -1);
    for (std::int64_t q = first; q < last; ++q) init_rank(q);
  }

  /// Runs the pass; `source`, when given, receives the [W][S][C] source table.
  std::vector<RankNodeWire> run(Tensor<std::int64_t>* source) {
    std::vector<std::int64_t> wire;
    std::size_t shard_id = 0;
    for (std::size_t r = 0; r < W_; ++r) {
      std::int64_t home_at = 0;
      for (std::size_t g = 0; g < S_; ++g) {
        const std::int64_t len = kv_.seq_len(r, g);
        if (len < 0) fail("plan_node_wire: kv_fwd.seq_len", index_str(r, g), " = ", len, " is negative");
        if (len == 0) continue;
        ++shard_id;
        distinct_destinations(r, g, shard_id, wire);
        shard(r, g, len, home_at, wire, source);
        home_at += len;
      }
    }
    for (RankNodeWire& w : out_) finish(w);
    return std::move(out_);
  }

 private:
  RankNodeWire* mine(std::int64_t rank) { return rank >= first_ && rank < last_ ? &out_[static_cast<std::size_t>(rank - first_)] : nullptr; }

  void init_rank(std::int64_t q) {
    RankNodeWire& w = out_[static_cast<std::size_t>(q - first_)];
    w.rank = q;
    w.num_copies = static_cast<std::int64_t>(C_);
    w.replica_mask.assign(S_ * C_, 0);
    w.gather_splits.assign(1, 0);
    const auto qu = static_cast<std::size_t>(q);
    for (std::size_t g = 0; g < S_; ++g) {
      w.shard_len.push_back(kv_.seq_len(qu, g));
      w.mlp_tokens += kv_.seq_len(qu, g) > 0 ? kv_.seq_len(qu, g) : 0;
    }
  }

  /// The shard's distinct destinations in first-copy order (section 2c's wire slots).
  void distinct_destinations(std::size_t r, std::size_t g, std::size_t shard_id, std::vector<std::int64_t>& wire) {
    wire.clear();
    for (std::size_t c = 0; c < C_; ++c) {
      const std::int64_t d = kv_.dst_rank(r, g, c);
      if (d < 0) continue;
      if (d >= kv_.world_size) fail("plan_node_wire: kv_fwd.dst_rank", index_str(r, g, c), " = ", d, " is outside [0, ", W_, ")");
      if (seen_[static_cast<std::size_t>(d)] == shard_id) continue;
      seen_[static_cast<std::size_t>(d)] = shard_id;
      wire.push_back(d);
    }
    // No destination: a KV shard nobody needs (section 2e) stays home; its
    // replica slots stay unmarked, so its gradient is 0.
  }

  void shard(std::size_t r, std::size_t g, std::int64_t len, std::int64_t home_at, const std::vector<std::int64_t>& wire,
             Tensor<std::int64_t>* source) {
    const auto home = static_cast<std::int64_t>(r);
    const std::int64_t home_node = topo_.node_of(home);
    const std::int64_t T = kv_.seq_len.size(1) ? row_tokens(r) : 0;
    // Relays: the first destination of each other node (any destination gives the fewest forwards).
    for (std::int64_t d : wire) {
      const std::int64_t n = topo_.node_of(d);
      if (n != home_node && relay_of_node_[static_cast<std::size_t>(n)] < 0) relay_of_node_[static_cast<std::size_t>(n)] = d;
    }
    for (std::size_t u = 0; u < wire.size(); ++u) {
      const std::int64_t d = wire[u];
      const std::int64_t n = topo_.node_of(d);
      const std::int64_t replica_at = static_cast<std::int64_t>(u) * T + home_at;
      const std::int64_t wire_at = wire_at_[static_cast<std::size_t>(d)];
      wire_at_[static_cast<std::size_t>(d)] += len;
      if (n == home_node) {  // served directly inside the home's node
        if (source) (*source)(r, g, u) = home;
        inside_piece(home, d, len, home_at, replica_at, wire_at, false);
        mark(home, g, u);
        continue;
      }
      const std::int64_t relay = relay_of_node_[static_cast<std::size_t>(n)];
      if (source) (*source)(r, g, u) = relay;
      if (d == relay) {  // crosses between nodes once, lands in the relay buffer, then into its own wire buffer
        const std::int64_t at = relay_at_[static_cast<std::size_t>(d)];
        relay_at_[static_cast<std::size_t>(d)] += len;
        between_piece(home, d, len, home_at, replica_at, at);
        mark(home, g, u);
        relay_entry(d, len, at, wire_at);
        inside_piece(d, d, len, at, -1, wire_at, true);
      } else {  // forwarded by the relay; its gradient comes back into the relay's gather buffer
        const std::int64_t at = relay_at_[static_cast<std::size_t>(relay)] - len;
        const std::int64_t gather = gather_at_[static_cast<std::size_t>(relay)];
        gather_at_[static_cast<std::size_t>(relay)] += len;
        if (RankNodeWire* w = mine(relay)) w->gather_offset.push_back(gather), ++w->gather_splits.back();
        inside_piece(relay, d, len, at, gather, wire_at, true);
      }
    }
    for (std::int64_t d : wire) relay_of_node_[static_cast<std::size_t>(topo_.node_of(d))] = -1;
  }

  std::int64_t row_tokens(std::size_t r) {
    if (row_tokens_rank_ != r) {
      row_tokens_rank_ = r;
      row_tokens_ = 0;
      for (std::size_t g = 0; g < S_; ++g) row_tokens_ += std::max<std::int64_t>(kv_.seq_len(r, g), 0);
    }
    return row_tokens_;
  }

  void mark(std::int64_t home, std::size_t g, std::size_t u) {
    if (RankNodeWire* w = mine(home)) w->replica_mask[g * C_ + u] = 1;
  }

  void relay_entry(std::int64_t relay, std::int64_t len, std::int64_t at, std::int64_t wire_at) {
    RankNodeWire* w = mine(relay);
    if (!w) return;
    w->relay_offset.push_back(at);
    w->relay_len.push_back(len);
    w->relay_wire_offset.push_back(wire_at);
    w->gather_splits.push_back(w->gather_splits.back());
  }

  void between_piece(std::int64_t home, std::int64_t relay, std::int64_t len, std::int64_t mlp_at, std::int64_t replica_at, std::int64_t relay_at) {
    if (RankNodeWire* w = mine(home)) w->between.send.push_back({relay, len, mlp_at, replica_at, false});
    if (RankNodeWire* w = mine(relay)) w->between.recv.push_back({home, len, relay_at, relay_at, false});
  }

  void inside_piece(std::int64_t from, std::int64_t to, std::int64_t len, std::int64_t read_at, std::int64_t rev_at, std::int64_t wire_at,
                    bool from_relay) {
    if (RankNodeWire* w = mine(from)) w->inside.send.push_back({to, len, read_at, rev_at, from_relay});
    if (RankNodeWire* w = mine(to)) w->inside.recv.push_back({from, len, wire_at, rev_at < 0 ? -1 : wire_at, false});
  }

  /// Groups a list by peer, keeping global order inside each peer (a counting sort).
  void group(std::vector<NodePiece>& pieces, std::vector<std::size_t>& splits) const {
    splits.assign(W_ + 1, 0);
    for (const NodePiece& p : pieces) ++splits[static_cast<std::size_t>(p.peer) + 1];
    for (std::size_t p = 0; p < W_; ++p) splits[p + 1] += splits[p];
    std::vector<NodePiece> sorted(pieces.size());
    std::vector<std::size_t> at(splits.begin(), splits.end() - 1);
    for (const NodePiece& p : pieces) sorted[at[static_cast<std::size_t>(p.peer)]++] = p;
    pieces = std::move(sorted);
  }

  void finish(RankNodeWire& w) {
    group(w.between.send, w.between.send_splits);
    group(w.between.recv, w.between.recv_splits);
    group(w.inside.send, w.inside.send_splits);
    group(w.inside.recv, w.inside.recv_splits);
    const auto q = static_cast<std::size_t>(w.rank);
    w.relay_tokens = relay_at_[q];
    w.gather_tokens = gather_at_[q];
    w.wire_tokens = wire_at_[q];
  }

  const Metadata& kv_;
  const Topology& topo_;
  std::int64_t first_, last_;
  std::size_t W_ = 0, S_ = 0, C_ = 0;
  std::vector<RankNodeWire> out_;
  std::vector<std::int64_t> wire_at_, relay_at_, gather_at_;  // running buffer ends per rank
  std::vector<std::size_t> seen_;
  std::vector<std::int64_t> relay_of_node_;
  std::size_t row_tokens_rank_ = static_cast<std::size_t>(-1);
  std::int64_t row_tokens_ = 0;
};

}  // namespace detail

/// Plans the node-level exchange of KV forward metadata (`kv_fwd` of
/// plan_qkv, any mask) on a topology. Throws invalid_input for metadata
/// without copies, a topology of another world size, or bad entries.
inline NodeWireMetadata plan_node_wire(const Metadata& kv_fwd, const Topology& topology) {
  NodeWireMetadata out;
  out.topology = topology;
  detail::NodeWirePlanner planner(kv_fwd, topology, 0, kv_fwd.world_size);
  out.source = Tensor<std::int64_t>({kv_fwd.dst_rank.size(0), kv_fwd.dst_rank.size(1), kv_fwd.dst_rank.size(2)}, -1);
  out.ranks = planner.run(&out.source);
  return out;
}

/// Rank `rank`'s part alone (equal to plan_node_wire(...).ranks[rank]).
inline RankNodeWire plan_node_wire_for_rank(const Metadata& kv_fwd, const Topology& topology, std::int64_t rank) {
  if (rank < 0 || rank >= kv_fwd.world_size) detail::fail("plan_node_wire_for_rank: rank ", rank, " is outside [0, ", kv_fwd.world_size, ")");
  detail::NodeWirePlanner planner(kv_fwd, topology, rank, rank + 1);
  return std::move(planner.run(nullptr).front());
}

/// Tokens that cross between nodes in the query exchange (section 1 / q_fwd).
inline std::int64_t inter_node_tokens(const Metadata& fwd, const Topology& topology) {
  detail::check_shapes(fwd, "inter_node_tokens: metadata");
  topology.check_world_size(fwd.world_size, "inter_node_tokens");
  const auto W = static_cast<std::size_t>(fwd.world_size);
  std::int64_t total = 0;
  for (std::size_t d = 0; d < W; ++d)
    for (std::size_t s = 0; s < W; ++s)
      if (!topology.same_node(static_cast<std::int64_t>(d), static_cast<std::int64_t>(s))) {
        total = detail::add_tokens(total, fwd.num_recv_tokens(d, s), "inter_node_tokens");
      }
  return total;
}

/// KV tokens that cross between nodes in the flat, deduplicated and
/// node-level exchanges of kv_fwd, and the node-level exchange's tokens
/// between ranks inside nodes.
inline NodeTokenCounts node_token_counts(const Metadata& kv_fwd, const Topology& topology) {
  const NodeWireMetadata node = plan_node_wire(kv_fwd, topology);
  NodeTokenCounts out;
  out.flat = inter_node_tokens(kv_fwd, topology);
  const auto W = static_cast<std::size_t>(kv_fwd.world_size);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < kv_fwd.max_seqs(); ++g) {
      for (std::size_t u = 0; u < kv_fwd.num_copies(); ++u) {
        const std::int64_t s = node.source(r, g, u);
        if (s < 0) continue;
        // Slot u's destination crossed nodes in the wire unless the home served it.
        if (!topology.same_node(s, static_cast<std::int64_t>(r))) out.dedup = detail::add_tokens(out.dedup, kv_fwd.seq_len(r, g), "node_token_counts");
      }
    }
  }
  for (const RankNodeWire& w : node.ranks) {
    for (const NodePiece& p : w.between.send) out.node_level = detail::add_tokens(out.node_level, p.len, "node_token_counts");
    for (const NodePiece& p : w.inside.send) {
      if (p.peer != w.rank) out.inside = detail::add_tokens(out.inside, p.len, "node_token_counts");
    }
  }
  return out;
}

}  // namespace cpdispatch
