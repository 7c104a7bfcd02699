#pragma once
// The head-parallel part of the attention op (docs/plan-format.md, section
// 2f): the documents a plan marks head-parallel go whole to every rank of
// their group of u ranks, each rank attending its share of the heads.
//
// A home rank first lays its head-parallel tokens out head-slab-major,
// [u][T][heads / u][head_dim] (slab c: the heads of the group's c-th rank),
// so that what goes to one rank of the group is a run of whole "tokens" of
// one slab; the exchange then moves slab c of each shard to the group's
// rank c (hp_fwd's copy c), and the way back (hp_rev) returns each rank's
// results into slab c of the same [u][T] buffer, which the home lays back
// out token-major. Where the key-value heads are fewer than u (they divide
// u), the u / heads_kv ranks that share a key-value head each get it, and
// their gradients are summed in the home's slabs in group-rank order. In the
// invariant mode those gradients travel home as exact sums (8-byte integers
// a value) and are rounded once there, after their integer sum.
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
  void plan(const RankQkvMetadata& share, const AttentionShape& shape, int me, int W, const char* op, bool invariant) {
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
    q_planner_.plan(share.hp_fwd, share.hp_rev, qb, me, W, who, q_plan_, ForwardFrom::replicas);
    kv_planner_.plan(share.hp_fwd, share.hp_rev, kb, me, W, who, kv_plan_, ForwardFrom::replicas);
    invariant_ = invariant;
    exact_home_ = invariant && split_.replicated;
    if (exact_home_) {
      exact_planner_.plan(share.hp_fwd, share.hp_rev, exact_slab_bytes(), me, W, who, exact_plan_, ForwardFrom::replicas);
    }
    if (layout_.tokens() != q_plan_.forward.output_tokens) {
      fail(who, ": share.hp_attn holds ", layout_.tokens(), " tokens, but share.hp_fwd delivers ", q_plan_.forward.output_tokens,
           " (not one plan's share)");
    }
    T_ = q_plan_.forward.input_tokens / split_.u;  // the slab buffer holds u slabs of the MLP layout's tokens
    lay_out_slabs(share.hp_fwd);
    lay_out_entries();
    size_buffers();
  }

  /// Registers the slab lists and the key-value fan-in with the path (between its clear() and commit()).
  void lay_out(Path& path) {
    if (!active_) return;
    q_to_slabs_ = path.add_copies(q_pieces_);
    q_from_slabs_ = path.add_copies(q_back_);
    kv_to_slabs_ = path.add_copies(kv_pieces_);
    kv_from_slabs_ = path.add_copies(kv_back_);
    if (split_.replicated) kv_fan_ = path.add_fan_in_place(fan_, exact_home_ ? exact_slab_bytes() : slab_bytes(1));
  }

  /// The plans of the exchanges the op's ride: Q (or dout) in, K and V in; outputs (or dq) back, dk and dv back.
  const ExchangePlan* q_in() const noexcept { return &q_plan_.forward; }
  const ExchangePlan* kv_in() const noexcept { return &kv_plan_.forward; }
  const ExchangePlan* q_back() const noexcept { return &q_plan_.reverse; }
  /// (The invariant mode's exact sums where key-value heads are shared.)
  const ExchangePlan* kv_back() const noexcept { return exact_home_ ? &exact_plan_.reverse : &kv_plan_.reverse; }

  // The tensors of those exchanges, for the op's StagedTensor lists.
  const std::byte* q_slabs() const noexcept { return bytes(q_slabs_); }
  std::byte* q_slabs() noexcept { return bytes(q_slabs_); }
  std::byte* k_slabs() noexcept { return bytes(k_slabs_); }
  std::byte* v_slabs() noexcept { return bytes(v_slabs_); }
  std::byte* q() noexcept { return bytes(q_); }
  std::byte* k() noexcept { return bytes(k_); }
  std::byte* v() noexcept { return bytes(v_); }
  std::byte* out() noexcept { return bytes(out_); }
  std::byte* dout() noexcept { return bytes(dout_); }
  std::byte* dq() noexcept { return bytes(dq_); }
  std::byte* dk() noexcept { return bytes(dk_); }
  std::byte* dv() noexcept { return bytes(dv_); }
  // The key-value gradients the invariant backward sends home (kv_back), and where they land.
  std::byte* dk_back() noexcept { return exact_home_ ? bytes(dk_exact_) : dk(); }
  std::byte* dv_back() noexcept { return exact_home_ ? bytes(dv_exact_) : dv(); }
  std::byte* dk_home() noexcept { return exact_home_ ? bytes(dk_exact_slabs_) : k_slabs(); }
  std::byte* dv_home() noexcept { return exact_home_ ? bytes(dv_exact_slabs_) : v_slabs(); }

  /// The last forward's log-sum-exp of this rank's head-parallel documents, [q heads][tokens] (the path's memory).
  const owned<float>& lse_buffer() const noexcept { return lse_; }

  /// Lays q, k, v (MLP layout) out slab-major for the exchange.
  void scatter_inputs(const Path& path, const std::byte* q, const std::byte* k, const std::byte* v) {
    if (!active_) return;
    path.copy(q_to_slabs_, q, q_slabs());
    path.copy(kv_to_slabs_, k, k_slabs());
    path.copy(kv_to_slabs_, v, v_slabs());
  }
  /// Lays dout out slab-major.
  void scatter_dout(const Path& path, const std::byte* dout) {
    if (active_) path.copy(q_to_slabs_, dout, q_slabs());
  }
  /// The outputs come back into the query slabs: laid back out token-major into `out`.
  void gather_output(const Path& path, std::byte* out) const {
    if (active_) path.copy(q_from_slabs_, q_slabs(), out);
  }
  /// dq, dk, dv came back into the slabs: the shared key-value heads' gradients summed, then laid out token-major.
  void gather_gradients(const Path& path, std::byte* dq, std::byte* dk, std::byte* dv) {
    if (!active_) return;
    path.copy(q_from_slabs_, q_slabs(), dq);
    for (std::byte* slabs : {k_slabs(), v_slabs()}) {
      if (split_.replicated) path.fan_in(kv_fan_, element_type_of<E>(), slabs);
    }
    path.copy(kv_from_slabs_, k_slabs(), dk);
    path.copy(kv_from_slabs_, v_slabs(), dv);
  }
  /// The invariant backward's: where key-value heads are shared, their exact
  /// sums came home: summed as integers, rounded once (at the batch's
  /// exponents) into the slabs, then laid out token-major as above.
  void gather_gradients_invariant(const Path& path, std::byte* dq, std::byte* dk, std::byte* dv, int dk_exponent, int dv_exponent) {
    if (!active_) return;
    if (!exact_home_) return gather_gradients(path, dq, dk, dv);
    path.copy(q_from_slabs_, q_slabs(), dq);
    path.fan_in(kv_fan_, ElementType::int64, bytes(dk_exact_slabs_));
    path.fan_in(kv_fan_, ElementType::int64, bytes(dv_exact_slabs_));
    path.round_exact(dk_exact_slabs_.data(), dk_exponent, k_slabs_.data(), k_slabs_.size());
    path.round_exact(dv_exact_slabs_.data(), dv_exponent, v_slabs_.data(), v_slabs_.size());
    path.copy(kv_from_slabs_, k_slabs(), dk);
    path.copy(kv_from_slabs_, v_slabs(), dv);
  }

  /// The kernel's forward over this rank's head-parallel documents (after their exchange).
  template <class Kernel>
  void attend_forward(Kernel& kernel, const Path& path) {
    if (!active_ || entries_.empty()) return;
    if (stray_rows_) {
      path.zero(out(), out_.size() * sizeof(E));
      path.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
    }
    kernel.forward(shape_, std::span<const AttentionEntry>(entries_), read(q_), read(k_), read(v_), view(out_), view(lse_));
  }

  template <class Kernel>
  void attend_backward(Kernel& kernel, const Path& path) {
    if (!active_ || entries_.empty()) return;
    if (stray_rows_) path.zero(dq(), dq_.size() * sizeof(E));
    if (stray_keys_) {
      path.zero(dk(), dk_.size() * sizeof(E));
      path.zero(dv(), dv_.size() * sizeof(E));
    }
    kernel.backward(shape_, std::span<const AttentionEntry>(entries_), read(q_), read(k_), read(v_), read(out_), read(lse_), read(dout_),
                    view(dq_), view(dk_), view(dv_));
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

  /// The slab lists of the home's head-parallel shards: token t's heads of
  /// slab c between the MLP row and row c * T + t of the slab buffer, and
  /// with shared key-value heads the fan list that sums each head's slabs.
  void lay_out_slabs(const RankMetadata& fwd) {
    for (auto* l : {&q_pieces_, &q_back_, &kv_pieces_, &kv_back_}) l->clear();
    clear_fan();
    const auto u = static_cast<std::size_t>(split_.u);
    std::int64_t at = 0;
    for (std::size_t j = 0; j < fwd.seq_len.size(); ++j) {
      const std::int64_t len = fwd.seq_len[j];
      if (len > 0 && fwd.dst_rank[j * u] >= 0) add_shard(at, len, j);
      at += len;
    }
    fan_.attention_tokens = split_.u * T_;
  }

  void add_shard(std::int64_t at, std::int64_t len, std::size_t j) {
    const std::int64_t Hq = split_.q * split_.u, Hkv = split_.heads_kv;
    for (std::int64_t c = 0; c < split_.u; ++c) {
      const bool kv_back = !split_.replicated || split_.first_kv(c) * split_.u == c * Hkv;  // the first rank of a shared head
      for (std::int64_t t = at; t < at + len; ++t) {
        add_row(q_pieces_, &q_back_, t * Hq + c * split_.q, c * T_ + t, split_.q);
        add_row(kv_pieces_, kv_back ? &kv_back_ : nullptr, t * Hkv + split_.first_kv(c), c * T_ + t, split_.kv);
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

  /// `heads` heads of head_dim from MLP row element `mlp_head` (in heads) to slab row `slab_row`, and back where `back`.
  void add_row(std::vector<CopyPiece>& to, std::vector<CopyPiece>* back, std::int64_t mlp_head, std::int64_t slab_row, std::int64_t heads) {
    const std::size_t n = slab_bytes(heads), mlp = static_cast<std::size_t>(mlp_head) * slab_bytes(1), slab = static_cast<std::size_t>(slab_row) * n;
    append_piece(to, mlp, slab, n);
    if (back) append_piece(*back, slab, mlp, n);
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
    q_slabs_.resize(t * q);
    for (owned<E>* b : {&k_slabs_, &v_slabs_}) b->resize(t * kv);
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
  DispatchPlan q_plan_, kv_plan_;  // forward: the home's slabs out to the group; reverse: each rank's results back into them
  DispatchPlan exact_plan_;        // the invariant mode's, where key-value heads are shared: exact sums back into exact slabs
  bool invariant_ = false, exact_home_ = false;
  std::vector<CopyPiece> q_pieces_, q_back_, kv_pieces_, kv_back_;
  KvFanList fan_;
  std::size_t q_to_slabs_ = 0, q_from_slabs_ = 0, kv_to_slabs_ = 0, kv_from_slabs_ = 0, kv_fan_ = 0;
  std::vector<AttentionEntry> entries_;
  attention::RowCover cover_;
  bool stray_rows_ = false, stray_keys_ = false;
  owned<E> q_slabs_, k_slabs_, v_slabs_, q_, k_, v_, out_, dout_, dq_, dk_, dv_;
  owned<float> lse_;
  owned<std::int64_t> dk_exact_, dv_exact_, dk_exact_slabs_, dv_exact_slabs_;  // the invariant mode's exact sums
};

}  // namespace cpdispatch::detail
