#pragma once
// Dispatch planning (../shared/spec/plan-json.md, sections 1 and 2): from
// shard lengths and attention destinations to forward and reverse Metadata.
//
// Cost: one pass over the dispatch entries plus the W x (W+1) count matrix;
// no [entries x W] one-hot intermediates.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// Forward (MLP layout -> attention layout) and reverse metadata of one tensor.
struct QueryMetadata {
  Metadata fwd;
  Metadata rev;
};

/// One document on a rank: its shards (contiguous, in order) and the rank
/// where each shard's queries attend.
struct Document {
  std::vector<std::int64_t> shard_len;
  std::vector<std::int64_t> dst;
};

struct RankDocuments {
  std::vector<Document> docs;
};

/// A QKV plan: per rank, its documents in MLP-layout order.
struct QkvPlan {
  std::int64_t world_size = 0;
  std::optional<std::int64_t> max_cp_degree;  ///< C; default: the most shards of any document
  std::vector<RankDocuments> ranks;           ///< exactly world_size entries
};

/// One shard of a document that may span ranks: where its tokens live in the
/// MLP layout (its home rank), how many there are, and the rank where its
/// queries attend.
struct DocumentShard {
  std::int64_t rank = 0;  ///< home rank
  std::int64_t len = 0;   ///< tokens, > 0
  std::int64_t dst = 0;   ///< attention rank
  friend bool operator==(const DocumentShard&, const DocumentShard&) = default;
};

/// A document as a list of shards in causal order; consecutive shards may
/// live on different home ranks (a long document packed across ranks).
struct PackedDocument {
  std::vector<DocumentShard> shards;
  friend bool operator==(const PackedDocument&, const PackedDocument&) = default;
};

/// A QKV plan in documents form: every document with its shards' home ranks.
/// Rank r's MLP layout holds the shards whose home is r, ordered by
/// (document, shard). The per-rank QkvPlan is the special case where all
/// shards of a document share one home.
struct QkvDocumentsPlan {
  std::int64_t world_size = 0;
  std::optional<std::int64_t> max_cp_degree;  ///< C; default: the most shards of any document
  std::vector<PackedDocument> documents;
};

/// What flash-attention needs per destination rank (variable-length batch).
struct AttentionLayout {
  std::vector<std::vector<std::int64_t>> seqlens_q;     ///< received query shards, arrival order
  std::vector<std::vector<std::int64_t>> seqlens_kv;    ///< context + own length of each
  std::vector<std::vector<std::int64_t>> cu_seqlens_q;  ///< leading 0, total last
  std::vector<std::vector<std::int64_t>> cu_seqlens_kv;
  std::vector<std::int64_t> max_seqlen_q;               ///< 0 when a rank receives nothing
  std::vector<std::int64_t> max_seqlen_kv;
};

struct QkvMetadata {
  Metadata q_fwd, q_rev;    ///< queries (and attention outputs) to and from the attention layout
  Metadata kv_fwd, kv_rev;  ///< key-values replicated to every query that needs them; gradients back
  AttentionLayout attn;
};

namespace detail {

/// Per-rank prefix sums of shard lengths: starts[r][j] = P_r(j), totals[r] = T_r.
struct RowPrefix {
  std::vector<std::int64_t> starts;  // [W][S] flat
  std::vector<std::int64_t> totals;  // [W]
};

inline RowPrefix row_prefix(const Tensor<std::int64_t>& seq_len, std::size_t copies, const char* who) {
  const std::size_t W = seq_len.size(0), S = seq_len.size(1);
  RowPrefix p{std::vector<std::int64_t>(W * S), std::vector<std::int64_t>(W)};
  for (std::size_t r = 0; r < W; ++r) {
    std::int64_t acc = 0;
    for (std::size_t j = 0; j < S; ++j) {
      p.starts[r * S + j] = acc;
      acc = add_tokens(acc, seq_len(r, j), who);
    }
    p.totals[r] = acc;
    // Reverse offsets address a [copies][T_r] replica buffer: it must be addressable.
    if (copies > 1 && acc > std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(copies)) {
      fail(who, ": rank ", r, " holds ", acc, " tokens; its replica buffer of ", copies, " copies overflows 64 bits");
    }
  }
  return p;
}

inline void fill_totals(Metadata& m) {
  const std::size_t W = static_cast<std::size_t>(m.world_size);
  m.num_total_recv_tokens.assign(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    std::int64_t total = 0;
    for (std::size_t s = 0; s < W; ++s) total = add_tokens(total, m.num_recv_tokens(d, s), "plan");
    m.num_recv_tokens(d, W) = total;
    m.num_total_recv_tokens[d] = total;
  }
}

}  // namespace detail

/// Query-level planning (spec section 1). `seq_len` is [W][S]; `dispatch` is
/// [W][S] (one destination per shard) or [W][S][C] (-1 = no copy).
inline QueryMetadata plan_query(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch) {
  using detail::fail;
  using detail::index_str;
  if (seq_len.dim() != 2) fail("plan_query: seq_len has ", seq_len.dim(), " dimensions, expected 2 ([W][S])");
  const std::size_t W = seq_len.size(0), S = seq_len.size(1);
  if (W == 0) fail("plan_query: seq_len has no rows (world_size must be at least 1)");
  if (dispatch.dim() != 2 && dispatch.dim() != 3) {
    fail("plan_query: dispatch has ", dispatch.dim(), " dimensions, expected 2 ([W][S]) or 3 ([W][S][C])");
  }
  if (dispatch.size(0) != W || dispatch.size(1) != S) {
    fail("plan_query: dispatch has shape ", detail::shape_str(dispatch.shape()), " but seq_len has ",
         detail::shape_str(seq_len.shape()), " (the first two dimensions must agree)");
  }
  const bool copies = dispatch.dim() == 3;
  const std::size_t C = copies ? dispatch.size(2) : 1;
  const auto world = static_cast<std::int64_t>(W);
  auto dst_of = [&](std::size_t r, std::size_t j, std::size_t k) { return copies ? dispatch(r, j, k) : dispatch(r, j); };
  auto where = [&](std::size_t r, std::size_t j, std::size_t k) { return copies ? index_str(r, j, k) : index_str(r, j); };

  // ---- validation, and the number of entries each destination receives
  std::vector<std::int64_t> entries_to(W, 0);
  for (std::size_t r = 0; r < W; ++r) {
    bool padding_seen = false;
    for (std::size_t j = 0; j < S; ++j) {
      const std::int64_t len = seq_len(r, j);
      if (len < 0) fail("plan_query: seq_len", index_str(r, j), " = ", len, " is negative");
      std::size_t n_dst = 0;
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = dst_of(r, j, k);
        if (d < -1 || d >= world) fail("plan_query: dispatch", where(r, j, k), " = ", d, " is outside [0, ", W, ") (-1 means no copy)");
        if (d < 0) continue;
        if (len == 0) fail("plan_query: dispatch", where(r, j, k), " = ", d, " but seq_len", index_str(r, j), " = 0 (a padding shard has no destination)");
        ++n_dst;
        ++entries_to[static_cast<std::size_t>(d)];
      }
      if (len > 0 && n_dst == 0) fail("plan_query: seq_len", index_str(r, j), " = ", len, " but dispatch", index_str(r, j), " has no destination");
      if (len > 0 && padding_seen) fail("plan_query: seq_len", index_str(r, j), " = ", len, " follows a padding shard (padding sits only at the end of a row)");
      if (len == 0) padding_seen = true;
    }
  }
  const detail::RowPrefix prefix = detail::row_prefix(seq_len, C, "plan_query");

  QueryMetadata out;
  Metadata& fwd = out.fwd;
  Metadata& rev = out.rev;
  fwd.world_size = rev.world_size = world;
  fwd.dst_rank = dispatch;
  fwd.seq_len = seq_len;
  fwd.dst_offset = Tensor<std::int64_t>(dispatch.shape(), 0);
  fwd.num_recv_tokens = Tensor<std::int64_t>({W, W + 1}, 0);
  fwd.num_seqs = Tensor<std::int64_t>({W}, 0);

  const std::size_t M = W ? static_cast<std::size_t>(*std::max_element(entries_to.begin(), entries_to.end())) : 0;
  rev.dst_rank = Tensor<std::int64_t>({W, M}, -1);
  rev.dst_offset = Tensor<std::int64_t>({W, M}, 0);
  rev.seq_len = Tensor<std::int64_t>({W, M}, 0);
  rev.num_recv_tokens = Tensor<std::int64_t>({W, W + 1}, 0);
  rev.num_seqs = Tensor<std::int64_t>({W}, 0);

  // One pass in global order (r, j, k): each destination receives its entries
  // back to back, and numbers them m = 0.. for the reverse.
  std::vector<std::int64_t> next_offset(W, 0);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t j = 0; j < S; ++j) {
      const std::int64_t len = seq_len(r, j);
      if (len == 0) break;  // padding only at the end of a row
      ++fwd.num_seqs(r);
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = dst_of(r, j, k);
        if (d < 0) continue;
        const auto du = static_cast<std::size_t>(d);
        const std::int64_t off = next_offset[du];
        next_offset[du] = detail::add_tokens(off, len, "plan_query");
        if (copies) fwd.dst_offset(r, j, k) = off; else fwd.dst_offset(r, j) = off;
        fwd.num_recv_tokens(du, r) += len;
        rev.num_recv_tokens(r, du) += len;  // row-wise here, so no strided transpose later
        const auto m = static_cast<std::size_t>(rev.num_seqs(du)++);
        rev.dst_rank(du, m) = static_cast<std::int64_t>(r);
        rev.seq_len(du, m) = len;
        // The entry's place in the source's [C][T_r] replica buffer.
        rev.dst_offset(du, m) = static_cast<std::int64_t>(k) * prefix.totals[r] + prefix.starts[r * S + j];
      }
    }
  }
  detail::fill_totals(fwd);
  detail::fill_totals(rev);
  if (copies) {
    Tensor<std::int64_t> mask(dispatch.shape(), 0);
    for (std::size_t i = 0; i < dispatch.numel(); ++i) mask.flat()[i] = dispatch.flat()[i] >= 0 ? 1 : 0;
    rev.seq_recv_mask = std::move(mask);
    rev.recv_seq_lens = seq_len;
  }
  return out;
}

/// The largest copy dimension plan_qkv accepts (CP degrees are a few dozen in practice).
inline constexpr std::int64_t max_supported_cp_degree = 65536;

/// QKV planning from documents (spec section 2).
inline QkvMetadata plan_qkv(const QkvPlan& plan) {
  using detail::fail;
  if (plan.world_size <= 0) fail("plan_qkv: world_size = ", plan.world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (plan.ranks.size() != W) fail("plan_qkv: ranks has ", plan.ranks.size(), " entries, but world_size = ", W);

  // ---- validation; the widest row (S) and the most shards of a document (C)
  std::size_t S = 0, most_shards = 0;
  for (std::size_t r = 0; r < W; ++r) {
    std::size_t shards = 0;
    const auto& docs = plan.ranks[r].docs;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      const Document& doc = docs[i];
      if (doc.shard_len.empty()) fail("plan_qkv: ranks[", r, "].docs[", i, "].shard_len is empty (a document has at least one shard)");
      if (doc.dst.size() != doc.shard_len.size()) {
        fail("plan_qkv: ranks[", r, "].docs[", i, "].dst has ", doc.dst.size(), " entries but shard_len has ", doc.shard_len.size());
      }
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
        if (doc.shard_len[s] <= 0) fail("plan_qkv: ranks[", r, "].docs[", i, "].shard_len[", s, "] = ", doc.shard_len[s], " must be positive");
        if (doc.dst[s] < 0 || doc.dst[s] >= plan.world_size) {
          fail("plan_qkv: ranks[", r, "].docs[", i, "].dst[", s, "] = ", doc.dst[s], " is outside [0, ", W, ")");
        }
      }
      shards += doc.shard_len.size();
      most_shards = std::max(most_shards, doc.shard_len.size());
    }
    S = std::max(S, shards);
  }
  std::size_t C = most_shards;
  if (plan.max_cp_degree) {
    if (*plan.max_cp_degree <= 0) fail("plan_qkv: max_cp_degree = ", *plan.max_cp_degree, " must be at least 1");
    // The copy axis is dense ([W][S][C] metadata, [C][T] replica buffers): an
    // absurd C would only allocate padding, so refuse it up front.
    if (*plan.max_cp_degree > max_supported_cp_degree) {
      fail("plan_qkv: max_cp_degree = ", *plan.max_cp_degree, " exceeds the supported maximum of ", max_supported_cp_degree);
    }
    C = static_cast<std::size_t>(*plan.max_cp_degree);
    if (C < most_shards) {
      for (std::size_t r = 0; r < W; ++r)
        for (std::size_t i = 0; i < plan.ranks[r].docs.size(); ++i)
          if (plan.ranks[r].docs[i].shard_len.size() > C) {
            fail("plan_qkv: max_cp_degree = ", C, " is smaller than the ", plan.ranks[r].docs[i].shard_len.size(),
                 " shards of ranks[", r, "].docs[", i, "]");
          }
    }
  }
  if (C == 0) C = 1;  // no documents at all: keep the copy axis non-empty

  // ---- local shard table: length, query destination, document base, context
  Tensor<std::int64_t> seq_len({W, S}, 0), q_dst({W, S}, -1);
  std::vector<std::size_t> doc_base(W * S, 0), doc_size(W * S, 0);
  std::vector<std::int64_t> context(W * S, 0);
  for (std::size_t r = 0; r < W; ++r) {
    std::size_t j = 0;
    for (const Document& doc : plan.ranks[r].docs) {
      std::int64_t ctx = 0;
      const std::size_t base = j;
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s, ++j) {
        seq_len(r, j) = doc.shard_len[s];
        q_dst(r, j) = doc.dst[s];
        doc_base[r * S + j] = base;
        doc_size[r * S + j] = doc.shard_len.size();
        context[r * S + j] = ctx;
        ctx = detail::add_tokens(ctx, doc.shard_len[s], "plan_qkv");
      }
    }
  }

  QkvMetadata out;
  QueryMetadata q = plan_query(seq_len, q_dst);
  out.q_fwd = std::move(q.fwd);
  out.q_rev = std::move(q.rev);
  const detail::RowPrefix prefix = detail::row_prefix(seq_len, C, "plan_qkv");

  // ---- KV groups: one per query shard at its destination, in arrival order
  std::vector<std::int64_t> group_start(W * S, 0);
  std::vector<std::int64_t> kv_next(W, 0);
  std::vector<std::size_t> kv_entries_to(W, 0);
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> arrivals(W);  // (source rank, local shard)
  for (std::size_t d = 0; d < W; ++d) arrivals[d].reserve(static_cast<std::size_t>(out.q_rev.num_seqs(d)));
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t j = 0; j < S && seq_len(r, j) > 0; ++j) {
      const auto d = static_cast<std::size_t>(q_dst(r, j));
      group_start[r * S + j] = kv_next[d];
      kv_next[d] = detail::add_tokens(kv_next[d], detail::add_tokens(context[r * S + j], seq_len(r, j), "plan_qkv"), "plan_qkv");
      kv_entries_to[d] += j - doc_base[r * S + j] + 1;  // KV shards 0..i of the document
      arrivals[d].emplace_back(r, j);
    }
  }

  // ---- kv_fwd: KV shard k of a document is sent to query shards k..n-1
  Metadata& kv_fwd = out.kv_fwd;
  kv_fwd.world_size = plan.world_size;
  kv_fwd.dst_rank = Tensor<std::int64_t>({W, S, C}, -1);
  kv_fwd.dst_offset = Tensor<std::int64_t>({W, S, C}, 0);
  kv_fwd.seq_len = seq_len;
  kv_fwd.num_recv_tokens = Tensor<std::int64_t>({W, W + 1}, 0);
  kv_fwd.num_seqs = out.q_fwd.num_seqs;
  Metadata& kv_rev = out.kv_rev;
  kv_rev.num_recv_tokens = Tensor<std::int64_t>({W, W + 1}, 0);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < S && seq_len(r, g) > 0; ++g) {
      const std::size_t base = doc_base[r * S + g];
      const std::size_t n = doc_size[r * S + g];
      const std::size_t k = g - base;
      for (std::size_t c = 0; c + k < n; ++c) {
        const std::size_t qj = g + c;  // query shard k + c of the same document
        const auto d = static_cast<std::size_t>(q_dst(r, qj));
        kv_fwd.dst_rank(r, g, c) = static_cast<std::int64_t>(d);
        kv_fwd.dst_offset(r, g, c) = group_start[r * S + qj] + context[r * S + g];
        kv_fwd.num_recv_tokens(d, r) += seq_len(r, g);
        kv_rev.num_recv_tokens(r, d) += seq_len(r, g);
      }
    }
  }
  detail::fill_totals(kv_fwd);

  // ---- kv_rev: at each destination, KV groups in order, shards in order
  kv_rev.world_size = plan.world_size;
  const std::size_t M = *std::max_element(kv_entries_to.begin(), kv_entries_to.end());
  kv_rev.dst_rank = Tensor<std::int64_t>({W, M}, -1);
  kv_rev.dst_offset = Tensor<std::int64_t>({W, M}, 0);
  kv_rev.seq_len = Tensor<std::int64_t>({W, M}, 0);
  kv_rev.num_seqs = Tensor<std::int64_t>({W}, 0);
  for (std::size_t d = 0; d < W; ++d) {
    std::size_t m = 0;
    for (auto [r, j] : arrivals[d]) {
      const std::size_t base = doc_base[r * S + j];
      const std::size_t i = j - base;
      for (std::size_t k = 0; k <= i; ++k, ++m) {
        const std::size_t g = base + k;
        kv_rev.dst_rank(d, m) = static_cast<std::int64_t>(r);
        kv_rev.seq_len(d, m) = seq_len(r, g);
        kv_rev.dst_offset(d, m) = static_cast<std::int64_t>(i - k) * prefix.totals[r] + prefix.starts[r * S + g];
      }
    }
    kv_rev.num_seqs(d) = static_cast<std::int64_t>(m);
  }
  detail::fill_totals(kv_rev);
  Tensor<std::int64_t> mask({W, S, C}, 0);
  for (std::size_t i = 0; i < mask.numel(); ++i) mask.flat()[i] = kv_fwd.dst_rank.flat()[i] >= 0 ? 1 : 0;
  kv_rev.seq_recv_mask = std::move(mask);
  kv_rev.recv_seq_lens = seq_len;

  // ---- attention layout
  AttentionLayout& attn = out.attn;
  for (auto* v : {&attn.seqlens_q, &attn.seqlens_kv, &attn.cu_seqlens_q, &attn.cu_seqlens_kv}) v->resize(W);
  attn.max_seqlen_q.assign(W, 0);
  attn.max_seqlen_kv.assign(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    attn.cu_seqlens_q[d].assign(1, 0);
    attn.cu_seqlens_kv[d].assign(1, 0);
    for (auto [r, j] : arrivals[d]) {
      const std::int64_t q = seq_len(r, j);
      const std::int64_t kv = context[r * S + j] + q;
      attn.seqlens_q[d].push_back(q);
      attn.seqlens_kv[d].push_back(kv);
      attn.cu_seqlens_q[d].push_back(attn.cu_seqlens_q[d].back() + q);
      attn.cu_seqlens_kv[d].push_back(attn.cu_seqlens_kv[d].back() + kv);
      attn.max_seqlen_q[d] = std::max(attn.max_seqlen_q[d], q);
      attn.max_seqlen_kv[d] = std::max(attn.max_seqlen_kv[d], kv);
    }
  }
  return out;
}

}  // namespace cpdispatch
