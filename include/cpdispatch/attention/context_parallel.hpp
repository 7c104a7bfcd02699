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
// attention layout (deduplicated with CpAttentionOptions::dedup), the kernel
// attends each KV group, and the outputs ride back. Backward mirrors it: dout
// travels like the queries, the kernel's dq goes home like the outputs, dk
// and dv come home with every copy summed in a fixed order.
//
// What forward keeps for backward (the attention-layout Q, K, V, output and
// log-sum-exp) is owned by the object and reused across steps. Every call is
// a collective of the transport: all ranks make the same calls in the same
// order. The transport is held by reference and must outlive the object.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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
#include "cpdispatch/execute/detail/rethrow.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
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

template <class E>
std::span<const std::byte> bytes_of(std::span<const E> s) { return std::as_bytes(s); }
template <class E>
std::span<std::byte> bytes_of(std::span<E> s) { return std::as_writable_bytes(s); }

}  // namespace detail

template <class T, class E, class Kernel = HostAttentionKernel>
class ContextParallelAttention {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  static_assert(detail::memory_space_of<T>() == MemorySpace::host,
                "cpdispatch: ContextParallelAttention takes host spans; its kernel and buffers live in host memory");
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                "cpdispatch: ContextParallelAttention's element type is float, bfloat16 or float16");
  static_assert(AttentionKernel<Kernel, E>, "cpdispatch: the kernel does not model AttentionKernel<Kernel, E> (attention/kernel.hpp)");

 public:
  using transport_type = T;
  using element_type = E;
  using kernel_type = Kernel;

  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options = {},
                           Kernel kernel = Kernel{})
      : transport_(transport), shape_(shape), options_(options), kernel_(std::move(kernel)) {
    detail::check_attention_shape(shape_, "ContextParallelAttention");
    if (options_.stages < 1) fail("options.stages = ", options_.stages, " must be at least 1");
    replan(share);
  }

  /// Takes the next step's share. Buffers keep their storage: nothing is
  /// allocated while the new plan fits what earlier plans (or reserve) sized.
  void replan(const RankQkvMetadata& share) {
    q_.emplace(transport_, share.q_fwd, share.q_rev, q_token_elems() * sizeof(E));
    kv_.emplace(transport_, share.kv_fwd, share.kv_rev, kv_token_elems() * sizeof(E));
    kv_wire_.reset();
    if (options_.dedup) {
      const RankKvWire* wire = detail::kv_wire_of(share);
      if (wire == nullptr) fail("options.dedup is set but the share has no kv_wire (plan the plan with dedup set)");
      kv_wire_.emplace(transport_, *wire, kv_token_elems() * sizeof(E));
    }
    layout_ = share.attn;
    mask_ = detail::mask_of(share);
    check_layout();
    entries_ = layout_entries(layout_.cu_seqlens_q, layout_.cu_seqlens_kv);
    size_buffers();
    if (staged()) plan_stages(share);
    forward_done_ = false;
  }

  /// This rank's tokens in the MLP layout (the leading extent of q, k, v, ...).
  std::int64_t mlp_tokens() const noexcept { return static_cast<std::int64_t>(q_->required_bytes().mlp_bytes / (q_token_elems() * sizeof(E))); }
  const RankAttentionLayout& attention() const noexcept { return layout_; }
  const AttentionMask& mask() const noexcept { return mask_; }
  const AttentionShape& shape() const noexcept { return shape_; }
  const CpAttentionOptions& options() const noexcept { return options_; }
  /// The last forward's log-sum-exp in the attention layout, [heads_q][q tokens].
  std::span<const float> lse() const noexcept { return lse_; }
  Kernel& kernel() noexcept { return kernel_; }

  /// q: [T][heads_q][head_dim], k, v: [T][heads_kv][head_dim] -> out: [T][heads_q][head_dim].
  void forward(std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out) {
    check_mlp("forward", {{q.size(), "q", true}, {k.size(), "k", false}, {v.size(), "v", false}, {out.size(), "out", true}});
    if (staged()) {
      forward_staged(q, k, v, out);
      forward_done_ = true;
      return;
    }
    q_->forward(detail::bytes_of(q), detail::bytes_of(std::span<E>(q_attn_)));
    if (kv_wire_) {
      kv_wire_->forward(detail::bytes_of(k), detail::bytes_of(std::span<E>(k_attn_)));
      kv_wire_->forward(detail::bytes_of(v), detail::bytes_of(std::span<E>(v_attn_)));
    } else {
      kv_->forward(detail::bytes_of(k), detail::bytes_of(std::span<E>(k_attn_)));
      kv_->forward(detail::bytes_of(v), detail::bytes_of(std::span<E>(v_attn_)));
    }
    kernel_.forward(shape_, mask_, std::span<const AttentionEntry>(entries_), cspan(q_attn_), cspan(k_attn_), cspan(v_attn_),
                    std::span<E>(out_attn_), std::span<float>(lse_));
    q_->reverse(detail::bytes_of(cspan(out_attn_)), detail::bytes_of(out));
    forward_done_ = true;
  }

  /// dout: [T][heads_q][head_dim] -> dq like q, dk and dv like k and v (every copy's gradient summed).
  void backward(std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    if (!forward_done_) fail("backward needs the forward of the same plan first");
    check_mlp("backward", {{dout.size(), "dout", true}, {dq.size(), "dq", true}, {dk.size(), "dk", false}, {dv.size(), "dv", false}});
    if (staged()) return backward_staged(dout, dq, dk, dv);
    q_->forward(detail::bytes_of(dout), detail::bytes_of(std::span<E>(dout_attn_)));
    kernel_.backward(shape_, mask_, std::span<const AttentionEntry>(entries_), cspan(q_attn_), cspan(k_attn_), cspan(v_attn_),
                     cspan(out_attn_), std::span<const float>(lse_), cspan(dout_attn_), std::span<E>(dq_attn_), std::span<E>(dk_attn_),
                     std::span<E>(dv_attn_));
    q_->reverse(detail::bytes_of(cspan(dq_attn_)), detail::bytes_of(dq));
    const ElementType type = element_type_of<E>();
    if (kv_wire_) {  // the attention-layout gradients are not needed afterwards
      kv_wire_->reverse_combine_in_place(detail::bytes_of(std::span<E>(dk_attn_)), detail::bytes_of(std::span<E>(replica_)), detail::bytes_of(dk), type);
      kv_wire_->reverse_combine_in_place(detail::bytes_of(std::span<E>(dv_attn_)), detail::bytes_of(std::span<E>(replica_)), detail::bytes_of(dv), type);
      return;
    }
    kv_->reverse_combine(detail::bytes_of(cspan(dk_attn_)), detail::bytes_of(std::span<E>(replica_)), detail::bytes_of(dk), type);
    kv_->reverse_combine(detail::bytes_of(cspan(dv_attn_)), detail::bytes_of(std::span<E>(replica_)), detail::bytes_of(dv), type);
  }

 private:
  using Tensors = std::span<const detail::StagedTensor>;

  /// Stages > 1 run the staged exchange (dedup keeps the one-stage path).
  bool staged() const noexcept { return options_.stages > 1 && !options_.dedup; }

  void plan_stages(const RankQkvMetadata& share) {
    const int me = transport_.rank(), W = transport_.world_size();
    groups_ = std::min(options_.stages - 1, W - 1);
    q_plan_ = detail::plan_dispatch(share.q_fwd, share.q_rev, q_token_elems() * sizeof(E), me, W);
    kv_plan_ = detail::plan_dispatch(share.kv_fwd, share.kv_rev, kv_token_elems() * sizeof(E), me, W);
    kv_rev_ = share.kv_rev;
    stage_plan_.build(entries_, share.q_rev, share.kv_rev, me, W, groups_, "ContextParallelAttention");
    const detail::ExchangePlan* fwd_in[] = {&q_plan_.forward, &kv_plan_.forward, &kv_plan_.forward};
    const detail::ExchangePlan* q_fwd[] = {&q_plan_.forward};
    const detail::ExchangePlan* q_rev[] = {&q_plan_.reverse};
    const detail::ExchangePlan* kv_rev[] = {&kv_plan_.reverse, &kv_plan_.reverse};
    fwd_in_.lay_out(fwd_in, me, W, groups_, true);
    dout_in_.lay_out(q_fwd, me, W, groups_, true);
    q_out_.lay_out(q_rev, me, W, groups_, false);
    kv_out_.lay_out(kv_rev, me, W, groups_, false);
    const std::size_t q_elems = out_attn_.size();
    acc_.resize(q_elems);
    out_part_.resize(q_elems);
    lse_part_.resize(lse_.size());
    replica_v_.resize(replica_.size());
    requests_.resize(static_cast<std::size_t>(groups_));
    kv_requests_.resize(static_cast<std::size_t>(groups_));
  }

  /// Runs a transport call, naming the op's call in front of its error.
  template <class F>
  auto exchange(const char* call, F&& f) {
    try {
      return f();
    } catch (...) {
      detail::rethrow_with_context(detail::concat("ContextParallelAttention::", call, " (rank ", transport_.rank(), " of ",
                                                  transport_.world_size(), "): exchange failed: "));
    }
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
    const Request r = exchange(call, [&] { return ex.post(transport_, tensors, detail::StagedExchange::all_groups); });
    exchange(call, [&] { detail::StagedExchange::wait(transport_, r); });
    ex.finish(tensors, detail::StagedExchange::all_groups);
  }

  std::span<const AttentionEntry> parts_of(const detail::StagePass& pass) const {
    return stage_plan_.parts().subspan(pass.begin, pass.end - pass.begin);
  }

  void forward_staged(std::span<const E> q, std::span<const E> k, std::span<const E> v, std::span<E> out) {
    const char* call = "forward";
    const detail::StagedTensor in[] = {{&q_plan_.forward, bytes_in(q), bytes_out(q_attn_)},
                                       {&kv_plan_.forward, bytes_in(k), bytes_out(k_attn_)},
                                       {&kv_plan_.forward, bytes_in(v), bytes_out(v_attn_)}};
    post_groups(call, fwd_in_, in);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(lse_.begin(), lse_.end(), -std::numeric_limits<float>::infinity());
    const auto passes = stage_plan_.passes();
    std::size_t next = 0;
    for (int round = 0; round < stage_plan_.rounds(); ++round) {
      if (round > 0) await_group(call, fwd_in_, in, round - 1);
      for (; next < passes.size() && passes[next].round == round; ++next) attend_forward(parts_of(passes[next]));
    }
    for (std::size_t i = 0; i < acc_.size(); ++i) out_attn_[i] = detail::from_f32<E>(acc_[i]);
    const detail::StagedTensor back[] = {{&q_plan_.reverse, bytes_out(out_attn_), detail::bytes_of(out).data()}};
    exchange_all(call, q_out_, back);
  }

  /// One pass: the kernel's partial output, folded into the running one through the log-sum-exp.
  void attend_forward(std::span<const AttentionEntry> parts) {
    kernel_.forward(shape_, mask_, parts, cspan(q_attn_), cspan(k_attn_), cspan(v_attn_), std::span<E>(out_part_), std::span<float>(lse_part_));
    for (const AttentionEntry& p : parts) {
      detail::merge_partial<E>(acc_, lse_, cspan(out_part_), lse_part_, layout_.q_tokens(), shape_.heads_q, shape_.head_dim, p.q_start,
                               p.q_start + p.q_len);
    }
  }

  void backward_staged(std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    const char* call = "backward";
    const detail::StagedTensor in[] = {{&q_plan_.forward, bytes_in(dout), bytes_out(dout_attn_)}};
    const detail::StagedTensor kv[] = {{&kv_plan_.reverse, bytes_out(dk_attn_), bytes_out(replica_)},
                                       {&kv_plan_.reverse, bytes_out(dv_attn_), bytes_out(replica_v_)}};
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
        kv_requests_[static_cast<std::size_t>(posted)] = exchange(call, [&] { return kv_out_.post(transport_, kv, posted); });
      }
    }
    for (std::size_t i = 0; i < acc_.size(); ++i) dq_attn_[i] = detail::from_f32<E>(acc_[i]);
    const detail::StagedTensor q_back[] = {{&q_plan_.reverse, bytes_out(dq_attn_), detail::bytes_of(dq).data()}};
    exchange_all(call, q_out_, q_back);
    detail::StagedExchange::copy_self(kv);
    for (int g = 0; g < groups_; ++g) {
      exchange(call, [&] { detail::StagedExchange::wait(transport_, kv_requests_[static_cast<std::size_t>(g)]); });
      kv_out_.finish(kv, g);
    }
    const auto width = kv_token_elems();
    combine_copies<E>(kv_rev_, std::span<const E>(replica_), dk, width);
    combine_copies<E>(kv_rev_, std::span<const E>(replica_v_), dv, width);
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

  static const std::byte* bytes_in(std::span<const E> s) noexcept { return detail::bytes_of(s).data(); }
  static std::byte* bytes_out(std::vector<E>& v) noexcept { return detail::bytes_of(std::span<E>(v)).data(); }

  struct MlpBuffer {
    std::size_t size;
    const char* name;
    bool query;  // [T][heads_q][head_dim], else [T][heads_kv][head_dim]
  };

  template <class... Args>
  [[noreturn]] void fail(Args&&... args) const {
    detail::fail("ContextParallelAttention (rank ", transport_.rank(), " of ", transport_.world_size(), "): ", std::forward<Args>(args)...);
  }

  static std::span<const E> cspan(const std::vector<E>& v) noexcept { return std::span<const E>(v); }
  std::size_t q_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_q * shape_.head_dim); }
  std::size_t kv_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }

  void check_mlp(const char* call, std::initializer_list<MlpBuffer> buffers) const {
    const auto tokens = static_cast<std::size_t>(mlp_tokens());
    for (const MlpBuffer& b : buffers) {
      const std::size_t want = tokens * (b.query ? q_token_elems() : kv_token_elems());
      if (b.size != want) {
        fail(call, ": ", b.name, " has ", b.size, " elements, but ", tokens, " tokens x ", b.query ? shape_.heads_q : shape_.heads_kv,
             " heads x ", shape_.head_dim, " = ", want);
      }
    }
  }

  /// The attention layout must describe what the dispatchers deliver.
  void check_layout() const {
    const auto q_tokens = static_cast<std::int64_t>(q_->required_bytes().attention_bytes / (q_token_elems() * sizeof(E)));
    const auto kv_tokens = static_cast<std::int64_t>(kv_->required_bytes().attention_bytes / (kv_token_elems() * sizeof(E)));
    if (layout_.q_tokens() != q_tokens || layout_.kv_tokens() != kv_tokens) {
      fail("share.attn holds ", layout_.q_tokens(), " query and ", layout_.kv_tokens(), " key-value tokens, but the share's metadata delivers ",
           q_tokens, " and ", kv_tokens, " (not one plan's share)");
    }
  }

  void size_buffers() {
    const auto tq = static_cast<std::size_t>(layout_.q_tokens()), tk = static_cast<std::size_t>(layout_.kv_tokens());
    for (std::vector<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_}) b->resize(tq * q_token_elems());
    for (std::vector<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) b->resize(tk * kv_token_elems());
    lse_.resize(tq * static_cast<std::size_t>(shape_.heads_q));
    replica_.resize(kv_->required_bytes().replica_bytes / sizeof(E));
  }

  T& transport_;
  AttentionShape shape_;
  CpAttentionOptions options_;
  Kernel kernel_;
  std::optional<Dispatcher<T>> q_, kv_;
  std::optional<KvWireDispatcher<T>> kv_wire_;
  RankAttentionLayout layout_;
  AttentionMask mask_;
  std::vector<AttentionEntry> entries_;
  std::vector<E> q_attn_, k_attn_, v_attn_, out_attn_, dout_attn_, dq_attn_, dk_attn_, dv_attn_, replica_;
  std::vector<float> lse_;
  bool forward_done_ = false;
  // The staged path (stages > 1).
  int groups_ = 0;
  detail::DispatchPlan q_plan_, kv_plan_;
  RankMetadata kv_rev_;
  detail::StagePlan stage_plan_;
  detail::StagedExchange fwd_in_, dout_in_, q_out_, kv_out_;
  std::vector<float> acc_, lse_part_;  // running fp32 output (forward) or dq (backward); a pass's lse
  std::vector<E> out_part_, replica_v_;  // a pass's output or dq; dv's replica buffer
  std::vector<Request> requests_, kv_requests_;
};

}  // namespace cpdispatch
