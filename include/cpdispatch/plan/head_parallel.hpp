#pragma once
// Head-parallel documents (docs/plan-format.md, section 2f): a document that
// spreads over most ranks goes whole to every rank of its group of u
// consecutive ranks, each of which attends its share of the heads
// (Ulysses-style), instead of being cut into query shards with key-value
// copies. This header plans that exchange (hp_fwd, hp_rev) and the layout it
// gives (hp_attn), globally and for one rank; plan.hpp plans the rest.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// One rank's row of HeadParallelLayout.
struct RankHeadParallelLayout {
  std::int64_t degree = 0;              ///< u; 0 when no document of the plan is head-parallel
  std::vector<std::int64_t> documents;  ///< the plan's indices of the documents this rank holds head-parallel, in order
  std::vector<std::int64_t> seqlens;    ///< each one's length
  std::vector<std::int64_t> cu_seqlens{0};  ///< leading 0, total last
  std::int64_t max_seqlen = 0;
  std::int64_t group_rank = 0;          ///< r mod u: query heads [p*Hq/u, (p+1)*Hq/u) for p = group_rank
  AttentionMask mask;
  /// Only when some head-parallel document has slices: per document, its
  /// entries in the document's own positions.
  std::vector<std::vector<AttentionEntry>> entries = {};
  std::int64_t tokens() const noexcept { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
};

namespace detail {

/// Empties a slice for reuse, keeping its vectors' memory. `mask_copies` > 0
/// gives it an (empty) copy mask of that width.
inline void reset_slice(RankMetadata& s, std::size_t rank, std::size_t W, bool has_copies, std::size_t copies, std::size_t mask_copies) {
  s.rank = static_cast<std::int64_t>(rank);
  s.world_size = static_cast<std::int64_t>(W);
  s.has_copies = has_copies;
  s.num_copies = copies;
  s.dst_rank.clear();
  s.dst_offset.clear();
  s.seq_len.clear();
  s.num_recv_tokens.assign(W + 1, 0);
  s.num_seqs = 0;
  s.num_total_recv_tokens = 0;
  s.mask_copies = mask_copies;
  if (!keep_copy_mask(s, mask_copies > 0)) return;
  s.seq_recv_mask->clear();
  s.recv_seq_lens->clear();
}

/// An empty slice of rank `rank` with `copies` copies per entry (and a copy
/// mask of width `mask_copies`, when not 0).
inline RankMetadata rank_slice(std::size_t rank, std::size_t W, bool has_copies, std::size_t copies, std::size_t mask_copies = 0) {
  RankMetadata s;
  reset_slice(s, rank, W, has_copies, copies, mask_copies);
  return s;
}

/// Appends an entry: its destination (or source) rank, offset and length.
inline void push_entry(RankMetadata& s, std::int64_t rank, std::int64_t offset, std::int64_t len) {
  s.dst_rank.push_back(rank);
  s.dst_offset.push_back(offset);
  s.seq_len.push_back(len);
}

/// Sets the row total (column W) from the cells.
inline void finish_slice(RankMetadata& s, const char* who) {
  const std::size_t W = s.num_recv_tokens.size() - 1;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < W; ++i) total = add_tokens(total, s.num_recv_tokens[i], who);
  s.num_recv_tokens[W] = total;
  s.num_total_recv_tokens = total;
  s.num_seqs = static_cast<std::int64_t>(s.seq_len.size());
}

/// The head-parallel documents of a plan, by group: which ones each group
/// holds and where each starts in its group's layout.
struct HeadParallelGroups {
  std::size_t W = 0, u = 1;
  bool sliced = false;                   // some head-parallel document has slices
  std::vector<std::size_t> docs;         // document indices, group-major, document order inside a group
  std::vector<std::size_t> group_begin;  // [W / u + 1] into docs
  std::vector<std::int64_t> start;       // [D]: where a head-parallel document starts in its group's layout
  std::size_t most_shards = 0;           // the most head-parallel shards one group holds
  std::uint64_t entry_total = 0;         // hp_attn.entries of one rank of each group, summed

  std::size_t group_of_rank(std::size_t r) const noexcept { return r / u; }
};

/// A document's length from the shard table: its last shard's end.
inline std::int64_t document_length(const ShardTable& t, std::size_t d) {
  const std::size_t last = t.doc_begin[d + 1] - 1;
  return t.context[last] + t.len[last];  // within the document's total, which add() checked
}

/// The groups of a validated plan whose shard table is `t`, into `g`.
inline void head_parallel_groups(const QkvDocumentsPlan& plan, const ShardTable& t, HeadParallelGroups& g) {
  g.W = t.W;
  g.u = static_cast<std::size_t>(head_parallel_degree(plan));
  g.sliced = false;
  g.most_shards = 0;
  g.entry_total = 0;
  const std::size_t groups = g.W / g.u, D = plan.documents.size();
  g.group_begin.assign(groups + 1, 0);
  g.start.assign(D, 0);
  const auto group_of = [&](std::size_t d) { return static_cast<std::size_t>(plan.documents[d].shards.front().rank) / g.u; };
  for (std::size_t d = 0; d < D; ++d)
    if (plan.documents[d].head_parallel) ++g.group_begin[group_of(d) + 1];
  for (std::size_t k = 0; k < groups; ++k) g.group_begin[k + 1] += g.group_begin[k];
  g.docs.resize(g.group_begin[groups]);
  std::vector<std::size_t> next(g.group_begin.begin(), g.group_begin.end() - 1);
  std::vector<std::int64_t> at(groups, 0);
  std::vector<std::size_t> shards(groups, 0);
  for (std::size_t d = 0; d < D; ++d) {
    const PackedDocument& doc = plan.documents[d];
    if (!doc.head_parallel) continue;
    const std::size_t k = group_of(d);
    g.docs[next[k]++] = d;
    g.start[d] = at[k];
    at[k] = add_tokens(at[k], document_length(t, d), "plan_qkv");
    shards[k] += doc.shards.size();
    g.most_shards = std::max(g.most_shards, shards[k]);
    g.sliced = g.sliced || !doc.slices.empty();
    g.entry_total = sat_add(g.entry_total, doc.slices.empty() ? 1 : doc.slices.size());
  }
}

/// f(id) for each head-parallel shard group k receives, in the order of its
/// layout: document by document, shard by shard.
template <class F>
void each_head_parallel_arrival(const ShardTable& t, const HeadParallelGroups& g, std::size_t k, F&& f) {
  for (std::size_t p = g.group_begin[k]; p < g.group_begin[k + 1]; ++p) {
    for (std::size_t id = t.doc_begin[g.docs[p]]; id < t.doc_begin[g.docs[p] + 1]; ++id) f(id);
  }
}

/// Where head-parallel shard `id` lands in every rank's layout of its group.
inline std::int64_t head_parallel_offset(const ShardTable& t, const HeadParallelGroups& g, std::size_t id) {
  return g.start[t.doc[id]] + t.context[id];  // within the group's layout, whose total head_parallel_groups checked
}

/// The entries of one head-parallel document of `length` tokens in its own
/// positions: its slices, or the plan's mask over the whole document.
inline void head_parallel_entries(const PackedDocument& doc, const AttentionMask& mask, std::int64_t length, std::vector<AttentionEntry>& out) {
  out.clear();
  if (doc.slices.empty()) {
    out.push_back(whole_group_entry(mask, length, length));
    return;
  }
  for (const AttentionSlice& s : doc.slices) out.push_back(slice_entry(s, 0, length, 0, length, 0));
}

/// Rank R's row of hp_attn.
inline RankHeadParallelLayout head_parallel_layout_row(const QkvDocumentsPlan& plan, const ShardTable& t, const HeadParallelGroups& g,
                                                       std::size_t R) {
  RankHeadParallelLayout a;
  a.degree = static_cast<std::int64_t>(g.u);
  a.group_rank = static_cast<std::int64_t>(R % g.u);
  a.mask = plan.mask;
  const std::size_t k = g.group_of_rank(R);
  for (std::size_t p = g.group_begin[k]; p < g.group_begin[k + 1]; ++p) {
    const std::size_t d = g.docs[p];
    const std::int64_t len = document_length(t, d);
    a.documents.push_back(static_cast<std::int64_t>(d));
    a.seqlens.push_back(len);
    a.cu_seqlens.push_back(a.cu_seqlens.back() + len);
    a.max_seqlen = std::max(a.max_seqlen, len);
    if (g.sliced) head_parallel_entries(plan.documents[d], plan.mask, len, a.entries.emplace_back());
  }
  return a;
}

/// Rank R's row of hp_fwd: each of its head-parallel shards to every rank of
/// its group, and the tokens R's layout receives from each home.
inline RankMetadata head_parallel_forward_slice(const ShardTable& t, const HeadParallelGroups& g, std::size_t R) {
  RankMetadata s = rank_slice(R, t.W, true, g.u);
  const std::size_t first = g.group_of_rank(R) * g.u;
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p];
    s.seq_len.push_back(t.len[id]);
    const bool hp = t.head_parallel(id);
    for (std::size_t c = 0; c < g.u; ++c) {
      s.dst_rank.push_back(hp ? static_cast<std::int64_t>(first + c) : -1);
      s.dst_offset.push_back(hp ? head_parallel_offset(t, g, id) : 0);
    }
  }
  each_head_parallel_arrival(t, g, g.group_of_rank(R), [&](std::size_t id) { s.num_recv_tokens[t.home[id]] += t.len[id]; });
  finish_slice(s, "plan_qkv");
  return s;
}

/// Rank R's row of hp_rev: its layout, shard by shard, back to slab R mod u
/// of each home's [u][T] replica buffer (`start` by shard, `total` by rank),
/// and the copy mask of R's own shards.
inline RankMetadata head_parallel_reverse_slice(const ShardTable& t, const HeadParallelGroups& g, std::span<const std::int64_t> start,
                                                std::span<const std::int64_t> total, std::size_t R) {
  RankMetadata s = rank_slice(R, t.W, false, 1, g.u);
  const auto slab = static_cast<std::int64_t>(R % g.u);
  each_head_parallel_arrival(t, g, g.group_of_rank(R),
                             [&](std::size_t id) { push_entry(s, static_cast<std::int64_t>(t.home[id]), slab * total[t.home[id]] + start[id], t.len[id]); });
  const std::size_t first = g.group_of_rank(R) * g.u;
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p];
    const bool hp = t.head_parallel(id);
    s.recv_seq_lens->push_back(t.len[id]);
    s.seq_recv_mask->insert(s.seq_recv_mask->end(), g.u, hp ? 1 : 0);
    if (!hp) continue;
    for (std::size_t c = 0; c < g.u; ++c) s.num_recv_tokens[first + c] += t.len[id];  // at most u x T_R
  }
  finish_slice(s, "plan_qkv");
  return s;
}

/// Writes rank r's slice as row r of global metadata whose tensors have
/// their final shapes (padding already in place).
inline void put_row(const RankMetadata& s, std::size_t r, Metadata& m) {
  const std::size_t C = s.num_copies, W = s.num_recv_tokens.size() - 1;
  for (std::size_t j = 0; j < s.seq_len.size(); ++j) {
    m.seq_len(r, j) = s.seq_len[j];
    for (std::size_t c = 0; c < C; ++c) {
      if (s.has_copies) {
        m.dst_rank(r, j, c) = s.dst_rank[j * C + c];
        m.dst_offset(r, j, c) = s.dst_offset[j * C + c];
      } else {
        m.dst_rank(r, j) = s.dst_rank[j];
        m.dst_offset(r, j) = s.dst_offset[j];
      }
    }
  }
  for (std::size_t i = 0; i <= W; ++i) m.num_recv_tokens(r, i) = s.num_recv_tokens[i];
  m.num_seqs(r) = s.num_seqs;
  m.num_total_recv_tokens[r] = s.num_total_recv_tokens;
  if (!s.seq_recv_mask) return;
  for (std::size_t j = 0; j < s.recv_seq_lens->size(); ++j) {
    (*m.recv_seq_lens)(r, j) = (*s.recv_seq_lens)[j];
    for (std::size_t c = 0; c < s.mask_copies; ++c) (*m.seq_recv_mask)(r, j, c) = (*s.seq_recv_mask)[j * s.mask_copies + c];
  }
}

/// Global metadata of `W` rows with these shapes, zero (dst_rank -1)
/// everywhere; S_mask > 0 adds a [W][S_mask][C_mask] copy mask.
inline void shape_metadata(Metadata& m, std::size_t W, std::size_t S, std::size_t C, bool copies, std::size_t S_mask, std::size_t C_mask) {
  m.world_size = static_cast<std::int64_t>(W);
  const std::vector<std::size_t> shape = copies ? std::vector<std::size_t>{W, S, C} : std::vector<std::size_t>{W, S};
  reuse_output<std::int64_t>(m.dst_rank, shape, -1);
  reuse_output<std::int64_t>(m.dst_offset, shape, 0);
  reuse_output<std::int64_t>(m.seq_len, {W, S}, 0);
  reuse_output<std::int64_t>(m.num_recv_tokens, {W, W + 1}, 0);
  reuse_output<std::int64_t>(m.num_seqs, {W}, 0);
  m.num_total_recv_tokens.assign(W, 0);
  if (!keep_copy_mask(m, S_mask > 0)) return;
  reuse_output<std::int64_t>(*m.seq_recv_mask, {W, S_mask, C_mask}, 0);
  reuse_output<std::int64_t>(*m.recv_seq_lens, {W, S_mask}, 0);
}

/// The global metadata and layout of section 2f, checked against `limits`
/// before they are allocated: each row is the rank's slice.
inline void plan_head_parallel(const QkvDocumentsPlan& plan, const ShardTable& t, QkvMetadata& out, const PlanLimits& limits) {
  if (!t.has_head_parallel) return;
  HeadParallelGroups g;
  head_parallel_groups(plan, t, g);
  const std::size_t W = t.W, u = g.u, M = g.most_shards, held = u * g.docs.size();  // documents held, over all ranks
  const PlanFootprint layout{sat_add(sat_mul(3, held, 1), sat_mul(7, g.entry_total, u)), 0};
  check_footprint(limits, plus(footprint::query(W, t.S, u, M), layout), "plan_qkv",
                  concat("the head-parallel exchange of world_size = ", W, ", head_parallel_degree = ", u, ", ", M,
                         " head-parallel shards in one group"));
  const RowPrefix prefix = row_prefix(t.rank_major(t.len, 0), u, "plan_qkv");  // [u][T_r] replica buffers must be addressable
  const std::vector<std::int64_t> start = send_starts(t, prefix);
  shape_metadata(out.hp_fwd, W, t.S, u, true, 0, 0);
  shape_metadata(out.hp_rev, W, M, 1, false, t.S, u);
  HeadParallelLayout& a = out.hp_attn;
  a.degree = static_cast<std::int64_t>(u);
  a.mask = plan.mask;
  for (std::size_t r = 0; r < W; ++r) {
    put_row(head_parallel_forward_slice(t, g, r), r, out.hp_fwd);
    put_row(head_parallel_reverse_slice(t, g, start, prefix.totals, r), r, out.hp_rev);
    RankHeadParallelLayout row = head_parallel_layout_row(plan, t, g, r);
    a.documents.push_back(std::move(row.documents));
    a.seqlens.push_back(std::move(row.seqlens));
    a.cu_seqlens.push_back(std::move(row.cu_seqlens));
    a.max_seqlen.push_back(row.max_seqlen);
    a.group_rank.push_back(row.group_rank);
    if (g.sliced) a.entries.push_back(std::move(row.entries));
  }
}

}  // namespace detail

}  // namespace cpdispatch
