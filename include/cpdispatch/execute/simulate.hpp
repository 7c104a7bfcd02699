#pragma once
// The memcpy simulation (the reference execution): a global-view
// execution of metadata over one byte buffer per rank. The KV-gradient
// combine that sums returned copies is in execute/combine.hpp (included).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/detail/platform.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch {

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

}  // namespace cpdispatch
