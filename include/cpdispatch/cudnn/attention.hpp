#pragma once
// CudnnAttentionKernel: varlen attention forward and backward on cuDNN's
// fused flash attention (the graph API of cuDNN 9), satisfying
// AttentionKernel (attention/kernel.hpp) for bfloat16 and float16 on device
// buffers. docs/attention-kernel.md, "CudnnAttentionKernel".
//
// A call maps its entries onto cuDNN's ragged sequences (cudnn/mapping.hpp):
// entries are trimmed to the rows that see a key and the keys some row sees,
// grouped by band (full, causal or window, and the band's bounds relative to
// bottom-right alignment), and each group is one cuDNN execution over THD
// buffers with per-sequence lengths and ragged offsets in device memory.
// cuDNN writes each sequence's rows on its own, so the entries of one call
// must share no query row and no key row: the kernel declares
// folds_shared_rows = false (attention/kernel.hpp; the op then attends a
// stage's parts in passes) and refuses calls whose entries share rows.
// Rows that see no key get out = 0 and lse = -inf (dq = 0; unseen keys dk =
// dv = 0) by memset and copies, so cuDNN never sees an empty row.
//
// Execution plans (operation graph + engine configuration, cudnn/detail/
// graph.hpp) are built once per (direction, type, heads, head_dim, band,
// determinism, capacity bucket of sequences, longest sequence and query rows)
// and kept; a call's own work is one upload of its int32 metadata (through
// pinned staging buffers that are reused only once their copy has run),
// one cudnnBackendExecute per group and the lse copies. Device buffers
// (metadata, statistics, workspace) grow with cudaMallocAsync / cudaFreeAsync
// on the stream and are kept. Everything runs on the kernel's stream
// (cudnnSetStream); no call synchronises: synchronise the stream before
// reading results on the host.
//
// Host-compiled (no kernels); link cpdispatch::cudnn.

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/call_check.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/cudnn/detail/api.hpp"
#include "cpdispatch/cudnn/detail/backend.hpp"
#include "cpdispatch/cudnn/detail/graph.hpp"
#include "cpdispatch/cudnn/mapping.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::cuda {

struct CudnnAttentionOptions {
  /// Backward through cuDNN's deterministic path (dQ written by the dS K
  /// matmul itself, no fp32 atomics: bitwise equal results run to run; what
  /// cuDNN's frontend selects with is_deterministic_algorithm on Hopper).
  /// false: dQ accumulated atomically in an fp32 workspace, usually faster.
  bool deterministic = true;
};

/// The element types cuDNN's fused attention takes.
template <class E>
inline constexpr bool cudnn_attention_type = std::is_same_v<E, bfloat16> || std::is_same_v<E, float16>;

class CudnnAttentionKernel {
 public:
  /// Its buffers are device memory (attention_kernel_memory_space).
  static constexpr MemorySpace memory_space = MemorySpace::device;
  /// cuDNN attends each sequence on its own: entries sharing rows are refused.
  static constexpr bool folds_shared_rows = false;

  /// Runs on the legacy default stream.
  CudnnAttentionKernel() : CudnnAttentionKernel(nullptr) {}
  /// Runs on `stream`. `api` is the table of cuDNN and CUDA calls (tests
  /// pass mocks). Nothing touches the device before the first call.
  explicit CudnnAttentionKernel(cudaStream_t stream, CudnnAttentionOptions options = {},
                                const cudnn::detail::Api& api = cudnn::detail::real_api())
      : state_(std::make_unique<State>(api, stream, options)) {}

  cudaStream_t stream() const noexcept { return state_->stream; }
  const CudnnAttentionOptions& options() const noexcept { return state_->options; }
  /// Execution plans built so far (each is reused by every later call with its key).
  std::size_t plan_count() const noexcept { return state_->plans.size(); }

  template <class E>
  void forward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
               std::span<const E> k, std::span<const E> v, std::span<E> out, std::span<float> lse) {
    static_assert(cudnn_attention_type<E>,
                  "CudnnAttentionKernel: cuDNN's fused attention takes bfloat16 and float16 (cpdispatch::bfloat16, "
                  "cpdispatch::float16), not float; use cuda::CudaAttentionKernel for float");
    State& s = *state_;
    const auto z = s.check.forward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size());
    s.check.separate_rows(name, "forward", entries);
    check_head_dim(shape);
    cudnn::map_entries(entries, s.map);
    if (s.map.groups.empty() && s.map.dead_q.empty()) return;
    const std::int64_t Hq = shape.heads_q, D = shape.head_dim, T = z.tokens_q;
    const std::int64_t pitch = s.prepare(shape, T, /*backward=*/false);
    for (std::size_t g = 0; g < s.map.groups.size(); ++g) {
      const cudnn::Group& group = s.map.groups[g];
      const cudnn::detail::ExecutionPlan& plan =
          s.plan_for(key<E>(shape, group, cudnn::detail::Direction::forward, s.metas[g].batch, pitch));
      s.set_scalars(shape, group);
      s.pointers.clear();
      for (std::int64_t id : plan.uids) {
        s.pointers.push_back(s.bind(id, g, q.data(), k.data(), v.data(), out.data(), nullptr, nullptr, nullptr, nullptr));
      }
      cudnn::detail::execute(*s.api, s.handle, plan, s.pointers, s.workspace.ptr);
      // cuDNN's statistics (pitch `pitch`) into the caller's lse (pitch T), the group's rows only
      cudnn::query_runs(group, s.runs);
      for (const cudnn::RowRange& r : s.runs) {
        s.copy2d(lse.data() + r.start, T, static_cast<const float*>(s.stats.ptr) + r.start, pitch, r.len, Hq);
      }
    }
    for (const cudnn::RowRange& r : s.map.dead_q) {
      s.zero(out.data() + r.start * Hq * D, static_cast<std::size_t>(r.len * Hq * D) * sizeof(E));
      s.copy2d(lse.data() + r.start, T, static_cast<const float*>(s.neg_inf.ptr), r.len, r.len, Hq);
    }
  }

  template <class E>
  void backward(const AttentionShape& shape, std::span<const AttentionEntry> entries, std::span<const E> q,
                std::span<const E> k, std::span<const E> v, std::span<const E> out, std::span<const float> lse,
                std::span<const E> dout, std::span<E> dq, std::span<E> dk, std::span<E> dv) {
    static_assert(cudnn_attention_type<E>,
                  "CudnnAttentionKernel: cuDNN's fused attention takes bfloat16 and float16 (cpdispatch::bfloat16, "
                  "cpdispatch::float16), not float; use cuda::CudaAttentionKernel for float");
    State& s = *state_;
    const auto z = s.check.backward(name, shape, entries, q.size(), k.size(), v.size(), out.size(), lse.size(),
                                    dout.size(), dq.size(), dk.size(), dv.size());
    s.check.separate_rows(name, "backward", entries);
    check_head_dim(shape);
    cudnn::map_entries(entries, s.map);
    if (s.map.groups.empty() && s.map.dead_q.empty() && s.map.dead_kv.empty()) return;
    const std::int64_t Hq = shape.heads_q, Hk = shape.heads_kv, D = shape.head_dim, T = z.tokens_q;
    const std::int64_t pitch = s.prepare(shape, T, /*backward=*/true);
    for (std::size_t g = 0; g < s.map.groups.size(); ++g) {
      const cudnn::Group& group = s.map.groups[g];
      const cudnn::detail::ExecutionPlan& plan =
          s.plan_for(key<E>(shape, group, cudnn::detail::Direction::backward, s.metas[g].batch, pitch));
      // the caller's lse rows of this group into cuDNN's statistics layout
      cudnn::query_runs(group, s.runs);
      for (const cudnn::RowRange& r : s.runs) {
        s.copy2d(static_cast<float*>(s.stats.ptr) + r.start, pitch, lse.data() + r.start, T, r.len, Hq);
      }
      s.set_scalars(shape, group);
      s.pointers.clear();
      for (std::int64_t id : plan.uids) {
        s.pointers.push_back(s.bind(id, g, q.data(), k.data(), v.data(), out.data(), dout.data(), dq.data(), dk.data(),
                                    dv.data()));
      }
      cudnn::detail::execute(*s.api, s.handle, plan, s.pointers, s.workspace.ptr);
    }
    for (const cudnn::RowRange& r : s.map.dead_q) {
      s.zero(dq.data() + r.start * Hq * D, static_cast<std::size_t>(r.len * Hq * D) * sizeof(E));
    }
    for (const cudnn::RowRange& r : s.map.dead_kv) {
      s.zero(dk.data() + r.start * Hk * D, static_cast<std::size_t>(r.len * Hk * D) * sizeof(E));
      s.zero(dv.data() + r.start * Hk * D, static_cast<std::size_t>(r.len * Hk * D) * sizeof(E));
    }
  }

 private:
  static constexpr const char* name = "CudnnAttentionKernel";

  static void check_head_dim(const AttentionShape& s) {
    if (s.head_dim % 8 != 0 || s.head_dim > 256) {
      detail::fail(name, ": shape.head_dim is ", s.head_dim,
                   "; cuDNN's fused attention takes a multiple of 8 up to 256 (up to 128 before Hopper)");
    }
  }

  template <class E>
  static cudnn::detail::GraphKey key(const AttentionShape& shape, const cudnn::Group& g, cudnn::detail::Direction dir,
                                     std::int64_t batch, std::int64_t pitch) {
    cudnn::detail::GraphKey key;
    key.direction = dir;
    key.io_type = std::is_same_v<E, bfloat16> ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    key.heads_q = shape.heads_q;
    key.heads_kv = shape.heads_kv;
    key.head_dim = shape.head_dim;
    key.band = g.band;
    key.batch = batch;
    key.max_q = cudnn::bucket(g.max_q, 64);
    key.max_kv = cudnn::bucket(g.max_kv, 64);
    key.stats_pitch = pitch;
    return key;
  }

  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  struct Slot {
    void* host = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };

  struct State {
    State(const cudnn::detail::Api& a, cudaStream_t st, CudnnAttentionOptions o) : api(&a), stream(st), options(o) {}
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      plans.clear();  // descriptors before the handle
      for (Buffer* b : {&meta, &stats, &workspace, &neg_inf}) {
        if (b->ptr) (void)api->free_async(b->ptr, stream);
      }
      for (Slot& slot : slots) {
        if (slot.done) (void)api->event_destroy(slot.done);
        if (slot.host) (void)api->free_host(slot.host);  // waits for its copy (cudaFreeHost synchronises)
      }
      if (handle) (void)api->destroy(handle);
    }

    const cudnn::detail::Api* api;
    cudaStream_t stream;
    CudnnAttentionOptions options;
    cudnnHandle_t handle = nullptr;
    int device = -1;
    std::map<cudnn::detail::GraphKey, std::unique_ptr<cudnn::detail::ExecutionPlan>> plans;
    detail::attention::CallCheck check;
    cudnn::EntryMap map;
    std::vector<cudnn::GroupMetadata> metas;
    std::vector<std::int32_t> meta_host;
    std::vector<cudnn::RowRange> runs;
    std::vector<float> neg_inf_host;
    std::vector<void*> pointers;
    Buffer meta, stats, workspace, neg_inf;
    std::size_t softmax_sum_offset = 0, dq_accum_offset = 0;
    std::vector<Slot> slots;
    // by-value scalars of the variant pack (read by cudnnBackendExecute)
    float scale = 0.0f, minus_infinity = -INFINITY, one = 1.0f;
    std::int32_t right = 0, left = 0;

    void cuda(cudaError_t e, const char* call) const { cudnn::detail::check_cuda(e, call); }

    /// The handle, on the current device, bound to the stream.
    void ensure_handle() {
      int dev = 0;
      cuda(api->get_device(&dev), "cudaGetDevice");
      if (!handle) {
        cudnn::detail::check(*api, api->create(&handle), "cudnnCreate");
        device = dev;
      } else if (dev != device) {
        cpdispatch::detail::fail(name, ": created its cuDNN handle on device ", device, " but is called on device ", dev);
      }
      cudnn::detail::check(*api, api->set_stream(handle, stream), "cudnnSetStream");
    }

    /// b at least `bytes`, stream-ordered (the old contents are not kept).
    void grow(Buffer& b, std::size_t bytes) {
      if (bytes <= b.bytes) return;
      const std::size_t want = std::max(bytes, b.bytes + b.bytes / 2);  // grow by half at least: fewer reallocations
      if (b.ptr) cuda(api->free_async(b.ptr, stream), "cudaFreeAsync");
      b.ptr = nullptr;
      b.bytes = 0;
      cuda(api->malloc_async(&b.ptr, want, stream), "cudaMallocAsync");
      b.bytes = want;
    }

    /// Copies `bytes` of host memory to `dst` on the stream through a pinned
    /// slot whose previous copy has run (a new slot when all are in flight):
    /// the host memory may change as soon as this returns; nothing waits.
    void upload(void* dst, const void* src, std::size_t bytes) {
      if (bytes == 0) return;
      Slot* use = nullptr;
      for (Slot& slot : slots) {
        if (slot.bytes < bytes) continue;
        const cudaError_t e = api->event_query(slot.done);
        if (e == cudaSuccess) {
          use = &slot;
          break;
        }
        if (e != cudaErrorNotReady) cuda(e, "cudaEventQuery");
      }
      if (!use) {
        Slot slot;
        slot.bytes = std::max<std::size_t>(bytes, 4096);
        cuda(api->host_alloc(&slot.host, slot.bytes, cudaHostAllocDefault), "cudaHostAlloc");
        const cudaError_t e = api->event_create(&slot.done, cudaEventDisableTiming);
        if (e != cudaSuccess) {
          (void)api->free_host(slot.host);
          cuda(e, "cudaEventCreateWithFlags");
        }
        slots.push_back(slot);
        use = &slots.back();
      }
      std::memcpy(use->host, src, bytes);
      cuda(api->memcpy_async(dst, use->host, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
      cuda(api->event_record(use->done, stream), "cudaEventRecord");
    }

    void zero(void* dst, std::size_t bytes) {
      if (bytes) cuda(api->memset_async(dst, 0, bytes, stream), "cudaMemsetAsync");
    }

    /// rows x `height` floats: dst[h * dst_pitch + i] = src[h * src_pitch + i], i < rows.
    void copy2d(float* dst, std::int64_t dst_pitch, const float* src, std::int64_t src_pitch, std::int64_t rows,
                std::int64_t height) {
      if (rows <= 0 || height <= 0) return;
      cuda(api->memcpy2d_async(dst, static_cast<std::size_t>(dst_pitch) * sizeof(float), src,
                               static_cast<std::size_t>(src_pitch) * sizeof(float),
                               static_cast<std::size_t>(rows) * sizeof(float), static_cast<std::size_t>(height),
                               cudaMemcpyDeviceToDevice, stream),
           "cudaMemcpy2DAsync");
    }

    /// The handle, every group's metadata uploaded, the statistics, -inf
    /// and workspace buffers large enough; returns the statistics' pitch.
    std::int64_t prepare(const AttentionShape& shape, std::int64_t tokens_q, bool backward) {
      ensure_handle();
      const std::int64_t Hq = shape.heads_q, D = shape.head_dim;
      const std::int64_t pitch = cudnn::bucket(tokens_q, 64);
      meta_host.clear();
      metas.clear();
      for (const cudnn::Group& g : map.groups) {
        const std::int64_t batch = cudnn::bucket(static_cast<std::int64_t>(g.sequences.size()));
        metas.push_back(cudnn::append_metadata(g, batch, Hq, shape.heads_kv, D, meta_host));
      }
      if (!meta_host.empty()) {
        grow(meta, meta_host.size() * sizeof(std::int32_t));
        upload(meta.ptr, meta_host.data(), meta_host.size() * sizeof(std::int32_t));
      }
      if (!map.groups.empty()) grow(stats, static_cast<std::size_t>(Hq * pitch) * sizeof(float));
      if (!backward) {
        std::int64_t most = 0;
        for (const cudnn::RowRange& r : map.dead_q) most = std::max(most, r.len);
        const auto need = static_cast<std::size_t>(Hq * most);
        if (need * sizeof(float) > neg_inf.bytes) {
          grow(neg_inf, need * sizeof(float));
          neg_inf_host.assign(neg_inf.bytes / sizeof(float), -INFINITY);
          upload(neg_inf.ptr, neg_inf_host.data(), neg_inf_host.size() * sizeof(float));
        }
      }
      return pitch;
    }

    const cudnn::detail::ExecutionPlan& plan_for(const cudnn::detail::GraphKey& k) {
      cudnn::detail::GraphKey key = k;
      key.deterministic = k.direction == cudnn::detail::Direction::backward && options.deterministic;
      auto it = plans.find(key);
      if (it == plans.end()) {
        auto spec = key.direction == cudnn::detail::Direction::forward ? cudnn::detail::forward_graph(key)
                                                                        : cudnn::detail::backward_graph(key);
        it = plans.emplace(key, cudnn::detail::build_plan(*api, handle, std::move(spec))).first;
      }
      const cudnn::detail::ExecutionPlan& plan = *it->second;
      // workspace: cuDNN's, then (backward) softmax_sum [Hq][pitch] and dQ_accum [pitch][Hq][D] fp32
      const auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
      std::size_t bytes = align(static_cast<std::size_t>(plan.workspace));
      softmax_sum_offset = dq_accum_offset = 0;
      if (key.direction == cudnn::detail::Direction::backward) {
        softmax_sum_offset = bytes;
        bytes += align(static_cast<std::size_t>(key.heads_q * key.stats_pitch) * sizeof(float));
        if (!key.deterministic) {
          dq_accum_offset = bytes;
          bytes += align(static_cast<std::size_t>(key.stats_pitch * key.heads_q * key.head_dim) * sizeof(float));
        }
      }
      grow(workspace, std::max<std::size_t>(bytes, 256));
      return plan;
    }

    void set_scalars(const AttentionShape& shape, const cudnn::Group& g) {
      scale = shape.softmax_scale;
      const cudnn::BandBounds b = cudnn::band_bounds(g);
      right = b.right;
      left = b.left;
    }

    /// The variant pack's pointer for tensor `id` of group g.
    void* bind(std::int64_t id, std::size_t g, const void* q, const void* k, const void* v, const void* o,
               const void* d_o, void* dq, void* dk, void* dv) {
      namespace uid = cudnn::detail::uid;
      const cudnn::GroupMetadata& m = metas[g];
      auto* ints = static_cast<std::int32_t*>(meta.ptr);
      auto* ws = static_cast<std::byte*>(workspace.ptr);
      switch (id) {
        case uid::q: return const_cast<void*>(q);
        case uid::k: return const_cast<void*>(k);
        case uid::v: return const_cast<void*>(v);
        case uid::o: return const_cast<void*>(o);
        case uid::d_o: return const_cast<void*>(d_o);
        case uid::dq: return dq;
        case uid::dk: return dk;
        case uid::dv: return dv;
        case uid::stats: return stats.ptr;
        case uid::seq_q: return ints + m.seq_q;
        case uid::seq_kv: return ints + m.seq_kv;
        case uid::ragged_q: return ints + m.offset_q;
        case uid::ragged_kv: return ints + m.offset_kv;
        case uid::ragged_stats: return ints + m.offset_stats;
        case uid::scale: return &scale;
        case uid::neg_inf: return &minus_infinity;
        case uid::one: return &one;
        case uid::right_bound: return &right;
        case uid::left_bound: return &left;
        case uid::softmax_sum: return ws + softmax_sum_offset;
        case uid::dq_accum: return ws + dq_accum_offset;
        default: break;
      }
      cpdispatch::detail::fail(name, ": no buffer for graph tensor ", id);
    }
  };

  std::unique_ptr<State> state_;
};

static_assert(AttentionKernel<CudnnAttentionKernel, bfloat16>);
static_assert(AttentionKernel<CudnnAttentionKernel, float16>);
static_assert(attention_kernel_memory_space<CudnnAttentionKernel>() == MemorySpace::device);
static_assert(!attention_kernel_folds_shared_rows<CudnnAttentionKernel>());

}  // namespace cpdispatch::cuda
