#pragma once
// What a plan costs: the attention work each rank does and the bytes each
// pair of ranks exchanges, counted as the layout of docs/plan-format.md
// sends them (a query shard attended off its home sends its queries; it
// gets a copy of every key-value shard it attends whose home is elsewhere).
// A document with slices (section 2e) costs its allowed pairs, and each of
// its query shards gets the key-value shards it needs, a set, not a range.
// A head-parallel document (section 2f) costs 1/u of its pairs on each rank
// of its group, and sends each of them 1/u of every token's bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// What a plan costs: attention work and communication, per rank.
struct PlanCost {
  std::int64_t world_size = 0;
  std::vector<std::int64_t> attention;  ///< [W] (query, key) pairs each rank attends, under `mask`
  std::vector<std::int64_t> kv_tokens;  ///< [W] tokens of the KV groups each rank holds (what recv_capacity limits)
  std::vector<std::int64_t> bytes;      ///< [W * W] bytes rank `src` (row) sends rank `dst` (column); diagonal 0
  std::int64_t bytes_moved = 0;         ///< sum of `bytes`
  std::int64_t query_bytes = 0;         ///< of which queries
  std::int64_t kv_bytes = 0;            ///< of which key-value copies
  AttentionMask mask;                   ///< the plan's mask, whose pairs `attention` counts

  std::int64_t max_attention() const noexcept {
    return attention.empty() ? 0 : *std::max_element(attention.begin(), attention.end());
  }
  std::int64_t total_attention() const noexcept {
    return std::accumulate(attention.begin(), attention.end(), std::int64_t{0});
  }
  double mean_attention() const noexcept {
    return attention.empty() ? 0.0 : static_cast<double>(total_attention()) / static_cast<double>(attention.size());
  }
  /// max / mean (1 when perfectly even, or when there is no work at all).
  double max_over_mean() const noexcept {
    const double mean = mean_attention();
    return mean > 0 ? static_cast<double>(max_attention()) / mean : 1.0;
  }
  std::int64_t sent(std::size_t src, std::size_t dst) const { return bytes[src * static_cast<std::size_t>(world_size) + dst]; }
};

/// Causal token pairs of a query shard of `len` tokens with `context` tokens
/// of its document before it: len*context + len*(len+1)/2.
inline std::int64_t attention_cost(std::int64_t context, std::int64_t len) {
  if (context < 0 || len < 0) detail::fail("attention_cost: context = ", context, " and len = ", len, " must not be negative");
  std::int64_t end = 0, sq = 0;
  if (__builtin_add_overflow(context, len, &end) || __builtin_mul_overflow(end, end + 1, &sq)) {
    detail::fail("attention_cost: ", context, " + ", len, " tokens overflow 64 bits");
  }
  return detail::pairs(context, end);
}

namespace detail::cost {

/// Checked arithmetic for plan_cost.
inline void add_to(std::int64_t& acc, std::int64_t v) {
  if (__builtin_add_overflow(acc, v, &acc)) fail("plan_cost: a total overflows 64 bits");
}
inline std::int64_t times(std::int64_t a, std::int64_t b) {
  std::int64_t v = 0;
  if (__builtin_mul_overflow(a, b, &v)) fail("plan_cost: a byte count overflows 64 bits");
  return v;
}

/// `tokens` tokens of `per_token` bytes each sent from rank `from` to rank
/// `to`, booked in out.bytes and in `kind` (out.query_bytes or
/// out.kv_bytes); nothing when they are one rank.
inline void add_sent(PlanCost& out, std::size_t from, std::size_t to, std::int64_t per_token, std::int64_t tokens, std::int64_t& kind) {
  if (from == to) return;
  const std::int64_t b = times(per_token, tokens);
  add_to(out.bytes[from * static_cast<std::size_t>(out.world_size) + to], b);
  add_to(kind, b);
}

/// A zero cost of `world_size` ranks under `mask` (checked).
inline PlanCost empty_cost(std::int64_t world_size, const PlanLimits& limits, const AttentionMask& mask = {}) {
  if (world_size <= 0) fail("plan_cost: world_size = ", world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(world_size);
  detail::check_footprint(limits, footprint::plan_cost(W), "plan_cost", detail::concat("the [W][W] byte matrix of world_size = ", W));
  PlanCost out;
  out.world_size = world_size;
  out.attention.assign(W, 0);
  out.kv_tokens.assign(W, 0);
  out.bytes.assign(W * W, 0);
  out.mask = mask;
  detail::check_mask(mask);
  return out;
}

/// Adds one document's shards (validated) to `out`: attention and KV group
/// at each shard's destination; its queries when attended off home, and a
/// copy of every key-value shard 0..i whose home is not the destination.
/// `held` is scratch: the tokens so far per home rank of this document.
inline void add_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                         std::vector<std::pair<std::size_t, std::int64_t>>& held) {
  held.clear();
  std::int64_t context = 0;
  for (const DocumentShard& s : shards) {
    const auto home = static_cast<std::size_t>(s.rank), d = static_cast<std::size_t>(s.dst);
    add_to(out.attention[d], attention_cost(context, s.len));
    const std::int64_t end = detail::add_tokens(context, s.len, "plan_cost");
    add_to(out.kv_tokens[d], end);
    auto it = std::find_if(held.begin(), held.end(), [&](const auto& h) { return h.first == home; });
    if (it == held.end()) it = held.insert(held.end(), {home, 0});
    it->second += s.len;
    add_sent(out, home, d, q_bytes, s.len, out.query_bytes);
    for (const auto& [from, tokens] : held) add_sent(out, from, d, kv_bytes, tokens, out.kv_bytes);
    context = end;
  }
}

/// The same under a mask other than causal (section 2d): query shard i costs
/// the pairs the mask lets through, holds KV shards lo(i)..hi(i), and gets
/// a copy of each of them whose home is not its destination.
inline void add_masked_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                                detail::DocumentRanges& need) {
  std::vector<std::int64_t> len, start;
  std::int64_t total = 0;
  for (const DocumentShard& s : shards) {
    len.push_back(s.len);
    start.push_back(total);
    total = detail::add_tokens(total, s.len, "plan_cost");
  }
  need.compute(out.mask, len.data(), len.size());
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto home = static_cast<std::size_t>(shards[i].rank), d = static_cast<std::size_t>(shards[i].dst);
    add_to(out.attention[d], attention_pairs(out.mask, start[i], len[i], total));
    add_to(out.kv_tokens[d], start[need.hi[i]] + len[need.hi[i]] - start[need.lo[i]]);
    add_sent(out, home, d, q_bytes, len[i], out.query_bytes);
    for (std::size_t k = need.lo[i]; k <= need.hi[i]; ++k) add_sent(out, static_cast<std::size_t>(shards[k].rank), d, kv_bytes, len[k], out.kv_bytes);
  }
}

/// The same for a document with slices (section 2e): query shard i costs the
/// allowed pairs of its queries, holds the KV shards it needs (a set), and
/// gets a copy of each of them whose home is not its destination.
inline void add_sliced_document(PlanCost& out, const std::vector<DocumentShard>& shards, const std::vector<AttentionSlice>& slices,
                                std::int64_t q_bytes, std::int64_t kv_bytes) {
  std::vector<std::int64_t> start{0};
  for (const DocumentShard& s : shards) start.push_back(detail::add_tokens(start.back(), s.len, "plan_cost"));
  const std::int64_t total = start.back();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto home = static_cast<std::size_t>(shards[i].rank), d = static_cast<std::size_t>(shards[i].dst);
    add_to(out.attention[d], slice_pairs(slices, start[i], start[i + 1], 0, total));
    add_sent(out, home, d, q_bytes, shards[i].len, out.query_bytes);
    for (std::size_t k = 0; k < shards.size(); ++k) {
      if (!slices_meet(slices, start[i], start[i + 1], start[k], start[k + 1])) continue;
      add_to(out.kv_tokens[d], shards[k].len);
      add_sent(out, static_cast<std::size_t>(shards[k].rank), d, kv_bytes, shards[k].len, out.kv_bytes);
    }
  }
}

/// Rank c of a group of u's share of a head-parallel document's `pairs`: it
/// attends 1/u of the heads; the remainder goes to the first ranks so that
/// the shares sum to the whole.
inline std::int64_t head_parallel_share(std::int64_t pairs, std::int64_t u, std::int64_t c) noexcept {
  return pairs / u + (c < pairs % u ? 1 : 0);
}

/// A head-parallel document (section 2f) of `pairs` into `out`: its work
/// split over the u ranks of its group, each of which holds the whole
/// document; each shard sends every other rank of the group 1/u of its query
/// and key-value bytes (rounded down; plan_cost does not know the heads, so
/// a replicated key-value head counts 1/u too).
inline void add_head_parallel_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t pairs, std::int64_t u,
                                       std::int64_t q_bytes, std::int64_t kv_bytes) {
  const auto W = static_cast<std::size_t>(out.world_size);
  const std::int64_t first = shards.front().rank / u * u;
  std::int64_t len = 0;
  for (const DocumentShard& s : shards) len = detail::add_tokens(len, s.len, "plan_cost");
  for (std::int64_t c = 0; c < u; ++c) {
    add_to(out.attention[static_cast<std::size_t>(first + c)], head_parallel_share(pairs, u, c));
    add_to(out.kv_tokens[static_cast<std::size_t>(first + c)], len);
  }
  for (const DocumentShard& s : shards) {
    const std::int64_t qb = times(q_bytes, s.len) / u, kvb = times(kv_bytes, s.len) / u;
    for (std::int64_t g = first; g < first + u; ++g) {
      if (g == s.rank) continue;
      add_to(out.bytes[static_cast<std::size_t>(s.rank) * W + static_cast<std::size_t>(g)], qb + kvb);
      add_to(out.query_bytes, qb);
      add_to(out.kv_bytes, kvb);
    }
  }
}

/// Document i's shards as plan_cost reads them: homes (and, unless it is
/// head-parallel, destinations) in [0, W), positive lengths, and a
/// head-parallel document inside one group of u.
inline void check_cost_shards(const PackedDocument& doc, std::size_t i, std::int64_t W, std::int64_t u) {
  const auto& shards = doc.shards;
  if (shards.empty()) fail("plan_cost: documents[", i, "] has no shards");
  for (std::size_t k = 0; k < shards.size(); ++k) {
    const DocumentShard& s = shards[k];
    if (s.rank < 0 || s.rank >= W) fail("plan_cost: documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", W, ")");
    if (!doc.head_parallel && (s.dst < 0 || s.dst >= W)) fail("plan_cost: documents[", i, "].shards[", k, "].dst = ", s.dst, " is outside [0, ", W, ")");
    if (s.len <= 0) fail("plan_cost: documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
    if (doc.head_parallel && s.rank / u != shards.front().rank / u) {
      fail("plan_cost: documents[", i, "] is head-parallel, but its shards[0] and shards[", k, "] live in different groups of ", u, " ranks");
    }
  }
}

/// One document into `out`, as its mask sends it.
inline void add_any_document(PlanCost& out, const std::vector<DocumentShard>& shards, std::int64_t q_bytes, std::int64_t kv_bytes,
                             std::vector<std::pair<std::size_t, std::int64_t>>& held, detail::DocumentRanges& need) {
  if (out.mask == AttentionMask::causal()) {
    add_document(out, shards, q_bytes, kv_bytes, held);
  } else {
    add_masked_document(out, shards, q_bytes, kv_bytes, need);
  }
}

}  // namespace detail::cost

/// Attention cost and bytes moved of a documents-form plan, counted as the
/// layout of docs/plan-format.md sends them (see the top of balance/balance.hpp;
/// a document with slices as section 2e sends it, a head-parallel one as
/// add_head_parallel_document counts it: 1/u of its pairs on each rank of
/// its group, its dst ignored). Throws invalid_input
/// naming `documents[i].shards[k].<field>` for a home or destination outside
/// [0, W), a non-positive length or an empty document, and
/// `documents[i].slices[j]` for a slice empty or outside its document.
inline PlanCost plan_cost(const QkvDocumentsPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1, const PlanLimits& limits = {}) {
  PlanCost out = detail::cost::empty_cost(plan.world_size, limits, plan.mask);
  detail::DocumentRanges need;
  std::vector<std::pair<std::size_t, std::int64_t>> held;
  const std::int64_t u = detail::has_head_parallel(plan) ? detail::head_parallel_degree(plan) : 1;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const PackedDocument& doc = plan.documents[i];
    const auto& shards = doc.shards;
    detail::cost::check_cost_shards(doc, i, plan.world_size, u);
    const auto& slices = doc.slices;
    if (slices.empty() && !doc.head_parallel) {
      detail::cost::add_any_document(out, shards, q_bytes, kv_bytes, held, need);
      continue;
    }
    std::int64_t len = 0;
    for (const DocumentShard& s : shards) len = detail::add_tokens(len, s.len, "plan_cost");
    if (!slices.empty()) detail::check_slices_inside(slices, len, i, "plan_cost");
    if (doc.head_parallel) {
      const std::int64_t pairs = !slices.empty() ? slice_pairs(slices, 0, len, 0, len)
                                 : plan.mask == AttentionMask::causal() ? attention_cost(0, len) : attention_pairs(plan.mask, 0, len, len);
      detail::cost::add_head_parallel_document(out, shards, pairs, u, q_bytes, kv_bytes);
    } else {
      detail::cost::add_sliced_document(out, shards, slices, q_bytes, kv_bytes);
    }
  }
  detail::cost::add_to(out.bytes_moved, out.query_bytes);
  detail::cost::add_to(out.bytes_moved, out.kv_bytes);
  return out;
}

/// Attention cost and bytes moved of a per-rank plan (every document on
/// one rank), counted as for the documents form.
inline PlanCost plan_cost(const QkvPlan& plan, std::int64_t q_bytes = 1, std::int64_t kv_bytes = 1, const PlanLimits& limits = {}) {
  using detail::fail;
  PlanCost out = detail::cost::empty_cost(plan.world_size, limits, plan.mask);
  detail::DocumentRanges need;
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (plan.ranks.size() != W) fail("plan_cost: ranks has ", plan.ranks.size(), " entries, but world_size = ", W);
  std::vector<std::pair<std::size_t, std::int64_t>> held;
  std::vector<DocumentShard> shards;
  for (std::size_t r = 0; r < W; ++r) {
    const auto& docs = plan.ranks[r].docs;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      const Document& doc = docs[i];
      detail::check_rank_document(doc, r, i, plan.world_size, "plan_cost");
      shards.clear();
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s) shards.push_back({static_cast<std::int64_t>(r), doc.shard_len[s], doc.dst[s]});
      detail::cost::add_any_document(out, shards, q_bytes, kv_bytes, held, need);
    }
  }
  detail::cost::add_to(out.bytes_moved, out.query_bytes);
  detail::cost::add_to(out.bytes_moved, out.kv_bytes);
  return out;
}

}  // namespace cpdispatch
