#pragma once
// One rank's queries and key-values through one object: what a training loop
// holds per attention layer.
//
//   auto plan = cpdispatch::gather_plan(transport, my_documents);    // identical on every rank
//   auto mine = cpdispatch::plan_qkv_for_rank(plan, transport.rank());  // this rank's share only
//   cpdispatch::QkvDispatch<Transport, bfloat16> qkv(transport, mine,
//                                                    heads * head_dim, 2 * kv_heads * head_dim);
//   qkv.forward_q(q_mlp, q_attn);         // std::span<const bfloat16> -> std::span<bfloat16>
//   qkv.forward_kv(kv_mlp, kv_attn);
//   const auto& a = qkv.attention();      // cu_seqlens_q/kv, max_seqlen_q/kv of this rank
//   ... varlen attention over q_attn, kv_attn ...
//   qkv.reverse_q(dq_attn, dq_mlp);
//   qkv.reverse_kv(dkv_attn, dkv_mlp);    // gradients of every copy summed (fixed order)
//   qkv.replan(next_share);               // the next step's share, same widths
//
// With QkvDispatchOptions{.dedup = true} (a share planned with plan.dedup,
// so it carries kv_wire) the key-values travel over the deduplicated wire
// (KvWireDispatcher: each shard once per destination, fanned out there); the
// attention layout is the same and the KV gradients equal the plain
// exchange's up to reassociation of the copies' sum.
//
// Built from a share, the object checks at each share that the ranks' shares
// belong to one plan (QkvDispatchOptions::check_plan_agreement,
// execute/plan_agreement.hpp): one small exchange per plan.
//
// Token widths are in elements of E; the element type of the KV-gradient sum
// is E's. The object owns the [C][T] replica buffer of the KV backward (and
// the wire scratch with dedup) and the dispatchers' staging, so after
// construction and the first calls nothing is allocated. On host transports
// replan replans the dispatchers in place: once a share fits what an earlier
// one needed (plan, staging, replica; with dedup the wire's lists per peer
// too), it allocates nothing. On device transports every dispatcher is
// rebuilt.
// Buffers are in the transport's memory space: std::span<E> on host
// transports (sim, MPI), cuda::DeviceSpan<E> on device transports (the
// device sim, NCCL; include cpdispatch/cuda/data_path.hpp from a .cu file),
// whose replica and wire scratch the object keeps in device memory. Every
// call is one collective of the transport: all ranks make the same calls in
// the same order.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/plan_agreement.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// How QkvDispatch moves key-values.
struct QkvDispatchOptions {
  bool dedup = false;  ///< over the deduplicated wire (needs a share with kv_wire)
  /// At construction from a share and each replan, check that the ranks'
  /// shares belong to one plan (execute/plan_agreement.hpp: one all_to_all_v
  /// of a few words a peer per plan, never per call); a mismatch throws on
  /// every rank. Turn off only where every rank is known to get the same plan.
  bool check_plan_agreement = true;
};

template <class T, class E>
class QkvDispatch {
  using path = typename detail::dispatcher_path<T>::type;
  static_assert(has_element_type_v<E>, "cpdispatch: QkvDispatch's element type must be one of ElementType's");

 public:
  /// A buffer of U in the transport's memory space (std::span<U>, or cuda::DeviceSpan<U>).
  template <class U>
  using buffer = typename path::template span<U>;

  /// From the global metadata (every rank plans the same plan) and the widths
  /// of a query and of a key-value token in elements of E.
  QkvDispatch(T& transport, const QkvMetadata& meta, std::size_t q_token_elems, std::size_t kv_token_elems)
      : transport_(transport),
        q_token_elems_(checked_width(q_token_elems, "q_token_elems")),
        kv_token_elems_(checked_width(kv_token_elems, "kv_token_elems")),
        q_(std::in_place, transport, meta.q_fwd, meta.q_rev, q_token_elems_ * sizeof(E)),
        kv_(std::in_place, transport, meta.kv_fwd, meta.kv_rev, kv_token_elems_ * sizeof(E)),
        attention_(attention_of(meta.attn, transport.rank())) {
    size_scratch();
  }

  /// From this rank's share alone (plan_qkv_for_rank: no global metadata).
  /// With options.dedup the share must carry kv_wire (planned with plan.dedup).
  QkvDispatch(T& transport, const RankQkvMetadata& meta, std::size_t q_token_elems, std::size_t kv_token_elems, QkvDispatchOptions options = {})
      : transport_(transport),
        q_token_elems_(checked_width(q_token_elems, "q_token_elems")),
        kv_token_elems_(checked_width(kv_token_elems, "kv_token_elems")),
        dedup_(options.dedup),
        check_(options.check_plan_agreement && transport.world_size() > 1),
        attention_(meta.attn) {
    if (check_) agreement_.size(transport.world_size(), agreement_slots);
    replan(meta);
  }

  /// The next step's share, with the widths and options of construction.
  /// On a throw (a bad share, a share without kv_wire under dedup, shares
  /// that disagree) the object keeps its previous plan. With
  /// check_plan_agreement (the default) the ranks check their shares against
  /// each other before any is taken: a share refused on one rank, or shares
  /// of different plans, throw on every rank. On device transports the
  /// dispatchers are rebuilt (and allocate); the scratch keeps its memory.
  void replan(const RankQkvMetadata& meta) {
    if (check_) detail::PlanAgreement::run([&] { prepare(meta); }, [&](bool refused) { agree(meta, refused); });
    else prepare(meta);
    commit();
  }

  const RankAttentionLayout& attention() const noexcept { return attention_; }
  /// Elements of each buffer: MLP layout (this rank's tokens), attention layout.
  std::size_t q_mlp_size() const noexcept { return q_->required_bytes().mlp_bytes / sizeof(E); }
  std::size_t q_attention_size() const noexcept { return q_->required_bytes().attention_bytes / sizeof(E); }
  std::size_t kv_mlp_size() const noexcept { return (wire_ ? wire_->required_bytes().mlp_bytes : kv_->required_bytes().mlp_bytes) / sizeof(E); }
  std::size_t kv_attention_size() const noexcept {
    return (wire_ ? wire_->required_bytes().attention_bytes : kv_->required_bytes().attention_bytes) / sizeof(E);
  }
  /// Whether key-values travel over the deduplicated wire.
  bool dedup() const noexcept { return dedup_; }

  /// Queries (or attention outputs) MLP -> attention layout.
  void forward_q(buffer<const E> q_mlp, buffer<E> q_attention) { q_->forward(path::bytes_of(q_mlp), path::bytes_of(q_attention)); }
  /// Key-values MLP -> attention layout: each KV group holds its causal context.
  void forward_kv(buffer<const E> kv_mlp, buffer<E> kv_attention) {
    if (wire_) wire_->forward(path::bytes_of(kv_mlp), path::bytes_of(kv_attention));
    else kv_->forward(path::bytes_of(kv_mlp), path::bytes_of(kv_attention));
  }
  /// Query gradients attention -> MLP layout.
  void reverse_q(buffer<const E> dq_attention, buffer<E> dq_mlp) { q_->reverse(path::bytes_of(dq_attention), path::bytes_of(dq_mlp)); }
  /// KV gradients attention -> MLP layout, the copies of each shard summed in
  /// ascending copy order (fp32 accumulation for 16-bit types); with dedup
  /// each destination first sums its copies, then the home sums the wire's.
  void reverse_kv(buffer<const E> dkv_attention, buffer<E> dkv_mlp) {
    const auto replica = ensure(replica_, replica_bytes());
    if (wire_) {
      wire_->reverse_combine(path::bytes_of(dkv_attention), ensure(wire_scratch_, wire_->required_bytes().wire_bytes), replica,
                             path::bytes_of(dkv_mlp), element_type_of<E>());
    } else {
      kv_->reverse_combine(path::bytes_of(dkv_attention), replica, path::bytes_of(dkv_mlp), element_type_of<E>());
    }
  }

  /// The underlying dispatchers, for callers that manage buffers themselves.
  Dispatcher<T>& queries() noexcept { return *q_; }
  /// The plain KV dispatcher; with dedup there is none (see key_value_wire).
  Dispatcher<T>& key_values() {
    if (!kv_) detail::fail("QkvDispatch::key_values: key-values travel over the dedup wire; use key_value_wire()");
    return *kv_;
  }
  /// The dedup KV dispatcher; without dedup there is none (see key_values).
  KvWireDispatcher<T>& key_value_wire() {
    if (!wire_) detail::fail("QkvDispatch::key_value_wire: built without dedup; use key_values()");
    return *wire_;
  }

 private:
  static std::size_t checked_width(std::size_t width, const char* name) {
    if (width == 0) detail::fail("QkvDispatch: ", name, " = 0; a token has at least one element");
    if (width > static_cast<std::size_t>(-1) / sizeof(E)) detail::fail("QkvDispatch: ", name, " = ", width, " elements overflow");
    return width;
  }

  static constexpr std::size_t agreement_slots = 2;
  static constexpr const char* slot_names[agreement_slots] = {"query", "key-value"};

  /// Plans `meta` without taking it: the host dispatchers prepare their
  /// replans in place; the first share (every share on a device transport,
  /// whose path uploads its piece lists per plan) builds new dispatchers.
  void prepare(const RankQkvMetadata& meta) {
    if (dedup_ && !meta.kv_wire) {
      detail::fail("QkvDispatch (rank ", transport_.rank(), "): dedup needs the share's kv_wire slices, but kv_wire is empty; plan with plan.dedup = true");
    }
    fresh_ = false;
    if constexpr (detail::memory_space_of<T>() == MemorySpace::host) {
      if (q_) {
        q_->prepare_replan(meta.q_fwd, meta.q_rev);
        if (dedup_) wire_->prepare_replan(*meta.kv_wire);
        else kv_->prepare_replan(meta.kv_fwd, meta.kv_rev);
        next_attention_ = meta.attn;
        return;
      }
    }
    next_q_.reset();
    next_kv_.reset();
    next_wire_.reset();
    next_q_.emplace(transport_, meta.q_fwd, meta.q_rev, q_token_elems_ * sizeof(E));
    if (dedup_) next_wire_.emplace(transport_, *meta.kv_wire, kv_token_elems_ * sizeof(E));
    else next_kv_.emplace(transport_, meta.kv_fwd, meta.kv_rev, kv_token_elems_ * sizeof(E));
    next_attention_ = meta.attn;
    fresh_ = true;
  }

  /// Takes the prepared plan (all dispatchers at once).
  void commit() {
    if (fresh_) {
      take(q_, next_q_);
      take(kv_, next_kv_);
      take(wire_, next_wire_);
      next_q_.reset();
      next_kv_.reset();
      next_wire_.reset();
      fresh_ = false;
    } else {
      q_->commit_replan();
      if (dedup_) wire_->commit_replan();
      else kv_->commit_replan();
    }
    std::swap(attention_, next_attention_);
    size_scratch();
  }

  /// Plan agreement over the query and key-value slices (the wire's with
  /// dedup): one exchange for both; a rank that refused its share takes part.
  void agree(const RankQkvMetadata& meta, bool refused) {
    const bool wire = dedup_ && meta.kv_wire;
    const detail::AgreementSlot slots[] = {{slot_names[0], &meta.q_fwd, &meta.q_rev},
                                           {slot_names[1], wire ? &meta.kv_wire->fwd : &meta.kv_fwd, wire ? &meta.kv_wire->rev : &meta.kv_rev}};
    detail::AgreementHeader h;
    h.world_size = meta.q_fwd.world_size;
    h.config = detail::agreement_hash({q_token_elems_, kv_token_elems_, sizeof(E), static_cast<std::uint64_t>(element_type_of<E>()), dedup_});
    h.mask = detail::agreement_hash({static_cast<std::uint64_t>(meta.attn.mask.type), static_cast<std::uint64_t>(meta.attn.mask.window)});
    h.layout = detail::agreement_hash({meta.kv_fwd.has_copies, meta.kv_fwd.num_copies});
    agreement_.build(transport_.rank(), h, slots, refused);
    try {
      agreement_.exchange(transport_);
    } catch (...) {
      detail::rethrow_with_context(detail::concat("QkvDispatch::replan (rank ", transport_.rank(), " of ", transport_.world_size(), "): plan agreement: all_to_all_v failed: "));
    }
    if (!refused) agreement_.check("QkvDispatch::replan", transport_.rank(), slot_names);
  }

  /// The dispatchers hold the transport by reference (no assignment), but
  /// they move without throwing: rebuilt in place from the new one.
  template <class D>
  static void take(std::optional<D>& to, std::optional<D>& from) noexcept {
    static_assert(std::is_nothrow_move_constructible_v<D>);
    to.reset();
    if (from) to.emplace(std::move(*from));
  }

  std::size_t replica_bytes() const { return wire_ ? wire_->required_bytes().replica_bytes : kv_->required_bytes().replica_bytes; }

  /// `bytes` of scratch: it grows (never shrinks), so it keeps its memory while the plan fits it.
  static typename path::mutable_buffer ensure(typename path::template buffer<std::byte>& scratch, std::size_t bytes) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    return typename path::mutable_buffer(scratch.data(), bytes);
  }

  /// The scratch keeps its memory while the plan fits it (calls then allocate nothing).
  void size_scratch() {
    ensure(replica_, replica_bytes());
    if (wire_) ensure(wire_scratch_, wire_->required_bytes().wire_bytes);
  }

  T& transport_;
  std::size_t q_token_elems_, kv_token_elems_;
  bool dedup_ = false;
  bool check_ = false;  // plan agreement at each share
  bool fresh_ = false;  // the prepared plan is new dispatchers (next_*), not prepared replans
  detail::PlanAgreement agreement_;
  std::optional<Dispatcher<T>> q_, kv_;
  std::optional<KvWireDispatcher<T>> wire_;  // in place of kv_ with dedup
  std::optional<Dispatcher<T>> next_q_, next_kv_;  // prepare's, for the first share (every share on device)
  std::optional<KvWireDispatcher<T>> next_wire_;
  RankAttentionLayout attention_, next_attention_;  // replan copies into the second, then swaps (both keep their storage)
  typename path::template buffer<std::byte> replica_, wire_scratch_;
};

}  // namespace cpdispatch
