#pragma once
// Context-parallel attention: one object per attention layer and rank that
// takes this rank's queries, keys and values in its MLP layout, attends every
// query to its document's keys under the plan's mask (or the document's
// slices, plan-format section 2e) wherever they live, and returns the output
// (forward) and the gradients (backward) in the MLP layout. The result
// equals attention over each whole document. The kernel gets entries with
// bands: one per KV group under the mask (layout_entries), or the plan's own
// (its attention layout's entries, moved to the buffers' rows).
//
//   auto share = cpdispatch::plan_qkv_for_rank(plan, transport.rank());
//   cpdispatch::ContextParallelAttention<Transport, cpdispatch::bfloat16> attn(transport, share, shape, {});
//   attn.forward(q, k, v, out);           // MLP layout, THD
//   attn.backward(dout, dq, dk, dv);      // dk, dv summed over every copy
//   attn.replan(next_share);              // next step
//
// Forward: queries and key-values ride the transport's all-to-all to the
// attention layout (with CpAttentionOptions::dedup, each key-value shard once
// per rank, then copied to its other places), the kernel attends each KV
// group, and the outputs ride back. Backward mirrors it: dout travels like
// the queries, the kernel's dq goes home like the outputs, dk and dv come
// home with every copy summed in a fixed order.
//
// With CpAttentionOptions::stages > 1 the exchanges are posted by stage
// group: the kernel attends the local key-values while the rest travel, a
// later group's parts as soon as they arrive, and the log-sum-exp merge folds
// the parts together; backward posts each group's key-value gradients home
// as soon as they are complete.
//
// Documents the plan marks head-parallel (plan-format section 2f) go whole
// to every rank of their group, each attending its share of the heads: their
// head slabs ride the same exchanges (attention/detail/head_parallel_part.hpp),
// the kernel attends them once every stage group has arrived, and their
// outputs and gradients go home with the queries'.
//
// One class body serves every transport: what differs by memory space (the
// buffers, the copies, the merges, the fan-out and fan-in, the default
// kernel) comes from the data path of the transport's memory space
// (attention/data_path.hpp). On host transports (sim, MPI) the buffers are
// std::span; on device transports (the device sim, NCCL) cuda::DeviceSpan,
// and the device path, the device kernel and this op come with one header,
// cpdispatch/cuda/context_parallel.hpp, included from a .cu file. There every
// call only enqueues work on the transport's stream (no host
// synchronisation: a posted exchange runs on the transport's communication
// stream, ordered by events), so results are there once that stream has run.
//
// Construction and replan check that the ranks' shares belong to one plan
// (CpAttentionOptions::check_plan_agreement, execute/plan_agreement.hpp):
// one small exchange per plan, and a mismatch throws on every rank.
//
// What forward keeps for backward (the attention-layout Q, K, V, output and
// log-sum-exp) is owned by the object and reused across steps. Every call is
// a collective of the transport: all ranks make the same calls in the same
// order. The transport is held by reference and must outlive the object.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/call_check.hpp"
#include "cpdispatch/attention/data_path.hpp"
#include "cpdispatch/attention/detail/head_parallel_part.hpp"
#include "cpdispatch/attention/detail/invariant_part.hpp"
#include "cpdispatch/attention/detail/kv_fan_part.hpp"
#include "cpdispatch/attention/detail/row_cover.hpp"
#include "cpdispatch/attention/detail/share_entries.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/attention/step_trace.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/plan_agreement.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// How the op exchanges and overlaps.
struct CpAttentionOptions {
  /// Send each key-value shard once per destination rank (the plan must be
  /// planned with dedup so that the share carries its wire slices).
  bool dedup = false;
  /// 1: exchange, then attend (bitwise reproducible). More: attend the local
  /// key-values first while the remote ones arrive in `stages - 1` parts.
  int stages = 1;
  /// At construction and each replan, check that the ranks' shares belong to
  /// one plan (execute/plan_agreement.hpp: one all_to_all_v of a few words a
  /// peer per plan, never per step); a mismatch throws on every rank. Turn
  /// off only where every rank is known to get the same plan.
  bool check_plan_agreement = true;
  /// Invariant mode (docs/invariant-attention.md): out, lse, dq, dk and dv
  /// bitwise the same for every world size, plan, stage count and thread
  /// count whose cuts lie on the grid (and equal to the run with W = 1). The
  /// kernel must have the mode (InvariantAttentionKernel: HostAttentionKernel,
  /// cuda::CudaAttentionKernel); host and device transports. With stages > 1
  /// the exchanges are still posted by group, but the kernel attends once
  /// everything has arrived; the ranks agree on each step's kernel calls and
  /// bounds (small all-gathers), so a refused step is refused on every rank.
  bool invariant = false;
  /// The invariant mode's grid, in tokens of the packed sequence: every cut
  /// of a document (the loader's and the plan's) must fall on a multiple.
  std::int64_t grid = 64;
  /// Where to record each step's timeline (attention/step_trace.hpp: posts,
  /// waits, kernel passes, merges, fans); nullptr (the default): nothing is
  /// recorded and no clock is read. Must outlive the calls that record.
  StepTrace* trace = nullptr;
};

/// The largest plan a rank expects (ContextParallelAttention::reserve): its
/// MLP tokens, its attention layout's query and key-value tokens, the shards
/// it holds or attends (each), and the copies of a key-value shard (C).
struct CpAttentionCapacity {
  std::int64_t mlp_tokens = 0;
  std::int64_t q_tokens = 0;
  std::int64_t kv_tokens = 0;
  std::int64_t shards = 0;
  std::int64_t copies = 1;
};

namespace detail {

inline void check_attention_shape(const AttentionShape& s, const char* who) {
  if (s.heads_q < 1) fail(who, ": shape.heads_q = ", s.heads_q, " must be at least 1");
  if (s.heads_kv < 1) fail(who, ": shape.heads_kv = ", s.heads_kv, " must be at least 1");
  if (s.heads_q % s.heads_kv != 0) fail(who, ": shape.heads_q = ", s.heads_q, " is not a multiple of shape.heads_kv = ", s.heads_kv);
  if (s.head_dim < 1) fail(who, ": shape.head_dim = ", s.head_dim, " must be at least 1");
  if (!std::isfinite(s.softmax_scale) || s.softmax_scale == 0.0f) {
    fail(who, ": shape.softmax_scale = ", s.softmax_scale, " must be finite and non-zero");
  }
}

/// One MLP-layout buffer of a forward or backward call: [T][heads_q][head_dim]
/// when `query`, else [T][heads_kv][head_dim].
struct MlpBuffer {
  std::size_t size;
  const char* name;
  bool query;
};

/// Refuses the first buffer whose size is not this rank's tokens x heads x head_dim.
inline void check_mlp_sizes(int rank, int world_size, const char* call, std::int64_t tokens, const AttentionShape& s,
                            std::initializer_list<MlpBuffer> buffers) {
  for (const MlpBuffer& b : buffers) {
    const std::int64_t heads = b.query ? s.heads_q : s.heads_kv;
    const auto want = static_cast<std::size_t>(tokens * heads * s.head_dim);
    if (b.size != want) {
      fail("ContextParallelAttention (rank ", rank, " of ", world_size, "): ", call, ": ", b.name, " has ", b.size, " elements, but ", tokens,
           " tokens x ", heads, " heads x ", s.head_dim, " = ", want);
    }
  }
}

/// Rethrows the exception in flight (a transport call's), naming the op's call, rank and world in front of its message.
[[noreturn]] inline void rethrow_exchange_failure(int rank, int world_size, const char* call) {
  rethrow_with_context(concat("ContextParallelAttention::", call, " (rank ", rank, " of ", world_size, "): exchange failed: "));
}

/// The kernel a transport's op builds when none is given: on the
/// transport's stream where the kernel takes one, else default-constructed.
template <class Kernel, class T>
Kernel kernel_for(T& transport) {
  if constexpr (requires { Kernel(transport.stream()); }) {
    return Kernel(transport.stream());
  } else {
    return Kernel{};
  }
}

}  // namespace detail

/// The kernel ContextParallelAttention<T, E> attends with when none is named:
/// HostAttentionKernel on host transports; on device transports
/// cuda::CudaAttentionKernel, declared by cpdispatch/cuda/context_parallel.hpp.
template <class T, MemorySpace = detail::memory_space_of<T>()>
struct default_attention_kernel;
template <class T>
struct default_attention_kernel<T, MemorySpace::host> {
  using type = HostAttentionKernel;
};

/// One attention layer of one rank, over transport T (host or device), elements E.
template <class T, class E, class Kernel = typename default_attention_kernel<T>::type>
class ContextParallelAttention {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  static constexpr MemorySpace space = detail::memory_space_of<T>();
  using Path = AttentionDataPath<space>;
  static_assert(Path::available,
                "cpdispatch: ContextParallelAttention over a device transport needs cpdispatch/cuda/context_parallel.hpp (from a .cu file)");
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                "cpdispatch: ContextParallelAttention's element type is float, bfloat16 or float16");
  static_assert(AttentionKernel<Kernel, E>, "cpdispatch: the kernel does not model AttentionKernel<Kernel, E> (attention/kernel.hpp)");
  static_assert(attention_kernel_memory_space<Kernel>() == space,
                "cpdispatch: the kernel's memory space is not the transport's (a device transport needs a kernel declaring "
                "`static constexpr MemorySpace memory_space = MemorySpace::device`, e.g. cuda::CudaAttentionKernel)");
  template <class U>
  using owned = typename Path::template buffer<U>;

 public:
  using transport_type = T;
  using element_type = E;
  using kernel_type = Kernel;
  /// A buffer of U in the transport's memory (std::span; cuda::DeviceSpan on device transports).
  template <class U>
  using buffer = typename Path::template span<U>;
  /// Whether the exchanges are posted and overlapped with compute (T is a
  /// PostedAllToAllTransport) or made in blocking calls where they would be posted.
  static constexpr bool overlaps = posted_all_to_all_v<T>;

  /// With the default kernel for the transport (on its stream where it has one).
  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options = {})
      : ContextParallelAttention(transport, share, shape, options, detail::kernel_for<Kernel>(transport)) {}

  /// With `kernel`, which must launch on the transport's stream when both say which (`stream()`).
  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options, Kernel kernel)
      : transport_(transport), shape_(shape), options_(options), kernel_(std::move(kernel)), path_(transport) {
    detail::check_attention_shape(shape_, "ContextParallelAttention");
    if (options_.stages < 1) fail("options.stages = ", options_.stages, " must be at least 1");
    if (options_.invariant) check_invariant_options();
    if constexpr (requires { kernel_.stream() == transport_.stream(); }) {
      if (kernel_.stream() != transport_.stream()) {
        fail("the kernel launches on another stream than the transport's; build it on transport.stream() so that its work is ordered with the exchange's");
      }
    }
    groups_ = detail::stage_groups(options_.stages, transport_.world_size());
    requests_.resize(static_cast<std::size_t>(groups_));
    kv_requests_.resize(static_cast<std::size_t>(std::max(groups_, 1)));
    if (options_.check_plan_agreement) agreement_.size(transport_.world_size(), agreement_slots);
    replan(share);
  }

  /// Sizes every buffer for plans up to `c`, so that replan, forward and
  /// backward allocate nothing while a plan stays within it (with dedup, see
  /// replan; a device path still uploads each plan's piece lists).
  void reserve(const CpAttentionCapacity& c) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(std::max<std::int64_t>(x, 0)); };
    const std::size_t hq = q_token_elems(), hk = kv_token_elems(), copies = std::max<std::size_t>(n(c.copies), 1);
    for (owned<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_, &out_part_}) b->reserve(n(c.q_tokens) * hq);
    for (owned<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) b->reserve(n(c.kv_tokens) * hk);
    for (owned<E>* b : {&replica_, &replica_v_}) b->reserve(copies * n(c.mlp_tokens) * hk);
    for (owned<float>* b : {&lse_, &lse_part_}) b->reserve(n(c.q_tokens) * static_cast<std::size_t>(shape_.heads_q));
    acc_.reserve(n(c.q_tokens) * hq);
    entries_.reserve(n(c.shards));
    entry_begin_.reserve(n(c.shards) + 1);
    for (auto* v : {&kv_rev_.dst_rank, &kv_rev_.dst_offset, &kv_rev_.seq_len}) v->reserve(n(c.shards));
    kv_rev_.num_recv_tokens.reserve(static_cast<std::size_t>(transport_.world_size()) + 1);
    for (auto* o : {&kv_rev_.seq_recv_mask, &kv_rev_.recv_seq_lens}) {
      if (!*o) o->emplace();
      (*o)->reserve(n(c.shards) * copies);
    }
    for (auto* v : {&layout_.seqlens_q, &layout_.seqlens_kv}) v->reserve(n(c.shards));
    for (auto* v : {&layout_.cu_seqlens_q, &layout_.cu_seqlens_kv}) v->reserve(n(c.shards) + 1);
    const auto W = static_cast<std::size_t>(transport_.world_size());
    q_planner_.reserve(q_plan_, n(c.shards), W);
    kv_planner_.reserve(kv_plan_, n(c.shards) * copies, W);
    stage_plan_.reserve(n(c.shards) * copies);
    const std::size_t mlp = n(c.mlp_tokens), tq = n(c.q_tokens), tk = n(c.kv_tokens), e = sizeof(E);  // staging is in bytes: (send, receive)
    const std::size_t pieces = n(c.shards) * copies;
    fwd_in_.reserve(mlp * (hq + 2 * hk * copies) * e, (tq * hq + 2 * tk * hk) * e, pieces);
    dout_in_.reserve(mlp * hq * e, tq * hq * e, pieces);
    for (Exchange* x : {&out_home_, &grads_home_}) x->reserve(tq * hq * e, mlp * hq * e, pieces);
    kv_out_.reserve(2 * tk * hk * e, copies * mlp * 2 * hk * e, pieces);
    calls_.reserve(pieces + W + 1);
    fan_.reserve(n(c.shards), pieces);
  }

  /// Takes the next step's share (the plan's mask and, with dedup, its wire
  /// slices). On host transports nothing is allocated while the plan fits
  /// what earlier plans or reserve() sized; with dedup the wire's lists per
  /// peer, and the head-parallel part (section 2f), are sized by the plans
  /// seen (reserve does not reach them), so a step allocates nothing once
  /// every plan of its size has been seen. After
  /// a throw (a bad share) the object needs a good share before its next forward.
  /// With options.check_plan_agreement (the default) every rank checks that
  /// the shares belong to one plan: a share refused here, or shares that
  /// disagree, throw on every rank (a collective, like every call).
  void replan(const RankQkvMetadata& share) {
    if (!options_.check_plan_agreement || transport_.world_size() == 1) {
      plan_share(share);
    } else {
      std::exception_ptr refused;
      try {
        plan_share(share);
      } catch (...) {
        refused = std::current_exception();
      }
      agree(share, refused != nullptr);
      if (refused) std::rethrow_exception(refused);
    }
    if (options_.invariant) lay_out_grid(share);
  }

 private:
  /// This rank's part of replan: its share planned, without the agreement.
  void plan_share(const RankQkvMetadata& share) {
    const char* who = "ContextParallelAttention";
    const int me = transport_.rank(), W = transport_.world_size();
    planned_ = forward_done_ = false;
    if (options_.dedup && !share.kv_wire) fail("options.dedup is set but the share has no kv_wire (plan the plan with dedup set)");
    fan_.plan(share, options_.dedup, kv_token_bytes(), me, W);
    q_planner_.plan(share.q_fwd, share.q_rev, q_token_elems() * sizeof(E), me, W, who, q_plan_);
    kv_planner_.plan(share.kv_fwd, share.kv_rev, kv_token_bytes(), me, W, who, kv_plan_);
    if (!share.kv_rev.seq_recv_mask) fail("share.kv_rev has no seq_recv_mask (not the reverse key-value slice of a QKV plan)");
    kv_rev_ = share.kv_rev;
    layout_ = share.attn;
    check_layout();
    hp_.plan(share, shape_, me, W, who, options_.invariant, mlp_tokens());
    if (options_.invariant) inv_.plan(share, kv_token_elems(), options_.dedup, me, W, who);
    if constexpr (!attention_kernel_folds_shared_rows<Kernel>()) row_check_.separate_rows(who, "replan", hp_.entries());
    lay_out_entries();
    stage_plan_.build(entries_, entry_begin_, layout_.cu_seqlens_q, layout_.cu_seqlens_kv, share.q_rev, share.kv_rev, me, W, groups_,
                      attention_kernel_folds_shared_rows<Kernel>(), who);
    hp_.cut_rounds(share.hp_rev, stage_plan_.rounds(), [&](std::int64_t home) { return stage_plan_.round_of(home); });
    size_buffers();
    path_.clear();
    lay_out_exchanges(me, W);
    fan_.lay_out(path_, stage_plan_);
    hp_.lay_out(path_);
    const RankMetadata& combine_rev = fan_.active() ? fan_.reverse_slice() : kv_rev_;
    combine_id_ = path_.add_combine(combine_rev, kv_token_bytes());
    if (options_.invariant) inv_.lay_out(path_, fan_.round_fans(), static_cast<std::size_t>(stage_plan_.rounds()), combine_rev, me, W);
    path_.commit();
    prepare_kernel();
    planned_ = true;
  }

 public:
  /// This rank's tokens in the MLP layout (the leading extent of q, k, v, ...).
  std::int64_t mlp_tokens() const noexcept { return q_plan_.forward.input_tokens; }
  const RankAttentionLayout& attention() const noexcept { return layout_; }
  const AttentionMask& mask() const noexcept { return layout_.mask; }
  const AttentionShape& shape() const noexcept { return shape_; }
  const CpAttentionOptions& options() const noexcept { return options_; }
  /// The last forward's log-sum-exp in the attention layout, [heads_q][q tokens] (in the transport's memory).
  buffer<const float> lse() const noexcept { return {lse_.data(), lse_.size()}; }
  /// This rank's head-parallel documents (section 2f; degree 0 when the plan
  /// has none): whole documents for the query heads [c * heads_q / u, +
  /// heads_q / u) of group rank c = group_rank. attention() and lse() hold
  /// only the dispatched documents.
  const RankHeadParallelLayout& head_parallel() const noexcept { return hp_.layout(); }
  /// The last forward's log-sum-exp of the head-parallel documents, [heads_q / u][their tokens] (in the transport's memory).
  buffer<const float> head_parallel_lse() const noexcept { return {hp_.lse_buffer().data(), hp_.lse_buffer().size()}; }
  Kernel& kernel() noexcept { return kernel_; }

  /// q: [T][heads_q][head_dim], k, v: [T][heads_kv][head_dim] -> out: [T][heads_q][head_dim].
  void forward(buffer<const E> q, buffer<const E> k, buffer<const E> v, buffer<E> out) {
    const char* call = "forward";
    if (!planned_) fail("forward needs a plan: the last replan threw");
    check_mlp(call, {{q.size(), "q", true}, {k.size(), "k", false}, {v.size(), "v", false}, {out.size(), "out", true}});
    forward_done_ = false;
    const auto in_all = forward_inputs(q.data(), k.data(), v.data());
    const Tensors in = with_head_parallel(in_all);
    if (options_.invariant) {
      forward_invariant(call, in, q, v);
    } else if (groups_ == 0) {  // one exchange, then one kernel call over the whole layout
      exchange_all(call, fwd_in_, in);
      fan_out(0);
      clear_stray_forward();
      traced("kernel", call, -1, 0, [&] {
        kernel_.forward(shape_, std::span<const AttentionEntry>(entries_), read(q_attn_), read(k_attn_), read(v_attn_), view(out_attn_), view(lse_));
      });
      attend_head_parallel(true, 0);
    } else {
      forward_by_stages(call, in);
    }
    const auto back = outputs_home(out.data());
    exchange_all(call, out_home_, with_head_parallel(back));
    forward_done_ = true;
  }

  /// dout: [T][heads_q][head_dim] -> dq like q, dk and dv like k and v (every copy's gradient summed).
  void backward(buffer<const E> dout, buffer<E> dq, buffer<E> dk, buffer<E> dv) {
    const char* call = "backward";
    if (!forward_done_) fail("backward needs the forward of the same plan first");
    check_mlp(call, {{dout.size(), "dout", true}, {dq.size(), "dq", true}, {dk.size(), "dk", false}, {dv.size(), "dv", false}});
    const auto in_all = dout_inputs(dout.data());
    const Tensors in = with_head_parallel(in_all);
    const auto kv = kv_gradients();
    if (options_.invariant) return backward_invariant(call, in, dout, dq, dk, dv);
    clear_stray_backward();
    if (groups_ == 0) {
      exchange_all(call, dout_in_, in);
      traced("kernel", call, -1, 0, [&] {
        kernel_.backward(shape_, std::span<const AttentionEntry>(entries_), read(q_attn_), read(k_attn_), read(v_attn_), read(out_attn_), read(lse_),
                         read(dout_attn_), view(dq_attn_), view(dk_attn_), view(dv_attn_));
      });
      fan_in(0);  // one round: every shard's copies
      post_kv_gradients(call, kv, 0);
      attend_head_parallel(false, 0);  // while the dispatched key-value gradients travel
    } else {
      backward_by_stages(call, in, kv);
    }
    finish_kv_gradients(call, kv, dk, dv);  // before the head-parallel gradients land in dk and dv (its sum writes every token)
    const auto back = gradients_home(dq.data(), dk.data(), dv.data());
    exchange_all(call, grads_home_, with_head_parallel(back));
    hp_.gather_gradients(path_, bytes(dk.data()), bytes(dv.data()));
  }

 private:
  using Tensors = std::span<const detail::StagedTensor>;
  using Exchange = detail::StagedExchange<Path>;
  /// An exchange's tensors: the first `dispatched`, then the head-parallel part's.
  template <std::size_t N>
  struct HeadParallelLast {
    std::array<detail::StagedTensor, N> tensors;
    std::size_t dispatched;
  };

  static constexpr std::size_t agreement_slots = 3;
  static constexpr const char* slot_names[agreement_slots] = {"query", "key-value", "head-parallel"};

  /// Plan agreement (execute/plan_agreement.hpp): this rank's record to every
  /// rank, then the same verdict everywhere. A rank that refused its share
  /// takes part, so that its peers throw too, and then throws its own error.
  void agree(const RankQkvMetadata& share, bool refused_here) {
    const int W = transport_.world_size();
    const RankMetadata* kv_fwd = options_.dedup && share.kv_wire ? &share.kv_wire->fwd : &share.kv_fwd;
    const RankMetadata* kv_rev = options_.dedup && share.kv_wire ? &share.kv_wire->rev : &share.kv_rev;
    const detail::AgreementSlot slots[] = {{slot_names[0], &share.q_fwd, &share.q_rev}, {slot_names[1], kv_fwd, kv_rev}, {slot_names[2], &share.hp_fwd, &share.hp_rev}};
    detail::AgreementHeader h;
    h.world_size = share.q_fwd.world_size;
    h.config = detail::agreement_hash({sizeof(E), static_cast<std::uint64_t>(element_type_of<E>()), static_cast<std::uint64_t>(shape_.heads_q),
                                       static_cast<std::uint64_t>(shape_.heads_kv), static_cast<std::uint64_t>(shape_.head_dim), options_.dedup,
                                       static_cast<std::uint64_t>(groups_), options_.invariant,
                                       static_cast<std::uint64_t>(options_.invariant ? options_.grid : 0)});
    h.mask = detail::agreement_hash({static_cast<std::uint64_t>(share.attn.mask.type), static_cast<std::uint64_t>(share.attn.mask.window)});
    h.layout = detail::agreement_hash({share.kv_fwd.has_copies, share.kv_fwd.num_copies, static_cast<std::uint64_t>(share.hp_attn.degree)});
    agreement_.build(transport_.rank(), h, slots, refused_here);
    try {
      agreement_.exchange(transport_);
    } catch (...) {
      planned_ = false;
      detail::rethrow_exchange_failure(transport_.rank(), W, "replan (plan agreement)");
    }
    if (refused_here) return;
    try {
      agreement_.check("ContextParallelAttention::replan", transport_.rank(), slot_names);
    } catch (...) {
      planned_ = false;
      throw;
    }
  }

  /// Runs a transport call, naming the op's call in front of its error.
  template <class F>
  auto exchange(const char* call, F&& f) {
    try {
      return f();
    } catch (...) {
      detail::rethrow_exchange_failure(transport_.rank(), transport_.world_size(), call);
    }
  }

  /// The forward plan of the key-values: the wire's with dedup (each shard once, at its first copy).
  const detail::ExchangePlan* kv_forward() const noexcept { return fan_.active() ? &fan_.forward() : &kv_plan_.forward; }
  /// Their gradients' reverse plan: with dedup the wire's, from each shard's first copy (after the fan-in).
  const detail::ExchangePlan* kv_reverse() const noexcept { return fan_.active() ? &fan_.reverse() : &kv_plan_.reverse; }

  /// A list of each exchange's tensors (below): its dispatched tensors, and
  /// the head-parallel part's after them where the plan has some.
  template <std::size_t N>
  Tensors with_head_parallel(const HeadParallelLast<N>& all) const noexcept {
    return Tensors(all.tensors).first(hp_.active() ? N : all.dispatched);
  }

  // Each exchange's tensors, in the one order its lay-out and its calls
  // share (the caller's buffers null when it is laid out). The head-parallel
  // part's tensors ride the dispatched ones' post (its outputs and gradients
  // go home with the queries').
  HeadParallelLast<6> forward_inputs(const E* q, const E* k, const E* v) {
    return {{{{&q_plan_.forward, bytes(q), bytes(q_attn_)},
              {kv_forward(), bytes(k), bytes(k_attn_)},
              {kv_forward(), bytes(v), bytes(v_attn_)},
              {hp_.q_in(), bytes(q), hp_.q()},
              {hp_.kv_in(), bytes(k), hp_.k()},
              {hp_.kv_in(), bytes(v), hp_.v()}}},
            3};
  }
  HeadParallelLast<2> dout_inputs(const E* dout) { return {{{{&q_plan_.forward, bytes(dout), bytes(dout_attn_)}, {hp_.q_in(), bytes(dout), hp_.dout()}}}, 1}; }
  HeadParallelLast<2> outputs_home(E* out) { return {{{{&q_plan_.reverse, bytes(out_attn_), bytes(out)}, {hp_.q_back(), hp_.out(), bytes(out)}}}, 1}; }
  /// dk and dv of the head-parallel part as it sends them (exact sums in the invariant mode).
  HeadParallelLast<4> gradients_home(E* dq, E* dk, E* dv) {
    return {{{{&q_plan_.reverse, bytes(dq_attn_), bytes(dq)},
              {hp_.q_back(), hp_.dq(), bytes(dq)},
              {hp_.kv_back(), hp_.dk_back(), hp_.dk_home(bytes(dk))},
              {hp_.kv_back(), hp_.dv_back(), hp_.dv_home(bytes(dv))}}},
            1};
  }
  std::array<detail::StagedTensor, 2> kv_gradients() {
    return {{{kv_reverse(), bytes(dk_attn_), bytes(replica_)}, {kv_reverse(), bytes(dv_attn_), bytes(replica_v_)}}};
  }

  /// The exchanges, each ONE post per stage group.
  void lay_out_exchanges(int me, int W) {
    fwd_in_.lay_out(path_, with_head_parallel(forward_inputs(nullptr, nullptr, nullptr)), me, W, groups_, true);
    dout_in_.lay_out(path_, with_head_parallel(dout_inputs(nullptr)), me, W, groups_, true);
    out_home_.lay_out(path_, with_head_parallel(outputs_home(nullptr)), me, W, 0, false);
    grads_home_.lay_out(path_, with_head_parallel(gradients_home(nullptr, nullptr, nullptr)), me, W, 0, false);
    kv_out_.lay_out(path_, kv_gradients(), me, W, groups_, false);
  }

  /// Tells the kernel every entry list this plan's calls pass (where it can be told).
  void prepare_kernel() {
    if constexpr (PreparedAttentionKernel<Kernel>) {
      calls_.clear();
      if (groups_ == 0) calls_.push_back(std::span<const AttentionEntry>(entries_));
      for (const detail::StagePass& pass : stage_plan_.passes()) {
        if (groups_ > 0) calls_.push_back(parts_of(pass));
      }
      for (int round = 0; round < hp_.rounds() && !options_.invariant; ++round) {
        if (!hp_.round_entries(round).empty()) calls_.push_back(hp_.round_entries(round));
      }
      if (options_.invariant && !hp_.entries().empty()) calls_.push_back(hp_.entries());
      kernel_.prepare(std::span<const std::span<const AttentionEntry>>(calls_));
    }
  }

  /// The fan-in of the key-value gradients of round `round`'s shards: each
  /// shard's copies summed at its first copy, whence the wire takes it home
  /// (nothing without dedup). Run once per round, when they are complete.
  void fan_in(int round) {
    if (!fan_.active()) return;
    traced("fan-in", "backward", round, 0, [&] {
      for (owned<E>* b : {&dk_attn_, &dv_attn_}) fan_.fan_in(path_, round, element_type_of<E>(), bytes(*b));
    });
  }

  /// The fan-out of round `round`'s key-values: each shard's first copy to its other places (nothing without dedup).
  void fan_out(int round) {
    if (!fan_.active()) return;
    traced("fan-out", "forward", round, 0, [&] {
      for (owned<E>* b : {&k_attn_, &v_attn_}) fan_.fan_out(path_, round, bytes(*b));
    });
  }

  /// Posts every stage group of `ex`, after the traffic to this rank itself.
  void post_groups(const char* call, Exchange& ex, Tensors tensors) {
    traced("copy self", call, -1, 0, [&] { ex.copy_self(path_, tensors); });
    for (int g = 0; g < groups_; ++g) requests_[static_cast<std::size_t>(g)] = post(call, ex, tensors, g);
  }

  void await_group(const char* call, Exchange& ex, Tensors tensors, int g) {
    traced("wait", call, g, 0, [&] { exchange(call, [&] { Exchange::wait(transport_, requests_[static_cast<std::size_t>(g)]); }); });
    traced("unpack", call, g, 0, [&] { ex.finish(path_, tensors, g); });
  }

  /// Packs and posts group g of `ex`.
  Request post(const char* call, Exchange& ex, Tensors tensors, int g) {
    return traced("post", call, g, options_.trace ? ex.group_bytes(g) : 0, [&] { return exchange(call, [&] { return ex.post(transport_, path_, tensors, g); }); });
  }

  /// One exchange of every peer at once (`ex` laid out in one group), waited for at once.
  void exchange_all(const char* call, Exchange& ex, Tensors tensors) {
    traced("copy self", call, -1, 0, [&] { ex.copy_self(path_, tensors); });
    if (transport_.world_size() == 1) return;
    const Request r = post(call, ex, tensors, 0);
    traced("wait", call, 0, 0, [&] { exchange(call, [&] { Exchange::wait(transport_, r); }); });
    traced("unpack", call, 0, 0, [&] { ex.finish(path_, tensors, 0); });
  }

  /// Runs f, recorded as one event of the step's timeline where options.trace asks for one.
  template <class F>
  decltype(auto) traced(const char* name, const char* call, int group, std::int64_t bytes, F&& f) {
    if (options_.trace == nullptr) return std::forward<F>(f)();
    return options_.trace->record(name, call, group, bytes, std::forward<F>(f));
  }

  // ---- The invariant mode (attention/detail/invariant_part.hpp) ----

  /// Whether this op has the invariant path: a kernel with the mode.
  static constexpr bool invariant_path = InvariantAttentionKernel<Kernel, E>;

  void check_invariant_options() const {
    if constexpr (!invariant_path) {
      fail("options.invariant: the kernel has no invariant mode (InvariantAttentionKernel, attention/invariant.hpp); HostAttentionKernel and "
           "CudaAttentionKernel have one, while cuDNN and flash-attention kernels cannot promise the same bits for every split");
    }
    if (options_.grid < 1 || options_.grid > (std::int64_t{1} << 40)) fail("options.grid = ", options_.grid, " must be in [1, 2^40]");
  }

  /// Each entry's phase on the grid, and the share's cuts checked (a collective).
  void lay_out_grid(const RankQkvMetadata& share) {
    try {
      inv_.lay_out_grid(transport_, options_.grid, mlp_tokens(), layout_, entries_, entry_begin_, share.q_rev, share.kv_rev,
                        "ContextParallelAttention::replan");
      inv_.lay_out_head_parallel(hp_.layout(), hp_.entries(), share.hp_rev);
    } catch (...) {
      planned_ = false;
      throw;
    }
  }

  /// Every stage group of `ex` received (key-values fanned out per round with `fan`).
  void receive_all(const char* call, Exchange& ex, Tensors tensors, bool fan) {
    if (groups_ == 0) {
      exchange_all(call, ex, tensors);
      if (fan) fan_out(0);
      return;
    }
    post_groups(call, ex, tensors);
    if (fan) fan_out(0);
    for (int round = 1; round < stage_plan_.rounds(); ++round) {
      await_group(call, ex, tensors, round - 1);
      if (fan) fan_out(round);
    }
  }

  /// One invariant kernel call over the whole layout, once every key-value is here.
  void forward_invariant(const char* call, Tensors in, buffer<const E> q, buffer<const E> v) {
    if constexpr (invariant_path) {
      max_q_ = path_.max_abs(q.data(), q.size());
      max_v_ = path_.max_abs(v.data(), v.size());
      receive_all(call, fwd_in_, in, true);
      if (stray_rows_) {
        path_.zero(bytes(out_attn_), out_attn_.size() * sizeof(E));
        path_.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
      }
      agree_on_kernels(call, [&] {
        traced("kernel", call, -1, 0, [&] {
          kernel_.forward_invariant(shape_, inv_.grid(), std::span<const AttentionEntry>(entries_), read(q_attn_), read(k_attn_), read(v_attn_),
                                    view(out_attn_), view(lse_));
        });
        if (hp_.active()) {
          traced("kernel (head-parallel)", call, -1, 0, [&] { hp_.attend_forward_invariant(kernel_, path_, inv_.head_parallel_grid()); });
        }
      });
    }
  }

  /// Runs the step's invariant kernel calls, which throw on a score or sum
  /// that is not finite (a NaN or infinity in the inputs), and refuses the
  /// step on every rank where one threw (a collective).
  template <class F>
  void agree_on_kernels(const char* call, F&& kernels) {
    inv_.agree_on(transport_, std::forward<F>(kernels), [&](std::size_t r) {
      fail("ContextParallelAttention::", call, " (rank ", transport_.rank(), " of ", transport_.world_size(), "): options.invariant: rank ", r,
           "'s kernel refused the step (its error names the row: a NaN or infinity in the inputs?)");
    });
  }

  /// dq as the default path sends it home; dk and dv as exact sums: fanned
  /// in and summed over copies as integers, rounded once at home.
  void backward_invariant(const char* call, Tensors in, buffer<const E> dout, buffer<E> dq, buffer<E> dk, buffer<E> dv) {
    if constexpr (invariant_path) {
      receive_all(call, dout_in_, in, false);
      if (stray_rows_) path_.zero(bytes(dq_attn_), dq_attn_.size() * sizeof(E));
      const InvariantBounds bounds = exchange(call, [&] { return inv_.agree_bounds(transport_, max_q_, max_v_, path_.max_abs(dout.data(), dout.size()), mlp_tokens()); });
      const KvGradientExponents ex = kv_gradient_exponents(shape_, bounds);
      for (auto* b : {&inv_.dk(), &inv_.dv()}) path_.zero(bytes(*b), b->size() * sizeof(std::int64_t));
      agree_on_kernels(call, [&] {
        traced("kernel", call, -1, 0, [&] {
          kernel_.backward_invariant(shape_, inv_.grid(), std::span<const AttentionEntry>(entries_), read(q_attn_), read(k_attn_), read(v_attn_),
                                     read(out_attn_), read(lse_), read(dout_attn_), view(dq_attn_), {view(inv_.dk()), view(inv_.dv()), ex.dk, ex.dv});
        });
        if (hp_.active()) {
          traced("kernel (head-parallel)", call, -1, 0, [&] { hp_.attend_backward_invariant(kernel_, path_, inv_.head_parallel_grid(), ex.dk, ex.dv); });
        }
      });
      for (std::size_t id : inv_.fan_in_ids()) {
        for (auto* b : {&inv_.dk(), &inv_.dv()}) path_.fan_in(id, ElementType::int64, bytes(*b));
      }
      exchange_all(call, inv_.home(), inv_.exact_home());
      const auto back = gradients_home(dq.data(), dk.data(), dv.data());
      exchange_all(call, grads_home_, with_head_parallel(back));
      const std::size_t replica_bytes = inv_.replica_k().size() * sizeof(std::int64_t), home_bytes = inv_.home_k().size() * sizeof(std::int64_t);
      path_.combine(inv_.combine_id(), ElementType::int64, bytes(inv_.replica_k()), replica_bytes, bytes(inv_.home_k()), home_bytes);
      path_.combine(inv_.combine_id(), ElementType::int64, bytes(inv_.replica_v()), replica_bytes, bytes(inv_.home_v()), home_bytes);
      path_.round_exact(inv_.home_k().data(), ex.dk, dk.data(), dk.size());
      path_.round_exact(inv_.home_v().data(), ex.dv, dv.data(), dv.size());
      hp_.gather_gradients_invariant(path_, bytes(dk.data()), bytes(dv.data()), ex.dk, ex.dv);
    }
  }

  std::span<const AttentionEntry> parts_of(const detail::StagePass& pass) const {
    return stage_plan_.parts().subspan(pass.begin, pass.end - pass.begin);
  }

  void forward_by_stages(const char* call, Tensors in) {
    post_groups(call, fwd_in_, in);
    path_.fill(acc_.data(), acc_.size(), 0.0f);
    path_.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
    const auto passes = stage_plan_.passes();
    std::size_t next = 0;
    for (int round = 0; round < stage_plan_.rounds(); ++round) {
      if (round > 0) await_group(call, fwd_in_, in, round - 1);
      fan_out(round);
      for (; next < passes.size() && passes[next].round == round; ++next) attend_forward(parts_of(passes[next]), round);
      attend_head_parallel(true, round);  // the documents whole by now, while later rounds travel
    }
    path_.store(acc_.data(), out_attn_.data(), acc_.size());
  }

  /// One pass (a round's parts, each query row's folded by the kernel): the
  /// kernel's partial output, folded into the running one through the
  /// log-sum-exp (rows outside the pass keep lse_part = -inf).
  void attend_forward(std::span<const AttentionEntry> parts, int round) {
    path_.fill(lse_part_.data(), lse_part_.size(), -std::numeric_limits<float>::infinity());
    traced("kernel", "forward", round, 0, [&] {
      kernel_.forward(shape_, parts, read(q_attn_), read(k_attn_), read(v_attn_), view(out_part_), view(lse_part_));
    });
    traced("merge", "forward", round, 0, [&] {
      path_.merge(acc_.data(), lse_.data(), out_part_.data(), lse_part_.data(), layout_.q_tokens(), shape_.heads_q, shape_.head_dim);
    });
  }

  void backward_by_stages(const char* call, Tensors in, Tensors kv) {
    post_groups(call, dout_in_, in);
    path_.fill(acc_.data(), acc_.size(), 0.0f);
    const auto passes = stage_plan_.passes();
    std::size_t next = 0;
    int posted = 0;
    for (int round = 0; round < stage_plan_.rounds(); ++round) {
      if (round > 0) await_group(call, dout_in_, in, round - 1);
      for (; next < passes.size() && passes[next].round == round; ++next) attend_backward(parts_of(passes[next]), round);
      // The KV gradients of a group go home as soon as they are complete, in group order on every rank.
      for (; posted < groups_ && stage_plan_.kv_ready(posted) <= round; ++posted) {
        fan_in(posted + 1);
        post_kv_gradients(call, kv, posted);
      }
      attend_head_parallel(false, round);
    }
    path_.store(acc_.data(), dq_attn_.data(), acc_.size());
  }

  /// One pass: dq shares summed in fp32 (rows outside the pass add zero); dk,
  /// dv of the pass's key rows written in place (each key row is in one pass).
  void attend_backward(std::span<const AttentionEntry> parts, int round) {
    path_.zero(bytes(out_part_), out_part_.size() * sizeof(E));
    traced("kernel", "backward", round, 0, [&] {
      kernel_.backward(shape_, parts, read(q_attn_), read(k_attn_), read(v_attn_), read(out_attn_), read(lse_), read(dout_attn_), view(out_part_),
                       view(dk_attn_), view(dv_attn_));
    });
    traced("merge", "backward", round, 0, [&] { path_.accumulate(acc_.data(), out_part_.data(), acc_.size()); });
  }

  /// The head-parallel documents whose slabs (forward: Q, K, V; backward:
  /// dout) are all here by round `round`: the kernel over them.
  void attend_head_parallel(bool forward, int round) {
    if (!hp_.active()) return;
    const auto attend = [&] { if (forward) hp_.attend_forward(kernel_, path_, round); else hp_.attend_backward(kernel_, path_, round); };
    if (hp_.round_entries(round).empty()) return attend();  // no kernel pass (round 0 may still clear rows no entry covers)
    traced("kernel (head-parallel)", forward ? "forward" : "backward", round, 0, attend);
  }

  /// Posts group `g`'s KV gradients home (with one group, every peer's).
  void post_kv_gradients(const char* call, Tensors kv, int g) {
    if (transport_.world_size() == 1) return;
    kv_requests_[static_cast<std::size_t>(g)] = post(call, kv_out_, kv, g);
  }

  /// Waits for the KV gradients, adds this rank's own, and sums every copy into dk, dv.
  void finish_kv_gradients(const char* call, Tensors kv, buffer<E> dk, buffer<E> dv) {
    if (groups_ > 0) fan_in(0);  // this rank's own shards (with one round, fanned in before the post)
    traced("copy self", call, -1, 0, [&] { kv_out_.copy_self(path_, kv); });
    if (transport_.world_size() > 1) {
      for (int g = 0; g < kv_out_.groups(); ++g) {
        traced("wait", call, g, 0, [&] { exchange(call, [&] { Exchange::wait(transport_, kv_requests_[static_cast<std::size_t>(g)]); }); });
        traced("unpack", call, g, 0, [&] { kv_out_.finish(path_, kv, g); });
      }
    }
    const std::size_t replica_bytes = replica_.size() * sizeof(E), grad_bytes = dk.size() * sizeof(E);
    traced("combine", call, -1, 0, [&] {
      path_.combine(combine_id_, element_type_of<E>(), bytes(replica_), replica_bytes, bytes(dk.data()), grad_bytes);
      path_.combine(combine_id_, element_type_of<E>(), bytes(replica_v_), replica_bytes, bytes(dv.data()), grad_bytes);
    });
  }

  template <class U>
  static const std::byte* bytes(const U* p) noexcept { return reinterpret_cast<const std::byte*>(p); }
  template <class U>
  static std::byte* bytes(U* p) noexcept { return reinterpret_cast<std::byte*>(p); }
  /// An owned buffer's bytes.
  template <class B>
  static std::byte* bytes(B& b) noexcept { return reinterpret_cast<std::byte*>(b.data()); }
  /// An owned buffer as the kernel takes it (a span over the transport's memory).
  template <class B>
  static auto view(B& b) noexcept { return std::span(b.data(), b.size()); }
  template <class B>
  static auto read(const B& b) noexcept { return std::span(b.data(), b.size()); }

  template <class... Args>
  [[noreturn]] void fail(Args&&... args) const {
    detail::fail("ContextParallelAttention (rank ", transport_.rank(), " of ", transport_.world_size(), "): ", std::forward<Args>(args)...);
  }

  std::size_t q_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_q * shape_.head_dim); }
  std::size_t kv_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }
  std::size_t kv_token_bytes() const noexcept { return kv_token_elems() * sizeof(E); }

  void check_mlp(const char* call, std::initializer_list<detail::MlpBuffer> buffers) const {
    detail::check_mlp_sizes(transport_.rank(), transport_.world_size(), call, mlp_tokens(), shape_, buffers);
  }

  /// The attention layout must describe what the exchanges deliver, and the MLP layouts of Q and KV agree.
  void check_layout() const {
    if (layout_.cu_seqlens_q.size() != layout_.cu_seqlens_kv.size()) {
      fail("share.attn has ", layout_.cu_seqlens_q.size(), " cu_seqlens_q but ", layout_.cu_seqlens_kv.size(), " cu_seqlens_kv");
    }
    const std::size_t shards = layout_.cu_seqlens_q.empty() ? 0 : layout_.cu_seqlens_q.size() - 1;
    if (!layout_.entries.empty() && layout_.entries.size() != shards) {
      fail("share.attn has entries for ", layout_.entries.size(), " query shards but ", shards, " query shards");
    }
    if (layout_.q_tokens() != q_plan_.forward.output_tokens || layout_.kv_tokens() != kv_plan_.forward.output_tokens) {
      fail("share.attn holds ", layout_.q_tokens(), " query and ", layout_.kv_tokens(), " key-value tokens, but the share's metadata delivers ",
           q_plan_.forward.output_tokens, " and ", kv_plan_.forward.output_tokens, " (not one plan's share)");
    }
    if (q_plan_.forward.input_tokens != kv_plan_.forward.input_tokens) {
      fail("share.q_fwd holds ", q_plan_.forward.input_tokens, " tokens but share.kv_fwd ", kv_plan_.forward.input_tokens, " (not one plan's share)");
    }
  }

  /// The kernel's entries (share_entries). A kernel that cannot fold shared
  /// rows gets only entries that share none.
  void lay_out_entries() {
    if (!detail::share_entries(layout_, entries_, entry_begin_)) {
      stray_rows_ = stray_keys_ = false;  // each KV group's entry covers its query shard's rows and all its keys
      return;
    }
    if constexpr (!attention_kernel_folds_shared_rows<Kernel>()) row_check_.separate_rows("ContextParallelAttention", "replan", entries_);
    // A kernel writes only the rows of its entries; a plan's own entries may leave some out.
    cover_.build(entries_, detail::attention::CoverSide::query);
    stray_rows_ = cover_.rows() != layout_.q_tokens();
    cover_.build(entries_, detail::attention::CoverSide::key);
    stray_keys_ = cover_.rows() != layout_.kv_tokens();
  }

  /// Rows no entry covers see nothing: out 0 and lse -inf (one kernel call
  /// over the layout; the staged path starts every row so), dq 0, and keys
  /// no entry covers get dk = dv = 0, written before the kernel writes the rest.
  void clear_stray_forward() {
    if (!stray_rows_ || groups_ > 0) return;
    path_.zero(bytes(out_attn_), out_attn_.size() * sizeof(E));
    path_.fill(lse_.data(), lse_.size(), -std::numeric_limits<float>::infinity());
  }
  void clear_stray_backward() {
    if (stray_rows_ && groups_ == 0) path_.zero(bytes(dq_attn_), dq_attn_.size() * sizeof(E));
    if (!stray_keys_) return;
    for (owned<E>* b : {&dk_attn_, &dv_attn_}) path_.zero(bytes(*b), b->size() * sizeof(E));
  }

  void size_buffers() {
    const auto tq = static_cast<std::size_t>(layout_.q_tokens()), tk = static_cast<std::size_t>(layout_.kv_tokens());
    for (owned<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_, &out_part_}) b->resize(tq * q_token_elems());
    for (owned<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) b->resize(tk * kv_token_elems());
    for (owned<float>* b : {&lse_, &lse_part_}) b->resize(tq * static_cast<std::size_t>(shape_.heads_q));
    acc_.resize(tq * q_token_elems());
    std::int64_t replica = kv_plan_.reverse.output_tokens;
    if (fan_.active()) replica = std::max(replica, fan_.replica_tokens());
    for (owned<E>* b : {&replica_, &replica_v_}) b->resize(static_cast<std::size_t>(replica) * kv_token_elems());
    if (options_.invariant) inv_.size(tk * kv_token_elems(), static_cast<std::size_t>(mlp_tokens()) * kv_token_elems());
  }

  T& transport_;
  AttentionShape shape_;
  CpAttentionOptions options_;
  Kernel kernel_;
  Path path_;
  int groups_ = 0;  // stage groups of remote peers (0: one exchange, no overlap)
  detail::DispatchPlanner q_planner_, kv_planner_;  // their storage, kept between plans
  detail::DispatchPlan q_plan_, kv_plan_;
  RankMetadata kv_rev_;
  RankAttentionLayout layout_;
  std::vector<AttentionEntry> entries_;                 // the kernel's, in the attention buffers' rows
  std::vector<std::size_t> entry_begin_;                // where each query shard's entries start in entries_ (one past the last at the end)
  detail::attention::CallCheck row_check_;              // for a kernel that cannot fold shared rows
  detail::attention::RowCover cover_;                   // the rows entries_ cover (lay_out_entries' scratch)
  bool stray_rows_ = false, stray_keys_ = false;        // some query row / key row is in no entry
  std::vector<std::span<const AttentionEntry>> calls_;  // what the kernel is told to expect
  detail::StagePlan stage_plan_;
  std::size_t combine_id_ = 0;
  Exchange fwd_in_, dout_in_, out_home_, grads_home_, kv_out_;
  detail::KvFanPart<Path> fan_;           // with dedup: the wire and the key-value shards' fan-out and fan-in
  detail::HeadParallelPart<Path, E> hp_;  // the plan's head-parallel documents on this rank
  detail::InvariantPart<Path> inv_;       // options.invariant's grid and exact key-value gradients
  double max_q_ = 0, max_v_ = 0;          // this rank's largest |q| and |v| of the last forward (invariant mode)
  owned<E> q_attn_, k_attn_, v_attn_, out_attn_, dout_attn_, dq_attn_, dk_attn_, dv_attn_, replica_, replica_v_;
  owned<E> out_part_;            // a pass's output (forward) or dq (backward)
  owned<float> lse_, lse_part_;  // the merged log-sum-exp; a pass's
  owned<float> acc_;             // the running fp32 output (forward) or dq (backward)
  std::vector<Request> requests_, kv_requests_;
  detail::PlanAgreement agreement_;  // sized once: its records depend on the world size alone
  bool forward_done_ = false;
  bool planned_ = false;
};

}  // namespace cpdispatch
