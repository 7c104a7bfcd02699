#pragma once
// Per-rank planning: what one rank needs from a plan (its metadata slices and
// its attention layout) without the global metadata. The result equals
// plan_qkv(plan) followed by get_slice(rank) on every metadata, for both plan
// forms, but costs O(shards + copies + W) time and memory: no W x W count
// matrix is built, so it stays cheap at thousands of ranks. Use it when every
// rank plans for itself each step; use plan_qkv when one process needs the
// whole plan (the JSON output, checks, pictures).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// One destination rank's row of AttentionLayout.
struct RankAttentionLayout {
  std::vector<std::int64_t> seqlens_q;      ///< received query shards, arrival order
  std::vector<std::int64_t> seqlens_kv;     ///< each one's KV group: the KV shards it needs, back to back
  std::vector<std::int64_t> cu_seqlens_q;   ///< leading 0, total last
  std::vector<std::int64_t> cu_seqlens_kv;
  std::int64_t max_seqlen_q = 0;            ///< 0 when the rank receives nothing
  std::int64_t max_seqlen_kv = 0;
  AttentionMask mask;  ///< the plan's mask; a kernel applies it bottom-right aligned (mask.allows with diagonal lk - lq)
  /// Section 2e's attn.entries row, only when some document has slices
  /// (else empty; empty too where the rank receives no query shard): per
  /// query shard, its entries (see AttentionLayout::entries).
  std::vector<std::vector<AttentionEntry>> entries = {};
  std::int64_t q_tokens() const noexcept { return cu_seqlens_q.empty() ? 0 : cu_seqlens_q.back(); }
  std::int64_t kv_tokens() const noexcept { return cu_seqlens_kv.empty() ? 0 : cu_seqlens_kv.back(); }
};

/// Rank `rank`'s row of a global attention layout.
inline RankAttentionLayout attention_of(const AttentionLayout& attn, std::int64_t rank) {
  if (rank < 0 || static_cast<std::size_t>(rank) >= attn.seqlens_q.size()) {
    detail::fail("attention_of: rank ", rank, " is outside [0, ", attn.seqlens_q.size(), ")");
  }
  const auto r = static_cast<std::size_t>(rank);
  return RankAttentionLayout{attn.seqlens_q[r],    attn.seqlens_kv[r],   attn.cu_seqlens_q[r],
                             attn.cu_seqlens_kv[r], attn.max_seqlen_q[r], attn.max_seqlen_kv[r], attn.mask,
                             attn.entries.empty() ? std::vector<std::vector<AttentionEntry>>{} : attn.entries.at(r)};
}

/// What one rank needs of a QKV plan: the get_slice() of each metadata and
/// its attention layout. Dispatcher(transport, q_fwd, q_rev, token_bytes)
/// and Dispatcher(transport, kv_fwd, kv_rev, token_bytes) take the slices.
struct RankQkvMetadata {
  RankMetadata q_fwd, q_rev, kv_fwd, kv_rev;
  RankAttentionLayout attn;
  std::optional<RankKvWire> kv_wire;  ///< the rank's kv_wire_fwd / kv_wire_rev slices and fan list when the plan asks for dedup
  /// Section 2f, default-constructed (hp_attn.degree 0) when no document is
  /// head-parallel: the rank's slices of hp_fwd and hp_rev and its layout.
  RankMetadata hp_fwd = {}, hp_rev = {};
  RankHeadParallelLayout hp_attn = {};
  bool has_head_parallel() const noexcept { return hp_attn.degree != 0; }
};

/// What one rank needs of a query plan: the get_slice() of fwd and rev.
struct RankQueryMetadata {
  RankMetadata fwd, rev;
};

namespace detail {

/// Where every shard starts on its home rank (P) and each rank's token count
/// (T), refusing a [C][T] replica buffer that 64 bits cannot address.
struct ShardPositions {
  std::vector<std::int64_t> start;  // [N]
  std::vector<std::int64_t> total;  // [W]
};

inline void shard_positions(const ShardTable& t, const char* who, ShardPositions& pos) {
  pos.start.resize(t.size());  // every entry is written below
  pos.total.resize(t.W);
  for (std::size_t r = 0; r < t.W; ++r) {
    std::int64_t at = 0;
    for (std::size_t p = t.rank_begin[r]; p < t.rank_begin[r + 1]; ++p) {
      pos.start[t.by_rank[p]] = at;
      at = add_tokens(at, t.len[t.by_rank[p]], who);
    }
    check_replica_buffer(at, t.C, r, who);
    pos.total[r] = at;
  }
}

/// q_fwd row of rank R: its shards, each placed after everything earlier
/// ranks and earlier shards of R send to the same destination.
inline RankMetadata q_forward_slice(const ShardTable& t, std::size_t R) {
  RankMetadata s = rank_slice(R, t.W, false, 1);
  std::vector<std::int64_t> before(t.W, 0);
  for (std::size_t p = 0; p < t.rank_begin[R]; ++p) {
    const std::size_t id = t.by_rank[p];
    if (t.dst[id] < 0) continue;  // head-parallel (section 2f): not sent here
    auto& b = before[static_cast<std::size_t>(t.dst[id])];
    b = add_tokens(b, t.len[id], "plan_qkv_for_rank");
  }
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p];
    if (t.dst[id] < 0) {
      push_entry(s, t.dst[id], 0, t.len[id]);
      continue;
    }
    auto& b = before[static_cast<std::size_t>(t.dst[id])];
    push_entry(s, t.dst[id], b, t.len[id]);
    b = add_tokens(b, t.len[id], "plan_qkv_for_rank");
  }
  for (std::size_t id = 0; id < t.size(); ++id) {
    if (t.dst[id] == static_cast<std::int64_t>(R)) s.num_recv_tokens[t.home[id]] += t.len[id];  // within R's KV groups, which kv_groups checked
  }
  finish_slice(s, "plan_qkv_for_rank");
  return s;
}

/// q_rev row of rank R: the query shards that attend on R, in arrival order,
/// each returning to its place in its home's MLP layout.
inline RankMetadata q_reverse_slice(const ShardTable& t, const KvGroups& g, const ShardPositions& pos, std::size_t R) {
  // Section 2f: which of R's shards come back (see query_return_mask).
  RankMetadata s = rank_slice(R, t.W, false, 1, t.has_head_parallel ? 1 : 0);
  for (std::size_t p = g.dest_begin[R]; p < g.dest_begin[R + 1]; ++p) {
    const std::size_t q = g.arrivals[p];
    push_entry(s, static_cast<std::int64_t>(t.home[q]), pos.start[q], t.len[q]);
  }
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p];
    if (t.has_head_parallel) {
      s.seq_recv_mask->push_back(t.dst[id] >= 0 ? 1 : 0);
      s.recv_seq_lens->push_back(t.len[id]);
    }
    if (t.dst[id] >= 0) s.num_recv_tokens[static_cast<std::size_t>(t.dst[id])] += t.len[id];  // at most T_R
  }
  finish_slice(s, "plan_qkv_for_rank");
  return s;
}

/// kv_fwd row of rank R: each of its KV shards to the groups of its users
/// (none for a shard nobody needs), and the KV tokens R's own groups receive.
inline RankMetadata kv_forward_slice(const ShardTable& t, const KvGroups& g, std::size_t R) {
  RankMetadata s = rank_slice(R, t.W, true, t.C);
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) s.seq_len.push_back(t.len[t.by_rank[p]]);
  s.dst_rank.assign(s.seq_len.size() * t.C, -1);
  s.dst_offset.assign(s.seq_len.size() * t.C, 0);
  kv_forward_row(t, g, R, s.dst_rank, s.dst_offset);
  for (std::size_t p = g.dest_begin[R]; p < g.dest_begin[R + 1]; ++p) {
    t.each_needed(g.arrivals[p], [&](std::size_t kv, std::int64_t, std::size_t) { s.num_recv_tokens[t.home[kv]] += t.len[kv]; });  // within R's groups
  }
  finish_slice(s, "plan_qkv_for_rank");
  return s;
}

/// kv_rev row of rank R: the KV shards of R's groups back to slab c of their
/// home's replica buffer, and the mask of R's own shards' copies.
inline RankMetadata kv_reverse_slice(const ShardTable& t, const KvGroups& g, const ShardPositions& pos, std::size_t R) {
  RankMetadata s = rank_slice(R, t.W, false, 1, t.C);
  for (std::size_t p = g.dest_begin[R]; p < g.dest_begin[R + 1]; ++p) {
    t.each_needed(g.arrivals[p], [&](std::size_t kv, std::int64_t, std::size_t c) {
      const std::size_t home = t.home[kv];
      push_entry(s, static_cast<std::int64_t>(home), static_cast<std::int64_t>(c) * pos.total[home] + pos.start[kv], t.len[kv]);
    });
  }
  std::vector<std::int64_t>& mask = *s.seq_recv_mask;
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p], row = mask.size();
    s.recv_seq_lens->push_back(t.len[id]);
    mask.insert(mask.end(), t.C, 0);
    t.each_user(id, [&](std::size_t c, std::size_t q, std::int64_t) {
      mask[row + c] = 1;
      s.num_recv_tokens[static_cast<std::size_t>(t.dst[q])] += t.len[id];  // at most C x T_R
    });
  }
  finish_slice(s, "plan_qkv_for_rank");
  return s;
}

/// A rank's attention layout as the row the planners write.
inline AttentionRow row_of(RankAttentionLayout& a) noexcept {
  return {a.seqlens_q, a.seqlens_kv, a.cu_seqlens_q, a.cu_seqlens_kv, a.max_seqlen_q, a.max_seqlen_kv, a.entries};
}

inline RankAttentionLayout rank_attention(const ShardTable& t, const KvGroups& g, std::size_t R) {
  RankAttentionLayout a;
  a.mask = t.mask;
  attention_row(t, g, R, row_of(a));
  return a;
}

inline std::size_t checked_rank(std::int64_t rank, std::int64_t world_size, const char* who) {
  if (rank < 0 || rank >= world_size) fail(who, ": rank ", rank, " is outside [0, ", world_size, ")");
  return static_cast<std::size_t>(rank);
}

/// The shard table of a documents-form plan with its home positions and KV
/// groups: what per-rank planning of that form builds (O(shards + W)).
struct DocumentsTables {
  ShardTable table;
  ShardPositions positions;
  KvGroups groups;
  HeadParallelGroups head_parallel;  // section 2f, filled only when some document is head-parallel
};

/// Rank R's section 2e entries (a plan with slices), counted and checked
/// against `limits` before they are built.
inline void check_rank_entries(const DocumentsTables& tables, std::size_t R, const PlanLimits& limits) {
  const ShardTable& t = tables.table;
  if (!t.has_slices) return;
  std::uint64_t entries = 0;
  for (std::size_t p = tables.groups.dest_begin[R]; p < tables.groups.dest_begin[R + 1]; ++p) entries += t.entry_count(tables.groups.arrivals[p]);
  check_footprint(limits, footprint::attention_entries(entries), "plan_qkv_for_rank", concat("rank ", R, "'s ", entries, " attention entries"));
}

/// Rank R's share of the shard table in `tables`.
inline void plan_shards_for_rank(const DocumentsTables& tables, std::size_t R, RankQkvMetadata& out) {
  const ShardTable& t = tables.table;
  out.q_fwd = q_forward_slice(t, R);
  out.q_rev = q_reverse_slice(t, tables.groups, tables.positions, R);
  out.kv_fwd = kv_forward_slice(t, tables.groups, R);
  out.kv_rev = kv_reverse_slice(t, tables.groups, tables.positions, R);
  out.attn = rank_attention(t, tables.groups, R);
}

/// Rank R's share of section 2f (head-parallel documents), or none.
inline void plan_head_parallel_for_rank(const QkvDocumentsPlan& plan, DocumentsTables& tables, std::size_t R, RankQkvMetadata& out,
                                        const PlanLimits& limits) {
  out.hp_fwd = {};
  out.hp_rev = {};
  out.hp_attn = {};
  const ShardTable& t = tables.table;
  if (!t.has_head_parallel) return;
  HeadParallelGroups& g = tables.head_parallel;
  head_parallel_groups(plan, t, g);
  const std::size_t own = t.rank_begin[R + 1] - t.rank_begin[R];
  check_footprint(limits, footprint::query_rank_share(t.W, sat_add(sat_mul(own, g.u), g.most_shards)), "plan_qkv_for_rank",
                  concat("rank ", R, "'s share of the head-parallel exchange (", own, " shards at home, head_parallel_degree = ", g.u, ")"));
  for (std::size_t r = 0; r < t.W; ++r) check_replica_buffer(tables.positions.total[r], g.u, r, "plan_qkv_for_rank");
  out.hp_fwd = head_parallel_forward_slice(t, g, R);
  out.hp_rev = head_parallel_reverse_slice(t, g, tables.positions.start, tables.positions.total, R);
  out.hp_attn = head_parallel_layout_row(plan, t, g, R);
}

}  // namespace detail

/// Memory a rank keeps between planning steps. Planning every step with the
/// same workspace and the same RankQkvMetadata reuses their storage, so the
/// plan-sized tables (a documents-form plan's shard table) and the outputs of
/// a per-rank plan touch no fresh memory after the first step.
struct RankPlanWorkspace {
  detail::DocumentsTables documents;      ///< a documents-form plan's shard table, positions and groups
  std::vector<std::int64_t> q_next;       ///< [W]: query tokens each destination has been sent so far
  std::vector<std::int64_t> group_next;   ///< [W]: KV-group tokens each destination holds so far
  std::vector<std::int64_t> group_start;  ///< the current document's group starts, shard by shard
  std::vector<std::int64_t> slab;         ///< kv_rev: each entry's copy index, until its home's total is known
  std::vector<std::int64_t> wire_next;    ///< [W]: wire tokens each destination has been sent so far
  std::vector<std::int64_t> wire_slot;    ///< kv_wire_rev: each entry's slot, until its home's total is known
  std::vector<std::uint64_t> wire_seen;   ///< [W]: the last KV shard with a wire slot at each destination
  detail::DocumentRanges ranges;          ///< the current document's needed ranges and users (section 2d)
  std::vector<std::int64_t> doc_context;  ///< the current document's shard starts a_k
  std::vector<std::int64_t> user_dst;     ///< a KV shard of a document with slices: its users' destinations
  std::vector<std::int64_t> user_offset;  ///< and where it sits in each one's KV group
  std::vector<std::uint8_t> set_dests{};  ///< [W]: destinations whose KV groups the rank's share reads (section 2e)
  std::vector<std::uint8_t> set_docs{};   ///< [D]: the documents with slices whose needed sets it reads
};

namespace detail {

/// Rank R's slices of the deduplicated exchange (section 2c), fed the KV
/// shards in global order (home rank, index there): each shard takes one
/// wire slot per distinct destination of its copies, in first-copy order.
class RankWireStream {
 public:
  RankWireStream(std::size_t W, std::size_t C, std::size_t R, RankKvWire& out, RankPlanWorkspace& ws) : C_(C), R_(R), out_(out), ws_(ws) {
    reset_slice(out.fwd, R, W, true, C, 0);
    reset_slice(out.rev, R, W, false, 1, C);
    KvFanList& fan = out.fan;
    for (auto* v : {&fan.wire_offset, &fan.seq_len, &fan.src_rank, &fan.src_shard, &fan.attn_offset}) v->clear();
    fan.copy_splits.assign(1, 0);
    ws.wire_next.assign(W, 0);
    ws.wire_seen.assign(W, 0);
  }

  void begin_rank() {
    rev_first_ = out_.rev.dst_offset.size();
    ws_.wire_slot.clear();
  }

  /// KV shard g of rank r: `start` tokens into r's MLP layout, `len` long;
  /// its n copies go to dst[0..n) at attention offsets attn_offset(c).
  template <class AttnOffset>
  void shard(std::size_t r, std::size_t g, std::int64_t start, std::int64_t len, const std::int64_t* dst, std::size_t n,
             const AttnOffset& attn_offset) {
    ++shard_id_;
    const std::size_t base = out_.fwd.dst_rank.size();
    if (r == R_) own_shard(len);
    std::size_t slots = 0;
    for (std::size_t c = 0; c < n; ++c) {
      const auto d = static_cast<std::size_t>(dst[c]);
      if (ws_.wire_seen[d] != shard_id_) {  // first copy to d: a wire slot
        ws_.wire_seen[d] = shard_id_;
        const std::int64_t offset = ws_.wire_next[d];
        ws_.wire_next[d] = add_tokens(offset, len, "plan_kv_wire");
        if (r == R_) {
          out_.fwd.dst_rank[base + slots] = dst[c];
          out_.fwd.dst_offset[base + slots] = offset;
          (*out_.rev.seq_recv_mask)[base + slots] = 1;
        }
        if (d == R_) arrival(r, g, start, len, offset, slots);
        ++slots;
      }
      if (d == R_) {  // every copy at R is a fan-out target of R's newest wire entry
        out_.fan.attn_offset.push_back(attn_offset(c));
        ++out_.fan.copy_splits.back();
      }
    }
  }

  /// Rank r holds `tokens` (checked against its replica buffer already).
  void end_rank(std::size_t r, std::int64_t tokens) {
    auto& offsets = out_.rev.dst_offset;
    for (std::size_t i = rev_first_; i < offsets.size(); ++i) offsets[i] += ws_.wire_slot[i - rev_first_] * tokens;
    if (r != R_) return;
    for (std::size_t e = 0; e < out_.fwd.seq_len.size(); ++e) {  // what returns to R: at most C x T_R
      for (std::size_t u = 0; u < C_; ++u) {
        const std::int64_t d = out_.fwd.dst_rank[e * C_ + u];
        if (d >= 0) out_.rev.num_recv_tokens[static_cast<std::size_t>(d)] += out_.fwd.seq_len[e];
      }
    }
  }

  /// `attention_tokens`: the KV tokens R's attention layout holds.
  void finish(std::int64_t attention_tokens) {
    finish_slice(out_.fwd, "plan_kv_wire_for_rank");
    finish_slice(out_.rev, "plan_kv_wire_for_rank");
    out_.fan.wire_tokens = ws_.wire_next[R_];
    out_.fan.attention_tokens = attention_tokens;
  }

 private:
  void own_shard(std::int64_t len) {
    out_.fwd.seq_len.push_back(len);
    out_.fwd.dst_rank.insert(out_.fwd.dst_rank.end(), C_, -1);
    out_.fwd.dst_offset.insert(out_.fwd.dst_offset.end(), C_, 0);
    out_.rev.recv_seq_lens->push_back(len);
    out_.rev.seq_recv_mask->insert(out_.rev.seq_recv_mask->end(), C_, 0);
  }

  /// The shard's wire slot at R: a fan entry, its way home (slot `slot` of
  /// rank r's replica buffer, completed in end_rank), and R's count from r.
  void arrival(std::size_t r, std::size_t g, std::int64_t start, std::int64_t len, std::int64_t offset, std::size_t slot) {
    KvFanList& fan = out_.fan;
    fan.wire_offset.push_back(offset);
    fan.seq_len.push_back(len);
    fan.src_rank.push_back(static_cast<std::int64_t>(r));
    fan.src_shard.push_back(static_cast<std::int64_t>(g));
    fan.copy_splits.push_back(fan.copy_splits.back());
    push_entry(out_.rev, static_cast<std::int64_t>(r), start, len);
    ws_.wire_slot.push_back(static_cast<std::int64_t>(slot));
    out_.fwd.num_recv_tokens[r] += len;  // within R's wire total, checked
  }

  std::size_t C_, R_;
  RankKvWire& out_;
  RankPlanWorkspace& ws_;
  std::uint64_t shard_id_ = 0;
  std::size_t rev_first_ = 0;
};

/// Rank R's share of a per-rank plan in one pass over the shards in global
/// order (rank, document, shard). That order is every destination's arrival
/// order, so running totals per destination give every offset and nothing
/// the size of the plan is kept: only [W] totals and the outputs.
class RankStream {
 public:
  RankStream(std::size_t W, std::size_t C, std::size_t R, const AttentionMask& mask, RankQkvMetadata& out, RankPlanWorkspace& ws,
             RankWireStream* wire)
      : C_(C), R_(R), mask_(mask), out_(out), ws_(ws), wire_(wire) {
    reset_slice(out.q_fwd, R, W, false, 1, 0);
    reset_slice(out.q_rev, R, W, false, 1, 0);
    reset_slice(out.kv_fwd, R, W, true, C, 0);
    reset_slice(out.kv_rev, R, W, false, 1, C);
    reset_row(row_of(out.attn), 0);
    out.attn.mask = mask;
    out.hp_fwd = {};  // a per-rank plan has no head-parallel documents (section 2f)
    out.hp_rev = {};
    out.hp_attn = {};
    ws.q_next.assign(W, 0);
    ws.group_next.assign(W, 0);
  }

  void begin_rank() {
    tokens_ = 0;
    shards_ = 0;
    rev_first_ = out_.kv_rev.dst_offset.size();
    ws_.slab.clear();
    if (wire_) wire_->begin_rank();
  }

  /// The shards of one document of rank r, in order.
  void document(std::size_t r, const Document& doc) {
    const std::size_t n = doc.shard_len.size();
    const std::int64_t total = ranges(doc), end = add_tokens(tokens_, total, "plan_qkv");
    const std::vector<std::int64_t>& a = ws_.doc_context;
    const DocumentRanges& need = ws_.ranges;
    ws_.group_start.resize(n);
    for (std::size_t s = 0; s < n; ++s) {
      const auto d = static_cast<std::size_t>(doc.dst[s]);
      const std::int64_t len = doc.shard_len[s], kv = a[need.hi[s]] + doc.shard_len[need.hi[s]] - a[need.lo[s]];  // within the total
      ws_.group_start[s] = ws_.group_next[d];
      ws_.group_next[d] = add_tokens(ws_.group_next[d], kv, "plan_qkv");
      const std::int64_t offset = ws_.q_next[d];
      ws_.q_next[d] = add_tokens(offset, len, "plan_qkv");
      if (r == R_) push_entry(out_.q_fwd, doc.dst[s], offset, len);
      if (d == R_) arrival(r, doc, s, kv);
    }
    if (r == R_) own_kv_forward(doc);
    if (wire_) wire_document(r, doc);
    tokens_ = end;
    shards_ += n;
  }

  /// Rank r's total is known: its replica buffer is checked and the reverse
  /// KV offsets into it are completed.
  void end_rank(std::size_t r, const std::vector<Document>& docs) {
    check_replica_buffer(tokens_, C_, r, "plan_qkv_for_rank");
    auto& offsets = out_.kv_rev.dst_offset;
    for (std::size_t i = rev_first_; i < offsets.size(); ++i) offsets[i] += ws_.slab[i - rev_first_] * tokens_;
    if (r == R_) own_returns(docs);
    if (wire_) wire_->end_rank(r, tokens_);
  }

  void finish() {
    for (RankMetadata* s : {&out_.q_fwd, &out_.q_rev, &out_.kv_fwd, &out_.kv_rev}) finish_slice(*s, "plan_qkv_for_rank");
    if (wire_) wire_->finish(out_.kv_fwd.num_total_recv_tokens);
  }

 private:
  /// The current document's shard starts and needed ranges (in the
  /// workspace); returns its total, checked.
  std::int64_t ranges(const Document& doc) {
    const std::size_t n = doc.shard_len.size();
    ws_.doc_context.resize(n);
    std::int64_t at = 0;
    for (std::size_t k = 0; k < n; ++k) {
      ws_.doc_context[k] = at;
      at = add_tokens(at, doc.shard_len[k], "plan_qkv");
    }
    ws_.ranges.compute(mask_, doc.shard_len.data(), n);
    return at;
  }

  /// Query shard s of a document of rank r attends on R: its reverse entry,
  /// its attention row (a KV group of `kv` tokens), and the KV shards it
  /// needs, which it brings along.
  void arrival(std::size_t r, const Document& doc, std::size_t s, std::int64_t kv) {
    const std::int64_t len = doc.shard_len[s];  // len and kv are within R's totals, checked
    const std::int64_t doc_start = tokens_;
    const std::vector<std::int64_t>& at = ws_.doc_context;
    const DocumentRanges& need = ws_.ranges;
    push_entry(out_.q_rev, static_cast<std::int64_t>(r), add_tokens(doc_start, at[s], "plan_qkv"), len);
    out_.q_fwd.num_recv_tokens[r] += len;
    out_.kv_fwd.num_recv_tokens[r] += kv;
    add_arrival(row_of(out_.attn), len, kv);
    // KV shard k goes back to slab c (s's place among k's users) of rank
    // r's replica buffer; the slab's size (rank r's total) is added in end_rank.
    for (std::size_t k = need.lo[s]; k <= need.hi[s]; ++k) {
      push_entry(out_.kv_rev, static_cast<std::int64_t>(r), doc_start + at[k], doc.shard_len[k]);  // within the document's end, checked
      ws_.slab.push_back(static_cast<std::int64_t>(s - need.first[k]));
    }
  }

  /// Where KV shard k sits at the group of query shard q (of the current document).
  std::int64_t attn_offset(std::size_t q, std::size_t k) const {
    return ws_.group_start[q] + ws_.doc_context[k] - ws_.doc_context[ws_.ranges.lo[q]];  // within the group, checked
  }

  /// kv_fwd rows of one of R's documents: KV shard k, copy c, to the group of
  /// its c-th user.
  void own_kv_forward(const Document& doc) {
    const DocumentRanges& need = ws_.ranges;
    for (std::size_t k = 0; k < doc.shard_len.size(); ++k) {
      out_.kv_fwd.seq_len.push_back(doc.shard_len[k]);
      for (std::size_t q = need.first[k]; q < need.first[k] + C_; ++q) {
        const bool sent = q < need.end[k];
        out_.kv_fwd.dst_rank.push_back(sent ? doc.dst[q] : -1);
        out_.kv_fwd.dst_offset.push_back(sent ? attn_offset(q, k) : 0);
      }
    }
  }

  /// The document's KV shards on the wire, in order (its group starts are known).
  void wire_document(std::size_t r, const Document& doc) {
    const DocumentRanges& need = ws_.ranges;
    for (std::size_t k = 0; k < doc.shard_len.size(); ++k) {
      const auto offset = [&](std::size_t c) { return attn_offset(need.first[k] + c, k); };
      wire_->shard(r, shards_ + k, tokens_ + ws_.doc_context[k], doc.shard_len[k], doc.dst.data() + need.first[k], need.users(k), offset);
    }
  }

  /// What comes back to R: the counts of q_rev and kv_rev (bounded by T_R and
  /// C x T_R, checked in end_rank) and kv_rev's copy mask.
  void own_returns(const std::vector<Document>& docs) {
    RankMetadata& kv = out_.kv_rev;
    DocumentRanges& need = ws_.ranges;
    for (const Document& doc : docs) {
      need.compute(mask_, doc.shard_len.data(), doc.shard_len.size());
      for (std::size_t k = 0; k < doc.shard_len.size(); ++k) {
        const std::int64_t len = doc.shard_len[k];
        out_.q_rev.num_recv_tokens[static_cast<std::size_t>(doc.dst[k])] += len;
        kv.recv_seq_lens->push_back(len);
        for (std::size_t q = need.first[k]; q < need.first[k] + C_; ++q) {
          kv.seq_recv_mask->push_back(q < need.end[k] ? 1 : 0);
          if (q < need.end[k]) kv.num_recv_tokens[static_cast<std::size_t>(doc.dst[q])] += len;
        }
      }
    }
  }

  std::size_t C_, R_;
  AttentionMask mask_;
  RankQkvMetadata& out_;
  RankPlanWorkspace& ws_;
  RankWireStream* wire_;        // null: no dedup slices
  std::int64_t tokens_ = 0;     // the current rank's tokens so far
  std::size_t shards_ = 0;      // and its shards
  std::size_t rev_first_ = 0;   // its first kv_rev entry
};

}  // namespace detail

namespace detail {

/// Where a rank's dedup slices go: the caller's `wire` when given, else
/// out.kv_wire for a plan that asks for dedup (its storage reused).
inline RankKvWire* wire_target(bool dedup, RankQkvMetadata& out, RankKvWire* wire) {
  if (!dedup) out.kv_wire.reset();
  if (wire || !dedup) return wire;
  if (!out.kv_wire) out.kv_wire.emplace();
  return &*out.kv_wire;
}

/// A plan that asks for dedup carries the slices in out.kv_wire, also when
/// the caller had them written elsewhere.
inline void keep_wire(bool dedup, RankQkvMetadata& out, const RankKvWire* wire) {
  if (dedup && !(out.kv_wire && wire == &*out.kv_wire)) out.kv_wire = *wire;
}

}  // namespace detail

/// Rank `rank`'s share of a per-rank plan, written into `out` (its storage is
/// reused), with `workspace` kept by the caller between steps. A plan with
/// `dedup` set also fills out.kv_wire. Equal to
/// plan_qkv_for_rank(plan, rank); with `wire`, also fills the rank's slices of
/// the deduplicated KV exchange (plan_kv_wire_for_rank) in the same pass.
/// Throws invalid_input like plan_qkv_for_rank; after a throw the outputs
/// hold no meaningful plan.
inline void plan_qkv_for_rank(const QkvPlan& plan, std::int64_t rank, RankQkvMetadata& out, RankPlanWorkspace& workspace,
                              RankKvWire* wire = nullptr, const PlanLimits& limits = {}) {
  wire = detail::wire_target(plan.dedup, out, wire);
  const std::size_t C = detail::check_rank_plan(plan);
  const std::size_t R = detail::checked_rank(rank, plan.world_size, "plan_qkv_for_rank");
  detail::check_rank_share(plan, R, C, limits, "plan_qkv_for_rank");
  const std::size_t W = plan.ranks.size();
  std::optional<detail::RankWireStream> wire_stream;
  if (wire) wire_stream.emplace(W, C, R, *wire, workspace);
  detail::RankStream stream(W, C, R, plan.mask, out, workspace, wire_stream ? &*wire_stream : nullptr);
  for (std::size_t r = 0; r < W; ++r) {
    stream.begin_rank();
    for (const Document& doc : plan.ranks[r].docs) stream.document(r, doc);
    stream.end_rank(r, plan.ranks[r].docs);
  }
  stream.finish();
  detail::keep_wire(plan.dedup, out, wire);
}

namespace detail {

/// Rank R's slices of the deduplicated exchange of the shard table in
/// `ws.documents`.
inline void wire_for_rank(RankPlanWorkspace& ws, std::size_t R, RankKvWire& out) {
  const ShardTable& t = ws.documents.table;
  const ShardPositions& pos = ws.documents.positions;
  const KvGroups& groups = ws.documents.groups;
  RankWireStream wire(t.W, t.C, R, out, ws);
  for (std::size_t r = 0; r < t.W; ++r) {
    wire.begin_rank();
    for (std::size_t p = t.rank_begin[r]; p < t.rank_begin[r + 1]; ++p) {
      const std::size_t id = t.by_rank[p];
      if (t.sliced(id)) {  // its users are a set, not a run of ids: list them
        ws.user_dst.clear();
        ws.user_offset.clear();
        t.each_user(id, [&](std::size_t, std::size_t q, std::int64_t column) {
          ws.user_dst.push_back(t.dst[q]);
          ws.user_offset.push_back(groups.start[q] + column);
        });
        const auto attn_offset = [&](std::size_t c) { return ws.user_offset[c]; };
        wire.shard(r, p - t.rank_begin[r], pos.start[id], t.len[id], ws.user_dst.data(), ws.user_dst.size(), attn_offset);
        continue;
      }
      const auto attn_offset = [&](std::size_t c) { return groups.start[t.first_of(id) + c] + t.group_offset(t.first_of(id) + c, id); };
      wire.shard(r, p - t.rank_begin[r], pos.start[id], t.len[id], t.dst.data() + t.first_of(id), t.users(id), attn_offset);
    }
    wire.end_rank(r, pos.total[r]);
  }
  std::int64_t attention = 0;  // R's KV groups, whose total kv_groups checked
  for (std::size_t p = groups.dest_begin[R]; p < groups.dest_begin[R + 1]; ++p) attention += t.group_tokens(groups.arrivals[p]);
  wire.finish(attention);
}

/// The documents with slices whose needed sets rank R's share (without the
/// dedup slices, which read every document's users) reads, into
/// ws.set_docs: those with a query shard attending on R or on a destination
/// of a copy of R's KV shards, where the groups before it decide the copy's
/// offset. A document's users attend where its shards do, so those
/// destinations are all the shards' destinations of R's documents. Empty
/// when every document's sets are read. `sliced`: whether any document has slices.
inline void documents_for_rank(const QkvDocumentsPlan& plan, std::size_t R, bool dedup, bool sliced, RankPlanWorkspace& ws) {
  ws.set_docs.clear();
  if (dedup || !sliced) return;
  ws.set_dests.assign(static_cast<std::size_t>(plan.world_size), 0);
  ws.set_dests[R] = 1;
  for (const PackedDocument& d : plan.documents) {
    if (d.head_parallel) continue;  // no KV copies (section 2f)
    const bool own = std::any_of(d.shards.begin(), d.shards.end(), [&](const DocumentShard& s) { return static_cast<std::size_t>(s.rank) == R; });
    if (own)
      for (const DocumentShard& s : d.shards) ws.set_dests[static_cast<std::size_t>(s.dst)] = 1;
  }
  ws.set_docs.resize(plan.documents.size());
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const PackedDocument& d = plan.documents[i];
    const auto here = [&](const DocumentShard& s) { return ws.set_dests[static_cast<std::size_t>(s.dst)] != 0; };
    ws.set_docs[i] = !d.slices.empty() && !d.head_parallel && std::any_of(d.shards.begin(), d.shards.end(), here) ? 1 : 0;
  }
}

}  // namespace detail

/// Rank `rank`'s share of a documents-form plan into `out`, with the
/// caller's workspace (its shard table is rebuilt in place each step) and,
/// with `wire`, the rank's dedup slices. Equal to plan_qkv_for_rank(plan,
/// rank) and plan_kv_wire_for_rank(plan, rank).
inline void plan_qkv_for_rank(const QkvDocumentsPlan& plan, std::int64_t rank, RankQkvMetadata& out, RankPlanWorkspace& workspace,
                              RankKvWire* wire = nullptr, const PlanLimits& limits = {}) {
  wire = detail::wire_target(plan.dedup, out, wire);
  const detail::DocumentsCheck check = detail::check_documents_plan_sizes(plan, limits);
  const std::size_t C = check.C;
  const std::size_t R = detail::checked_rank(rank, plan.world_size, "plan_qkv_for_rank");
  detail::check_rank_share(plan, R, C, limits, "plan_qkv_for_rank");
  detail::DocumentsTables& tables = workspace.documents;
  detail::documents_for_rank(plan, R, wire != nullptr, check.slices.slices > 0, workspace);
  detail::shard_table(plan, C, tables.table, workspace.set_docs);
  detail::shard_positions(tables.table, "plan_qkv_for_rank", tables.positions);
  detail::kv_groups(tables.table, tables.groups);
  detail::check_rank_entries(tables, R, limits);
  detail::plan_shards_for_rank(tables, R, out);
  detail::plan_head_parallel_for_rank(plan, tables, R, out, limits);
  if (wire) detail::wire_for_rank(workspace, R, *wire);
  detail::keep_wire(plan.dedup, out, wire);
}

namespace detail {

/// Rank `rank`'s share of a plan of either form in fresh storage; with
/// `wire`, its dedup slices too.
template <class Plan>
RankQkvMetadata fresh_share(const Plan& plan, std::int64_t rank, RankKvWire* wire, const PlanLimits& limits) {
  RankQkvMetadata out;
  RankPlanWorkspace workspace;
  plan_qkv_for_rank(plan, rank, out, workspace, wire, limits);
  return out;
}

template <class Plan>
RankKvWire kv_wire_for_rank(const Plan& plan, std::int64_t rank, const PlanLimits& limits) {
  (void)checked_rank(rank, plan.world_size, "plan_kv_wire_for_rank");
  RankKvWire wire;
  (void)fresh_share(plan, rank, &wire, limits);
  return wire;
}

}  // namespace detail

/// plan_qkv(plan).X.get_slice(rank) for every metadata X, and row `rank` of
/// the attention layout, in O(shards + copies + W).
inline RankQkvMetadata plan_qkv_for_rank(const QkvPlan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  return detail::fresh_share(plan, rank, nullptr, limits);
}

/// The same for a plan in documents form.
inline RankQkvMetadata plan_qkv_for_rank(const QkvDocumentsPlan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  return detail::fresh_share(plan, rank, nullptr, limits);
}

/// plan_kv_wire(plan_qkv(plan)).get_slice(rank): rank `rank`'s slices of
/// kv_wire_fwd and kv_wire_rev and its fan list, in O(shards + copies + W)
/// without the global metadata. KvWireDispatcher takes the result directly.
inline RankKvWire plan_kv_wire_for_rank(const QkvPlan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  return detail::kv_wire_for_rank(plan, rank, limits);
}

/// The same for a plan in documents form.
inline RankKvWire plan_kv_wire_for_rank(const QkvDocumentsPlan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  return detail::kv_wire_for_rank(plan, rank, limits);
}

namespace detail {

/// fwd row of rank R of a query plan: its entries, each after what earlier
/// entries (global order) send to the same destination.
inline RankMetadata query_forward_slice(const QueryInput& in, std::size_t R) {
  RankMetadata s = rank_slice(R, in.W, in.copies, in.C);
  std::vector<std::int64_t> next(in.W, 0);
  for (std::size_t r = 0; r <= R; ++r) {
    for (std::size_t j = 0; j < in.S && in.seq_len(r, j) > 0; ++j) {
      if (r == R) s.seq_len.push_back(in.seq_len(r, j));
      for (std::size_t k = 0; k < in.C; ++k) {
        const std::int64_t d = in.dst(r, j, k);
        const std::int64_t off = d < 0 ? 0 : next[static_cast<std::size_t>(d)];
        if (d >= 0) next[static_cast<std::size_t>(d)] = add_tokens(off, in.seq_len(r, j), "plan_query_for_rank");
        if (r == R) s.dst_rank.push_back(d);
        if (r == R) s.dst_offset.push_back(off);
      }
    }
  }
  for (std::size_t r = 0; r < in.W; ++r)
    for (std::size_t j = 0; j < in.S; ++j)
      for (std::size_t k = 0; k < in.C; ++k)
        if (in.dst(r, j, k) == static_cast<std::int64_t>(R)) {
          s.num_recv_tokens[r] = add_tokens(s.num_recv_tokens[r], in.seq_len(r, j), "plan_query_for_rank");
        }
  finish_slice(s, "plan_query_for_rank");
  return s;
}

/// rev row of rank R of a query plan: what R received, in global order,
/// back to slab k of its source's replica buffer.
inline RankMetadata query_reverse_slice(const QueryInput& in, const RowPrefix& prefix, std::size_t R) {
  RankMetadata s = rank_slice(R, in.W, false, 1);
  for (std::size_t r = 0; r < in.W; ++r) {
    for (std::size_t j = 0; j < in.S; ++j) {
      for (std::size_t k = 0; k < in.C; ++k) {
        const std::int64_t d = in.dst(r, j, k);
        if (r == R && d >= 0) s.num_recv_tokens[static_cast<std::size_t>(d)] += in.seq_len(r, j);  // at most C x T_R
        if (d != static_cast<std::int64_t>(R)) continue;
        push_entry(s, static_cast<std::int64_t>(r), static_cast<std::int64_t>(k) * prefix.totals[r] + prefix.starts[r * in.S + j], in.seq_len(r, j));
      }
    }
  }
  if (in.copies) {
    s.mask_copies = in.C;
    std::vector<std::int64_t> mask, lens;
    for (std::size_t j = 0; j < in.S && in.seq_len(R, j) > 0; ++j) {
      lens.push_back(in.seq_len(R, j));
      for (std::size_t k = 0; k < in.C; ++k) mask.push_back(in.dst(R, j, k) >= 0 ? 1 : 0);
    }
    s.seq_recv_mask = std::move(mask);
    s.recv_seq_lens = std::move(lens);
  }
  finish_slice(s, "plan_query_for_rank");
  return s;
}

}  // namespace detail

/// plan_query(seq_len, dispatch).fwd/.rev .get_slice(rank), in O(entries + W).
inline RankQueryMetadata plan_query_for_rank(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch,
                                             std::int64_t rank, const PlanLimits& limits = {}) {
  const detail::QueryInput in = detail::check_query_shapes(seq_len, dispatch);
  detail::check_footprint(limits, footprint::query_rank_share(in.W, dispatch.numel()), "plan_query_for_rank",
                          detail::concat("a rank's share of a plan of world_size = ", in.W, " and ", dispatch.numel(), " dispatch entries"));
  (void)detail::check_query_entries(in);
  const std::size_t R = detail::checked_rank(rank, static_cast<std::int64_t>(in.W), "plan_query_for_rank");
  const detail::RowPrefix prefix = detail::row_prefix(seq_len, in.C, "plan_query_for_rank");
  return {detail::query_forward_slice(in, R), detail::query_reverse_slice(in, prefix, R)};
}

}  // namespace cpdispatch
