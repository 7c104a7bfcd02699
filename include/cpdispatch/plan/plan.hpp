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
#include <numeric>
#include <optional>
#include <span>
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
  /// The document's mask as slices in its positions (section 2e); empty:
  /// the plan's mask over the whole document.
  std::vector<AttentionSlice> slices{};
  /// Section 2f: the whole document goes to every rank of its group, each
  /// attending its share of the heads; its shards' dst are ignored.
  bool head_parallel = false;
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
  /// u of section 2f: head-parallel groups are u consecutive ranks; 0 means W.
  std::int64_t head_parallel_degree = 0;
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
  /// Section 2e's attn.entries, only when some document has slices (else
  /// empty): per destination rank, per query shard in arrival order, its
  /// entries in the shard's own rows and its KV group's columns. Where
  /// present they alone decide what is attended.
  std::vector<std::vector<std::vector<AttentionEntry>>> entries;
};

/// Section 2f's head-parallel layout, per rank: the head-parallel documents
/// of its group, whole, back to back in document order (the same on every
/// rank of the group), and which share of the heads the rank attends.
struct HeadParallelLayout {
  std::int64_t degree = 0;                             ///< u, the ranks of a group; 0 when no document is head-parallel
  std::vector<std::vector<std::int64_t>> documents;    ///< per rank: the plan's document indices, in order
  std::vector<std::vector<std::int64_t>> seqlens;      ///< per rank: each document's length
  std::vector<std::vector<std::int64_t>> cu_seqlens;   ///< per rank: leading 0, total last
  std::vector<std::int64_t> max_seqlen;                ///< per rank: 0 when it holds none
  std::vector<std::int64_t> group_rank;                ///< per rank: r mod u, which decides its heads
  AttentionMask mask;                                  ///< for a document without slices, over the whole document
  /// Only when some head-parallel document has slices (else empty): per
  /// rank, per document, its entries in the document's own positions.
  std::vector<std::vector<std::vector<AttentionEntry>>> entries;
  bool empty() const noexcept { return degree == 0; }
};

struct QkvMetadata {
  Metadata q_fwd, q_rev;    ///< queries (and attention outputs) to and from the attention layout
  Metadata kv_fwd, kv_rev;  ///< key-values replicated to every query that needs them; gradients back
  AttentionLayout attn;
  /// Section 2f, default-constructed when no document is head-parallel:
  /// every head-parallel shard to each rank of its group ([W][S][u]), the
  /// way back into a [u][T_r] replica buffer, and the layout there.
  Metadata hp_fwd, hp_rev;
  HeadParallelLayout hp_attn;
};

namespace detail {

/// Per-rank prefix sums of shard lengths: starts[r][j] = P_r(j), totals[r] = T_r.
struct RowPrefix {
  std::vector<std::int64_t> starts;  // [W][S] flat
  std::vector<std::int64_t> totals;  // [W]
};

/// Refuses a [copies][T_r] replica buffer that 64 bits cannot address:
/// reverse offsets address it.
inline void check_replica_buffer(std::int64_t tokens, std::size_t copies, std::size_t r, const char* who) {
  if (copies > 1 && tokens > std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(copies)) {
    fail(who, ": rank ", r, " holds ", tokens, " tokens; its replica buffer of ", copies, " copies overflows 64 bits");
  }
}

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
    check_replica_buffer(acc, copies, r, who);
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

/// Checks every entry (ranges, padding, a destination per shard unless
/// `unsent_allowed`) and counts the entries each destination receives.
/// Section 2e's wire lets a KV shard nobody needs stay home: unsent_allowed.
inline std::vector<std::int64_t> check_query_entries(const QueryInput& in, bool unsent_allowed = false) {
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
      if (len > 0 && n_dst == 0 && !unsent_allowed) fail("plan_query: seq_len", index_str(r, j), " = ", len, " but dispatch", index_str(r, j), " has no destination");
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

/// Gives `m` (global metadata or one rank's slice) a copy mask and its
/// lengths when `wanted`, keeping their storage, else neither; returns `wanted`.
template <class M>
bool keep_copy_mask(M& m, bool wanted) {
  if (!wanted) {
    m.seq_recv_mask.reset();
    m.recv_seq_lens.reset();
    return false;
  }
  if (!m.seq_recv_mask) m.seq_recv_mask.emplace();
  if (!m.recv_seq_lens) m.recv_seq_lens.emplace();
  return true;
}

/// 1 where a copy exists: which slabs of the replica buffer come back.
inline void copy_mask(const Tensor<std::int64_t>& dst_rank, std::optional<Tensor<std::int64_t>>& mask) {
  if (!mask) mask.emplace();
  if (mask->shape() != dst_rank.shape()) *mask = output_tensor<std::int64_t>(dst_rank.shape(), 0);
  for (std::size_t i = 0; i < dst_rank.numel(); ++i) mask->flat()[i] = dst_rank.flat()[i] >= 0 ? 1 : 0;
}

/// plan_query into `fwd` and `rev`, reusing their storage; with
/// `unsent_allowed` a shard may have no destination (it stays home).
inline void plan_query_into(const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& dispatch, Metadata& fwd, Metadata& rev,
                            const PlanLimits& limits = {}, bool unsent_allowed = false) {
  const QueryInput in = check_query_shapes(seq_len, dispatch);
  const std::vector<std::int64_t> entries_to = check_query_entries(in, unsent_allowed);
  const auto M = static_cast<std::size_t>(*std::max_element(entries_to.begin(), entries_to.end()));
  check_footprint(limits, footprint::query(in.W, in.S, in.C, M), "plan_query",
                  concat("a plan of world_size = ", in.W, ", ", in.S, " shards a rank, ", in.C, " copies, ", M, " entries at one rank"));
  const RowPrefix prefix = row_prefix(seq_len, in.C, "plan_query");
  prepare_query(in, M, fwd, rev);
  fill_query(in, prefix, fwd, rev);
  keep_copy_mask(fwd, false);
  if (!keep_copy_mask(rev, in.copies)) return;
  copy_mask(dispatch, rev.seq_recv_mask);
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
    if (!plan.documents[i].slices.empty()) fail("to_rank_plan: documents[", i, "] has slices (section 2e); only the documents form holds them");
    if (plan.documents[i].head_parallel) fail("to_rank_plan: documents[", i, "] is head-parallel (section 2f); only the documents form holds it");
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

/// Document i of rank r of a per-rank plan: a destination per shard, in
/// [0, world_size), and positive lengths; `who` starts the messages.
inline void check_rank_document(const Document& doc, std::size_t r, std::size_t i, std::int64_t world_size, const char* who) {
  if (doc.dst.size() != doc.shard_len.size()) {
    fail(who, ": ranks[", r, "].docs[", i, "].dst has ", doc.dst.size(), " entries but shard_len has ", doc.shard_len.size());
  }
  for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
    if (doc.shard_len[s] <= 0) fail(who, ": ranks[", r, "].docs[", i, "].shard_len[", s, "] = ", doc.shard_len[s], " must be positive");
    if (doc.dst[s] < 0 || doc.dst[s] >= world_size) fail(who, ": ranks[", r, "].docs[", i, "].dst[", s, "] = ", doc.dst[s], " is outside [0, ", world_size, ")");
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
      if (docs[i].shard_len.empty()) fail("plan_qkv: ranks[", r, "].docs[", i, "].shard_len is empty (a document has at least one shard)");
      check_rank_document(docs[i], r, i, plan.world_size, "plan_qkv");
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

// ---- section 2e: documents with slices

/// Where one slice meets one query shard of its document: KV shards first ..
/// last (inclusive) each hold a pair of the slice's rectangle, cut to the two
/// shards, inside the slice's band, and no other KV shard does.
struct SlicePiece {
  std::size_t query = 0;
  std::size_t slice = 0;
  std::size_t first = 0, last = 0;
};

/// The shards of a document (n of them, starting at start[k]) that hold
/// positions [from, to), 0 <= from < to <= its length: [first, end).
inline std::pair<std::size_t, std::size_t> shards_holding(const std::int64_t* start, std::size_t n, std::int64_t from, std::int64_t to) {
  if (n <= 16) {  // a few shards: counting without branches beats a binary search
    std::size_t at_or_before = 0, before = 0;
    for (std::size_t k = 0; k < n; ++k) {
      at_or_before += start[k] <= from ? 1 : 0;
      before += start[k] < to ? 1 : 0;
    }
    return {at_or_before - 1, before};  // start[0] = 0 <= from
  }
  const auto first = static_cast<std::size_t>(std::upper_bound(start, start + n, from) - start) - 1;  // start[0] = 0 <= from
  const auto end = static_cast<std::size_t>(std::lower_bound(start, start + n, to) - start);
  return {first, end};
}

/// Section 2e's needed sets of one document with slices, its shards numbered
/// from 0 (shard k at start[k], len[k] tokens): the KV shards each query shard
/// needs, where each starts in its KV group, and each KV shard's users. The
/// vectors keep their memory from one document to the next.
class SliceNeeds {
 public:
  std::vector<SlicePiece> pieces;        ///< grouped by query shard, slice order inside a group
  std::vector<std::size_t> piece_begin;  ///< [n + 1] into pieces
  std::vector<std::size_t> need_begin;   ///< [n + 1] into needs
  std::vector<std::size_t> needs;        ///< each query shard's needed set, increasing
  std::vector<std::int64_t> columns;     ///< col_i(k) of each needs entry
  std::vector<std::size_t> copies;       ///< of each needs entry: the query shard's place among k's users
  std::vector<std::size_t> user_begin;   ///< [n + 1] into users
  std::vector<std::size_t> users;        ///< each KV shard's users, increasing
  std::vector<std::size_t> user_need;    ///< of each users entry: its needs entry (its column)

  /// Both steps below.
  void compute(std::span<const AttentionSlice> slices, const std::int64_t* start, const std::int64_t* len, std::size_t n) {
    find(slices, start, len, n);
    link(len, n);
  }

  /// The pieces of every slice, grouped by query shard.
  void find(std::span<const AttentionSlice> slices, const std::int64_t* start, const std::int64_t* len, std::size_t n) {
    found_.clear();
    for (std::size_t s = 0; s < slices.size(); ++s) find_pieces(slices[s], s, start, len, n);
    group_by_query(n);
  }

  /// The entries the pieces give: one per piece and KV shard.
  std::uint64_t entry_count() const noexcept {
    std::uint64_t total = 0;
    for (const SlicePiece& p : pieces) total += p.last - p.first + 1;
    return total;
  }

  /// The needed sets (the union of each query shard's pieces), their
  /// columns, and the users of each KV shard; after find().
  void link(const std::int64_t* len, std::size_t n) {
    union_needs(len, n);
    list_users(n);
  }

  /// (the most users of one KV shard, the first shard with that many).
  std::pair<std::size_t, std::size_t> most_users() const noexcept {
    std::pair<std::size_t, std::size_t> best{0, 0};
    for (std::size_t k = 0; k + 1 < user_begin.size(); ++k) {
      if (user_begin[k + 1] - user_begin[k] > best.first) best = {user_begin[k + 1] - user_begin[k], k};
    }
    return best;
  }

 private:
  std::vector<SlicePiece> found_;                          // pieces in slice order
  std::vector<std::pair<std::size_t, std::size_t>> runs_;  // one query shard's KV ranges
  std::vector<std::size_t> fill_;

  void find_pieces(const AttentionSlice& slice, std::size_t s, const std::int64_t* start, const std::int64_t* len, std::size_t n) {
    const Band band = slice.band();
    const auto [q_first, q_end] = shards_holding(start, n, slice.q_begin, slice.q_end);
    const auto [k_first, k_end] = shards_holding(start, n, slice.k_begin, slice.k_end);
    for (std::size_t i = q_first; i < q_end; ++i) {
      const std::int64_t p0 = std::max(slice.q_begin, start[i]), p1 = std::min(slice.q_end, start[i] + len[i]);
      // band_meets's two bounds, each monotone in k: the last key minus the
      // first query reaches lo from some shard on, and the first key minus
      // the last query stays within hi up to some shard.
      const std::size_t first = first_where(k_first, k_end, [&](std::size_t k) {
        return std::min(slice.k_end, start[k] + len[k]) - 1 - p0 >= band.lo;
      });
      const std::size_t end = first_where(first, k_end, [&](std::size_t k) { return std::max(slice.k_begin, start[k]) - (p1 - 1) > band.hi; });
      if (first < end) found_.push_back({i, s, first, end - 1});
    }
  }

  /// A stable counting sort by query shard: each group keeps slice order.
  void group_by_query(std::size_t n) {
    piece_begin.assign(n + 1, 0);
    for (const SlicePiece& p : found_) ++piece_begin[p.query + 1];
    for (std::size_t i = 0; i < n; ++i) piece_begin[i + 1] += piece_begin[i];
    pieces.resize(found_.size());
    fill_.assign(piece_begin.begin(), piece_begin.end() - 1);
    for (const SlicePiece& p : found_) pieces[fill_[p.query]++] = p;
  }

  void union_needs(const std::int64_t* len, std::size_t n) {
    need_begin.assign(1, 0);
    needs.clear();
    columns.clear();
    for (std::size_t i = 0; i < n; ++i) {
      runs_.clear();
      for (std::size_t p = piece_begin[i]; p < piece_begin[i + 1]; ++p) runs_.emplace_back(pieces[p].first, pieces[p].last);
      std::sort(runs_.begin(), runs_.end());
      std::int64_t column = 0;  // within the document's length: each shard is listed once
      std::size_t next = 0;     // shards below `next` are listed already
      for (const auto& [first, last] : runs_) {
        for (std::size_t k = std::max(first, next); k <= last; ++k) {
          needs.push_back(k);
          columns.push_back(column);
          column += len[k];
        }
        next = std::max(next, last + 1);
      }
      need_begin.push_back(needs.size());
    }
  }

  /// Users in increasing query shard order: copy c of KV shard k goes to its c-th user.
  void list_users(std::size_t n) {
    user_begin.assign(n + 1, 0);
    for (std::size_t k : needs) ++user_begin[k + 1];
    for (std::size_t k = 0; k < n; ++k) user_begin[k + 1] += user_begin[k];
    users.resize(needs.size());
    user_need.resize(needs.size());
    copies.resize(needs.size());
    fill_.assign(user_begin.begin(), user_begin.end() - 1);
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t p = need_begin[i]; p < need_begin[i + 1]; ++p) {
        const std::size_t slot = fill_[needs[p]]++;
        users[slot] = i;
        user_need[slot] = p;
        copies[p] = slot - user_begin[needs[p]];
      }
    }
  }
};

/// Section 2e's entry of `slice` for the query shard at document positions
/// [a_i, a_i + len_i) and the KV shard at [a_k, a_k + len_k), which starts at
/// `column` of the query shard's KV group: the slice's rectangle cut to both
/// shards, moved into the query shard's rows and the group's columns, its
/// band shifted by as much (s = column - a_k + a_i). Only where they meet.
inline AttentionEntry slice_entry(const AttentionSlice& slice, std::int64_t a_i, std::int64_t len_i, std::int64_t a_k, std::int64_t len_k,
                                  std::int64_t column) {
  const std::int64_t p0 = std::max(slice.q_begin, a_i), p1 = std::min(slice.q_end, a_i + len_i);
  const std::int64_t k0 = std::max(slice.k_begin, a_k), k1 = std::min(slice.k_end, a_k + len_k);
  std::int64_t shift = 0;
  if (__builtin_add_overflow(column - a_k, a_i, &shift)) fail("plan_qkv: an attention entry's band shift overflows 64 bits");
  AttentionEntry e;
  e.q_start = p0 - a_i;
  e.q_len = p1 - p0;
  e.kv_start = k0 - a_k + column;
  e.kv_len = k1 - k0;
  e.band = slice.band().shifted(shift);
  return e;
}

/// The one entry of a query shard of a document without slices: its whole
/// KV group under the plan's mask, bottom-right aligned (the group ends where
/// the query shard ends), so the mask's band shifted by lk - lq.
inline AttentionEntry whole_group_entry(const AttentionMask& mask, std::int64_t lq, std::int64_t lk) {
  AttentionEntry e;
  e.q_len = lq;
  e.kv_len = lk;
  e.band = mask.band().shifted(lk - lq);
  return e;
}

/// Whether any document of the plan has slices.
inline bool has_slices(const QkvDocumentsPlan& plan) {
  return std::any_of(plan.documents.begin(), plan.documents.end(), [](const PackedDocument& d) { return !d.slices.empty(); });
}

/// The sizes of a plan's slice tables, counted while validating.
struct SliceSizes {
  std::uint64_t slices = 0;   ///< slices in all
  std::uint64_t pieces = 0;   ///< (slice, query shard) pieces, at most
  std::uint64_t entries = 0;  ///< entries of the documents with slices: exact, or at most where that bound fits the limits
};

/// Section 2e's rules for one slice of documents[d] on its own: a type, a
/// rectangle inside the document's `length` tokens, a pair inside its band.
inline void check_slice(const AttentionSlice& s, std::size_t d, std::size_t i, std::int64_t length) {
  const auto type = static_cast<int>(s.type);
  if (type < static_cast<int>(SliceType::full) || type > static_cast<int>(SliceType::bi_causal)) {
    fail("plan_qkv: documents[", d, "].slices[", i, "].type = ", type, " is not a slice type (full, causal, inv_causal or bi_causal)");
  }
  const auto check_range = [&](const char* key, std::int64_t a, std::int64_t b) {
    if (0 <= a && a < b && b <= length) return;
    fail("plan_qkv: documents[", d, "].slices[", i, "].", key, " = [", a, ", ", b, "] is empty or outside the document (0 <= ", key,
         "[0] < ", key, "[1] <= ", length, ", its length)");
  };
  check_range("q", s.q_begin, s.q_end);
  check_range("k", s.k_begin, s.k_end);
  if (!slice_has_pair(s)) {
    fail("plan_qkv: documents[", d, "].slices[", i, "] (", to_string(s.type), ", q [", s.q_begin, ", ", s.q_end, "], k [", s.k_begin, ", ",
         s.k_end, "]) has no (query, key) pair inside its band: key - query in ", to_string(s.band()));
  }
}

/// documents[d].slices[a] and [b] (a < b) share a pair: the error naming both and one such pair.
[[noreturn]] inline void fail_shared_pair(const std::vector<AttentionSlice>& slices, std::size_t d, std::size_t a, std::size_t b) {
  const AttentionSlice &x = slices[a], &y = slices[b];
  const auto [p, t] = first_pair(std::max(x.q_begin, y.q_begin), std::min(x.q_end, y.q_end), std::max(x.k_begin, y.k_begin),
                                 x.band().intersect(y.band()));
  fail("plan_qkv: documents[", d, "].slices[", a, "] and documents[", d, "].slices[", b, "] share the pair (query ", p, ", key ", t,
       "); each allowed pair belongs to exactly one slice");
}

/// Scratch memory of slice validation, kept from one document to the next.
struct SliceCheckScratch {
  std::vector<std::int64_t> start, len;    // the current document's shard starts and lengths
  std::vector<std::size_t> order, active;  // check_disjoint_slices's sweep
  SliceNeeds needs;
};

/// No two slices of documents[d] share a pair. A sweep over the slices by
/// first query compares each one only with those whose query ranges reach
/// it; that work is bounded by limits.max_bytes / 16 comparisons.
inline void check_disjoint_slices(const std::vector<AttentionSlice>& slices, std::size_t d, const PlanLimits& limits, SliceCheckScratch& scratch) {
  std::vector<std::size_t>& order = scratch.order;
  std::vector<std::size_t>& active = scratch.active;  // slices whose queries reach the current one's first query
  order.resize(slices.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  const auto by_first_query = [&](std::size_t a, std::size_t b) { return slices[a].q_begin < slices[b].q_begin; };
  if (!std::is_sorted(order.begin(), order.end(), by_first_query)) std::stable_sort(order.begin(), order.end(), by_first_query);
  const std::uint64_t budget = limits.max_bytes / 16;
  std::uint64_t compared = 0;
  active.clear();
  for (std::size_t s : order) {
    const AttentionSlice& slice = slices[s];
    std::erase_if(active, [&](std::size_t o) { return slices[o].q_end <= slice.q_begin; });  // sorted by q_begin: done for good
    compared += active.size();
    if (compared > budget) {
      fail("plan_qkv: documents[", d, "].slices: checking its ", slices.size(), " slices for shared pairs takes more than ", budget,
           " comparisons of slices whose query ranges overlap (PlanLimits::max_bytes / 16)");
    }
    for (std::size_t o : active) {
      if (slices_share_pair(slices[o], slice)) fail_shared_pair(slices, d, std::min(o, s), std::max(o, s));
    }
    active.push_back(s);
  }
}

inline void check_disjoint_slices(const std::vector<AttentionSlice>& slices, std::size_t d, const PlanLimits& limits) {
  SliceCheckScratch scratch;
  check_disjoint_slices(slices, d, limits, scratch);
}

/// The (slice, query shard) pieces a document's slices can give at most
/// (each slice's query range in shards), and the attention entries (each
/// piece's whole key range in shards). O(slices x log shards).
inline SliceSizes slice_bounds(const std::vector<AttentionSlice>& slices, const std::vector<std::int64_t>& start) {
  SliceSizes total;
  for (const AttentionSlice& s : slices) {
    const auto [q_first, q_end] = shards_holding(start.data(), start.size(), s.q_begin, s.q_end);
    const auto [k_first, k_end] = shards_holding(start.data(), start.size(), s.k_begin, s.k_end);
    total.pieces += q_end - q_first;
    total.entries = sat_add(total.entries, sat_mul(q_end - q_first, k_end - k_first));
  }
  return total;
}

/// A document's shard starts and lengths into `start` and `len`; returns its length, checked.
inline std::int64_t document_shards(const PackedDocument& doc, std::vector<std::int64_t>& start, std::vector<std::int64_t>& len) {
  start.clear();
  len.clear();
  std::int64_t length = 0;
  for (const DocumentShard& s : doc.shards) {
    start.push_back(length);
    len.push_back(s.len);
    length = add_tokens(length, s.len, "plan_qkv");
  }
  return length;
}

/// Whether the slice tables of documents[0..d] (`sizes`) fit `limits`; when
/// `exact`, a table that does not is refused (invalid_input naming the sizes).
inline bool slice_tables_fit(const SliceSizes& sizes, std::size_t d, const PlanLimits& limits, bool exact) {
  const PlanFootprint f = footprint::slice_tables(sizes.slices, sizes.pieces, sizes.entries);
  if (!exact) return footprint_bytes(f, limits) <= limits.max_bytes;
  check_footprint(limits, f, "plan_qkv", [&] {
    return concat("the slices of documents[0..", d, "] (", sizes.slices, " slices, ", sizes.pieces, " (slice, query shard) pieces, ",
                  sizes.entries, " attention entries)");
  });
  return true;
}

/// Validates documents[d]'s slices and counts its slice tables into
/// `sizes`: exactly when `exact` (refusing them beyond `limits` before they
/// are built), else with each entry count bounded from above, without the
/// needed sets. Returns whether the tables fit (always true when `exact`).
inline bool check_document_slices(const PackedDocument& doc, std::size_t d, const PlanLimits& limits, SliceSizes& sizes,
                                  SliceCheckScratch& scratch, bool exact) {
  const std::int64_t length = document_shards(doc, scratch.start, scratch.len);
  for (std::size_t i = 0; i < doc.slices.size(); ++i) check_slice(doc.slices[i], d, i, length);
  check_disjoint_slices(doc.slices, d, limits, scratch);
  const SliceSizes bound = slice_bounds(doc.slices, scratch.start);
  sizes.slices = sat_add(sizes.slices, doc.slices.size());
  sizes.pieces = sat_add(sizes.pieces, bound.pieces);
  if (!slice_tables_fit(sizes, d, limits, exact)) return false;
  if (exact) {
    scratch.needs.find(doc.slices, scratch.start.data(), scratch.len.data(), scratch.len.size());
    sizes.entries = sat_add(sizes.entries, scratch.needs.entry_count());
  } else {
    sizes.entries = sat_add(sizes.entries, bound.entries);
  }
  return slice_tables_fit(sizes, d, limits, exact);
}

/// Asks the cache for a document's shards and slices ahead of their checks:
/// each document's lie apart in memory, and a plan's slices rarely fit in cache.
inline void prefetch_document(const PackedDocument& doc) {
  if (doc.slices.empty()) return;  // nothing of it is read here
  const auto ahead = [](const void* data, std::size_t bytes) {
    for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(data) + b);
  };
  ahead(doc.shards.data(), doc.shards.size() * sizeof(DocumentShard));
  ahead(doc.slices.data(), doc.slices.size() * sizeof(AttentionSlice));
}

/// Validates the slices of every document and counts their tables. Bounds
/// on the entry counts settle the footprint without any needed set when
/// they fit; else the exact counts decide, as planning would build them.
inline SliceSizes check_plan_slices(const QkvDocumentsPlan& plan, const PlanLimits& limits, SliceCheckScratch& scratch) {
  for (const bool exact : {false, true}) {
    SliceSizes sizes;
    bool fit = true;
    for (std::size_t i = 0; i < plan.documents.size() && fit; ++i) {
      if (i + 4 < plan.documents.size()) prefetch_document(plan.documents[i + 4]);
      if (!plan.documents[i].slices.empty()) fit = check_document_slices(plan.documents[i], i, limits, sizes, scratch, exact);
    }
    if (fit) return sizes;
  }
  return {};  // the exact pass fits or throws
}

/// The KV shard of a document with slices (validated) with the most users,
/// as (users, shard): its needed sets, computed in `scratch`.
inline std::pair<std::size_t, std::size_t> slice_most_users(const PackedDocument& doc, SliceCheckScratch& scratch) {
  (void)document_shards(doc, scratch.start, scratch.len);
  scratch.needs.compute(doc.slices, scratch.start.data(), scratch.len.data(), scratch.len.size());
  return scratch.needs.most_users();
}

/// Section 2f's u of a documents-form plan, checked: head_parallel_degree,
/// or W when it is 0.
inline std::int64_t head_parallel_degree(const QkvDocumentsPlan& plan) {
  const std::int64_t W = plan.world_size, u = plan.head_parallel_degree == 0 ? W : plan.head_parallel_degree;
  if (u < 1 || u > W || W % u != 0) {
    fail("plan_qkv: head_parallel_degree = ", plan.head_parallel_degree, " must divide world_size = ", W,
         " (0 means world_size; the groups are that many consecutive ranks)");
  }
  return u;
}

/// Whether any document of the plan is head-parallel (section 2f).
inline bool has_head_parallel(const QkvDocumentsPlan& plan) {
  return std::any_of(plan.documents.begin(), plan.documents.end(), [](const PackedDocument& d) { return d.head_parallel; });
}

/// What validation learns of a documents-form plan: C and the sizes of its
/// slice tables.
struct DocumentsCheck {
  std::size_t C = 1;
  SliceSizes slices;
};

/// Validates a documents-form plan (its slices' work bounded by `limits`);
/// returns C and the slice tables' sizes.
inline DocumentsCheck check_documents_plan_sizes(const QkvDocumentsPlan& plan, const PlanLimits& limits) {
  if (plan.world_size <= 0) fail("plan_qkv: world_size = ", plan.world_size, " must be at least 1");
  const std::int64_t W = plan.world_size;
  const std::int64_t u = head_parallel_degree(plan);
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty()) fail("plan_qkv: documents[", i, "].shards is empty (a document has at least one shard)");
    const bool hp = plan.documents[i].head_parallel;  // its dst are ignored (section 2f)
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const DocumentShard& s = shards[k];
      if (s.rank < 0 || s.rank >= W) fail("plan_qkv: documents[", i, "].shards[", k, "].rank = ", s.rank, " is outside [0, ", W, ")");
      if (s.len <= 0) fail("plan_qkv: documents[", i, "].shards[", k, "].len = ", s.len, " must be positive");
      if (!hp && (s.dst < 0 || s.dst >= W)) fail("plan_qkv: documents[", i, "].shards[", k, "].dst = ", s.dst, " is outside [0, ", W, ")");
      if (hp && s.rank / u != shards.front().rank / u) {
        fail("plan_qkv: documents[", i, "] is head-parallel but its shards live on ranks ", shards.front().rank, " (shards[0]) and ", s.rank,
             " (shards[", k, "]), in different groups of head_parallel_degree = ", u, " ranks (a head-parallel document lies within one group)");
      }
    }
  }
  check_mask(plan.mask);
  DocumentsCheck out;
  SliceCheckScratch scratch;
  out.slices = check_plan_slices(plan, limits, scratch);
  DocumentRanges ranges;
  std::vector<std::int64_t>& len = scratch.len;
  const auto users_of = [&](std::size_t i) -> std::pair<std::size_t, std::size_t> {
    const PackedDocument& d = plan.documents[i];
    if (d.head_parallel) return {0, 0};  // it sends no KV copies: C counts dispatched documents only
    if (!d.slices.empty()) return slice_most_users(d, scratch);
    if (plan.mask.type != MaskType::sliding_window) return {d.shards.size(), 0};  // every shard needs shard 0
    len.clear();
    for (const DocumentShard& s : d.shards) len.push_back(s.len);
    return most_users(plan.mask, len.data(), len.size(), ranges);
  };
  // A KV shard has at most one user per shard of its document: a document
  // with no more shards than the most users so far (or than C) is skipped.
  const auto may_exceed = [&](std::size_t i, std::size_t users) { return !plan.documents[i].head_parallel && plan.documents[i].shards.size() > users; };
  std::size_t most = 0;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    if (may_exceed(i, most)) most = std::max(most, users_of(i).first);
  }
  const std::size_t C = copy_dimension(plan.max_cp_degree, most);
  for (std::size_t i = 0; i < plan.documents.size() && C < most; ++i) {
    if (!may_exceed(i, C)) continue;
    const auto [users, k] = users_of(i);
    if (users <= C) continue;
    if (!plan.documents[i].slices.empty()) {
      fail("plan_qkv: documents[", i, "].shards[", k, "] is needed by ", users, " query shards (by the document's slices), more than max_cp_degree = ", C);
    }
    fail("plan_qkv: documents[", i, "].shards has ", users, " shards", mask_detail(plan.mask, "documents[", i, "].shards[", k, "]"),
         ", more than max_cp_degree = ", C);
  }
  out.C = C;
  return out;
}

/// Validates a documents-form plan; returns C.
inline std::size_t check_documents_plan(const QkvDocumentsPlan& plan, const PlanLimits& limits = {}) {
  return check_documents_plan_sizes(plan, limits).C;
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
  // Section 2e, kept only when some document has slices (has_slices, set
  // before the first add()), as ids, for the shards of documents with
  // slices (the lists of other shards are empty: the ranges above hold):
  // query shard q needs need_kv[need_begin[q] .. need_begin[q + 1]),
  // increasing, each starting at need_column in q's KV group, q being copy
  // need_copy of it; KV shard k's users are user_query[user_begin[k] ..
  // user_begin[k + 1]), increasing, k starting at user_column in each one's
  // group; q's entries come from pieces[piece_begin[q] .. piece_begin[q + 1]).
  // A table built for one rank's share may leave the lists of a document
  // with slices empty where that share reads none of them (see
  // shard_table's `sets`).
  bool has_slices = false;
  std::vector<std::uint8_t> doc_sliced;                // [D]
  std::vector<AttentionSlice> slices;                  // every document's, back to back
  std::vector<std::size_t> need_begin{0}, need_kv, need_copy;
  std::vector<std::int64_t> need_column;
  std::vector<std::size_t> user_begin{0}, user_query;
  std::vector<std::int64_t> user_column;
  std::vector<std::size_t> piece_begin{0};
  std::vector<SlicePiece> pieces;                      // query and KV shards as ids, slice an index into `slices`
  std::size_t entry_total = 0;                         // attn.entries of every query shard
  SliceNeeds slice_needs;                              // one document's, relative to its first id
  // Section 2f, kept only when some document is head-parallel (set before
  // the first add()): such a document's shards have no destination (dst
  // -1), need no KV shards and have no users; doc_hp marks its documents.
  bool has_head_parallel = false;
  std::vector<std::uint8_t> doc_hp;                    // [D]

  std::size_t size() const noexcept { return len.size(); }
  bool causal() const noexcept { return mask.type == MaskType::causal; }
  std::size_t lo_of(std::size_t q) const noexcept { return causal() ? doc_begin[doc[q]] : lo[q]; }
  std::size_t hi_of(std::size_t q) const noexcept { return causal() ? q : hi[q]; }
  std::size_t first_of(std::size_t k) const noexcept { return causal() ? k : first[k]; }
  std::size_t end_of(std::size_t k) const noexcept { return causal() ? doc_begin[doc[k] + 1] : end[k]; }
  /// Whether shard id belongs to a document with slices (section 2e).
  bool sliced(std::size_t id) const noexcept { return has_slices && doc_sliced[doc[id]] != 0; }
  /// Whether shard id belongs to a head-parallel document (section 2f).
  bool head_parallel(std::size_t id) const noexcept { return has_head_parallel && doc_hp[doc[id]] != 0; }
  std::size_t users(std::size_t id) const noexcept {
    if (head_parallel(id)) return 0;
    return sliced(id) ? user_begin[id + 1] - user_begin[id] : end_of(id) - first_of(id);
  }
  /// The KV shards query shard q needs.
  std::size_t needed_count(std::size_t q) const noexcept {
    if (head_parallel(q)) return 0;
    return sliced(q) ? need_begin[q + 1] - need_begin[q] : hi_of(q) - lo_of(q) + 1;
  }
  /// Tokens of the KV group of query shard q: the KV shards it needs, back to back.
  std::int64_t group_tokens(std::size_t q) const {
    if (sliced(q)) {
      const std::size_t last = need_begin[q + 1];
      return last == need_begin[q] ? 0 : need_column[last - 1] + len[need_kv[last - 1]];  // within the document, checked
    }
    const std::size_t h = hi_of(q);
    return add_tokens(context[h], len[h], "plan_qkv") - context[lo_of(q)];
  }
  /// Where KV shard kv sits inside the KV group of query shard q (a document without slices).
  std::int64_t group_offset(std::size_t q, std::size_t kv) const noexcept { return context[kv] - context[lo_of(q)]; }

  /// f(kv, column, copy) for each KV shard query shard q needs, in
  /// increasing order: where it starts in q's group, and q's place among its users.
  template <class F>
  void each_needed(std::size_t q, F&& f) const {
    if (head_parallel(q)) return;
    if (sliced(q)) {
      for (std::size_t p = need_begin[q]; p < need_begin[q + 1]; ++p) f(need_kv[p], need_column[p], need_copy[p]);
      return;
    }
    for (std::size_t kv = lo_of(q); kv <= hi_of(q); ++kv) f(kv, group_offset(q, kv), q - first_of(kv));
  }

  /// f(copy, q, column) for each user q of KV shard k, in increasing order:
  /// copy c goes to the c-th user, whose group holds k at `column`.
  template <class F>
  void each_user(std::size_t k, F&& f) const {
    if (head_parallel(k)) return;
    if (sliced(k)) {
      for (std::size_t p = user_begin[k]; p < user_begin[k + 1]; ++p) f(p - user_begin[k], user_query[p], user_column[p]);
      return;
    }
    for (std::size_t q = first_of(k); q < end_of(k); ++q) f(q - first_of(k), q, group_offset(q, k));
  }

  /// Query shard q's attn.entries (section 2e), appended to `out`.
  void append_entries(std::size_t q, std::vector<AttentionEntry>& out) const {
    if (!sliced(q)) {
      out.push_back(whole_group_entry(mask, len[q], group_tokens(q)));
      return;
    }
    const std::size_t* needed = need_kv.data();
    for (std::size_t p = piece_begin[q]; p < piece_begin[q + 1]; ++p) {
      const SlicePiece& piece = pieces[p];
      // A piece's KV shards are consecutive in q's needed set, which is the union of its pieces.
      auto at = static_cast<std::size_t>(std::lower_bound(needed + need_begin[q], needed + need_begin[q + 1], piece.first) - needed);
      for (std::size_t kv = piece.first; kv <= piece.last; ++kv, ++at) {
        out.push_back(slice_entry(slices[piece.slice], context[q], len[q], context[kv], len[kv], need_column[at]));
      }
    }
  }

  /// The entries of query shard q, counted without building them.
  std::size_t entry_count(std::size_t q) const noexcept {
    if (!sliced(q)) return 1;
    std::size_t n = 0;
    for (std::size_t p = piece_begin[q]; p < piece_begin[q + 1]; ++p) n += pieces[p].last - pieces[p].first + 1;
    return n;
  }

  /// Empty, keeping the memory of every field (a table refilled each step).
  void clear() {
    for (auto* v : {&len, &dst, &context}) v->clear();
    for (auto* v : {&home, &local, &doc, &by_rank, &lo, &hi, &first, &end}) v->clear();
    doc_begin.assign(1, 0);
    W = S = 0;
    C = 1;
    has_slices = false;
    doc_sliced.clear();
    slices.clear();
    for (auto* v : {&need_kv, &need_copy, &user_query}) v->clear();
    for (auto* v : {&need_begin, &user_begin, &piece_begin}) v->assign(1, 0);
    need_column.clear();
    user_column.clear();
    pieces.clear();
    entry_total = 0;
    has_head_parallel = false;
    doc_hp.clear();
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
  /// Closes the current document: its needed ranges and users, as ids, or
  /// with `doc_slices` (a document with slices, section 2e) its needed sets,
  /// left empty unless `with_sets`.
  void end_document(std::span<const AttentionSlice> doc_slices = {}, bool hp = false, bool with_sets = true) {
    const std::size_t base = doc_begin.back(), n = len.size() - base;
    if (has_head_parallel) doc_hp.push_back(hp ? 1 : 0);
    if (has_slices) add_sets(base, n, doc_slices, with_sets);
    if (!causal()) add_ranges(base, n, !doc_slices.empty());
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

 private:
  /// Section 2d's ranges of the document at ids base .. base + n; a document
  /// with slices keeps its sets instead, and these rows only hold its place.
  void add_ranges(std::size_t base, std::size_t n, bool has_sets) {
    if (has_sets) {
      for (auto* v : {&lo, &hi, &first, &end}) v->insert(v->end(), n, base);
      return;
    }
    ranges.compute(mask, len.data() + base, n);
    for (std::size_t k = 0; k < n; ++k) {
      lo.push_back(base + ranges.lo[k]);
      hi.push_back(base + ranges.hi[k]);
      first.push_back(base + ranges.first[k]);
      end.push_back(base + ranges.end[k]);
    }
  }

  /// Section 2e's lists of the document at ids base .. base + n: its needed
  /// sets, users and pieces, as ids; empty lists (and one entry a query
  /// shard) for a document without slices, and empty lists for one whose
  /// sets are not wanted.
  void add_sets(std::size_t base, std::size_t n, std::span<const AttentionSlice> doc_slices, bool wanted) {
    doc_sliced.push_back(doc_slices.empty() ? 0 : 1);
    if (doc_slices.empty() || !wanted) {
      need_begin.insert(need_begin.end(), n, need_kv.size());
      user_begin.insert(user_begin.end(), n, user_query.size());
      piece_begin.insert(piece_begin.end(), n, pieces.size());
      entry_total += doc_slices.empty() ? n : 0;
      return;
    }
    const std::size_t first_slice = slices.size();
    slices.insert(slices.end(), doc_slices.begin(), doc_slices.end());
    SliceNeeds& s = slice_needs;
    s.compute(doc_slices, context.data() + base, len.data() + base, n);
    for (std::size_t i = 0; i < n; ++i) {  // i: query shard base + i, and KV shard base + i
      for (std::size_t p = s.need_begin[i]; p < s.need_begin[i + 1]; ++p) {
        need_kv.push_back(base + s.needs[p]);
        need_column.push_back(s.columns[p]);
        need_copy.push_back(s.copies[p]);
      }
      need_begin.push_back(need_kv.size());
      for (std::size_t u = s.user_begin[i]; u < s.user_begin[i + 1]; ++u) {
        user_query.push_back(base + s.users[u]);
        user_column.push_back(s.columns[s.user_need[u]]);
      }
      user_begin.push_back(user_query.size());
      for (std::size_t p = s.piece_begin[i]; p < s.piece_begin[i + 1]; ++p) {
        const SlicePiece& piece = s.pieces[p];
        pieces.push_back({base + i, first_slice + piece.slice, base + piece.first, base + piece.last});
        entry_total += piece.last - piece.first + 1;
      }
      piece_begin.push_back(pieces.size());
    }
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

/// The shard table of a documents-form plan, written into `t` (its memory
/// reused). With `sets` ([D]), only documents i with sets[i] != 0 get their
/// section 2e lists (one rank's share reads no others); empty: all do.
inline void shard_table(const QkvDocumentsPlan& plan, std::size_t C, ShardTable& t, std::span<const std::uint8_t> sets = {}) {
  t.clear();
  t.mask = plan.mask;
  // Head-parallel documents are planned in section 2f, not here: their slices do not count.
  t.has_slices = std::any_of(plan.documents.begin(), plan.documents.end(), [](const PackedDocument& d) { return !d.slices.empty() && !d.head_parallel; });
  t.has_head_parallel = has_head_parallel(plan);
  std::size_t n = 0;
  for (const PackedDocument& d : plan.documents) n += d.shards.size();
  t.reserve(n);
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const PackedDocument& d = plan.documents[i];
    for (const DocumentShard& s : d.shards) t.add(s.rank, s.len, d.head_parallel ? -1 : s.dst);
    t.end_document(d.head_parallel ? std::span<const AttentionSlice>{} : std::span<const AttentionSlice>{d.slices}, d.head_parallel,
                   sets.empty() || sets[i] != 0);
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
  for (std::size_t id : t.by_rank)
    if (t.dst[id] >= 0) ++g.dest_begin[static_cast<std::size_t>(t.dst[id]) + 1];  // a head-parallel shard (section 2f) has no KV group
  for (std::size_t d = 0; d < t.W; ++d) g.dest_begin[d + 1] += g.dest_begin[d];
  std::vector<std::size_t> next(g.dest_begin.begin(), g.dest_begin.end() - 1);
  g.arrivals.resize(g.dest_begin[t.W]);
  for (std::size_t id : t.by_rank)
    if (t.dst[id] >= 0) g.arrivals[next[static_cast<std::size_t>(t.dst[id])]++] = id;
  for (std::size_t d = 0; d < t.W; ++d) {
    std::int64_t at = 0;
    std::size_t entries = 0;
    for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
      const std::size_t q = g.arrivals[p];
      g.start[q] = at;
      at = add_tokens(at, t.group_tokens(q), "plan_qkv");  // a group lies within its document, whose total add() checked
      entries += t.needed_count(q);
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
      t.each_needed(g.arrivals[p], [&](std::size_t kv, std::int64_t, std::size_t) {
        row[t.home[kv]] += t.len[kv];
        row[t.W] += t.len[kv];
      });
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
      t.each_user(id, [&](std::size_t, std::size_t q, std::int64_t) {
        row[static_cast<std::size_t>(t.dst[q])] += t.len[id];
        row[t.W] += t.len[id];
      });
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

/// Rank r's kv_fwd destinations and offsets (its j-th shard's copy c at
/// [j * C + c], entries without a copy left as they are): KV shard k of a
/// document goes in one copy per user (query shard that needs it), copy c to
/// the group of its c-th user; a shard nobody needs (section 2e) has no copies.
inline void kv_forward_row(const ShardTable& t, const KvGroups& g, std::size_t r, std::span<std::int64_t> dst, std::span<std::int64_t> offset) {
  for (std::size_t p = t.rank_begin[r]; p < t.rank_begin[r + 1]; ++p) {
    const std::size_t row = (p - t.rank_begin[r]) * t.C;
    t.each_user(t.by_rank[p], [&](std::size_t c, std::size_t q, std::int64_t column) {
      dst[row + c] = t.dst[q];
      offset[row + c] = g.start[q] + column;
    });
  }
}

/// kv_fwd, rank by rank (kv_forward_row). Counts follow the bytes: they are
/// charged to the KV shard's home rank.
inline void kv_forward(const ShardTable& t, const KvGroups& g, const Tensor<std::int64_t>& seq_len, const Tensor<std::int64_t>& num_seqs,
                       Metadata& fwd) {
  const std::size_t W = t.W, S = t.S, C = t.C;
  fwd.world_size = static_cast<std::int64_t>(W);
  reuse_output<std::int64_t>(fwd.dst_rank, {W, S, C}, -1);
  reuse_output<std::int64_t>(fwd.dst_offset, {W, S, C}, 0);
  reuse_copy(fwd.seq_len, seq_len);
  reuse_copy(fwd.num_seqs, num_seqs);
  keep_copy_mask(fwd, false);
  for (std::size_t r = 0; r < W; ++r) kv_forward_row(t, g, r, fwd.dst_rank.row(r), fwd.dst_offset.row(r));
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

/// kv_rev: at each destination the KV groups in order, each group's needed
/// shards in order; each entry returns to slab c (its copy) of its home's
/// [C][T] replica buffer.
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
      t.each_needed(g.arrivals[p], [&](std::size_t kv, std::int64_t, std::size_t c) {
        const std::size_t r = t.home[kv];
        rev.dst_rank(d, m) = static_cast<std::int64_t>(r);
        rev.seq_len(d, m) = t.len[kv];
        rev.dst_offset(d, m) = static_cast<std::int64_t>(c) * prefix.totals[r] + start[kv];
        ++m;
      });
    }
    rev.num_seqs(d) = static_cast<std::int64_t>(m);
  }
  kv_return_counts(t, rev.num_recv_tokens);
  rev.num_total_recv_tokens = row_totals(rev.num_recv_tokens);
  keep_copy_mask(rev, true);
  reuse_copy(*rev.recv_seq_lens, seq_len);
}

/// One destination's row of the attention layout, where the global planner
/// and the per-rank one keep it.
struct AttentionRow {
  std::vector<std::int64_t>& seqlens_q;
  std::vector<std::int64_t>& seqlens_kv;
  std::vector<std::int64_t>& cu_seqlens_q;
  std::vector<std::int64_t>& cu_seqlens_kv;
  std::int64_t& max_seqlen_q;
  std::int64_t& max_seqlen_kv;
  std::vector<std::vector<AttentionEntry>>& entries;
};

/// One arriving query shard of `len` tokens, with a KV group of `kv` tokens, appended to a row.
inline void add_arrival(const AttentionRow& row, std::int64_t len, std::int64_t kv) {
  row.seqlens_q.push_back(len);
  row.seqlens_kv.push_back(kv);
  row.cu_seqlens_q.push_back(row.cu_seqlens_q.back() + len);
  row.cu_seqlens_kv.push_back(row.cu_seqlens_kv.back() + kv);
  row.max_seqlen_q = std::max(row.max_seqlen_q, len);
  row.max_seqlen_kv = std::max(row.max_seqlen_kv, kv);
}

/// Empties a row with room for `arrivals` query shards; the vectors' storage is kept.
inline void reset_row(const AttentionRow& row, std::size_t arrivals) {
  for (auto* v : {&row.seqlens_q, &row.seqlens_kv}) {
    v->clear();
    v->reserve(arrivals);
  }
  for (auto* v : {&row.cu_seqlens_q, &row.cu_seqlens_kv}) {
    v->reserve(arrivals + 1);
    v->assign(1, 0);
  }
  row.max_seqlen_q = row.max_seqlen_kv = 0;
  row.entries.clear();
}

/// Destination d's row: per query shard in arrival order, its length and
/// its KV group's, their prefix sums and maxima, and (a plan with slices,
/// section 2e) its entries. The vectors' storage is kept.
inline void attention_row(const ShardTable& t, const KvGroups& g, std::size_t d, AttentionRow row) {
  reset_row(row, g.dest_begin[d + 1] - g.dest_begin[d]);
  for (std::size_t p = g.dest_begin[d]; p < g.dest_begin[d + 1]; ++p) {
    const std::size_t q = g.arrivals[p];
    add_arrival(row, t.len[q], t.group_tokens(q));
    if (t.has_slices) t.append_entries(q, row.entries.emplace_back());
  }
}

/// What a varlen attention kernel needs at each destination.
inline void attention_layout(const ShardTable& t, const KvGroups& g, AttentionLayout& attn) {
  for (auto* v : {&attn.seqlens_q, &attn.seqlens_kv, &attn.cu_seqlens_q, &attn.cu_seqlens_kv}) v->resize(t.W);  // rows keep their memory
  attn.max_seqlen_q.assign(t.W, 0);
  attn.max_seqlen_kv.assign(t.W, 0);
  attn.mask = t.mask;
  attn.entries.clear();
  if (t.has_slices) attn.entries.resize(t.W);
  std::vector<std::vector<AttentionEntry>> no_entries;  // a plan without slices has none
  for (std::size_t d = 0; d < t.W; ++d) {
    attention_row(t, g, d, {attn.seqlens_q[d], attn.seqlens_kv[d], attn.cu_seqlens_q[d], attn.cu_seqlens_kv[d], attn.max_seqlen_q[d],
                            attn.max_seqlen_kv[d], t.has_slices ? attn.entries[d] : no_entries});
  }
}

/// The shard tables of a validated plan of `shards` shards, checked before
/// they are built (its slice tables validation checked).
inline void check_table_footprint(std::size_t W, std::size_t shards, std::size_t C, const PlanLimits& limits) {
  check_footprint(limits, footprint::shard_tables(W, shards), "plan_qkv",
                  concat("a plan of world_size = ", W, ", ", shards, " shards, max_cp_degree = ", C));
}

/// A footprint with another's allocations added.
inline PlanFootprint plus(PlanFootprint a, const PlanFootprint& b) noexcept {
  return {sat_add(a.elements, b.elements), sat_add(a.work_bytes, b.work_bytes)};
}

/// The dense metadata of a shard table, checked before it is allocated.
inline void check_qkv_footprint(const ShardTable& t, const KvGroups& g, const PlanLimits& limits) {
  std::size_t Mq = 0;
  for (std::size_t d = 0; d < t.W; ++d) Mq = std::max(Mq, g.dest_begin[d + 1] - g.dest_begin[d]);
  const std::string entries = t.has_slices ? concat(", ", t.entry_total, " attention entries") : std::string();
  check_footprint(limits, plus(footprint::qkv(t.W, t.size(), t.S, t.C, Mq, g.most_entries), footprint::attention_entries(t.entry_total)),
                  "plan_qkv",
                  concat("a plan of world_size = ", t.W, ", ", t.size(), " shards (", t.S, " on one rank), max_cp_degree = ", t.C, ", ", Mq,
                         " query and ", g.most_entries, " key-value entries at one rank", entries));
}

/// q_rev of a plan with head-parallel shards (section 2f), which stay home
/// and leave gaps in the MLP layout it returns into: like kv_rev, it marks
/// the shards that come back ([W][S][1]) and gives their lengths.
inline void query_return_mask(const Metadata& q_fwd, Metadata& q_rev) {
  const std::size_t W = q_fwd.dst_rank.size(0), S = q_fwd.dst_rank.size(1);
  keep_copy_mask(q_rev, true);
  reuse_output<std::int64_t>(*q_rev.seq_recv_mask, {W, S, 1}, 0);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < S; ++j) (*q_rev.seq_recv_mask)(r, j, 0) = q_fwd.dst_rank(r, j) >= 0 ? 1 : 0;
  reuse_copy(*q_rev.recv_seq_lens, q_fwd.seq_len);
}

/// Plans a validated shard table into `out`: queries, KV forward and
/// reverse, attention layout.
inline void plan_shards(const ShardTable& t, QkvMetadata& out, const PlanLimits& limits) {
  const KvGroups groups = kv_groups(t);
  check_qkv_footprint(t, groups, limits);
  const Tensor<std::int64_t> seq_len = t.rank_major(t.len, 0);
  // A head-parallel shard (section 2f) has no query destination: it stays home here.
  plan_query_into(seq_len, t.rank_major(t.dst, -1), out.q_fwd, out.q_rev, limits, t.has_head_parallel);
  if (t.has_head_parallel) query_return_mask(out.q_fwd, out.q_rev);
  const RowPrefix prefix = row_prefix(seq_len, t.C, "plan_qkv");
  kv_forward(t, groups, seq_len, out.q_fwd.num_seqs, out.kv_fwd);
  kv_reverse(t, groups, prefix, seq_len, out.kv_rev);
  copy_mask(out.kv_fwd.dst_rank, out.kv_rev.seq_recv_mask);
  attention_layout(t, groups, out.attn);
  out.hp_fwd = {};
  out.hp_rev = {};
  out.hp_attn = {};
}

/// Section 2f's hp_fwd, hp_rev and hp_attn of a plan with head-parallel
/// documents (plan/head_parallel.hpp); nothing otherwise.
inline void plan_head_parallel(const QkvDocumentsPlan& plan, const ShardTable& t, QkvMetadata& out, const PlanLimits& limits);

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
  const std::size_t C = detail::check_documents_plan(plan, limits);
  std::size_t shards = 0;
  for (const PackedDocument& d : plan.documents) shards += d.shards.size();
  detail::check_table_footprint(static_cast<std::size_t>(plan.world_size), shards, C, limits);
  const detail::ShardTable table = detail::shard_table(plan, C);
  detail::plan_shards(table, out, limits);
  detail::plan_head_parallel(plan, table, out, limits);
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

#include "cpdispatch/plan/head_parallel.hpp"  // section 2f, planned on the shard table above
