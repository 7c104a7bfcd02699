#pragma once
// ContextParallelAttention on device transports (the device sim, NCCL): the
// same op as attention/context_parallel.hpp, with every buffer in device
// memory and a device kernel (cuda::CudaAttentionKernel unless another is
// named). docs/attention.md, "On device transports".
//
//   cpdispatch::NcclTransport t(comm, stream);
//   cpdispatch::ContextParallelAttention<cpdispatch::NcclTransport, cpdispatch::bfloat16> attn(t, share, shape, {.dedup = true});
//   attn.forward(q, k, v, out);          // cuda::DeviceSpan<const E> in the MLP layout -> cuda::DeviceSpan<E>
//   attn.backward(dout, dq, dk, dv);
//   attn.replan(next_share);
//
// Queries, key-values (deduplicated with CpAttentionOptions::dedup) and
// outputs move with QkvDispatch's device data path, on the transport's
// stream; the kernel launches on that stream too (the default kernel is
// built on it, and a kernel on another stream is refused), so a call's work
// is ordered on one stream and the results are there once it has run.
// One stage only: the device op does not overlap the exchange with compute
// yet, and refuses CpAttentionOptions::stages > 1 rather than ignore it.
//
// What forward keeps for backward (attention-layout Q, K, V, output and
// log-sum-exp) lives in device buffers the object owns; they grow only, so
// steps whose plans fit what earlier steps sized allocate no device memory.
// replan rebuilds the dispatchers (the device path uploads its piece lists
// per plan). Every call is a collective of the transport.
//
// Requires nvcc (kernels): include from a .cu translation unit (the tests
// also compile it against the cuda-cpu harness, CPDISPATCH_CUDA_HOST_HARNESS).

#if !defined(__CUDACC__) && !defined(CPDISPATCH_CUDA_HOST_HARNESS)
#error "cpdispatch/cuda/context_parallel.hpp launches CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/cuda/attention.hpp"
#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"

namespace cpdispatch {

template <class T>
struct default_attention_kernel<T, MemorySpace::device> {
  using type = cuda::CudaAttentionKernel;
};

template <class T, class E, class Kernel>
class ContextParallelAttention<T, E, Kernel, MemorySpace::device> {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>,
                "cpdispatch: ContextParallelAttention's element type is float, bfloat16 or float16");
  static_assert(AttentionKernel<Kernel, E>, "cpdispatch: the kernel does not model AttentionKernel<Kernel, E> (attention/kernel.hpp)");
  static_assert(attention_kernel_memory_space<Kernel>() == MemorySpace::device,
                "cpdispatch: a device transport's ContextParallelAttention needs a device kernel (declaring "
                "`static constexpr MemorySpace memory_space = MemorySpace::device`), e.g. cuda::CudaAttentionKernel");

 public:
  using transport_type = T;
  using element_type = E;
  using kernel_type = Kernel;
  /// A buffer of U in device memory.
  template <class U>
  using buffer = cuda::DeviceSpan<U>;
  /// The device op makes its exchanges in one stage, not overlapped.
  static constexpr bool overlaps = false;

  /// With the default kernel built on the transport's stream (a kernel
  /// constructible from a cudaStream_t), else default-constructed.
  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options = {})
      : ContextParallelAttention(transport, share, shape, options, kernel_on(transport)) {}

  /// With `kernel`, which must launch on the transport's stream when it says which (`stream()`).
  ContextParallelAttention(T& transport, const RankQkvMetadata& share, const AttentionShape& shape, CpAttentionOptions options, Kernel kernel)
      : transport_(transport), shape_(shape), options_(options), kernel_(std::move(kernel)) {
    detail::check_attention_shape(shape_, "ContextParallelAttention");
    if (options_.stages != 1) {
      fail("options.stages = ", options_.stages, ": on a device transport the op runs one stage (no overlap); pass stages = 1");
    }
    if constexpr (requires { kernel_.stream(); }) {
      if (kernel_.stream() != detail::stream_of(transport_)) {
        fail("the kernel launches on another stream than the transport's; build it on transport.stream() so that its work is ordered with the exchange's");
      }
    }
    check_share(share);
    qkv_.emplace(transport_, share, q_token_elems(), kv_token_elems(), QkvDispatchOptions{.dedup = options_.dedup});
    take_plan();
  }

  /// Sizes the device buffers for plans up to `c`, so that forward and
  /// backward allocate no device memory while a plan stays within it
  /// (replan still rebuilds the dispatchers).
  void reserve(const CpAttentionCapacity& c) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(std::max<std::int64_t>(x, 0)); };
    for (cuda::DeviceBuffer<E>* b : {&q_attn_, &out_attn_, &dout_attn_, &dq_attn_}) grow(*b, n(c.q_tokens) * q_token_elems());
    for (cuda::DeviceBuffer<E>* b : {&k_attn_, &v_attn_, &dk_attn_, &dv_attn_}) grow(*b, n(c.kv_tokens) * kv_token_elems());
    grow(lse_, n(c.q_tokens) * static_cast<std::size_t>(shape_.heads_q));
  }

  /// Takes the next step's share. After a throw (a bad share) the object
  /// needs a good share before its next forward.
  void replan(const RankQkvMetadata& share) {
    planned_ = false;
    check_share(share);
    qkv_->replan(share);
    take_plan();
  }

  /// This rank's tokens in the MLP layout (the leading extent of q, k, v, ...).
  std::int64_t mlp_tokens() const noexcept { return static_cast<std::int64_t>(qkv_->q_mlp_size() / q_token_elems()); }
  const RankAttentionLayout& attention() const noexcept { return qkv_->attention(); }
  const AttentionMask& mask() const noexcept { return qkv_->attention().mask; }
  const AttentionShape& shape() const noexcept { return shape_; }
  const CpAttentionOptions& options() const noexcept { return options_; }
  /// The last forward's log-sum-exp in the attention layout, [heads_q][q tokens], in device memory.
  buffer<const float> lse() const noexcept { return {lse_.data(), q_tokens() * static_cast<std::size_t>(shape_.heads_q)}; }
  Kernel& kernel() noexcept { return kernel_; }

  /// q: [T][heads_q][head_dim], k, v: [T][heads_kv][head_dim] -> out: [T][heads_q][head_dim].
  void forward(buffer<const E> q, buffer<const E> k, buffer<const E> v, buffer<E> out) {
    const char* call = "forward";
    if (!planned_) fail("forward needs a plan: the last replan threw");
    check_mlp(call, {{q.size(), "q", true}, {k.size(), "k", false}, {v.size(), "v", false}, {out.size(), "out", true}});
    forward_done_ = false;
    exchange(call, [&] {
      qkv_->forward_q(q, attn(q_attn_, true));
      qkv_->forward_kv(k, attn(k_attn_, false));
      qkv_->forward_kv(v, attn(v_attn_, false));
    });
    kernel_.forward(shape_, mask(), std::span<const AttentionEntry>(entries_), kernel_in(q_attn_, true), kernel_in(k_attn_, false),
                    kernel_in(v_attn_, false), kernel_out(out_attn_, true), std::span<float>(lse_.data(), lse().size()));
    exchange(call, [&] { qkv_->reverse_q(attn(out_attn_, true), out); });
    forward_done_ = true;
  }

  /// dout: [T][heads_q][head_dim] -> dq like q, dk and dv like k and v (every copy's gradient summed).
  void backward(buffer<const E> dout, buffer<E> dq, buffer<E> dk, buffer<E> dv) {
    const char* call = "backward";
    if (!forward_done_) fail("backward needs the forward of the same plan first");
    check_mlp(call, {{dout.size(), "dout", true}, {dq.size(), "dq", true}, {dk.size(), "dk", false}, {dv.size(), "dv", false}});
    exchange(call, [&] { qkv_->forward_q(dout, attn(dout_attn_, true)); });
    kernel_.backward(shape_, mask(), std::span<const AttentionEntry>(entries_), kernel_in(q_attn_, true), kernel_in(k_attn_, false),
                     kernel_in(v_attn_, false), kernel_in(out_attn_, true), std::span<const float>(lse_.data(), lse().size()),
                     kernel_in(dout_attn_, true), kernel_out(dq_attn_, true), kernel_out(dk_attn_, false), kernel_out(dv_attn_, false));
    exchange(call, [&] {
      qkv_->reverse_q(attn(dq_attn_, true), dq);
      qkv_->reverse_kv(attn(dk_attn_, false), dk);
      qkv_->reverse_kv(attn(dv_attn_, false), dv);
    });
  }

 private:
  static Kernel kernel_on(T& transport) {
    if constexpr (std::is_constructible_v<Kernel, cudaStream_t>) {
      return Kernel(detail::stream_of(transport));
    } else {
      return Kernel{};
    }
  }

  template <class... Args>
  [[noreturn]] void fail(Args&&... args) const {
    detail::fail("ContextParallelAttention (rank ", transport_.rank(), " of ", transport_.world_size(), "): ", std::forward<Args>(args)...);
  }

  /// Runs transport calls, naming the op's call in front of their error.
  template <class F>
  void exchange(const char* call, F&& f) {
    try {
      f();
    } catch (...) {
      detail::rethrow_exchange_failure(transport_.rank(), transport_.world_size(), call);
    }
  }

  std::size_t q_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_q * shape_.head_dim); }
  std::size_t kv_token_elems() const noexcept { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }
  std::size_t q_tokens() const noexcept { return static_cast<std::size_t>(qkv_->attention().q_tokens()); }
  std::size_t kv_tokens() const noexcept { return static_cast<std::size_t>(qkv_->attention().kv_tokens()); }

  void check_share(const RankQkvMetadata& share) const {
    if (options_.dedup && !share.kv_wire) fail("options.dedup is set but the share has no kv_wire (plan the plan with dedup set)");
  }

  /// The plan's entries, once its layout is checked against what the dispatchers deliver.
  void take_plan() {
    const RankAttentionLayout& a = qkv_->attention();
    if (a.cu_seqlens_q.size() != a.cu_seqlens_kv.size()) {
      fail("share.attn has ", a.cu_seqlens_q.size(), " cu_seqlens_q but ", a.cu_seqlens_kv.size(), " cu_seqlens_kv");
    }
    if (q_tokens() * q_token_elems() != qkv_->q_attention_size() || kv_tokens() * kv_token_elems() != qkv_->kv_attention_size()) {
      fail("share.attn holds ", q_tokens(), " query and ", kv_tokens(), " key-value tokens, but the share's metadata delivers ",
           qkv_->q_attention_size() / q_token_elems(), " and ", qkv_->kv_attention_size() / kv_token_elems(), " (not one plan's share)");
    }
    if (qkv_->q_mlp_size() / q_token_elems() != qkv_->kv_mlp_size() / kv_token_elems()) {
      fail("share.q_fwd holds ", qkv_->q_mlp_size() / q_token_elems(), " tokens but share.kv_fwd ", qkv_->kv_mlp_size() / kv_token_elems(),
           " (not one plan's share)");
    }
    layout_entries(a.cu_seqlens_q, a.cu_seqlens_kv, entries_);
    size_buffers();
    forward_done_ = false;
    planned_ = true;
  }

  void check_mlp(const char* call, std::initializer_list<detail::MlpBuffer> buffers) const {
    detail::check_mlp_sizes(transport_.rank(), transport_.world_size(), call, mlp_tokens(), shape_, buffers);
  }

  /// Grow-only: a buffer is reallocated only when a plan needs more than it holds (never empty, so pointers stay valid).
  template <class U>
  static void grow(cuda::DeviceBuffer<U>& b, std::size_t count) {
    if (b.size() < std::max<std::size_t>(count, 1)) b.allocate(std::max<std::size_t>(count, 1));
  }

  void size_buffers() { reserve({0, static_cast<std::int64_t>(q_tokens()), static_cast<std::int64_t>(kv_tokens()), 0, 1}); }

  std::size_t attn_elems(bool query) const noexcept { return query ? q_tokens() * q_token_elems() : kv_tokens() * kv_token_elems(); }
  buffer<E> attn(const cuda::DeviceBuffer<E>& b, bool query) const noexcept { return {b.data(), attn_elems(query)}; }
  std::span<const E> kernel_in(const cuda::DeviceBuffer<E>& b, bool query) const noexcept { return {b.data(), attn_elems(query)}; }
  std::span<E> kernel_out(const cuda::DeviceBuffer<E>& b, bool query) const noexcept { return {b.data(), attn_elems(query)}; }

  T& transport_;
  AttentionShape shape_;
  CpAttentionOptions options_;
  Kernel kernel_;
  std::optional<QkvDispatch<T, E>> qkv_;
  std::vector<AttentionEntry> entries_;
  cuda::DeviceBuffer<E> q_attn_, k_attn_, v_attn_, out_attn_, dout_attn_, dq_attn_, dk_attn_, dv_attn_;
  cuda::DeviceBuffer<float> lse_;
  bool forward_done_ = false;
  bool planned_ = false;
};

}  // namespace cpdispatch
