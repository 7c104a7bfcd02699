#pragma once
// The deduplicated KV exchange on one rank (../shared/spec/plan-json.md,
// section 2c): each KV shard crosses the network once per destination rank.
//
//   const QkvMetadata meta = plan_qkv(plan);          // same plan on every rank
//   const KvWireMetadata wire = plan_kv_wire(meta);
//   KvWireDispatcher kv(transport, wire, kv_token_bytes);
//   kv.forward(kv_mlp, kv_attn, kv_wire);              // one exchange + local fan-out
//   ... attention ...
//   kv.reverse_combine(dkv_attn, kv_wire, dkv_replica, dkv_mlp, ElementType::bfloat16);
//
// forward: ONE exchange of the wire (a Dispatcher over kv_wire_fwd/_rev) into
// this rank's wire buffer, then the fan-out copies every received shard into
// each KV group of the attention layout that needs it. The attention layout is
// exactly the one Dispatcher(kv_fwd, kv_rev).forward writes.
// reverse_combine: the fan-in sums, for every received shard, the gradients of
// its copies (copy index ascending; fp32 accumulation for 16-bit types,
// integers wrap) into the wire buffer, ONE exchange takes them home into slot
// u of the [C][T] replica buffer, and the home sums the slots in use
// (ascending). Equal to the non-deduplicated reverse_combine up to
// floating-point reassociation, exact for integers, deterministic.
//
// When to use it: when query shards of one document share a destination rank
// (zig-zag causal balancing puts two on every rank), the wire carries fewer
// bytes than kv_fwd; when they never do, the wire equals kv_fwd and the
// fan-out is pure overhead.
//
// Buffers are the caller's (bytes; a token is `token_bytes` wide): mlp [T],
// attention (this rank's KV attention layout), wire (this rank's wire buffer:
// the KV shards it receives, once each), replica [C][T], grad [T], and the
// staging of the underlying Dispatcher (or the overloads without it, which own
// it). required_bytes() gives the sizes; short buffers throw capacity_error
// naming the buffer, the needed and the given size, before anything is
// written. Buffers of one call must not overlap. After the first call nothing
// is allocated. Every rank makes the same calls (each is one collective).
//
// Host transports only: the device fan-out and fan-in kernels are not written
// yet, so a device transport is refused at compile time.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/detail/dispatch_plan.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/dedup.hpp"

namespace cpdispatch {

/// The buffer sizes of one KvWireDispatcher, in bytes.
struct KvWireBufferSizes {
  std::size_t mlp_bytes = 0;        ///< forward input; reverse_combine's gradient output
  std::size_t attention_bytes = 0;  ///< forward output; reverse_combine's input
  std::size_t wire_bytes = 0;       ///< the received shards, once each (forward and backward scratch)
  std::size_t replica_bytes = 0;    ///< [C][T] replica buffer
  std::size_t staging_bytes = 0;    ///< the wire Dispatcher's staging (0: none)
  friend bool operator==(const KvWireBufferSizes&, const KvWireBufferSizes&) = default;
};

namespace detail {

/// Fan-in of one wire entry: out = sum of the copies at `ins` (ascending),
/// accumulated in accumulator_t<E> (fp32 for 16-bit types; integers wrap).
template <class E>
void fan_in_entry(const E* attention, std::span<const std::int64_t> copies, std::size_t count, std::size_t token_elems, E* out) {
  if (copies.size() == 1) {
    std::memcpy(out, attention + static_cast<std::size_t>(copies[0]) * token_elems, count * sizeof(E));
    return;
  }
  using Acc = accumulator_t<E>;
  if constexpr (std::is_same_v<Acc, E>) {
    std::memcpy(out, attention + static_cast<std::size_t>(copies[0]) * token_elems, count * sizeof(E));
    for (std::size_t c = 1; c < copies.size(); ++c) {
      const E* in = attention + static_cast<std::size_t>(copies[c]) * token_elems;
      for (std::size_t i = 0; i < count; ++i) out[i] = sum_of(out[i], in[i]);
    }
  } else {
    constexpr std::size_t block = 1024;  // fp32 scratch on the stack
    for (std::size_t b = 0; b < count; b += block) {
      const std::size_t n = std::min(block, count - b);
      Acc acc[block] = {};
      for (std::int64_t at : copies) {
        const E* in = attention + static_cast<std::size_t>(at) * token_elems + b;
        for (std::size_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(in[i]);
      }
      for (std::size_t i = 0; i < n; ++i) out[b + i] = E(acc[i]);
    }
  }
}

/// The fan-in of a whole fan list: attention-layout gradients -> wire buffer.
template <class E>
void fan_in(const KvFanList& fan, const std::byte* attention, std::byte* wire, std::size_t token_elems) {
  const E* in = reinterpret_cast<const E*>(attention);
  E* out = reinterpret_cast<E*>(wire);
  for (std::size_t e = 0; e < fan.num_entries(); ++e) {
    const std::span<const std::int64_t> copies(fan.attn_offset.data() + fan.copy_splits[e], fan.copy_splits[e + 1] - fan.copy_splits[e]);
    fan_in_entry<E>(in, copies, static_cast<std::size_t>(fan.seq_len[e]) * token_elems, token_elems,
                    out + static_cast<std::size_t>(fan.wire_offset[e]) * token_elems);
  }
}

/// Calls f(E*) with a null pointer of the C++ type of `type`.
template <class F>
void with_element_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::int8: f(static_cast<std::int8_t*>(nullptr)); break;
    case ElementType::uint8: f(static_cast<std::uint8_t*>(nullptr)); break;
    case ElementType::int32: f(static_cast<std::int32_t*>(nullptr)); break;
    case ElementType::int64: f(static_cast<std::int64_t*>(nullptr)); break;
    case ElementType::float32: f(static_cast<float*>(nullptr)); break;
    case ElementType::float64: f(static_cast<double*>(nullptr)); break;
    case ElementType::bfloat16: f(static_cast<bfloat16*>(nullptr)); break;
    case ElementType::float16: f(static_cast<float16*>(nullptr)); break;
  }
}

/// Checks that a rank's fan list belongs to its wire slices: one entry per
/// received wire entry, in order, back to back, each with at least one copy
/// inside the attention layout.
inline void check_fan_list(const KvFanList& fan, const RankMetadata& wire_rev, const std::string& who) {
  const std::size_t n = fan.num_entries();
  if (fan.wire_offset.size() != n || fan.src_rank.size() != n || fan.src_shard.size() != n || fan.copy_splits.size() != n + 1) {
    fail(who, ": the fan list's arrays disagree on the number of entries (", n, ")");
  }
  if (wire_rev.seq_len.size() != n) fail(who, ": the fan list has ", n, " entries, kv_wire_rev receives ", wire_rev.seq_len.size());
  if (fan.copy_splits[0] != 0 || fan.copy_splits[n] != fan.attn_offset.size()) {
    fail(who, ": fan.copy_splits must run from 0 to the ", fan.attn_offset.size(), " copies of fan.attn_offset");
  }
  std::int64_t at = 0;
  for (std::size_t e = 0; e < n; ++e) {
    const std::int64_t len = fan.seq_len[e];
    if (len != wire_rev.seq_len[e] || fan.src_rank[e] != wire_rev.dst_rank[e] || fan.wire_offset[e] != at) {
      fail(who, ": fan entry ", e, " (", len, " tokens of rank ", fan.src_rank[e], " at wire offset ", fan.wire_offset[e],
           ") does not match kv_wire_rev entry ", e, " (", wire_rev.seq_len[e], " tokens of rank ", wire_rev.dst_rank[e], " at ", at, ")");
    }
    at += len;
    if (fan.copy_splits[e + 1] <= fan.copy_splits[e]) fail(who, ": fan entry ", e, " has no copy in the attention layout");
    for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i) {
      if (fan.attn_offset[i] < 0 || fan.attn_offset[i] > fan.attention_tokens - len) {
        fail(who, ": fan.attn_offset[", i, "] = ", fan.attn_offset[i], " with ", len, " tokens falls outside the attention layout of ",
             fan.attention_tokens, " tokens");
      }
    }
  }
  if (fan.wire_tokens != at) fail(who, ": fan.wire_tokens = ", fan.wire_tokens, " but its entries hold ", at);
}

}  // namespace detail

template <class T>
class KvWireDispatcher {
  static_assert(detail::memory_space_of<T>() == MemorySpace::host,
                "cpdispatch: the deduplicated KV exchange (KvWireDispatcher) runs on host transports only for now");

 public:
  using transport_type = T;
  using const_buffer = ConstBytes;
  using mutable_buffer = MutableBytes;

  /// From this rank's part of plan_kv_wire's output. Throws invalid_input when
  /// it is not this transport's rank, or its parts do not belong together.
  KvWireDispatcher(T& transport, RankKvWire slice, std::size_t token_bytes)
      : wire_(transport, std::move(slice.fwd), slice.rev, token_bytes), fan_(std::move(slice.fan)) {
    detail::check_fan_list(fan_, slice.rev, detail::concat("KvWireDispatcher (rank ", wire_.rank(), " of ", wire_.world_size(), ")"));
    const std::size_t tb = token_bytes;
    for (std::size_t e = 0; e < fan_.num_entries(); ++e) {
      const auto from = static_cast<std::size_t>(fan_.wire_offset[e]) * tb, bytes = static_cast<std::size_t>(fan_.seq_len[e]) * tb;
      for (std::size_t i = fan_.copy_splits[e]; i < fan_.copy_splits[e + 1]; ++i) {
        detail::append_piece(fan_out_, from, static_cast<std::size_t>(fan_.attn_offset[i]) * tb, bytes);
      }
    }
    const BufferSizes& inner = wire_.required_bytes();
    sizes_ = {inner.mlp_bytes, detail::token_bytes_of(fan_.attention_tokens, tb, "KvWireDispatcher"), inner.attention_bytes,
              inner.replica_bytes, inner.staging_bytes};
  }

  /// The same from the global wire metadata: takes the part of transport.rank().
  KvWireDispatcher(T& transport, const KvWireMetadata& wire, std::size_t token_bytes)
      : KvWireDispatcher(transport, slice_of(transport, wire), token_bytes) {}

  const KvWireBufferSizes& required_bytes() const noexcept { return sizes_; }
  int rank() const noexcept { return wire_.rank(); }
  int world_size() const noexcept { return wire_.world_size(); }
  std::size_t token_bytes() const noexcept { return wire_.token_bytes(); }

  /// MLP layout -> attention layout: one wire exchange into `wire`, then the fan-out.
  void forward(const_buffer mlp, mutable_buffer attention, mutable_buffer wire) { forward_impl(mlp, attention, wire, nullptr); }
  void forward(const_buffer mlp, mutable_buffer attention, mutable_buffer wire, mutable_buffer staging) {
    forward_impl(mlp, attention, wire, &staging);
  }

  /// Attention-layout gradients -> `grad` [T]: fan-in into `wire`, one wire
  /// exchange home into `replica` ([C][T], slot u in slab u), the home combine.
  void reverse_combine(const_buffer attention_grad, mutable_buffer wire, mutable_buffer replica, mutable_buffer grad, ElementType type) {
    reverse_impl(attention_grad, wire, replica, grad, type, nullptr);
  }
  void reverse_combine(const_buffer attention_grad, mutable_buffer wire, mutable_buffer replica, mutable_buffer grad, ElementType type,
                       mutable_buffer staging) {
    reverse_impl(attention_grad, wire, replica, grad, type, &staging);
  }

 private:
  struct Buffer {
    const std::byte* data;
    std::size_t size;
    const char* name;
    std::size_t used;
  };

  static RankKvWire slice_of(const T& transport, const KvWireMetadata& wire) {
    if (wire.fwd.world_size != transport.world_size() || wire.fan.size() != static_cast<std::size_t>(transport.world_size())) {
      detail::fail("KvWireDispatcher (rank ", transport.rank(), " of ", transport.world_size(), "): the wire metadata is for ",
                   wire.fwd.world_size, " ranks, with ", wire.fan.size(), " fan lists");
    }
    detail::check_shapes(wire.fwd, "kv_wire_fwd");
    detail::check_shapes(wire.rev, "kv_wire_rev");
    return wire.get_slice(transport.rank());
  }

  template <class E = invalid_input, class... Args>
  [[noreturn]] void fail(const char* call, Args&&... args) const {
    detail::fail<E>("KvWireDispatcher::", call, " (rank ", rank(), " of ", world_size(), "): ", std::forward<Args>(args)...);
  }

  /// Capacity of every buffer first, then pairwise overlap: nothing is written before all pass.
  void check_buffers(const char* call, std::initializer_list<Buffer> buffers) const {
    for (const Buffer& b : buffers) {
      if (b.size < b.used) fail<capacity_error>(call, b.name, " holds ", b.size, " bytes, the plan needs ", b.used);
    }
    const std::less<const std::byte*> before;
    for (auto a = buffers.begin(); a != buffers.end(); ++a) {
      for (auto b = a + 1; b != buffers.end(); ++b) {
        if (a->used && b->used && before(a->data, b->data + b->used) && before(b->data, a->data + a->used)) {
          fail(call, a->name, " and ", b->name, " overlap");
        }
      }
    }
  }

  void forward_impl(const_buffer mlp, mutable_buffer attention, mutable_buffer wire, mutable_buffer* staging) {
    const char* call = "forward";
    const std::size_t stage = staging ? sizes_.staging_bytes : 0;
    check_buffers(call, {{mlp.data(), mlp.size(), "mlp", sizes_.mlp_bytes},
                         {attention.data(), attention.size(), "attention", sizes_.attention_bytes},
                         {wire.data(), wire.size(), "wire", sizes_.wire_bytes},
                         {staging ? staging->data() : nullptr, staging ? staging->size() : 0, "staging", stage}});
    const mutable_buffer into = wire.first(sizes_.wire_bytes);
    if (staging) wire_.forward(mlp, into, *staging); else wire_.forward(mlp, into);
    for (const detail::CopyPiece& p : fan_out_) std::memcpy(attention.data() + p.dst, wire.data() + p.src, p.bytes);
  }

  void reverse_impl(const_buffer attention_grad, mutable_buffer wire, mutable_buffer replica, mutable_buffer grad, ElementType type,
                    mutable_buffer* staging) {
    const char* call = "reverse_combine";
    const std::size_t es = element_size(type);
    if (token_bytes() % es != 0) {
      fail(call, "token_bytes = ", token_bytes(), " is not a multiple of the ", es, "-byte ", element_name(type), " element");
    }
    for (const auto& [data, name] : {std::pair{attention_grad.data(), "attention_grad"}, std::pair{static_cast<const std::byte*>(wire.data()), "wire"},
                                     std::pair{static_cast<const std::byte*>(replica.data()), "replica"},
                                     std::pair{static_cast<const std::byte*>(grad.data()), "grad"}}) {
      if (reinterpret_cast<std::uintptr_t>(data) % es != 0) fail(call, name, " is not aligned to ", es, " bytes for ", element_name(type));
    }
    const std::size_t stage = staging ? sizes_.staging_bytes : 0;
    check_buffers(call, {{attention_grad.data(), attention_grad.size(), "attention_grad", sizes_.attention_bytes},
                         {wire.data(), wire.size(), "wire", sizes_.wire_bytes},
                         {replica.data(), replica.size(), "replica", sizes_.replica_bytes},
                         {grad.data(), grad.size(), "grad", sizes_.mlp_bytes},
                         {staging ? staging->data() : nullptr, staging ? staging->size() : 0, "staging", stage}});
    detail::with_element_type(type, [&]<class E>(E*) { detail::fan_in<E>(fan_, attention_grad.data(), wire.data(), token_bytes() / es); });
    const mutable_buffer from = wire.first(sizes_.wire_bytes);
    if (staging) wire_.reverse_combine(from, replica, grad, type, *staging); else wire_.reverse_combine(from, replica, grad, type);
  }

  Dispatcher<T> wire_;
  KvFanList fan_;
  std::vector<detail::CopyPiece> fan_out_;  // wire -> attention, bytes
  KvWireBufferSizes sizes_;
};

}  // namespace cpdispatch
