#pragma once
// Token indices of one rank's exchanges, for frameworks that move tensors
// with their own collective (e.g. torch.distributed.all_to_all_single) and
// their own gather/scatter (index_select / index_add_). The indices come from
// the dispatcher's own plan (detail::plan_dispatch at one byte per token), so
// the wire order and the pack/unpack agree with the C++ Dispatcher.
//
// One exchange, on the rank that owns the indices:
//   send = input[send_index]                        (pack; send_counts[p] rows to peer p, p ascending)
//   recv = all_to_all(send, send_counts, recv_counts)
//   output[recv_index] = recv                       (unpack; output_tokens rows, untouched rows 0)
// Traffic to the rank itself goes through the collective like any other peer.
//
// The forward exchange takes the MLP layout to the attention layout; the
// reverse one the attention layout back to the [C][T] replica buffer, which
// the combine folds into [T]: grad[combine_target] += replica[combine_source],
// copies in ascending order (the order combine_copies sums in).
// The deduplicated KV exchange adds the fan-out: attention = wire[fan_source],
// and its adjoint, the fan-in: wire[fan_source] += attention gradient.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch {

/// One exchange of one rank as token indices (see the header comment).
struct ExchangeIndices {
  std::vector<std::int64_t> send_index;   ///< rows of the input, in wire order
  std::vector<std::int64_t> send_counts;  ///< [W] rows to each peer
  std::vector<std::int64_t> recv_index;   ///< rows of the output, in wire order
  std::vector<std::int64_t> recv_counts;  ///< [W] rows from each peer
  std::int64_t input_tokens = 0;
  std::int64_t output_tokens = 0;
};

/// Both exchanges of one rank's (forward, reverse) slice pair and the copy combine.
struct DispatchIndices {
  ExchangeIndices forward;  ///< MLP layout -> attention layout
  ExchangeIndices reverse;  ///< attention layout -> [C][T] replica buffer
  std::int64_t copies = 1;  ///< C (1 without a copy dimension)
  std::int64_t tokens = 0;  ///< T: the rank's MLP-layout tokens
  std::vector<std::int64_t> combine_source;  ///< rows of the replica buffer, copy-major
  std::vector<std::int64_t> combine_target;  ///< the MLP-layout row each one adds into
};

/// The fan-out of the deduplicated KV exchange on one rank: row i of the KV
/// attention layout is row fan_source[i] of the wire buffer.
struct FanIndices {
  std::vector<std::int64_t> fan_source;
  std::int64_t wire_tokens = 0;
  std::int64_t attention_tokens = 0;
};

namespace detail {

inline void append_range(std::vector<std::int64_t>& out, std::size_t start, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) out.push_back(static_cast<std::int64_t>(start + i));
}

/// One side's rows in wire order: each peer's pieces, with the self pieces
/// (src or dst side) standing in for this rank's own.
inline void side_indices(const Side& side, const std::vector<CopyPiece>& self, bool self_src, std::size_t me,
                         std::vector<std::int64_t>& index, std::vector<std::int64_t>& counts) {
  const std::size_t W = side.counts.size();
  counts.assign(W, 0);
  for (std::size_t p = 0; p < W; ++p) {
    const std::size_t before = index.size();
    if (p == me) {
      for (const CopyPiece& c : self) append_range(index, self_src ? c.src : c.dst, c.bytes);
    } else {
      for (std::size_t i = side.splits[p]; i < side.splits[p + 1]; ++i) append_range(index, side.pieces[i].offset, side.pieces[i].bytes);
    }
    counts[p] = static_cast<std::int64_t>(index.size() - before);
  }
}

inline ExchangeIndices exchange_indices(const ExchangePlan& ex, std::size_t me) {
  ExchangeIndices out;
  out.input_tokens = ex.input_tokens;
  out.output_tokens = ex.output_tokens;
  side_indices(ex.send, ex.self, true, me, out.send_index, out.send_counts);
  side_indices(ex.recv, ex.self, false, me, out.recv_index, out.recv_counts);
  return out;
}

/// The combine's rows: for each copy c ascending, each shard g whose copy c
/// comes back (seq_recv_mask), its tokens at c * T + P(g) -> P(g).
inline void combine_indices(const RankMetadata& rev, DispatchIndices& out) {
  if (!rev.seq_recv_mask) return;
  const std::size_t C = rev.mask_copies;
  const auto& lens = *rev.recv_seq_lens;
  const auto& mask = *rev.seq_recv_mask;
  for (std::size_t c = 0; c < C; ++c) {
    std::int64_t start = 0;
    for (std::size_t g = 0; g < lens.size(); ++g) {
      if (mask[g * C + c]) {
        append_range(out.combine_source, static_cast<std::size_t>(static_cast<std::int64_t>(c) * out.tokens + start), static_cast<std::size_t>(lens[g]));
        append_range(out.combine_target, static_cast<std::size_t>(start), static_cast<std::size_t>(lens[g]));
      }
      start += lens[g];
    }
  }
}

}  // namespace detail

/// Token indices of rank `fwd.rank`'s forward and reverse exchanges and of
/// its copy combine. The slices are checked as the Dispatcher checks them
/// (throws invalid_input when they are not one rank's slices of one plan).
inline DispatchIndices dispatch_indices(const RankMetadata& fwd, const RankMetadata& rev) {
  const auto W = static_cast<int>(fwd.world_size);
  const auto me = static_cast<int>(fwd.rank);
  const detail::DispatchPlan plan = detail::plan_dispatch(fwd, rev, 1, me, W);
  DispatchIndices out;
  out.forward = detail::exchange_indices(plan.forward, static_cast<std::size_t>(me));
  out.reverse = detail::exchange_indices(plan.reverse, static_cast<std::size_t>(me));
  out.copies = static_cast<std::int64_t>(fwd.num_copies);
  out.tokens = plan.forward.input_tokens;
  detail::combine_indices(rev, out);
  return out;
}

/// The fan-out rows of one rank's deduplicated KV exchange (its fan list).
inline FanIndices fan_indices(const KvFanList& fan) {
  FanIndices out;
  out.wire_tokens = fan.wire_tokens;
  out.attention_tokens = fan.attention_tokens;
  out.fan_source.assign(static_cast<std::size_t>(fan.attention_tokens), -1);
  for (std::size_t e = 0; e < fan.seq_len.size(); ++e) {
    for (std::size_t c = fan.copy_splits[e]; c < fan.copy_splits[e + 1]; ++c) {
      for (std::int64_t t = 0; t < fan.seq_len[e]; ++t) {
        const std::int64_t at = fan.attn_offset[c] + t;
        if (at < 0 || at >= fan.attention_tokens) {
          detail::fail("fan_indices: attn_offset[", c, "] + ", t, " = ", at, " is outside the attention layout of ", fan.attention_tokens, " tokens");
        }
        out.fan_source[static_cast<std::size_t>(at)] = fan.wire_offset[e] + t;
      }
    }
  }
  for (std::size_t i = 0; i < out.fan_source.size(); ++i) {
    if (out.fan_source[i] < 0) detail::fail("fan_indices: attention row ", i, " gets no wire row (the fan list does not cover the layout)");
  }
  return out;
}

}  // namespace cpdispatch
