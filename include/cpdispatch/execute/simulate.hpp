#pragma once
// The memcpy simulation (the seeds' orchestrate_simulate): a global-view
// execution of metadata over one byte buffer per rank, and the KV-gradient
// combine that sums returned copies.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch {

namespace detail {

/// tokens * token_bytes, refusing to overflow.
inline std::size_t token_bytes_of(std::int64_t tokens, std::size_t token_bytes, std::string_view who) {
  std::size_t bytes = 0;
  if (tokens < 0 || __builtin_mul_overflow(static_cast<std::size_t>(tokens), token_bytes, &bytes)) {
    fail(who, ": ", tokens, " tokens of ", token_bytes, " bytes do not fit in memory");
  }
  return bytes;
}

/// Output size from which a simulation writes with non-temporal stores: the
/// size from which glibc's memcpy would stream a single copy (3/4 of the
/// last-level cache). The simulation issues one memcpy per shard, so glibc
/// never sees the total and would keep polluting the cache with output that
/// cannot stay there.
inline std::size_t streaming_threshold() {
  static const std::size_t threshold = [] {
    const long llc = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    return llc > 0 ? static_cast<std::size_t>(llc) / 4 * 3 : std::size_t{32} << 20;
  }();
  return threshold;
}

/// memcpy with streaming (cache-bypassing) stores where SSE2 exists; the
/// caller issues one store fence after the last copy.
inline void copy_streaming(std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__SSE2__)
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n & ~std::size_t{63};
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

inline void streaming_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace detail

/// How simulate() writes its outputs: `automatic` streams (bypasses the
/// cache) when the outputs together exceed detail::streaming_threshold().
enum class StoreMode { automatic, cached, streaming };

/// Performs every copy `meta` describes: entry j of rank r (read back to back
/// from inputs[r]) is copied to outputs[dst_rank] at dst_offset, for every
/// copy. Sizes are checked (capacity_error names the rank, needed and given
/// bytes); destination regions are bounds-checked entry by entry.
inline void simulate(const Metadata& meta, std::span<const ConstBytes> inputs, std::span<const MutableBytes> outputs,
                     std::size_t token_bytes, StoreMode mode = StoreMode::automatic) {
  using detail::fail;
  detail::check_shapes(meta, "simulate: metadata");
  const auto W = static_cast<std::size_t>(meta.world_size);
  if (token_bytes == 0) fail("simulate: token_bytes must be positive");
  if (inputs.size() != W) fail("simulate: inputs has ", inputs.size(), " buffers, world_size is ", W);
  if (outputs.size() != W) fail("simulate: outputs has ", outputs.size(), " buffers, world_size is ", W);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < meta.max_seqs(); ++j)
      if (meta.seq_len(r, j) < 0) fail("simulate: seq_len[", r, "][", j, "] = ", meta.seq_len(r, j), " is negative");
  std::vector<std::int64_t> out_tokens(W);
  for (std::size_t r = 0; r < W; ++r) {
    const std::size_t need_in = detail::token_bytes_of(meta.send_tokens(static_cast<std::int64_t>(r)), token_bytes, "simulate");
    if (inputs[r].size() < need_in) {
      fail<capacity_error>("simulate: inputs[", r, "] holds ", inputs[r].size(), " bytes, the plan reads ", need_in, " (",
                           meta.send_tokens(static_cast<std::int64_t>(r)), " tokens x ", token_bytes, " bytes)");
    }
    out_tokens[r] = meta.output_tokens(static_cast<std::int64_t>(r));
    const std::size_t need_out = detail::token_bytes_of(out_tokens[r], token_bytes, "simulate");
    if (outputs[r].size() < need_out) {
      fail<capacity_error>("simulate: outputs[", r, "] holds ", outputs[r].size(), " bytes, the plan needs ", need_out,
                           " (", out_tokens[r], " tokens x ", token_bytes, " bytes)");
    }
  }
  const std::size_t S = meta.max_seqs(), C = meta.num_copies();
  const bool copies = meta.has_copies();
  std::size_t total_out = 0;
  for (std::int64_t t : out_tokens) total_out += static_cast<std::size_t>(t) * token_bytes;
  const bool streaming =
      mode == StoreMode::streaming || (mode == StoreMode::automatic && total_out > detail::streaming_threshold());
  for (std::size_t r = 0; r < W; ++r) {
    std::size_t src = 0;  // byte offset of entry j in inputs[r]
    const std::size_t n = static_cast<std::size_t>(meta.num_seqs(r));
    for (std::size_t j = 0; j < n && j < S; ++j) {
      const std::int64_t len = meta.seq_len(r, j);
      const std::size_t bytes = static_cast<std::size_t>(len) * token_bytes;
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = copies ? meta.dst_rank(r, j, k) : meta.dst_rank(r, j);
        if (d < 0) continue;
        const std::int64_t off = copies ? meta.dst_offset(r, j, k) : meta.dst_offset(r, j);
        if (d >= meta.world_size) fail("simulate: dst_rank[", r, "][", j, "] = ", d, " is outside [0, ", W, ")");
        const auto du = static_cast<std::size_t>(d);
        if (off < 0 || off > out_tokens[du] - len) {
          fail("simulate: dst_offset[", r, "][", j, "] = ", off, " with seq_len ", len, " falls outside the ",
               out_tokens[du], " tokens of rank ", d, "'s output");
        }
        std::byte* dst = outputs[du].data() + static_cast<std::size_t>(off) * token_bytes;
        if (bytes == 0) continue;
        if (streaming) detail::copy_streaming(dst, inputs[r].data() + src, bytes); else std::memcpy(dst, inputs[r].data() + src, bytes);
      }
      src += bytes;
    }
  }
  if (streaming) detail::streaming_fence();  // streamed stores are visible before we return
}

/// Convenience for tests and examples: typed per-rank vectors; each output is
/// resized to what the plan needs (zero-filled) before the copies.
template <class T>
void simulate(const Metadata& meta, const std::vector<std::vector<T>>& inputs, std::vector<std::vector<T>>& outputs,
              std::size_t elems_per_token) {
  detail::check_shapes(meta, "simulate: metadata");
  const auto W = static_cast<std::size_t>(meta.world_size);
  outputs.assign(W, {});
  std::vector<ConstBytes> in;
  std::vector<MutableBytes> out;
  for (std::size_t r = 0; r < W; ++r) {
    const std::int64_t tokens = meta.output_tokens(static_cast<std::int64_t>(r));
    outputs[r].assign(detail::token_bytes_of(tokens, elems_per_token, "simulate"), T{});
    out.push_back(std::as_writable_bytes(std::span<T>(outputs[r])));
  }
  for (const auto& v : inputs) in.push_back(std::as_bytes(std::span<const T>(v)));
  simulate(meta, std::span<const ConstBytes>(in), std::span<const MutableBytes>(out), elems_per_token * sizeof(T));
}

namespace detail {

/// a + b; integers wrap (two's complement) instead of overflowing, so integer
/// sums are exact modulo 2^bits and never undefined.
template <class T>
constexpr T sum_of(T a, T b) noexcept {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

}  // namespace detail

/// KV-gradient combine on one rank: `replica` is the [C][T] buffer the
/// reverse KV exchange filled (token = `token_elems` elements), `grad` gets
/// [T]: for each shard, the sum over its copies whose seq_recv_mask is 1, in
/// ascending copy order, accumulated in fp32 for 16-bit types (integers wrap).
template <class T>
void combine_copies(const RankMetadata& kv_rev, std::span<const T> replica, std::span<T> grad, std::size_t token_elems) {
  using detail::fail;
  if (!kv_rev.seq_recv_mask || !kv_rev.recv_seq_lens) {
    fail("combine_copies: the metadata has no seq_recv_mask (it is not reverse KV metadata)");
  }
  if (token_elems == 0) fail("combine_copies: token_elems must be positive");
  const auto& lens = *kv_rev.recv_seq_lens;
  const auto& mask = *kv_rev.seq_recv_mask;
  const std::size_t C = kv_rev.mask_copies;
  if (mask.size() != lens.size() * C) {
    fail("combine_copies: seq_recv_mask has ", mask.size(), " entries, expected ", lens.size(), " shards x ", C, " copies");
  }
  std::int64_t total = 0;
  for (std::size_t g = 0; g < lens.size(); ++g) {
    if (lens[g] < 0) fail("combine_copies: recv_seq_lens[", g, "] = ", lens[g], " is negative");
    total = detail::add_tokens(total, lens[g], "combine_copies");
  }
  const std::size_t slab = detail::token_bytes_of(total, token_elems, "combine_copies");  // elements per copy
  std::size_t need_replica = 0;
  if (__builtin_mul_overflow(slab, C, &need_replica)) fail("combine_copies: the replica buffer does not fit in memory");
  if (replica.size() < need_replica) {
    fail<capacity_error>("combine_copies: replica holds ", replica.size(), " elements, the plan needs ", need_replica, " (", C,
                         " copies x ", total, " tokens x ", token_elems, ")");
  }
  if (grad.size() < slab) {
    fail<capacity_error>("combine_copies: grad holds ", grad.size(), " elements, the plan needs ", slab, " (", total,
                         " tokens x ", token_elems, ")");
  }
  using Acc = accumulator_t<T>;
  constexpr std::size_t block = 1024;  // fp32 scratch on the stack for 16-bit types
  std::size_t start = 0;                // first element of the shard
  for (std::size_t g = 0; g < lens.size(); ++g) {
    const std::size_t count = static_cast<std::size_t>(lens[g]) * token_elems;
    for (std::size_t b = 0; b < count; b += block) {
      const std::size_t n = std::min(block, count - b);
      T* out = grad.data() + start + b;
      if constexpr (std::is_same_v<Acc, T>) {
        bool first = true;
        for (std::size_t c = 0; c < C; ++c) {
          if (!mask[g * C + c]) continue;
          const T* in = replica.data() + c * slab + start + b;
          if (first) std::copy(in, in + n, out); else for (std::size_t i = 0; i < n; ++i) out[i] = detail::sum_of(out[i], in[i]);
          first = false;
        }
        if (first) std::fill(out, out + n, T{});
      } else {
        Acc acc[block] = {};
        for (std::size_t c = 0; c < C; ++c) {
          if (!mask[g * C + c]) continue;
          const T* in = replica.data() + c * slab + start + b;
          for (std::size_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(in[i]);
        }
        for (std::size_t i = 0; i < n; ++i) out[i] = T(acc[i]);
      }
    }
    start += count;
  }
}

/// The same on raw bytes with a runtime element type (token_bytes must be a
/// multiple of the element size and the buffers aligned for it).
inline void combine_copies(const RankMetadata& kv_rev, ConstBytes replica, MutableBytes grad, std::size_t token_bytes,
                           ElementType type) {
  using detail::fail;
  const std::size_t es = element_size(type);
  if (token_bytes == 0 || token_bytes % es != 0) {
    fail("combine_copies: token_bytes = ", token_bytes, " is not a positive multiple of the ", es, "-byte ", element_name(type),
         " element");
  }
  auto aligned = [es](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % es == 0; };
  if (!aligned(replica.data()) || !aligned(grad.data())) {
    fail("combine_copies: replica and grad must be aligned to ", es, " bytes for ", element_name(type));
  }
  auto run = [&]<class T>(T*) {
    combine_copies<T>(kv_rev, std::span<const T>(reinterpret_cast<const T*>(replica.data()), replica.size() / es),
                      std::span<T>(reinterpret_cast<T*>(grad.data()), grad.size() / es), token_bytes / es);
  };
  switch (type) {
    case ElementType::int8: run(static_cast<std::int8_t*>(nullptr)); break;
    case ElementType::uint8: run(static_cast<std::uint8_t*>(nullptr)); break;
    case ElementType::int32: run(static_cast<std::int32_t*>(nullptr)); break;
    case ElementType::int64: run(static_cast<std::int64_t*>(nullptr)); break;
    case ElementType::float32: run(static_cast<float*>(nullptr)); break;
    case ElementType::float64: run(static_cast<double*>(nullptr)); break;
    case ElementType::bfloat16: run(static_cast<bfloat16*>(nullptr)); break;
    case ElementType::float16: run(static_cast<float16*>(nullptr)); break;
  }
}

/// Global-view convenience: the combine for rank `rank` of reverse KV metadata.
template <class T>
void combine_copies(const Metadata& kv_rev, std::int64_t rank, std::span<const T> replica, std::span<T> grad,
                    std::size_t token_elems) {
  detail::check_shapes(kv_rev, "combine_copies: metadata");
  combine_copies<T>(kv_rev.get_slice(rank), replica, grad, token_elems);
}

}  // namespace cpdispatch
