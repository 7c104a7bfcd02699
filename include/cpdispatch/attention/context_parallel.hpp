#pragma once
// Context-parallel attention: one object per attention layer and rank that
// takes this rank's queries, keys and values in its MLP layout, attends every
// query to its document's keys under the plan's mask wherever they live, and
// returns the output (forward) and the gradients (backward) in the MLP layout.
// The result equals attention over each whole document.
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
// What forward keeps for backward (the attention-layout Q, K, V, output and
// log-sum-exp) is owned by the object and reused across steps. Every call is
// a collective of the transport: all ranks make the same calls in the same
// order. The transport is held by reference and must outlive the object.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/detail/lse_merge.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/attention/detail/staged_exchange.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/execute/dedup.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
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

/// The plan's mask as this rank's share carries it.
inline AttentionMask mask_of(const RankQkvMetadata& share) { return share.attn.mask; }

/// The share's slices of the deduplicated exchange, null when it has none.
inline const RankKvWire* kv_wire_of(const RankQkvMetadata& share) { return share.kv_wire ? &*share.kv_wire : nullptr; }

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

template <class E>
std::span<const std::byte> bytes_of(std::span<const E> s) { return std::as_bytes(s); }
template <class E>
std::span<std::byte> bytes_of(std::span<E> s) { return std::as_writable_bytes(s); }

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

/// One attention layer of one rank. Host transports (sim, MPI) take host
/// spans and are defined here; device transports (the device sim, NCCL) take
/// cuda::DeviceSpan and are defined in cpdispatch/cuda/context_parallel.hpp.
/// `Space` follows from T; never name it.
template <class T, class E, class Kernel = typename default_attention_kernel<T>::type, MemorySpace Space = detail::memory_space_of<T>()>
class ContextParallelAttention;

template <class T, class E, class Kernel>
class ContextParallelAttention<T, E, Kernel, MemorySpace::host> {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                "cpdispatch: ContextParallelAttention's element type is float, bfloat16 or float16");
  static_assert(AttentionKernel<Kernel, E>, "cpdispatch: the kernel does not model AttentionKernel<Kernel, E> (attention/kernel.hpp)");
  static_assert(attention_kernel_memory_space<Kernel>() == MemorySpace::host,
                "cpdispatch: a host transport's ContextParallelAttention needs a host kernel (the kernel declares device memory)");

 public:
  using transport_type = T;
  using element_type = E;
  using kernel_type = Kernel;
  /// Whether the exchanges are posted and overlapped with compute (T is a
  /// PostedAllToAllTransport) or made in blocking calls where they would be posted.
  static constexpr bool overlaps = posted_all_to_all_v<T>;

  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options = {},
                           Kernel kernel = Kernel{})
      : transport_(transport), shape_(shape), options_(options), kernel_(std::move(kernel)) {
    detail::check_attention_shape(shape_, "ContextParallelAttention");
    if (options_.stages < 1) fail("options.stages = ", options_.stages, " must be at least 1");
    groups_ = std::min(options_.stages - 1, transport_.world_size() - 1);
    requests_.resize(static_cast<std::size_t>(groups_));
    kv_requests_.resize(static_cast<std::size_t>(std::max(groups_, 1)));
    replan(share);
  }

  /// Sizes every buffer for plans up to `c`, so that replan, forward and
  /// backward allocate nothing while a plan stays within it (with dedup, see
  /// replan).
  void reserve(const CpAttentionCapacity& c) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(std::max<std::int64_t>(x, 0)); };
    const std::size_t hq = q_token_elems(), hk = kv_token_elems();
    for (std::vector<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_, &out_part_}) b->reserve(n(c.q_tokens) * hq);
    for (std::vector<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) b->reserve(n(c.kv_tokens) * hk);
    for (std::vector<E>* b : {&replica_, &replica_v_}) b->reserve(n(c.copies) * n(c.mlp_tokens) * hk);
    for (std::vector<float>* b : {&lse_, &lse_part_}) b->reserve(n(c.q_tokens) * static_cast<std::size_t>(shape_.heads_q));
    acc_.reserve(n(c.q_tokens) * hq);
    entries_.reserve(n(c.shards));
    for (auto* v : {&kv_rev_.dst_rank, &kv_rev_.dst_offset, &kv_rev_.seq_len}) v->reserve(n(c.shards));
    kv_rev_.num_recv_tokens.reserve(static_cast<std::size_t>(transport_.world_size()) + 1);
    for (auto* o : {&kv_rev_.seq_recv_mask, &kv_rev_.recv_seq_lens}) {
      if (!*o) o->emplace();
      (*o)->reserve(n(c.shards) * std::max<std::size_t>(n(c.copies), 1));
    }
    layout_.seqlens_q.reserve(n(c.shards));
    layout_.seqlens_kv.reserve(n(c.shards));
    layout_.cu_seqlens_q.reserve(n(c.shards) + 1);
    layout_.cu_seqlens_kv.reserve(n(c.shards) + 1);
    const auto W = static_cast<std::size_t>(transport_.world_size());
    q_planner_.reserve(q_plan_, n(c.shards), W);
    kv_planner_.reserve(kv_plan_, n(c.shards) * std::max<std::size_t>(n(c.copies), 1), W);
    stage_plan_.reserve(n(c.shards) * std::max<std::size_t>(n(c.copies), 1));
    fan_entries_.reserve(n(c.shards));
    for (auto* v : {&fan_fill_, &fan_entry_splits_}) v->reserve(static_cast<std::size_t>(groups_) + 2);
    const std::size_t copies = std::max<std::size_t>(n(c.copies), 1), mlp = n(c.mlp_tokens), tq = n(c.q_tokens), tk = n(c.kv_tokens);
    const std::size_t e = sizeof(E);  // staging is in bytes: (send, receive)
    fwd_in_.reserve(mlp * (hq + 2 * hk * copies) * e, (tq * hq + 2 * tk * hk) * e);
    dout_in_.reserve(mlp * hq * e, tq * hq * e);
    q_out_.reserve(tq * hq * e, mlp * hq * e);
    kv_out_.reserve(2 * tk * hk * e, copies * mlp * 2 * hk * e);
  }

  /// Takes the next step's share (the plan's mask and, with dedup, its wire
  /// slices). Nothing is allocated while the plan fits what earlier plans or
  /// reserve() sized; with dedup the wire's lists per peer are sized by the
  /// plans seen (reserve does not reach them), so a step allocates nothing
  /// once every plan of its size has been seen.
  void replan(const RankQkvMetadata& share) {
    const char* who = "ContextParallelAttention";
    const int me = transport_.rank(), W = transport_.world_size();
    if (options_.dedup) {
      const RankKvWire* wire = detail::kv_wire_of(share);
      if (wire == nullptr) fail("options.dedup is set but the share has no kv_wire (plan the plan with dedup set)");
      if (kv_wire_) kv_wire_->replan(*wire);
      else kv_wire_.emplace(transport_, *wire, kv_token_elems() * sizeof(E));
    }
    q_planner_.plan(share.q_fwd, share.q_rev, q_token_elems() * sizeof(E), me, W, who, q_plan_);
    kv_planner_.plan(share.kv_fwd, share.kv_rev, kv_token_elems() * sizeof(E), me, W, who, kv_plan_);
    if (!share.kv_rev.seq_recv_mask) fail("share.kv_rev has no seq_recv_mask (not the reverse key-value slice of a QKV plan)");
    copy_kv_rev(share.kv_rev);
    copy_layout(share.attn);
    mask_ = detail::mask_of(share);
    check_layout();
    layout_entries(layout_.cu_seqlens_q, layout_.cu_seqlens_kv, entries_);
    stage_plan_.build(entries_, share.q_rev, share.kv_rev, me, W, groups_, who);
    lay_out_fan();
    lay_out_exchanges(me, W);
    size_buffers();
    forward_done_ = false;
  }

  /// This rank's tokens in the MLP layout (the leading extent of q, k, v, ...).
  std::int64_t mlp_tokens() const noexcept { return q_plan_.forward.input_tokens; }
  const RankAttentionLayout& attention() const noexcept { return layout_; }
  const AttentionMask& mask() const noexcept { return mask_; }
  const AttentionShape& shape() const noexcept { return shape_; }
  const CpAttentionOptions& options() const noexcept { return options_; }
  /// The last forward's log-sum-exp in the attention layout, [heads_q][q tokens].
  std::span<const float> lse() const noexcept { return lse_; }
  Kernel& kernel() noexcept { return kernel_; }

  /// q: [T][heads_q][head_dim], k, v: [T][heads_kv][head_dim] -> out: [T][heads_q][head_dim].
  void forward(std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out) {
    const char* call = "forward";
    check_mlp(call, {{q.size(), "q", true}, {k.size(), "k", false}, {v.size(), "v", false}, {out.size(), "out", true}});
    forward_done_ = false;
    const detail::StagedTensor in[] = {{&q_plan_.forward, bytes_in(q), bytes_out(q_attn_)},
                                       {kv_forward(), bytes_in(k), bytes_out(k_attn_)},
                                       {kv_forward(), bytes_in(v), bytes_out(v_attn_)}};
    if (groups_ == 0) {  // one exchange, then one kernel call over the whole layout
      exchange_all(call, fwd_in_, in);
      fan_out(0);
      kernel_.forward(shape_, mask_, std::span<const AttentionEntry>(entries_), cspan(q_attn_), cspan(k_attn_), cspan(v_attn_),
                      std::span<E>(out_attn_), std::span<float>(lse_));
    } else {
      forward_by_stages(call, in);
    }
    const detail::StagedTensor back[] = {{&q_plan_.reverse, bytes_out(out_attn_), detail::bytes_of(out).data()}};
    exchange_all(call, q_out_, back);
    forward_done_ = true;
  }

  /// dout: [T][heads_q][head_dim] -> dq like q, dk and dv like k and v (every copy's gradient summed).
  void backward(std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    const char* call = "backward";
    if (!forward_done_) fail("backward needs the forward of the same plan first");
    check_mlp(call, {{dout.size(), "dout", true}, {dq.size(), "dq", true}, {dk.size(), "dk", false}, {dv.size(), "dv", false}});
    const detail::StagedTensor in[] = {{&q_plan_.forward, bytes_in(dout), bytes_out(dout_attn_)}};
    const detail::StagedTensor kv[] = {{kv_reverse(), bytes_out(dk_attn_), bytes_out(replica_)},
                                       {kv_reverse(), bytes_out(dv_attn_), bytes_out(replica_v_)}};
    if (groups_ == 0) {
      exchange_all(call, dout_in_, in);
      kernel_.backward(shape_, mask_, std::span<const AttentionEntry>(entries_), cspan(q_attn_), cspan(k_attn_), cspan(v_attn_),
                       cspan(out_attn_), std::span<const float>(lse_), cspan(dout_attn_), std::span<E>(dq_attn_), std::span<E>(dk_attn_),
                       std::span<E>(dv_attn_));
      fan_in(0);  // one round: every shard's copies
      post_kv_gradients(call, kv, detail::StagedExchange::all_groups);
    } else {
      backward_by_stages(call, in, kv);
    }
    const detail::StagedTensor q_back[] = {{&q_plan_.reverse, bytes_out(dq_attn_), detail::bytes_of(dq).data()}};
    exchange_all(call, q_out_, q_back);
    finish_kv_gradients(call, kv, dk, dv);
  }

 private:
  using Tensors = std::span<const detail::StagedTensor>;

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
  const detail::ExchangePlan* kv_forward() const noexcept { return kv_wire_ ? &kv_wire_->plan().forward : &kv_plan_.forward; }
  /// Their gradients' reverse plan: with dedup the wire's, from each shard's first copy (after the fan-in).
  const detail::ExchangePlan* kv_reverse() const noexcept { return kv_wire_ ? &kv_wire_->plan().reverse_in_place : &kv_plan_.reverse; }

  /// With dedup, the fan list's entries with several copies, round by round
  /// (the round their key-values arrive in): forward copies each one's first
  /// copy to its other places, backward sums its copies' gradients there.
  void lay_out_fan() {
    const auto rounds = static_cast<std::size_t>(stage_plan_.rounds());
    fan_entry_splits_.assign(rounds + 1, 0);
    fan_entries_.clear();
    if (!kv_wire_) return;
    const KvFanList& fan = kv_wire_->fan();
    const auto round_of = [&](std::size_t e) { return static_cast<std::size_t>(stage_plan_.round_of(fan.src_rank[e])); };
    for (std::size_t e = 0; e < fan.num_entries(); ++e) {
      if (fan.copies(e).size() > 1) ++fan_entry_splits_[round_of(e) + 1];
    }
    for (std::size_t r = 0; r < rounds; ++r) fan_entry_splits_[r + 1] += fan_entry_splits_[r];
    fan_entries_.resize(fan_entry_splits_[rounds]);
    fan_fill_.assign(fan_entry_splits_.begin(), fan_entry_splits_.end() - 1);
    for (std::size_t e = 0; e < fan.num_entries(); ++e) {
      if (fan.copies(e).size() > 1) fan_entries_[fan_fill_[round_of(e)]++] = e;
    }
  }

  /// Round `round`'s entries of the fan list (none without dedup).
  std::span<const std::size_t> fan_entries(int round) const {
    const auto r = static_cast<std::size_t>(round);
    return std::span<const std::size_t>(fan_entries_).subspan(fan_entry_splits_[r], fan_entry_splits_[r + 1] - fan_entry_splits_[r]);
  }

  /// The fan-in of the key-value gradients of round `round`'s shards: each
  /// shard's copies summed at its first copy, whence the wire takes it home
  /// (nothing without dedup). Run once per round, when they are complete.
  void fan_in(int round) {
    for (std::size_t e : fan_entries(round)) {
      for (std::vector<E>* b : {&dk_attn_, &dv_attn_}) detail::fan_in_entry_in_place<E>(kv_wire_->fan(), e, b->data(), kv_token_elems());
    }
  }

  /// The fan-out of round `round`'s key-values: each shard's first copy to its other places (nothing without dedup).
  void fan_out(int round) {
    const std::size_t width = kv_token_elems();
    for (std::size_t e : fan_entries(round)) {
      const std::span<const std::int64_t> copies = kv_wire_->fan().copies(e);
      const std::size_t count = static_cast<std::size_t>(kv_wire_->fan().seq_len[e]) * width;
      for (std::vector<E>* b : {&k_attn_, &v_attn_}) {
        const E* first = b->data() + static_cast<std::size_t>(copies[0]) * width;
        for (std::size_t c = 1; c < copies.size(); ++c) std::memcpy(b->data() + static_cast<std::size_t>(copies[c]) * width, first, count * sizeof(E));
      }
    }
  }

  void lay_out_exchanges(int me, int W) {
    const detail::ExchangePlan* fwd_in[] = {&q_plan_.forward, kv_forward(), kv_forward()};
    const detail::ExchangePlan* kv_rev[] = {kv_reverse(), kv_reverse()};
    fwd_in_.lay_out(fwd_in, me, W, groups_, true);
    dout_in_.lay_out(std::span(fwd_in).first(1), me, W, groups_, true);
    const detail::ExchangePlan* q_rev[] = {&q_plan_.reverse};
    q_out_.lay_out(q_rev, me, W, groups_, false);
    kv_out_.lay_out(kv_rev, me, W, groups_, false);
  }

  /// Posts every stage group of `ex`, after the traffic to this rank itself.
  void post_groups(const char* call, detail::StagedExchange& ex, Tensors tensors) {
    detail::StagedExchange::copy_self(tensors);
    for (int g = 0; g < groups_; ++g) requests_[static_cast<std::size_t>(g)] = exchange(call, [&] { return ex.post(transport_, tensors, g); });
  }

  void await_group(const char* call, detail::StagedExchange& ex, Tensors tensors, int g) {
    exchange(call, [&] { detail::StagedExchange::wait(transport_, requests_[static_cast<std::size_t>(g)]); });
    ex.finish(tensors, g);
  }

  /// One exchange of every peer at once, waited for at once.
  void exchange_all(const char* call, detail::StagedExchange& ex, Tensors tensors) {
    detail::StagedExchange::copy_self(tensors);
    if (transport_.world_size() == 1) return;
    const Request r = exchange(call, [&] { return ex.post(transport_, tensors, detail::StagedExchange::all_groups); });
    exchange(call, [&] { detail::StagedExchange::wait(transport_, r); });
    ex.finish(tensors, detail::StagedExchange::all_groups);
  }

  std::span<const AttentionEntry> parts_of(const detail::StagePass& pass) const {
    return stage_plan_.parts().subspan(pass.begin, pass.end - pass.begin);
  }

  void forward_by_stages(const char* call, Tensors in) {
    post_groups(call, fwd_in_, in);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(lse_.begin(), lse_.end(), -std::numeric_limits<float>::infinity());
    const auto passes = stage_plan_.passes();
    std::size_t next = 0;
    for (int round = 0; round < stage_plan_.rounds(); ++round) {
      if (round > 0) await_group(call, fwd_in_, in, round - 1);
      fan_out(round);
      for (; next < passes.size() && passes[next].round == round; ++next) attend_forward(parts_of(passes[next]));
    }
    for (std::size_t i = 0; i < acc_.size(); ++i) out_attn_[i] = detail::from_f32<E>(acc_[i]);
  }

  /// One pass: the kernel's partial output, folded into the running one through the log-sum-exp.
  void attend_forward(std::span<const AttentionEntry> parts) {
    kernel_.forward(shape_, mask_, parts, cspan(q_attn_), cspan(k_attn_), cspan(v_attn_), std::span<E>(out_part_), std::span<float>(lse_part_));
    for (const AttentionEntry& p : parts) {
      detail::merge_partial<E>(acc_, lse_, cspan(out_part_), lse_part_, layout_.q_tokens(), shape_.heads_q, shape_.head_dim, p.q_start,
                               p.q_start + p.q_len);
    }
  }

  void backward_by_stages(const char* call, Tensors in, Tensors kv) {
    post_groups(call, dout_in_, in);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    const auto passes = stage_plan_.passes();
    std::size_t next = 0;
    int posted = 0;
    for (int round = 0; round < stage_plan_.rounds(); ++round) {
      if (round > 0) await_group(call, dout_in_, in, round - 1);
      for (; next < passes.size() && passes[next].round == round; ++next) attend_backward(parts_of(passes[next]));
      // The KV gradients of a group go home as soon as they are complete, in group order on every rank.
      for (; posted < groups_ && stage_plan_.kv_ready(posted) <= round; ++posted) {
        fan_in(posted + 1);
        post_kv_gradients(call, kv, posted);
      }
    }
    for (std::size_t i = 0; i < acc_.size(); ++i) dq_attn_[i] = detail::from_f32<E>(acc_[i]);
  }

  /// One pass: dq shares summed in fp32; dk, dv of the pass's key rows written in place (each key row is in one part).
  void attend_backward(std::span<const AttentionEntry> parts) {
    kernel_.backward(shape_, mask_, parts, cspan(q_attn_), cspan(k_attn_), cspan(v_attn_), cspan(out_attn_), std::span<const float>(lse_),
                     cspan(dout_attn_), std::span<E>(out_part_), std::span<E>(dk_attn_), std::span<E>(dv_attn_));
    const auto width = static_cast<std::size_t>(shape_.heads_q * shape_.head_dim);
    for (const AttentionEntry& p : parts) {
      for (std::size_t i = static_cast<std::size_t>(p.q_start) * width; i < static_cast<std::size_t>(p.q_start + p.q_len) * width; ++i) {
        acc_[i] += detail::to_f32(out_part_[i]);
      }
    }
  }

  /// Posts group `g`'s (or every peer's) KV gradients home.
  void post_kv_gradients(const char* call, Tensors kv, int g) {
    const std::size_t slot = g == detail::StagedExchange::all_groups ? 0 : static_cast<std::size_t>(g);
    if (transport_.world_size() == 1) return;
    kv_requests_[slot] = exchange(call, [&] { return kv_out_.post(transport_, kv, g); });
  }

  /// Waits for the KV gradients, adds this rank's own, and sums every copy into dk, dv.
  void finish_kv_gradients(const char* call, Tensors kv, std::span<E> dk, std::span<E> dv) {
    if (groups_ > 0) fan_in(0);  // this rank's own shards (with one round, fanned in before the post)
    detail::StagedExchange::copy_self(kv);
    if (transport_.world_size() > 1) {
      const int posts = groups_ == 0 ? 1 : groups_;
      for (int g = 0; g < posts; ++g) {
        exchange(call, [&] { detail::StagedExchange::wait(transport_, kv_requests_[static_cast<std::size_t>(g)]); });
        kv_out_.finish(kv, groups_ == 0 ? detail::StagedExchange::all_groups : g);
      }
    }
    const auto width = kv_token_elems();
    const RankMetadata& rev = kv_wire_ ? kv_wire_->reverse_slice() : kv_rev_;  // whose slots the replica holds
    combine_copies<E>(rev, std::span<const E>(replica_), dk, width);
    combine_copies<E>(rev, std::span<const E>(replica_v_), dv, width);
  }

  static const std::byte* bytes_in(std::span<const E> s) noexcept { return detail::bytes_of(s).data(); }
  static std::byte* bytes_out(std::vector<E>& v) noexcept { return detail::bytes_of(std::span<E>(v)).data(); }

  template <class... Args>
  [[noreturn]] void fail(Args&&... args) const {
    detail::fail("ContextParallelAttention (rank ", transport_.rank(), " of ", transport_.world_size(), "): ", std::forward<Args>(args)...);
  }

  static std::span<const E> cspan(const std::vector<E>& v) noexcept { return std::span<const E>(v); }
  std::size_t q_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_q * shape_.head_dim); }
  std::size_t kv_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }

  void check_mlp(const char* call, std::initializer_list<detail::MlpBuffer> buffers) const {
    detail::check_mlp_sizes(transport_.rank(), transport_.world_size(), call, mlp_tokens(), shape_, buffers);
  }

  /// The reverse key-value slice (for the combine), copied into storage kept between plans.
  void copy_kv_rev(const RankMetadata& m) {
    const auto copy = [](std::vector<std::int64_t>& to, const std::vector<std::int64_t>& from) { to.assign(from.begin(), from.end()); };
    kv_rev_.rank = m.rank, kv_rev_.world_size = m.world_size, kv_rev_.has_copies = m.has_copies, kv_rev_.num_copies = m.num_copies;
    copy(kv_rev_.dst_rank, m.dst_rank);
    copy(kv_rev_.dst_offset, m.dst_offset);
    copy(kv_rev_.seq_len, m.seq_len);
    copy(kv_rev_.num_recv_tokens, m.num_recv_tokens);
    kv_rev_.num_seqs = m.num_seqs, kv_rev_.num_total_recv_tokens = m.num_total_recv_tokens, kv_rev_.mask_copies = m.mask_copies;
    for (auto [to, from] : {std::pair{&kv_rev_.seq_recv_mask, &m.seq_recv_mask}, std::pair{&kv_rev_.recv_seq_lens, &m.recv_seq_lens}}) {
      if (!*from) {
        to->reset();
        continue;
      }
      if (!*to) to->emplace();
      copy(**to, **from);
    }
  }

  /// The share's layout, copied into storage kept between plans.
  void copy_layout(const RankAttentionLayout& a) {
    layout_.seqlens_q.assign(a.seqlens_q.begin(), a.seqlens_q.end());
    layout_.seqlens_kv.assign(a.seqlens_kv.begin(), a.seqlens_kv.end());
    layout_.cu_seqlens_q.assign(a.cu_seqlens_q.begin(), a.cu_seqlens_q.end());
    layout_.cu_seqlens_kv.assign(a.cu_seqlens_kv.begin(), a.cu_seqlens_kv.end());
    layout_.max_seqlen_q = a.max_seqlen_q;
    layout_.max_seqlen_kv = a.max_seqlen_kv;
    layout_.mask = a.mask;
  }

  /// The attention layout must describe what the exchanges deliver, and the MLP layouts of Q and KV agree.
  void check_layout() const {
    if (layout_.cu_seqlens_q.size() != layout_.cu_seqlens_kv.size()) {
      fail("share.attn has ", layout_.cu_seqlens_q.size(), " cu_seqlens_q but ", layout_.cu_seqlens_kv.size(), " cu_seqlens_kv");
    }
    if (layout_.q_tokens() != q_plan_.forward.output_tokens || layout_.kv_tokens() != kv_plan_.forward.output_tokens) {
      fail("share.attn holds ", layout_.q_tokens(), " query and ", layout_.kv_tokens(), " key-value tokens, but the share's metadata delivers ",
           q_plan_.forward.output_tokens, " and ", kv_plan_.forward.output_tokens, " (not one plan's share)");
    }
    if (q_plan_.forward.input_tokens != kv_plan_.forward.input_tokens) {
      fail("share.q_fwd holds ", q_plan_.forward.input_tokens, " tokens but share.kv_fwd ", kv_plan_.forward.input_tokens, " (not one plan's share)");
    }
  }

  void size_buffers() {
    const auto tq = static_cast<std::size_t>(layout_.q_tokens()), tk = static_cast<std::size_t>(layout_.kv_tokens());
    for (std::vector<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_, &out_part_}) b->resize(tq * q_token_elems());
    for (std::vector<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) b->resize(tk * kv_token_elems());
    for (std::vector<float>* b : {&lse_, &lse_part_}) b->resize(tq * static_cast<std::size_t>(shape_.heads_q));
    acc_.resize(tq * q_token_elems());
    std::int64_t replica = kv_plan_.reverse.output_tokens;
    if (kv_wire_) replica = std::max(replica, kv_wire_->plan().replica_tokens);
    const auto replica_tokens = static_cast<std::size_t>(replica);
    for (std::vector<E>* b : {&replica_, &replica_v_}) b->resize(replica_tokens * kv_token_elems());
  }

  T& transport_;
  AttentionShape shape_;
  CpAttentionOptions options_;
  Kernel kernel_;
  int groups_ = 0;  // stage groups of remote peers (0: one exchange, no overlap)
  detail::DispatchPlanner q_planner_, kv_planner_;  // their storage, kept between plans
  detail::DispatchPlan q_plan_, kv_plan_;
  std::optional<KvWireDispatcher<T>> kv_wire_;
  RankMetadata kv_rev_;
  RankAttentionLayout layout_;
  AttentionMask mask_;
  std::vector<AttentionEntry> entries_;
  detail::StagePlan stage_plan_;
  std::vector<std::size_t> fan_entries_, fan_entry_splits_, fan_fill_;  // with dedup: fan entries with several copies, round by round
  detail::StagedExchange fwd_in_, dout_in_, q_out_, kv_out_;
  std::vector<E> q_attn_, k_attn_, v_attn_, out_attn_, dout_attn_, dq_attn_, dk_attn_, dv_attn_, replica_, replica_v_;
  std::vector<E> out_part_;            // a pass's output (forward) or dq (backward)
  std::vector<float> lse_, lse_part_;  // the merged log-sum-exp; a pass's
  std::vector<float> acc_;             // the running fp32 output (forward) or dq (backward)
  std::vector<Request> requests_, kv_requests_;
  bool forward_done_ = false;
};

}  // namespace cpdispatch
