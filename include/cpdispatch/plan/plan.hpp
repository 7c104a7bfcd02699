#pragma once
// Dispatch planning (docs/plan-format.md, sections 1, 2 and 2b): from shard
// lengths and attention destinations to forward and reverse Metadata.
//
// Cost: a few passes over the dispatch entries plus writing the W x (W+1)
// count matrices once; no [entries x W] one-hot intermediates.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
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
  std::optional<std::int64_t> max_cp_degree;  ///< C; default: the most users of any KV shard (section 2d)
  std::vector<RankDocuments> ranks;           ///< exactly world_size entries
  AttentionMask mask;                         ///< which keys each query sees; decides the KV exchange
  bool dedup = false;                         ///< also plan the deduplicated KV exchange (section 2c)
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
  std::optional<std::int64_t> max_cp_degree;  ///< C; default: the most users of any KV shard (section 2d)
  std::vector<PackedDocument> documents;
  AttentionMask mask;                         ///< which keys each query sees; decides the KV exchange
  bool dedup = false;                         ///< also plan the deduplicated KV exchange (section 2c)
};

/// What flash-attention needs per destination rank (variable-length batch).
struct AttentionLayout {
  std::vector<std::vector<std::int64_t>> seqlens_q;     ///< received query shards, arrival order
  std::vector<std::vector<std::int64_t>> seqlens_kv;    ///< each one's KV group: the KV shards it needs, back to back
  std::vector<std::vector<std::int64_t>> cu_seqlens_q;  ///< leading 0, total last
  std::vector<std::vector<std::int64_t>> cu_seqlens_kv;
  std::vector<std::int64_t> max_seqlen_q;               ///< 0 when a rank receives nothing
  std::vector<std::int64_t> max_seqlen_kv;
  AttentionMask mask;  ///< the plan's mask; a kernel applies it bottom-right aligned (mask.allows with diagonal lk - lq)
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

}  // namespace detail

namespace detail {

/// The two inputs of query-level planning, read as [W][S][C] whatever their rank.
struct QueryInput {
  const Tensor<std::int64_t>& seq_len;
  const Tensor<std::int64_t>& dispatch;
  std::size_t W = 0, S = 0, C = 1;
  bool copies = false;

  std::int64_t dst(std::size_t r, std::size_t j, std::size_t k) const { return copies ? dispatch(r, j, k) : dispatch(r, j); }
  std::string where(std::size_t r, std::size_t j, std::size_t k) const { return copies ? index_str(r, j, k) : index_str(r, j); }
};

inline QueryInput check_query_shapes(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch) {
  if (seq_len.dim() != 2) fail("plan_query: seq_len has ", seq_len.dim(), " dimensions, expected 2 ([W][S])");
  const std::size_t W = seq_len.size(0), S = seq_len.size(1);
  if (W == 0) fail("plan_query: seq_len has no rows (world_size must be at least 1)");
  if (dispatch.dim() != 2 && dispatch.dim() != 3) {
    fail("plan_query: dispatch has ", dispatch.dim(), " dimensions, expected 2 ([W][S]) or 3 ([W][S][C])");
  }
  if (dispatch.size(0) != W || dispatch.size(1) != S) {
    fail("plan_query: dispatch has shape ", shape_str(dispatch.shape()), " but seq_len has ", shape_str(seq_len.shape()),
         " (the first two dimensions must agree)");
  }
  const bool copies = dispatch.dim() == 3;
  return QueryInput{seq_len, dispatch, W, S, copies ? dispatch.size(2) : 1, copies};
}

/// Checks every entry (ranges, padding, a destination per shard) and counts
/// the entries each destination receives.
inline std::vector<std::int64_t> check_query_entries(const QueryInput& in) {
  const auto world = static_cast<std::int64_t>(in.W);
  std::vector<std::int64_t> entries_to(in.W, 0);
  for (std::size_t r = 0; r < in.W; ++r) {
    bool padding_seen = false;
    for (std::size_t j = 0; j < in.S; ++j) {
      const std::int64_t len = in.seq_len(r, j);
      if (len < 0) fail("plan_query: seq_len", index_str(r, j), " = ", len, " is negative");
      std::size_t n_dst = 0;
      for (std::size_t k = 0; k < in.C; ++k) {
        const std::int64_t d = in.dst(r, j, k);
        if (d < -1 || d >= world) fail("plan_query: dispatch", in.where(r, j, k), " = ", d, " is outside [0, ", in.W, ") (-1 means no copy)");
        if (d < 0) continue;
        if (len == 0) {
          fail("plan_query: dispatch", in.where(r, j, k), " = ", d, " but seq_len", index_str(r, j), " = 0 (a padding shard has no destination)");
        }
        ++n_dst;
        ++entries_to[static_cast<std::size_t>(d)];
      }
      if (len > 0 && n_dst == 0) fail("plan_query: seq_len", index_str(r, j), " = ", len, " but dispatch", index_str(r, j), " has no destination");
      if (len > 0 && padding_seen) fail("plan_query: seq_len", index_str(r, j), " = ", len, " follows a padding shard (padding sits only at the end of a row)");
      if (len == 0) padding_seen = true;
    }
  }
  return entries_to;
}

/// Writes column W of a count matrix (and num_total_recv_tokens) from row
/// totals kept while the cells were filled, so no W x W re-summing.
inline void set_totals(Metadata& m, const std::vector<std::int64_t>& totals) {
  const std::size_t W = totals.size();
  for (std::size_t d = 0; d < W; ++d) m.num_recv_tokens(d, W) = totals[d];
  m.num_total_recv_tokens = totals;
}

/// Forward and reverse metadata with their final shapes (storage reused
/// where the shapes already agree); `M` is the most entries any destination
/// receives.
inline void prepare_query(const QueryInput& in, std::size_t M, Metadata& fwd, Metadata& rev) {
  const std::size_t W = in.W;
  fwd.world_size = rev.world_size = static_cast<std::int64_t>(W);
  reuse_copy(fwd.dst_rank, in.dispatch);
  reuse_copy(fwd.seq_len, in.seq_len);
  reuse_output<std::int64_t>(fwd.dst_offset, in.dispatch.shape(), 0);
  reuse_output<std::int64_t>(fwd.num_seqs, {W}, 0);
  reuse_output<std::int64_t>(rev.dst_rank, {W, M}, -1);
  reuse_output<std::int64_t>(rev.dst_offset, {W, M}, 0);
  reuse_output<std::int64_t>(rev.seq_len, {W, M}, 0);
  reuse_output<std::int64_t>(rev.num_seqs, {W}, 0);
}

/// The forward counts [d][s], read back from the reverse rows (each
/// destination's arrivals, in order) so the W x (W+1) matrix is written row
/// by row rather than one scattered column per source.
inline void count_arrivals(const Metadata& rev, Metadata& fwd) {
  CountRows rows(fwd.num_recv_tokens, rev.num_seqs.size(0));
  for (std::size_t d = 0; d < rev.num_seqs.size(0); ++d) {
    const auto arrivals = static_cast<std::size_t>(rev.num_seqs(d));
    const auto from = rev.dst_rank.row(d), lens = rev.seq_len.row(d);
    auto counts = rows.row(d);
    for (std::size_t m = 0; m < arrivals; ++m) counts[static_cast<std::size_t>(from[m])] += lens[m];
  }
}

/// One pass in global order (r, j, k): each destination receives its entries
/// back to back, and numbers them m = 0.. for the reverse.
inline void fill_query(const QueryInput& in, const RowPrefix& prefix, Metadata& fwd, Metadata& rev) {
  std::vector<std::int64_t> next_offset(in.W, 0), sent(in.W, 0);
  CountRows rows(rev.num_recv_tokens, in.W);
  for (std::size_t r = 0; r < in.W; ++r) {
    (void)rows.row(r);
    for (std::size_t j = 0; j < in.S; ++j) {
      const std::int64_t len = in.seq_len(r, j);
      if (len == 0) break;  // padding only at the end of a row
      ++fwd.num_seqs(r);
      for (std::size_t k = 0; k < in.C; ++k) {
        const std::int64_t d = in.dst(r, j, k);
        if (d < 0) continue;
        const auto du = static_cast<std::size_t>(d);
        const std::int64_t off = next_offset[du];
        next_offset[du] = add_tokens(off, len, "plan_query");
        if (in.copies) fwd.dst_offset(r, j, k) = off; else fwd.dst_offset(r, j) = off;
        rev.num_recv_tokens(r, du) += len;  // row r: written row by row
        sent[r] += len;  // bounded by C x T_r, which row_prefix checked
        const auto m = static_cast<std::size_t>(rev.num_seqs(du)++);
        rev.dst_rank(du, m) = static_cast<std::int64_t>(r);
        rev.seq_len(du, m) = len;
        // The entry's place in the source's [C][T_r] replica buffer.
        rev.dst_offset(du, m) = static_cast<std::int64_t>(k) * prefix.totals[r] + prefix.starts[r * in.S + j];
      }
    }
  }
  count_arrivals(rev, fwd);
  set_totals(fwd, next_offset);  // a destination's offsets end at what it receives
  set_totals(rev, sent);
}

/// 1 where a copy exists: which slabs of the replica buffer come back.
inline void copy_mask(const Tensor<std::int64_t>& dst_rank, std::optional<Tensor<std::int64_t>>& mask) {
  if (!mask) mask.emplace();
  if (mask->shape() != dst_rank.shape()) *mask = output_tensor<std::int64_t>(dst_rank.shape(), 0);
  for (std::size_t i = 0; i < dst_rank.numel(); ++i) mask->flat()[i] = dst_rank.flat()[i] >= 0 ? 1 : 0;
}

/// plan_query into `fwd` and `rev`, reusing their storage.
inline void plan_query_into(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch, Metadata& fwd, Metadata& rev,
                            const PlanLimits& limits = {}) {
  const QueryInput in = check_query_shapes(seq_len, dispatch);
  const std::vector<std::int64_t> entries_to = check_query_entries(in);
  const auto M = static_cast<std::size_t>(*std::max_element(entries_to.begin(), entries_to.end()));
  check_footprint(limits, footprint::query(in.W, in.S, in.C, M), "plan_query",
                  concat("a plan of world_size = ", in.W, ", ", in.S, " shards a rank, ", in.C, " copies, ", M, " entries at one rank"));
  const RowPrefix prefix = row_prefix(seq_len, in.C, "plan_query");
  prepare_query(in, M, fwd, rev);
  fill_query(in, prefix, fwd, rev);
  fwd.seq_recv_mask.reset();
  fwd.recv_seq_lens.reset();
  if (!in.copies) {
    rev.seq_recv_mask.reset();
    rev.recv_seq_lens.reset();
    return;
  }
  copy_mask(dispatch, rev.seq_recv_mask);
  if (!rev.recv_seq_lens) rev.recv_seq_lens.emplace();
  reuse_copy(*rev.recv_seq_lens, seq_len);
}

}  // namespace detail

/// Query-level planning (section 1 of docs/plan-format.md). `seq_len` is
/// [W][S]; `dispatch` is [W][S] (one destination per shard) or [W][S][C]
/// (-1 = no copy). A plan whose metadata would exceed `limits` is an
/// invalid_input naming its sizes, raised before the metadata is allocated.
inline QueryMetadata plan_query(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch, const PlanLimits& limits = {}) {
  QueryMetadata out;
  detail::plan_query_into(seq_len, dispatch, out.fwd, out.rev, limits);
  return out;
}

/// The largest copy dimension plan_qkv accepts (CP degrees are a few dozen in practice).
inline constexpr std::int64_t max_supported_cp_degree = 65536;

/// The documents form of a per-rank plan: rank 0's documents, then rank 1's,
/// ... Planning either gives identical metadata.
inline QkvDocumentsPlan to_documents(const QkvPlan& plan) {
  QkvDocumentsPlan out;
  out.world_size = plan.world_size;
  out.max_cp_degree = plan.max_cp_degree;
  out.mask = plan.mask;
  out.dedup = plan.dedup;
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const Document& doc : plan.ranks[r].docs) {
      PackedDocument packed;
      packed.shards.reserve(doc.shard_len.size());
      for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
        packed.shards.push_back({static_cast<std::int64_t>(r), doc.shard_len[s], s < doc.dst.size() ? doc.dst[s] : -1});
      }
      out.documents.push_back(std::move(packed));
    }
  }
  return out;
}

/// The per-rank form of a documents-form plan whose documents each live on
/// one rank (every plan of a per-rank problem): document order kept within
/// each rank. Throws invalid_input naming the first document that spans ranks.
inline QkvPlan to_rank_plan(const QkvDocumentsPlan& plan) {
  using detail::fail;
  if (plan.world_size <= 0) fail("to_rank_plan: world_size = ", plan.world_size, " must be at least 1");
  QkvPlan out;
  out.world_size = plan.world_size;
  out.max_cp_degree = plan.max_cp_degree;
  out.ranks.resize(static_cast<std::size_t>(plan.world_size));
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty()) fail("to_rank_plan: documents[", i, "] has no shards");
    const std::int64_t home = shards.front().rank;
    if (home < 0 || home >= plan.world_size) fail("to_rank_plan: documents[", i, "].shards[0].rank = ", home, " is outside [0, ", plan.world_size, ")");
    Document doc;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      if (shards[k].rank != home) {
        fail("to_rank_plan: documents[", i, "] spans ranks ", home, " and ", shards[k].rank, " (shards[", k, "]); only the documents form holds it");
      }
      doc.shard_len.push_back(shards[k].len);
      doc.dst.push_back(shards[k].dst);
    }
    out.ranks[static_cast<std::size_t>(home)].docs.push_back(std::move(doc));
  }
  return out;
}

namespace detail {

/// The copy dimension C: the plan's max_cp_degree, checked, or the most
/// users of any KV shard (at least 1, so the copy axis is never empty).
inline std::size_t copy_dimension(const std::optional<std::int64_t>& max_cp_degree, std::size_t most_users) {
  if (!max_cp_degree) return std::max<std::size_t>(most_users, 1);
  if (*max_cp_degree <= 0) fail("plan_qkv: max_cp_degree = ", *max_cp_degree, " must be at least 1");
  // The copy axis is dense ([W][S][C] metadata, [C][T] replica buffers): an
  // absurd C would only allocate padding, so refuse it up front.
  if (*max_cp_degree > max_supported_cp_degree) {
    fail("plan_qkv: max_cp_degree = ", *max_cp_degree, " exceeds the supported maximum of ", max_supported_cp_degree);
  }
  return static_cast<std::size_t>(*max_cp_degree);
}

/// The KV shard of one document with the most users under `mask`:
/// (users, shard). Causal and full: shard 0, used by every query shard.
inline std::pair<std::size_t, std::size_t> most_users(const AttentionMask& mask, const std::int64_t* len, std::size_t n, DocumentRanges& ranges) {
  if (mask.type != MaskType::sliding_window) return {n, 0};
  ranges.compute(mask, len, n);
  std::pair<std::size_t, std::size_t> best{0, 0};
  for (std::size_t k = 0; k < n; ++k) best = std::max(best, std::pair{ranges.users(k), n - 1 - k});
  return {best.first, n - 1 - best.second};  // the first shard with the most users
}

/// " whose queries need <shard> (<mask> mask)" for the C error; empty under
/// the causal mask, whose every shard needs shard 0.
template <class... Parts>
std::string mask_detail(const AttentionMask& mask, const Parts&... shard) {
  if (mask.type == MaskType::causal) return {};
  std::ostringstream os;
  os << " whose queries need ";
  (os << ... << shard);
  os << " (" << to_string(mask) << " mask)";
  return os.str();
}

inline void check_mask(const AttentionMask& mask) {
  if (mask.type == MaskType::sliding_window && mask.window < 1) {
    fail("plan_qkv: mask.window = ", mask.window, "; a sliding window must be at least 1 token");
  }
}

/// Validates a per-rank plan; returns C.
inline std::size_t check_rank_plan(const QkvPlan& plan) {
  if (plan.world_size <= 0) fail("plan_qkv: world_size = ", plan.world_size, " must be at least 1");
  const auto W = static_cast<std::size_t>(plan.world_size);
  if (plan.ranks.size() != W) fail("plan_qkv: ranks has ", plan.ranks.size(), " entries, but world_size = ", W);
  for (std::size_t r = 0; r < W; ++r) {
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
    }
  }
  check_mask(plan.mask);
  DocumentRanges ranges;
  std::size_t most = 0;
  for (std::size_t r = 0; r < W; ++r) {
    for (const Document& doc : plan.ranks[r].docs) most = std::max(most, most_users(plan.mask, doc.shard_len.data(), doc.shard_len.size(), ranges).first);
  }
  const std::size_t C = copy_dimension(plan.max_cp_degree, most);
  for (std::size_t r = 0; r < W && C < most; ++r) {
    for (std::size_t i = 0; i < plan.ranks[r].docs.size(); ++i) {
      const auto& len = plan.ranks[r].docs[i].shard_len;
      const auto [users, k] = most_users(plan.mask, len.data(), len.size(), ranges);
      if (users > C) {  // causal: shard 0 is needed by every shard, as the message has always said
        fail("plan_qkv: max_cp_degree = ", C, " is smaller than the ", users, " shards of ranks[", r, "].docs[", i, "]",
             mask_detail(plan.mask, "its shard_len[", k, "]"));
      }
    }
  }
  return C;
}

/// Validates a documents-form plan; returns C.
inline std::size_t check_documents_plan(const QkvDocumentsPlan& plan) {
  if (plan.world_size <= 0) fail("plan_qkv: world_size = ", plan.world_size, " must be at least 1");
  const std::int64_t W = plan.world_size;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty()) fail("plan_qkv: documents[", i, "].shards is empty (a document has at least one shard)");
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const DocumentShard& s = shards[k];
      if (s.rank < 0 || s.rank >= W) fail("plan_qkv: documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", W, ")");
      if (s.len <= 0) fail("plan_qkv: documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
      if (s.dst < 0 || s.dst >= W) fail("plan_qkv: documents[", i, "].shards[", k, "].dst = ", s.dst, " is outside [0, ", W, ")");
    }
  }
  check_mask(plan.mask);
  DocumentRanges ranges;
  std::vector<std::int64_t> len;
  std::size_t most = 0;
  const auto users_of = [&](const PackedDocument& d) -> std::pair<std::size_t, std::size_t> {
    if (plan.mask.type != MaskType::sliding_window) return {d.shards.size(), 0};  // every shard needs shard 0
    len.clear();
    for (const DocumentShard& s : d.shards) len.push_back(s.len);
    return most_users(plan.mask, len.data(), len.size(), ranges);
  };
  for (const PackedDocument& d : plan.documents) most = std::max(most, users_of(d).first);
  const std::size_t C = copy_dimension(plan.max_cp_degree, most);
  for (std::size_t i = 0; i < plan.documents.size() && C < most; ++i) {
    const auto [users, k] = users_of(plan.documents[i]);
    if (users > C) {
      fail("plan_qkv: documents[", i, "].shards has ", users, " shards", mask_detail(plan.mask, "documents[", i, "].shards[", k, "]"),
           ", more than max_cp_degree = ", C);
    }
  }
  return C;
}

/// Every shard of a QKV plan, numbered in document order (document, then
/// shard: the ids of one document are consecutive), with its home rank and
/// its index in its home's MLP layout. Both plan forms fill it, so both are
/// planned by the same code.
struct ShardTable {
  std::size_t W = 0, S = 0, C = 1;
  std::vector<std::int64_t> len, dst, context;  // [N]; context = tokens of the document before the shard
  std::vector<std::size_t> home, local, doc;    // [N]
  std::vector<std::size_t> doc_begin{0};        // [D + 1]: the first id of each document
  std::vector<std::size_t> rank_begin;          // [W + 1] into by_rank
  std::vector<std::size_t> by_rank;             // ids, rank-major, each rank in MLP order
  AttentionMask mask;                           // set before the first add()
  // Section 2d, as ids: query shard id needs KV shards lo_of(id)..hi_of(id);
  // KV shard id is needed by query shards first_of(id)..end_of(id)-1 (its
  // users). Stored for masks other than causal, whose ranges follow from the
  // documents' bounds.
  std::vector<std::size_t> lo, hi, first, end;  // [N], or empty when causal
  DocumentRanges ranges;                        // one document's, relative to its first id

  std::size_t size() const noexcept { return len.size(); }
  bool causal() const noexcept { return mask.type == MaskType::causal; }
  std::size_t lo_of(std::size_t q) const noexcept { return causal() ? doc_begin[doc[q]] : lo[q]; }
  std::size_t hi_of(std::size_t q) const noexcept { return causal() ? q : hi[q]; }
  std::size_t first_of(std::size_t k) const noexcept { return causal() ? k : first[k]; }
  std::size_t end_of(std::size_t k) const noexcept { return causal() ? doc_begin[doc[k] + 1] : end[k]; }
  std::size_t users(std::size_t id) const noexcept { return end_of(id) - first_of(id); }
  /// Tokens of the KV group of query shard q: KV shards lo..hi back to back.
  std::int64_t group_tokens(std::size_t q) const {
    const std::size_t h = hi_of(q);
    return add_tokens(context[h], len[h], "plan_qkv") - context[lo_of(q)];
  }
  /// Where KV shard kv sits inside the KV group of query shard q.
  std::int64_t group_offset(std::size_t q, std::size_t kv) const noexcept { return context[kv] - context[lo_of(q)]; }

  /// Empty, keeping the memory of every field (a table refilled each step).
  void clear() {
    for (auto* v : {&len, &dst, &context}) v->clear();
    for (auto* v : {&home, &local, &doc, &by_rank, &lo, &hi, &first, &end}) v->clear();
    doc_begin.assign(1, 0);
    W = S = 0;
    C = 1;
  }
  void reserve(std::size_t n) {
    for (auto* v : {&len, &dst, &context}) v->reserve(n);
    for (auto* v : {&home, &local, &doc}) v->reserve(n);
    if (!causal())
      for (auto* v : {&lo, &hi, &first, &end}) v->reserve(n);
  }
  /// Appends the next shard of the current document.
  void add(std::int64_t rank, std::int64_t length, std::int64_t destination) {
    const bool first = doc_begin.back() == len.size();
    context.push_back(first ? 0 : add_tokens(context.back(), len.back(), "plan_qkv"));
    len.push_back(length);
    dst.push_back(destination);
    home.push_back(static_cast<std::size_t>(rank));
    doc.push_back(doc_begin.size() - 1);
  }
  /// Closes the current document: its needed ranges and users, as ids.
  void end_document() {
    const std::size_t base = doc_begin.back(), n = len.size() - base;
    if (causal()) {  // the ranges follow from doc_begin
      doc_begin.push_back(len.size());
      return;
    }
    ranges.compute(mask, len.data() + base, n);
    for (std::size_t k = 0; k < n; ++k) {
      lo.push_back(base + ranges.lo[k]);
      hi.push_back(base + ranges.hi[k]);
      first.push_back(base + ranges.first[k]);
      end.push_back(base + ranges.end[k]);
    }
    doc_begin.push_back(len.size());
  }

  /// Orders the shards by home rank (a stable counting sort keeps document
  /// order on each rank: the MLP layout) and numbers them there.
  void place(std::size_t world, std::size_t copies) {
    W = world;
    C = copies;
    rank_begin.assign(W + 1, 0);
    for (std::size_t r : home) ++rank_begin[r + 1];
    for (std::size_t r = 0; r < W; ++r) {
      S = std::max(S, rank_begin[r + 1]);
      rank_begin[r + 1] += rank_begin[r];
    }
    by_rank.resize(size());
    local.resize(size());
    std::vector<std::size_t> next(rank_begin.begin(), rank_begin.end() - 1);
    for (std::size_t id = 0; id < size(); ++id) {
      const std::size_t pos = next[home[id]]++;
      by_rank[pos] = id;
      local[id] = pos - rank_begin[home[id]];
    }
  }

  /// A per-shard field as a [W][S] rank-major tensor, `pad` beyond each row.
  Tensor<std::int64_t> rank_major(const std::vector<std::int64_t>& field, std::int64_t pad) const {
    Tensor<std::int64_t> out = output_tensor<std::int64_t>({W, S}, pad);
    for (std::size_t r = 0; r < W; ++r) {
      for (std::size_t p = rank_begin[r]; p < rank_begin[r + 1]; ++p) out(r, p - rank_begin[r]) = field[by_rank[p]];
    }
    return out;
  }
};

inline ShardTable shard_table(const QkvPlan& plan, std::size_t C) {
  ShardTable t;
  t.mask = plan.mask;
  std::size_t n = 0;
  for (const auto& rank : plan.ranks)
    for (const Document& d : rank.docs) n += d.shard_len.size();
  t.reserve(n);
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const Document& d : plan.ranks[r].docs) {
      for (std::size_t s = 0; s < d.shard_len.size(); ++s) t.add(static_cast<std::int64_t>(r), d.shard_len[s], d.dst[s]);
      t.end_document();
    }
  }
  t.place(plan.ranks.size(), C);
  return t;
}

/// The shard table of a documents-form plan, written into `t` (its memory reused).
inline void shard_table(const QkvDocumentsPlan& plan, std::size_t C, ShardTable& t) {
  t.clear();
  t.mask = plan.mask;
  std::size_t n = 0;
  for (const PackedDocument& d : plan.documents) n += d.shards.size();
  t.reserve(n);
  for (const PackedDocument& d : plan.documents) {
    for (const DocumentShard& s : d.shards) t.add(s.rank, s.len, s.dst);
    t.end_document();
  }
  t.place(static_cast<std::size_t>(plan.world_size), C);
}

inline ShardTable shard_table(const QkvDocumentsPlan& plan, std::size_t C) {
  ShardTable t;
  shard_table(plan, C, t);
  return t;
}

/// One KV group per query shard at its destination, in arrival order
/// (global order over the query shards' home rank and local index).
struct KvGroups {
  std::vector<std::int64_t> start;      // [N]: where the group of query shard id begins at its destination
  std::vector<std::size_t> dest_begin;  // [W + 1] into arrivals
  std::vector<std::size_t> arrivals;    // query shard ids, destination-major, arrival order
  std::size_t most_entries = 0;         // the most KV shards one destination receives
};

/// The KV groups of `t`, written into `g` (its memory reused).
inline void kv_groups(const ShardTable& t, KvGroups& g) {
  g.most_entries = 0;
  g.start.assign(t.size(), 0);
  g.dest_begin.assign(t.W + 1, 0);
  for (std::size_t id : t.by_rank) ++g.dest_begin[static_cast<std::size_t>(t.dst[id]) + 1];
  for (std::size_t d = 0; d < t.W; ++d) g.dest_begin[d + 1] += g.dest_begin[d];
  g.arrivals.resize(t.size());
  std::vector<std::size_t> next(g.dest_begin.begin(), g.dest_begin.end() - 1);
  for (std::size_t id : t.by_rank) g.arrivals[next[static_cast<std::size_t>(t.dst[id])]++] = id;
  for (std::size_t d = 0; d < t.W; ++d) {
    std::int64_t at = 0;
    std::size_t entries = 0;
    for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
      const std::size_t q = g.arrivals[p];
      g.start[q] = at;
      at = add_tokens(at, t.group_tokens(q), "plan_qkv");  // a group lies within its document, whose total add() checked
      entries += t.hi_of(q) - t.lo_of(q) + 1;
    }
    g.most_entries = std::max(g.most_entries, entries);
  }
}

inline KvGroups kv_groups(const ShardTable& t) {
  KvGroups g;
  kv_groups(t, g);
  return g;
}

/// kv_fwd's counts [d][r]: each destination's KV groups, shard by shard,
/// charged to the shards' home ranks; filled one destination row at a time.
/// Column W holds each row's total (bounded by the groups' total, which
/// kv_groups checked).
inline void kv_arrival_counts(const ShardTable& t, const KvGroups& g, Tensor<std::int64_t>& counts) {
  CountRows rows(counts, t.W);
  for (std::size_t d = 0; d < t.W; ++d) {
    auto row = rows.row(d);
    for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
      const std::size_t q = g.arrivals[p];
      for (std::size_t kv = t.lo_of(q); kv <= t.hi_of(q); ++kv) {
        row[t.home[kv]] += t.len[kv];
        row[t.W] += t.len[kv];
      }
    }
  }
}

/// kv_rev's counts [r][d]: the copies of each home rank's KV shards, charged
/// to the destinations they return from; filled one home row at a time.
/// Column W holds each row's total (bounded by C x T_r, which row_prefix
/// checked).
inline void kv_return_counts(const ShardTable& t, Tensor<std::int64_t>& counts) {
  CountRows rows(counts, t.W);
  for (std::size_t r = 0; r < t.W; ++r) {
    auto row = rows.row(r);
    for (std::size_t p = t.rank_begin[r]; p < t.rank_begin[r + 1]; ++p) {
      const std::size_t id = t.by_rank[p];
      for (std::size_t q = t.first_of(id); q < t.end_of(id); ++q) {
        row[static_cast<std::size_t>(t.dst[q])] += t.len[id];
        row[t.W] += t.len[id];
      }
    }
  }
}

/// Column W of a count matrix: num_total_recv_tokens.
inline std::vector<std::int64_t> row_totals(const Tensor<std::int64_t>& counts) {
  const std::size_t W = counts.size(0);
  std::vector<std::int64_t> totals(W);
  for (std::size_t d = 0; d < W; ++d) totals[d] = counts(d, W);
  return totals;
}

/// kv_fwd: KV shard k of a document goes in one copy per user (query shard
/// that needs it), copy c to the group of its c-th user. Counts follow the
/// bytes: they are charged to the KV shard's home rank.
inline void kv_forward(const ShardTable& t, const KvGroups& g, const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& num_seqs,
                       Metadata& fwd) {
  const std::size_t W = t.W, S = t.S, C = t.C;
  fwd.world_size = static_cast<std::int64_t>(W);
  reuse_output<std::int64_t>(fwd.dst_rank, {W, S, C}, -1);
  reuse_output<std::int64_t>(fwd.dst_offset, {W, S, C}, 0);
  reuse_copy(fwd.seq_len, seq_len);
  reuse_copy(fwd.num_seqs, num_seqs);
  fwd.seq_recv_mask.reset();
  fwd.recv_seq_lens.reset();
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t p = t.rank_begin[r]; p < t.rank_begin[r + 1]; ++p) {
      const std::size_t id = t.by_rank[p], j = p - t.rank_begin[r];
      for (std::size_t q = t.first_of(id); q < t.end_of(id); ++q) {  // its users, copy c = q - first
        const std::size_t c = q - t.first_of(id);
        fwd.dst_rank(r, j, c) = t.dst[q];
        fwd.dst_offset(r, j, c) = g.start[q] + t.group_offset(q, id);
      }
    }
  }
  kv_arrival_counts(t, g, fwd.num_recv_tokens);
  fwd.num_total_recv_tokens = row_totals(fwd.num_recv_tokens);
}

/// Where each shard starts in its home's send buffer, by shard id: a
/// document's shards are read together, so this keeps those reads local.
inline std::vector<std::int64_t> send_starts(const ShardTable& t, const RowPrefix& prefix) {
  std::vector<std::int64_t> start(t.size());
  for (std::size_t id = 0; id < t.size(); ++id) start[id] = prefix.starts[t.home[id] * t.S + t.local[id]];
  return start;
}

/// kv_rev: at each destination the KV groups in order, shards in order; each
/// entry returns to slab c (its copy) of its home's [C][T] replica buffer.
inline void kv_reverse(const ShardTable& t, const KvGroups& g, const RowPrefix& prefix, const Tensor<std::int64_t>& seq_len, Metadata& rev) {
  const std::size_t W = t.W, M = g.most_entries;
  rev.world_size = static_cast<std::int64_t>(W);
  reuse_output<std::int64_t>(rev.dst_rank, {W, M}, -1);
  reuse_output<std::int64_t>(rev.dst_offset, {W, M}, 0);
  reuse_output<std::int64_t>(rev.seq_len, {W, M}, 0);
  reuse_output<std::int64_t>(rev.num_seqs, {W}, 0);
  const std::vector<std::int64_t> start = send_starts(t, prefix);
  for (std::size_t d = 0; d < W; ++d) {
    std::size_t m = 0;
    for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
      const std::size_t q = g.arrivals[p];
      for (std::size_t kv = t.lo_of(q); kv <= t.hi_of(q); ++kv, ++m) {
        const std::size_t r = t.home[kv];
        rev.dst_rank(d, m) = static_cast<std::int64_t>(r);
        rev.seq_len(d, m) = t.len[kv];
        rev.dst_offset(d, m) = static_cast<std::int64_t>(q - t.first_of(kv)) * prefix.totals[r] + start[kv];
      }
    }
    rev.num_seqs(d) = static_cast<std::int64_t>(m);
  }
  kv_return_counts(t, rev.num_recv_tokens);
  rev.num_total_recv_tokens = row_totals(rev.num_recv_tokens);
  if (!rev.recv_seq_lens) rev.recv_seq_lens.emplace();
  reuse_copy(*rev.recv_seq_lens, seq_len);
}

/// What a varlen attention kernel needs at each destination.
inline void attention_layout(const ShardTable& t, const KvGroups& g, AttentionLayout& attn) {
  for (auto* v : {&attn.seqlens_q, &attn.seqlens_kv, &attn.cu_seqlens_q, &attn.cu_seqlens_kv}) {
    v->resize(t.W);
    for (auto& row : *v) row.clear();  // keeps each row's memory for the next plan
  }
  attn.max_seqlen_q.assign(t.W, 0);
  attn.max_seqlen_kv.assign(t.W, 0);
  attn.mask = t.mask;
  for (std::size_t d = 0; d < t.W; ++d) {
    const std::size_t arrivals = g.dest_begin[d + 1] - g.dest_begin[d];
    for (auto* v : {&attn.seqlens_q[d], &attn.seqlens_kv[d]}) v->reserve(arrivals);
    for (auto* v : {&attn.cu_seqlens_q[d], &attn.cu_seqlens_kv[d]}) v->reserve(arrivals + 1);
    attn.cu_seqlens_q[d].assign(1, 0);
    attn.cu_seqlens_kv[d].assign(1, 0);
    for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
      const std::size_t q = g.arrivals[p];
      const std::int64_t len = t.len[q], kv = t.group_tokens(q);
      attn.seqlens_q[d].push_back(len);
      attn.seqlens_kv[d].push_back(kv);
      attn.cu_seqlens_q[d].push_back(attn.cu_seqlens_q[d].back() + len);
      attn.cu_seqlens_kv[d].push_back(attn.cu_seqlens_kv[d].back() + kv);
      attn.max_seqlen_q[d] = std::max(attn.max_seqlen_q[d], len);
      attn.max_seqlen_kv[d] = std::max(attn.max_seqlen_kv[d], kv);
    }
  }
}

/// The shard tables of a validated plan of `shards` shards, checked before
/// they are built.
inline void check_table_footprint(std::size_t W, std::size_t shards, std::size_t C, const PlanLimits& limits) {
  check_footprint(limits, footprint::shard_tables(W, shards), "plan_qkv",
                  concat("a plan of world_size = ", W, ", ", shards, " shards, max_cp_degree = ", C));
}

/// The dense metadata of a shard table, checked before it is allocated.
inline void check_qkv_footprint(const ShardTable& t, const KvGroups& g, const PlanLimits& limits) {
  std::size_t Mq = 0;
  for (std::size_t d = 0; d < t.W; ++d) Mq = std::max(Mq, g.dest_begin[d + 1] - g.dest_begin[d]);
  check_footprint(limits, footprint::qkv(t.W, t.size(), t.S, t.C, Mq, g.most_entries), "plan_qkv",
                  concat("a plan of world_size = ", t.W, ", ", t.size(), " shards (", t.S, " on one rank), max_cp_degree = ", t.C, ", ", Mq,
                         " query and ", g.most_entries, " key-value entries at one rank"));
}

/// Plans a validated shard table into `out`: queries, KV forward and
/// reverse, attention layout.
inline void plan_shards(const ShardTable& t, QkvMetadata& out, const PlanLimits& limits) {
  const KvGroups groups = kv_groups(t);
  check_qkv_footprint(t, groups, limits);
  const Tensor<std::int64_t> seq_len = t.rank_major(t.len, 0);
  plan_query_into(seq_len, t.rank_major(t.dst, -1), out.q_fwd, out.q_rev, limits);
  const RowPrefix prefix = row_prefix(seq_len, t.C, "plan_qkv");
  kv_forward(t, groups, seq_len, out.q_fwd.num_seqs, out.kv_fwd);
  kv_reverse(t, groups, prefix, seq_len, out.kv_rev);
  copy_mask(out.kv_fwd.dst_rank, out.kv_rev.seq_recv_mask);
  attention_layout(t, groups, out.attn);
}

}  // namespace detail

/// QKV planning from per-rank documents (section 2 of docs/plan-format.md),
/// written into `out`, reusing its storage where the shapes agree: a job that
/// plans every step into the same QkvMetadata touches no fresh memory for the
/// W x (W+1) count matrices. Throws invalid_input like plan_qkv(plan); after
/// a throw `out` holds no meaningful plan. A plan whose metadata would
/// exceed `limits` is refused (invalid_input naming its sizes) before the
/// metadata is allocated.
inline void plan_qkv(const QkvPlan& plan, QkvMetadata& out, const PlanLimits& limits = {}) {
  const std::size_t C = detail::check_rank_plan(plan);
  std::size_t shards = 0;
  for (const RankDocuments& rank : plan.ranks)
    for (const Document& d : rank.docs) shards += d.shard_len.size();
  detail::check_table_footprint(plan.ranks.size(), shards, C, limits);
  detail::plan_shards(detail::shard_table(plan, C), out, limits);
}

/// QKV planning from documents whose shards may live on several home ranks
/// (section 2b of docs/plan-format.md), into `out` (see above). A per-rank
/// plan and its to_documents() form give identical metadata.
inline void plan_qkv(const QkvDocumentsPlan& plan, QkvMetadata& out, const PlanLimits& limits = {}) {
  const std::size_t C = detail::check_documents_plan(plan);
  std::size_t shards = 0;
  for (const PackedDocument& d : plan.documents) shards += d.shards.size();
  detail::check_table_footprint(static_cast<std::size_t>(plan.world_size), shards, C, limits);
  detail::plan_shards(detail::shard_table(plan, C), out, limits);
}

/// QKV planning of a per-rank plan into fresh metadata.
inline QkvMetadata plan_qkv(const QkvPlan& plan, const PlanLimits& limits = {}) {
  QkvMetadata out;
  plan_qkv(plan, out, limits);
  return out;
}

/// QKV planning of a documents-form plan into fresh metadata.
inline QkvMetadata plan_qkv(const QkvDocumentsPlan& plan, const PlanLimits& limits = {}) {
  QkvMetadata out;
  plan_qkv(plan, out, limits);
  return out;
}

}  // namespace cpdispatch
