#pragma once
// Deduplicated KV exchange planning (docs/plan-format.md, section 2c).
//
// In the layout of section 2 a rank that computes attention for several query
// shards of one document receives one copy of each shared KV shard per query
// shard. The deduplicated exchange sends each KV shard once per destination
// rank (the *wire*) and copies it locally into every KV group that needs it
// (the *fan-out*); backward, the destination first sums the gradients of those
// groups (the *fan-in*), so one gradient per (shard, destination) travels home.
// The attention layout is unchanged: dedup is a switch, not a new layout.
//
//   const QkvMetadata meta = plan_qkv(plan);
//   const KvWireMetadata wire = plan_kv_wire(meta);  // kv_wire_fwd / kv_wire_rev + fan lists
//
// Cost: one pass over kv_fwd's [W][S][C] entries plus section 1's planning of
// the wire dispatch; linear in the entries.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// What one destination rank does locally with the KV shards it receives over
/// the wire: wire entry e (a KV shard of home rank src_rank[e], local index
/// src_shard[e], seq_len[e] tokens) sits at wire_offset[e] of the rank's wire
/// buffer and is copied to attn_offset[copy_splits[e] .. copy_splits[e+1]) of
/// its attention layout (the kv_fwd.dst_offset of each copy, copy index
/// ascending). Entries are in wire order (global order over home rank, shard),
/// back to back in the wire buffer.
struct KvFanList {
  std::vector<std::int64_t> wire_offset;  ///< [entries], tokens
  std::vector<std::int64_t> seq_len;      ///< [entries], tokens
  std::vector<std::int64_t> src_rank;     ///< [entries]: the KV shard's home rank
  std::vector<std::int64_t> src_shard;    ///< [entries]: its local index on the home
  std::vector<std::size_t> copy_splits;   ///< [entries + 1] into attn_offset
  std::vector<std::int64_t> attn_offset;  ///< [copies], tokens
  std::int64_t wire_tokens = 0;           ///< the wire buffer: sum of seq_len
  std::int64_t attention_tokens = 0;      ///< the KV attention layout of this rank

  std::size_t num_entries() const noexcept { return seq_len.size(); }
  /// Entry e's copies: their token offsets in the attention layout, the first copy first.
  std::span<const std::int64_t> copies(std::size_t e) const noexcept {
    return {attn_offset.data() + copy_splits[e], copy_splits[e + 1] - copy_splits[e]};
  }
  friend bool operator==(const KvFanList&, const KvFanList&) = default;
};

/// One rank's part of the deduplicated exchange: its slices of kv_wire_fwd
/// and kv_wire_rev, and its own fan list.
struct RankKvWire {
  RankMetadata fwd;
  RankMetadata rev;
  KvFanList fan;
};

/// The deduplicated KV exchange of a plan (section 2c).
struct KvWireMetadata {
  Tensor<std::int64_t> dispatch;  ///< [W][S][C]: each KV shard's distinct destinations, first-copy order, -1 padded
  Metadata fwd;                   ///< kv_wire_fwd: home MLP layout -> each destination's wire buffer
  Metadata rev;                   ///< kv_wire_rev: wire buffers -> slot u of the home's [C][T] replica buffer
  std::vector<KvFanList> fan;     ///< [W]: each destination's fan-out / fan-in list

  /// Rank `rank`'s part (throws invalid_input for a rank outside [0, W)).
  RankKvWire get_slice(std::int64_t rank) const {
    if (rank < 0 || rank >= fwd.world_size) detail::fail("KvWireMetadata::get_slice: rank ", rank, " is outside [0, ", fwd.world_size, ")");
    return {fwd.get_slice(rank), rev.get_slice(rank), fan[static_cast<std::size_t>(rank)]};
  }
};

namespace detail {

/// Section 2c's wire dispatch of kv_fwd, and each destination's fan list
/// (wire offsets still 0: they come from the wire planning).
inline void plan_wire_dispatch(const Metadata& kv_fwd, KvWireMetadata& out) {
  const auto W = static_cast<std::size_t>(kv_fwd.world_size);
  const std::size_t S = kv_fwd.max_seqs(), C = kv_fwd.num_copies();
  out.dispatch = Tensor<std::int64_t>({W, S, C}, -1);
  out.fan.assign(W, KvFanList{});
  for (std::size_t d = 0; d < W; ++d) {
    out.fan[d].copy_splits.assign(1, 0);
    out.fan[d].attention_tokens = kv_fwd.num_recv_tokens(d, W);
  }
  // seen[d] == the running entry id when d is already a slot of the current shard.
  std::vector<std::size_t> seen(W, 0);
  std::size_t entry_id = 0;
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < S; ++g) {
      const std::int64_t len = kv_fwd.seq_len(r, g);
      if (len < 0) fail("plan_kv_wire: kv_fwd.seq_len", index_str(r, g), " = ", len, " is negative");
      if (len == 0) continue;
      ++entry_id;
      std::size_t slots = 0;
      for (std::size_t c = 0; c < C; ++c) {
        const std::int64_t d = kv_fwd.dst_rank(r, g, c);
        if (d < 0) continue;
        if (d >= kv_fwd.world_size) fail("plan_kv_wire: kv_fwd.dst_rank", index_str(r, g, c), " = ", d, " is outside [0, ", W, ")");
        const auto du = static_cast<std::size_t>(d);
        const std::int64_t at = kv_fwd.dst_offset(r, g, c);
        if (at < 0 || at > out.fan[du].attention_tokens - len) {
          fail("plan_kv_wire: kv_fwd.dst_offset", index_str(r, g, c), " = ", at, " with seq_len ", len, " falls outside the ",
               out.fan[du].attention_tokens, " KV tokens rank ", d, " receives");
        }
        KvFanList& fan = out.fan[du];
        if (seen[du] != entry_id) {  // first copy to d: a new wire slot and fan entry
          seen[du] = entry_id;
          out.dispatch(r, g, slots++) = d;
          fan.seq_len.push_back(len);
          fan.src_rank.push_back(static_cast<std::int64_t>(r));
          fan.src_shard.push_back(static_cast<std::int64_t>(g));
          fan.copy_splits.push_back(fan.copy_splits.back());
        }
        // Only d's newest entry grows: shards are visited in wire order.
        fan.attn_offset.push_back(at);
        ++fan.copy_splits.back();
      }
    }
  }
}

}  // namespace detail

/// Plans the deduplicated KV exchange (section 2c) of KV forward metadata
/// (`kv_fwd` of plan_qkv, from either plan form). Throws invalid_input for
/// metadata without copies (a query plan: nothing to deduplicate), and for
/// metadata whose copies do not fit the destinations' attention layouts.
inline KvWireMetadata plan_kv_wire(const Metadata& kv_fwd) {
  detail::check_shapes(kv_fwd, "plan_kv_wire: kv_fwd");
  if (!kv_fwd.has_copies()) {
    detail::fail("plan_kv_wire: kv_fwd.dst_rank has shape ", detail::shape_str(kv_fwd.dst_rank.shape()),
                 "; deduplication needs KV metadata with a copy axis [W][S][C] (a query plan sends each shard once)");
  }
  KvWireMetadata out;
  detail::plan_wire_dispatch(kv_fwd, out);
  // A KV shard nobody needs (section 2e) has no wire slot: it stays home.
  detail::plan_query_into(kv_fwd.seq_len, out.dispatch, out.fwd, out.rev, {}, true);
  // Wire entries arrive back to back in wire order: the fan lists' order.
  for (KvFanList& fan : out.fan) {
    std::int64_t at = 0;
    fan.wire_offset.resize(fan.seq_len.size());
    for (std::size_t e = 0; e < fan.seq_len.size(); ++e) {
      fan.wire_offset[e] = at;
      at += fan.seq_len[e];
    }
    fan.wire_tokens = at;
  }
  return out;
}

/// The same for a QKV plan's metadata.
inline KvWireMetadata plan_kv_wire(const QkvMetadata& meta) { return plan_kv_wire(meta.kv_fwd); }

/// Tokens that cross between ranks (every source's tokens to every other
/// destination): what an exchange costs the network.
inline std::int64_t off_rank_tokens(const Metadata& fwd) {
  detail::check_shapes(fwd, "off_rank_tokens: metadata");
  const auto W = static_cast<std::size_t>(fwd.world_size);
  std::int64_t total = 0;
  for (std::size_t d = 0; d < W; ++d)
    for (std::size_t s = 0; s < W; ++s)
      if (s != d) total = detail::add_tokens(total, fwd.num_recv_tokens(d, s), "off_rank_tokens");
  return total;
}

}  // namespace cpdispatch
