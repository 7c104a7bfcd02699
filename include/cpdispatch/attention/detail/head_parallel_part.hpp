#pragma once
// The head-parallel part of the attention op (docs/plan-format.md, section
// 2f): the documents a plan marks head-parallel go whole to every rank of
// their group of u ranks, each rank attending its share of the heads.
//
// The exchange is planned over a head-slab-major view of a home rank's
// tokens, [u][T][heads / u][head_dim] (slab c: the heads of the group's c-th
// rank), so that what goes to one rank of the group is a run of whole
// "tokens" of one slab: hp_fwd's copy c of a shard is its slab c, and the
// way back (hp_rev) returns each rank's results into slab c. The plans'
// slab side is then moved to the MLP layout, a piece per token and slab
// (slabs_to_mlp), so that the pack reads the caller's tensors and the
// unpack writes them, as for the dispatched documents: no slab buffer and no
// pass into or out of one. Where the key-value heads are fewer than u (they
// divide u), the u / heads_kv ranks that share a key-value head each get it,
// and their gradients come back into slabs, where the home sums them in
// group-rank order before laying them out token-major (the invariant mode's
// key-value gradients come home through slabs too: as exact sums, 8-byte
// integers a value, rounded once there after their integer sum, where heads
// are shared; rounded at the group rank otherwise).
//
// The part owns its buffers, piece lists and plans; its exchanges ride the
// op's (execute/staged_exchange.hpp) as extra tensors.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/attention/detail/row_cover.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/head_parallel.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cpdispatch::detail {

/// How the heads split over a group of u ranks: group rank c attends query
/// heads [c * q, (c + 1) * q) and key-value heads [first_kv(c), + kv).
struct HeadSplit {
  std::int64_t u = 1;
  std::int64_t q = 1, kv = 1;  // per rank of the group
  bool replicated = false;     // heads_kv < u: u / heads_kv ranks share each key-value head
  std::int64_t heads_kv = 1;   // of the layer

  std::int64_t first_kv(std::int64_t c) const noexcept { return replicated ? c * heads_kv / u : c * kv; }
};

/// The split of `shape` over u ranks; heads that do not split are refused.
inline HeadSplit head_split(const AttentionShape& shape, std::int64_t u, const std::string& who) {
  if (u < 1) fail(who, ": share.hp_attn.degree = ", u, " must be at least 1");
  if (shape.heads_q % u != 0) {
    fail(who, ": shape.heads_q = ", shape.heads_q, " is not divisible by the plan's head_parallel_degree = ", u,
         " (each rank of a group attends heads_q / u query heads)");
  }
  HeadSplit s;
  s.u = u;
  s.q = shape.heads_q / u;
  s.heads_kv = shape.heads_kv;
  if (shape.heads_kv % u == 0) {
    s.kv = shape.heads_kv / u;
  } else if (u % shape.heads_kv == 0) {
    s.kv = 1;
    s.replicated = true;
  } else {
    fail(who, ": shape.heads_kv = ", shape.heads_kv, " neither divides nor is divisible by the plan's head_parallel_degree = ", u);
  }
  return s;
}

/// Where a slab row lies in the MLP layout: row c * T + t of a slab buffer
/// holds token t's heads [first(c), first(c) + per) of the `heads` heads of
/// `head_bytes` each.
struct SlabRows {
  std::size_t head_bytes = 0;
  std::int64_t T = 0, heads = 0, per = 0;
  const HeadSplit* split = nullptr;
  bool kv = false;  // key-value heads (first_kv), else query heads

  std::size_t row_bytes() const noexcept { return static_cast<std::size_t>(per) * head_bytes; }
  std::size_t mlp(std::size_t slab_offset) const noexcept {
    const auto r = static_cast<std::int64_t>(slab_offset / row_bytes()), c = r / T, t = r % T;
    const std::int64_t head = kv ? split->first_kv(c) : c * per;
    return static_cast<std::size_t>(t * heads + head) * head_bytes;
  }
};

/// `slab` with one side moved from the slab buffer to the MLP layout, into
/// `mlp` (`input`: what it reads, the send side and the self sources; else
/// what it writes, the receive side and the self targets), a piece per slab
/// row. What travels, and in which order, stays; the side is packed (or
/// unpacked) through staging laid out by peer, as its pieces are no longer
/// one run a peer. `mlp` keeps its storage: once it has held a plan as
/// large, this allocates nothing.
inline void slabs_to_mlp(const ExchangePlan& slab, bool input, const SlabRows& rows, ExchangePlan& mlp) {
  const std::size_t rb = rows.row_bytes();
  mlp = slab;
  const Side& from = input ? slab.send : slab.recv;
  Side& side = input ? mlp.send : mlp.recv;
  const std::size_t W = from.counts.size();
  side.pieces.clear();
  side.splits.assign(1, 0);
  side.copies.clear();
  side.displs.assign(W, 0);
  std::size_t at = 0;
  for (std::size_t p = 0; p < W; ++p) {
    side.displs[p] = from.counts[p] > 0 ? at : 0;
    for (std::size_t i = from.splits[p]; i < from.splits[p + 1]; ++i) {
      for (std::size_t o = from.pieces[i].offset; o < from.pieces[i].offset + from.pieces[i].bytes; o += rb) {
        side.pieces.push_back({rows.mlp(o), rb});
        if (input) append_piece(side.copies, rows.mlp(o), at, rb); else append_piece(side.copies, at, rows.mlp(o), rb);
        at += rb;
      }
    }
    side.splits.push_back(side.pieces.size());
  }
  side.direct = false;
  side.staging = at;
  mlp.self.clear();
  for (const CopyPiece& c : slab.self) {
    for (std::size_t o = 0; o < c.bytes; o += rb) {
      if (input) append_piece(mlp.self, rows.mlp(c.src + o), c.dst + o, rb); else append_piece(mlp.self, c.src + o, rows.mlp(c.dst + o), rb);
    }
  }
  (input ? mlp.input_tokens : mlp.output_tokens) = rows.T;
  (input ? mlp.input_bytes : mlp.output_bytes) = static_cast<std::size_t>(rows.T * rows.heads) * rows.head_bytes;
}

/// One rank's head-parallel part, over data path `Path`, elements E.
template <class Path, class E>
class HeadParallelPart {
  template <class U>
  using owned = typename Path::template buffer<U>;

 public:
  bool active() const noexcept { return active_; }
  const RankHeadParallelLayout& layout() const noexcept { return layout_; }

  /// Plans the part of `share` (inactive without head-parallel documents);
  /// the path's lists are registered by lay_out. `invariant`: the backward
  /// gives exact key-value gradients (attend_backward_invariant).
  /// `mlp_tokens`: the tokens of the caller's tensors, which the exchanges read and write.
  void plan(const RankQkvMetadata& share, const AttentionShape& shape, int me, int W, const char* op, bool invariant, std::int64_t mlp_tokens) {
    active_ = share.has_head_parallel();
    if (!active_) return forget();
    const std::string& who = name(op, me, W);
    layout_ = share.hp_attn;
    split_ = head_split(shape, layout_.degree, who);
    if (!share.hp_fwd.has_copies || share.hp_fwd.num_copies != static_cast<std::size_t>(split_.u)) {
      fail(who, ": share.hp_fwd holds ", share.hp_fwd.has_copies ? share.hp_fwd.num_copies : 1, " copies of each shard but share.hp_attn.degree = ",
           split_.u, " (not one plan's share)");
    }
    shape_head_dim_ = shape.head_dim;
    shape_ = {split_.q, split_.kv, shape.head_dim, shape.softmax_scale};
    const std::size_t qb = slab_bytes(split_.q), kb = slab_bytes(split_.kv);
    // Copy c of a shard leaves from slab c, where the reverse returns it.
    q_planner_.plan(share.hp_fwd, share.hp_rev, qb, me, W, who, q_slab_plan_, ForwardFrom::replicas);
    kv_planner_.plan(share.hp_fwd, share.hp_rev, kb, me, W, who, kv_slab_plan_, ForwardFrom::replicas);
    invariant_ = invariant;
    exact_home_ = invariant && split_.replicated;
    if (exact_home_) {
      exact_planner_.plan(share.hp_fwd, share.hp_rev, exact_slab_bytes(), me, W, who, exact_plan_, ForwardFrom::replicas);
    }
    if (layout_.tokens() != q_slab_plan_.forward.output_tokens) {
      fail(who, ": share.hp_attn holds ", layout_.tokens(), " tokens, but share.hp_fwd delivers ", q_slab_plan_.forward.output_tokens,
           " (not one plan's share)");
    }
    T_ = q_slab_plan_.forward.input_tokens / split_.u;  // the slab view holds u slabs of the MLP layout's tokens
    if (T_ != mlp_tokens) {
      fail(who, ": share.hp_fwd lists ", T_, " tokens of this rank's MLP layout, share.q_fwd ", mlp_tokens, " (not one plan's share)");
    }
    kv_slabs_ = split_.replicated || invariant;    // gradients summed (or rounded) at home, through slabs
    const SlabRows q_rows{slab_bytes(1), T_, split_.q * split_.u, split_.q, &split_, false};
    const SlabRows kv_rows{slab_bytes(1), T_, split_.heads_kv, split_.kv, &split_, true};
    slabs_to_mlp(q_slab_plan_.forward, true, q_rows, q_plan_.forward);
    slabs_to_mlp(q_slab_plan_.reverse, false, q_rows, q_plan_.reverse);
    slabs_to_mlp(kv_slab_plan_.forward, true, kv_rows, kv_plan_.forward);
    if (kv_slabs_) kv_plan_.reverse = kv_slab_plan_.reverse; else slabs_to_mlp(kv_slab_plan_.reverse, false, kv_rows, kv_plan_.reverse);
    lay_out_slabs(share.hp_fwd);
    lay_out_entries();
    size_buffers();
  }

  /// Registers the key-value gradients' lists (slabs -> MLP layout, and the
  /// fan-in of shared heads) with the path (between its clear() and commit()).
  void lay_out(Path& path) {
    if (!active_ || !kv_slabs_) return;
    kv_from_slabs_ = path.add_copies(kv_back_);
    if (split_.replicated) kv_fan_ = path.add_fan_in_place(fan_, exact_home_ ? exact_slab_bytes() : slab_bytes(1));
  }

  /// The plans of the exchanges the op's ride: Q (or dout) in, K and V in
  /// (from the MLP layout); outputs (or dq) back, dk and dv back (into the
  /// MLP layout, or slabs: dk_home).
  const ExchangePlan* q_in() const noexcept { return &q_plan_.forward; }
  const ExchangePlan* kv_in() const noexcept { return &kv_plan_.forward; }
  const ExchangePlan* q_back() const noexcept { return &q_plan_.reverse; }
  /// (The invariant mode's exact sums where key-value heads are shared.)
  const ExchangePlan* kv_back() const noexcept { return exact_home_ ? &exact_plan_.reverse : &kv_plan_.reverse; }

  // The tensors of those exchanges, for the op's StagedTensor lists.
  std::byte* q() noexcept { return bytes(q_); }
  std::byte* k() noexcept { return bytes(k_); }
  std::byte* v() noexcept { return bytes(v_); }
  std::byte* out() noexcept { return bytes(out_); }
  std::byte* dout() noexcept { return bytes(dout_); }
  std::byte* dq() noexcept { return bytes(dq_); }
  std::byte* dk() noexcept { return bytes(dk_); }
  std::byte* dv() noexcept { return bytes(dv_); }
  // The key-value gradients the backward sends home (kv_back), and where
  // they land: the caller's dk, dv, or slabs that gather_gradients lays out there.
  std::byte* dk_back() noexcept { return exact_home_ ? bytes(dk_exact_) : dk(); }
  std::byte* dv_back() noexcept { return exact_home_ ? bytes(dv_exact_) : dv(); }
  std::byte* dk_home(std::byte* dk) noexcept { return exact_home_ ? bytes(dk_exact_slabs_) : kv_slabs_ ? bytes(k_slabs_) : dk; }
  std::byte* dv_home(std::byte* dv) noexcept { return exact_home_ ? bytes(dv_exact_slabs_) : kv_slabs_ ? bytes(v_slabs_) : dv; }

  /// The last forward's log-sum-exp of this rank's head-parallel documents, [q heads][tokens] (the path's memory).
  const owned<float>& lse_buffer() const noexcept { return lse_; }

  /// Where dk and dv came back into slabs: the shared key-value heads'
  /// gradients summed, then laid out token-major into dk, dv (nothing where
  /// they came straight into dk and dv).
  void gather_gradients(const Path& path, std::byte* dk, std::byte* dv) {
    if (!active_ || !kv_slabs_) return;
    for (auto* slabs : {&k_slabs_, &v_slabs_}) {
      if (split_.replicated) path.fan_in(kv_fan_, element_type_of<E>(), bytes(*slabs));
    }
    path.copy(kv_from_slabs_, bytes(k_slabs_), dk);
    path.copy(kv_from_slabs_, bytes(v_slabs_), dv);
  }
  /// The invariant backward's: where key-value heads are shared, their exact
  /// sums came home: summed as integers, rounded once (at the batch's
  /// exponents) into the slabs, then laid out token-major as above.
  void gather_gradients_invariant(const Path& path, std::byte* dk, std::byte* dv, int dk_exponent, int dv_exponent) {
    if (!active_) return;
    if (!exact_home_) return gather_gradients(path, dk, dv);
    path.fan_in(kv_fan_, ElementType::int64, bytes(dk_exact_slabs_));
    path.fan_in(kv_fan_, ElementType::int64, bytes(dv_exact_slabs_));
    path.round_exact(dk_exact_slabs_.data(), dk_exponent, k_slabs_.data(), k_slabs_.size());
    path.round_exact(dv_exact_slabs_.data(), dv_exponent, v_slabs_.data(), v_slabs_.size());
    path.copy(kv_from_slabs_, bytes(k_slabs_), dk);
    path.copy(kv_from_slabs_, bytes(v_slabs_), dv);
  }

  /// Orders the entries by the round in which every slab of their document
  /// has arrived (the latest `round_of(home)` of its shards' homes, as the
  /// op's stage plan gives it; `rounds` rounds), so that the op attends a
  /// round's documents as soon as they are whole, while later rounds
  /// travel. hp_rev lists this rank's layout shard by shard, with each one's
  /// home. Documents are independent: the bits do not depend on the cut.
  template <class RoundOf>
  void cut_rounds(const RankMetadata& hp_rev, int rounds, RoundOf round_of) {
    round_begin_.assign(static_cast<std::size_t>(rounds) + 1, 0);
    if (!active_) return;
    const auto& cu = layout_.cu_seqlens;
    document_rounds(cu, hp_rev, round_of, doc_round_);
    entry_round_.clear();
    for (const AttentionEntry& e : entries_) {  // each entry's document's round, counted
      const auto doc = static_cast<std::size_t>(std::upper_bound(cu.begin(), cu.end(), e.q_start) - cu.begin() - 1);
      entry_round_.push_back(static_cast<std::size_t>(doc_round_[doc]));
      ++round_begin_[entry_round_.back() + 1];
    }
    for (std::size_t r = 1; r < round_begin_.size(); ++r) round_begin_[r] += round_begin_[r - 1];
    by_round_.resize(entries_.size());
    round_next_.assign(round_begin_.begin(), round_begin_.end() - 1);
    for (std::size_t i = 0; i < entries_.size(); ++i) by_round_[round_next_[entry_round_[i]]++] = entries_[i];
  }

  /// The entries of the documents whole in round `round` (cut_rounds).
  std::span<const AttentionEntry> round_entries(int round) const noexcept {
    const auto r = static_cast<std::size_t>(round);
    return std::span<const AttentionEntry>(by_round_).subspan(round_begin_[r], round_begin_[r + 1] - round_begin_[r]);
  }
  int rounds() const noexcept { return static_cast<int>(round_begin_.size()) - 1; }

  /// The kernel's forward over the head-parallel documents whole in round
  /// `round` (once it has arrived); round 0 first clears the rows no entry covers.
  template <class Kernel>
  void attend_forward(Kernel& kernel, const Path& path, int round) {
    if (!active_ || entries_.empty()) return;
    if (round == 0 && stray_rows_) {
      path.zero(out(), out_.size() * sizeof(E));
      path.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
    }
    const auto entries = round_entries(round);
    if (!entries.empty()) kernel.forward(shape_, entries, read(q_), read(k_), read(v_), view(out_), view(lse_));
  }

  template <class Kernel>
  void attend_backward(Kernel& kernel, const Path& path, int round) {
    if (!active_ || entries_.empty()) return;
    if (round == 0 && stray_rows_) path.zero(dq(), dq_.size() * sizeof(E));
    if (round == 0 && stray_keys_) {
      path.zero(dk(), dk_.size() * sizeof(E));
      path.zero(dv(), dv_.size() * sizeof(E));
    }
    const auto entries = round_entries(round);
    if (!entries.empty()) {
      kernel.backward(shape_, entries, read(q_), read(k_), read(v_), read(out_), read(lse_), read(dout_), view(dq_), view(dk_), view(dv_));
    }
  }

  /// The invariant mode's forward (attention/invariant.hpp): the documents
  /// are whole here, so each row's units are all in this call.
  template <class Kernel>
  void attend_forward_invariant(Kernel& kernel, const Path& path, const InvariantGrid& grid) {
    if (!active_ || entries_.empty()) return;
    if (stray_rows_) {
      path.zero(out(), out_.size() * sizeof(E));
      path.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
    }
    kernel.forward_invariant(shape_, grid, std::span<const AttentionEntry>(entries_), read(q_), read(k_), read(v_), view(out_), view(lse_));
  }

  /// The invariant mode's backward: the key-value gradients as exact sums
  /// at the batch's exponents. Where every query head of this rank's
  /// key-value heads is here, they are whole and are rounded here into what
  /// goes home; where key-value heads are shared, the exact sums go home
  /// (dk_back) and are summed there (gather_gradients_invariant).
  template <class Kernel>
  void attend_backward_invariant(Kernel& kernel, const Path& path, const InvariantGrid& grid, int dk_exponent, int dv_exponent) {
    if (!active_) return;
    path.zero(bytes(dk_exact_), dk_exact_.size() * sizeof(std::int64_t));
    path.zero(bytes(dv_exact_), dv_exact_.size() * sizeof(std::int64_t));
    if (!entries_.empty()) {
      if (stray_rows_) path.zero(dq(), dq_.size() * sizeof(E));
      kernel.backward_invariant(shape_, grid, std::span<const AttentionEntry>(entries_), read(q_), read(k_), read(v_), read(out_), read(lse_),
                                read(dout_), view(dq_), {view(dk_exact_), view(dv_exact_), dk_exponent, dv_exponent});
    }
    if (exact_home_) return;
    path.round_exact(dk_exact_.data(), dk_exponent, dk_.data(), dk_.size());
    path.round_exact(dv_exact_.data(), dv_exponent, dv_.data(), dv_.size());
  }

  /// Whether key-value heads are shared by several ranks of a group.
  bool replicated() const noexcept { return active_ && split_.replicated; }

  /// The kernel's entry list, for a prepared kernel (empty when inactive).
  std::span<const AttentionEntry> entries() const noexcept { return active_ ? std::span<const AttentionEntry>(entries_) : std::span<const AttentionEntry>(); }

 private:
  /// "<op> (rank r of W)", for error messages, in storage kept between plans.
  const std::string& name(const char* op, int me, int W) {
    who_.assign(op).append(" (rank ").append(std::to_string(me)).append(" of ").append(std::to_string(W)).append(")");
    return who_;
  }

  /// A plan without head-parallel documents: the layout and lse say so (an
  /// earlier plan's are dropped; storage is kept, nothing is allocated).
  void forget() {
    layout_.degree = layout_.max_seqlen = layout_.group_rank = 0;
    for (auto* v : {&layout_.documents, &layout_.seqlens}) v->clear();
    layout_.cu_seqlens.resize(1);  // never empty: at least the leading 0
    layout_.cu_seqlens[0] = 0;
    layout_.mask = AttentionMask::causal();
    layout_.entries.clear();
    entries_.clear();
    lse_.resize(0);
  }

  std::size_t slab_bytes(std::int64_t heads) const noexcept { return static_cast<std::size_t>(heads * shape_head_dim_) * sizeof(E); }
  /// A key-value slab token of exact sums (one head where heads are shared).
  std::size_t exact_slab_bytes() const noexcept { return static_cast<std::size_t>(split_.kv * shape_head_dim_) * sizeof(std::int64_t); }

  /// Where the key-value gradients come home through slabs: the list that
  /// lays them out token-major (row c * T + t of slab c to token t's heads
  /// in the MLP layout), and with shared heads the fan list that sums each
  /// head's slabs.
  void lay_out_slabs(const RankMetadata& fwd) {
    kv_back_.clear();
    clear_fan();
    const auto u = static_cast<std::size_t>(split_.u);
    std::int64_t at = 0;
    for (std::size_t j = 0; j < fwd.seq_len.size(); ++j) {
      const std::int64_t len = fwd.seq_len[j];
      if (len > 0 && fwd.dst_rank[j * u] >= 0 && kv_slabs_) add_shard(at, len, j);
      at += len;
    }
    fan_.attention_tokens = split_.u * T_;
  }

  void add_shard(std::int64_t at, std::int64_t len, std::size_t j) {
    const std::int64_t Hkv = split_.heads_kv;
    for (std::int64_t c = 0; c < split_.u; ++c) {
      if (split_.replicated && split_.first_kv(c) * split_.u != c * Hkv) continue;  // not the first rank of a shared head
      for (std::int64_t t = at; t < at + len; ++t) {
        const std::size_t n = slab_bytes(split_.kv), mlp = static_cast<std::size_t>(t * Hkv + split_.first_kv(c)) * slab_bytes(1);
        append_piece(kv_back_, static_cast<std::size_t>(c * T_ + t) * n, mlp, n);
      }
    }
    if (!split_.replicated) return;
    const std::int64_t share = split_.u / Hkv;  // ranks per key-value head
    for (std::int64_t h = 0; h < Hkv; ++h) {
      fan_.seq_len.push_back(len);
      fan_.src_rank.push_back(0);
      fan_.src_shard.push_back(static_cast<std::int64_t>(j));
      fan_.wire_offset.push_back(h * share * T_ + at);  // summed in place, in the first rank's slab
      for (std::int64_t i = 0; i < share; ++i) fan_.attn_offset.push_back((h * share + i) * T_ + at);
      fan_.copy_splits.push_back(fan_.attn_offset.size());
    }
  }

  void clear_fan() {
    for (auto* v : {&fan_.seq_len, &fan_.src_rank, &fan_.src_shard, &fan_.wire_offset, &fan_.attn_offset}) v->clear();
    fan_.copy_splits.assign(1, 0);
  }

  /// One entry per document under the plan's mask, or its slices' entries, at the document's rows.
  void lay_out_entries() {
    entries_.clear();
    const auto& cu = layout_.cu_seqlens;
    if (layout_.entries.empty()) {
      layout_entries(cu, cu, layout_.mask, entries_);
    } else {
      for (std::size_t d = 0; d < layout_.entries.size(); ++d) {
        for (const AttentionEntry& e : layout_.entries[d]) entries_.push_back({e.q_start + cu[d], e.q_len, e.kv_start + cu[d], e.kv_len, e.band});
      }
    }
    cover_.build(entries_, attention::CoverSide::query);
    stray_rows_ = cover_.rows() != layout_.tokens();
    cover_.build(entries_, attention::CoverSide::key);
    stray_keys_ = cover_.rows() != layout_.tokens();
  }

  void size_buffers() {
    const auto n = static_cast<std::size_t>(layout_.tokens()), t = static_cast<std::size_t>(split_.u * T_);
    const auto hd = static_cast<std::size_t>(shape_head_dim_), q = static_cast<std::size_t>(split_.q) * hd, kv = static_cast<std::size_t>(split_.kv) * hd;
    for (owned<E>* b : {&k_slabs_, &v_slabs_}) b->resize(kv_slabs_ ? t * kv : 0);
    for (owned<E>* b : {&q_, &out_, &dout_, &dq_}) b->resize(n * q);
    for (owned<E>* b : {&k_, &v_, &dk_, &dv_}) b->resize(n * kv);
    lse_.resize(n * static_cast<std::size_t>(split_.q));
    for (owned<std::int64_t>* b : {&dk_exact_, &dv_exact_}) b->resize(invariant_ ? n * kv : 0);
    for (owned<std::int64_t>* b : {&dk_exact_slabs_, &dv_exact_slabs_}) b->resize(exact_home_ ? t * kv : 0);
  }

  template <class B>
  static std::byte* bytes(B& b) noexcept { return reinterpret_cast<std::byte*>(b.data()); }
  template <class B>
  static const std::byte* bytes(const B& b) noexcept { return reinterpret_cast<const std::byte*>(b.data()); }
  template <class B>
  static auto view(B& b) noexcept { return std::span(b.data(), b.size()); }
  template <class B>
  static auto read(const B& b) noexcept { return std::span(b.data(), b.size()); }

  bool active_ = false;
  std::string who_;
  RankHeadParallelLayout layout_;
  HeadSplit split_;
  AttentionShape shape_;
  std::int64_t shape_head_dim_ = 0, T_ = 0;
  DispatchPlanner q_planner_, kv_planner_, exact_planner_;
  DispatchPlan q_slab_plan_, kv_slab_plan_;  // forward: the home's slabs out to the group; reverse: each rank's results back into them
  DispatchPlan q_plan_, kv_plan_;            // the same from and into the MLP layout (kv_plan_.reverse: into slabs where kv_slabs_)
  DispatchPlan exact_plan_;        // the invariant mode's, where key-value heads are shared: exact sums back into exact slabs
  bool invariant_ = false, exact_home_ = false;
  bool kv_slabs_ = false;  // the key-value gradients come home through slabs (shared heads, or the invariant mode)
  std::vector<CopyPiece> kv_back_;  // slabs -> MLP layout
  KvFanList fan_;
  std::size_t kv_from_slabs_ = 0, kv_fan_ = 0;
  std::vector<AttentionEntry> entries_, by_round_;  // by_round_: the entries by round (cut_rounds), round r's from round_begin_[r]
  std::vector<int> doc_round_;
  std::vector<std::size_t> round_begin_{0}, round_next_, entry_round_;
  attention::RowCover cover_;
  bool stray_rows_ = false, stray_keys_ = false;
  owned<E> k_slabs_, v_slabs_, q_, k_, v_, out_, dout_, dq_, dk_, dv_;
  owned<float> lse_;
  owned<std::int64_t> dk_exact_, dv_exact_, dk_exact_slabs_, dv_exact_slabs_;  // the invariant mode's exact sums
};

}  // namespace cpdispatch::detail
