#pragma once
// Metadata: the communication description of one exchange (the format is
// docs/plan-format.md).
//
// One entry is a shard (or a received sequence, for reverse metadata) of a
// source rank. Entry j of rank r occupies tokens [P_r(j), P_r(j)+seq_len) of
// r's send buffer, P_r(j) being the sum of the lengths before it, and copy k
// of it lands at dst_offset[r][j][k] of rank dst_rank[r][j][k]'s receive
// buffer. 2-D metadata has one copy per entry.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/tensor.hpp"


namespace cpdispatch {

namespace detail {

/// The sum of `lens`, checked: invalid_input (naming `who`) when it overflows 64 bits.
inline std::int64_t token_sum(std::span<const std::int64_t> lens, const char* who) {
  std::int64_t total = 0;
  for (std::int64_t len : lens) total = add_tokens(total, len, who);
  return total;
}

/// Rank `rank`'s [copies][tokens] replica buffer, checked likewise.
inline std::int64_t replica_tokens(std::int64_t rank, std::size_t copies, std::int64_t tokens) {
  std::int64_t out = 0;  // negative lengths (unvalidated metadata) may overflow downwards too
  if (__builtin_mul_overflow(static_cast<std::int64_t>(copies), tokens, &out)) {
    fail("output_tokens: rank ", rank, "'s replica buffer (", copies, " x ", tokens, " tokens) overflows 64 bits");
  }
  return out;
}

}  // namespace detail

/// The metadata of one rank (`get_slice`): its own rows without
/// padding, flattened to [entries][copies].
struct RankMetadata {
  std::int64_t rank = 0;
  std::int64_t world_size = 0;
  bool has_copies = false;                 ///< the global dst_rank is [W][S][C]
  std::size_t num_copies = 1;              ///< C, or 1 for 2-D metadata
  std::vector<std::int64_t> dst_rank;      ///< [entries * num_copies], -1 = no copy
  std::vector<std::int64_t> dst_offset;    ///< [entries * num_copies], tokens
  std::vector<std::int64_t> seq_len;       ///< [entries], tokens
  std::vector<std::int64_t> num_recv_tokens;  ///< [W + 1]: from each source, then the total
  std::int64_t num_seqs = 0;               ///< entries (== seq_len.size())
  std::int64_t num_total_recv_tokens = 0;  ///< == num_recv_tokens[W]
  /// Reverse-KV only: which copies of each of this rank's shards come back
  /// ([shards * mask_copies], 0/1) and the shards' lengths.
  std::optional<std::vector<std::int64_t>> seq_recv_mask;
  std::optional<std::vector<std::int64_t>> recv_seq_lens;
  std::size_t mask_copies = 0;

  std::size_t num_entries() const noexcept { return seq_len.size(); }

  /// Checks the slice on its own, by the rules Metadata::validate applies
  /// to each rank's row: shapes, entry lengths, destinations and offsets in
  /// range, num_recv_tokens non-negative and summing to its total, the
  /// reverse-KV mask and lengths. `name` prefixes messages (e.g. "fwd").
  /// Throws invalid_input.
  void validate(std::string_view name = "slice") const;

  /// Tokens this rank's send buffer holds: the sum of its entry lengths.
  /// A slice may come from anywhere, so the sum is checked: invalid_input
  /// when it overflows 64 bits.
  std::int64_t send_tokens() const { return detail::token_sum(seq_len, "send_tokens"); }

  /// Tokens this rank's receive buffer must hold. For reverse KV metadata
  /// that is the [C][T] replica buffer, otherwise everything received.
  /// Checked like send_tokens().
  std::int64_t output_tokens() const {
    return recv_seq_lens ? detail::replica_tokens(rank, mask_copies, detail::token_sum(*recv_seq_lens, "output_tokens")) : num_total_recv_tokens;
  }
};

struct NormalizedMetadata;

/// Global metadata, all ranks' rows padded to a common length.
struct Metadata {
  Tensor<std::int64_t> dst_rank;         ///< [W][S] or [W][S][C]; -1 = padding / no copy
  Tensor<std::int64_t> dst_offset;       ///< same shape as dst_rank; tokens
  Tensor<std::int64_t> seq_len;          ///< [W][S]; 0 = padding
  Tensor<std::int64_t> num_recv_tokens;  ///< [W][W+1]; [d][s] = tokens d receives from s, [d][W] = total
  std::optional<Tensor<std::int64_t>> seq_recv_mask;  ///< [W][S'][C] 0/1 (reverse of a 3-D plan)
  std::optional<Tensor<std::int64_t>> recv_seq_lens;  ///< [W][S'] (reverse of a 3-D plan)
  Tensor<std::int64_t> num_seqs;         ///< [W]: entries per rank, the rest is padding
  std::int64_t world_size = 0;
  std::vector<std::int64_t> num_total_recv_tokens;  ///< [W] == column W of num_recv_tokens

  bool has_copies() const noexcept { return dst_rank.dim() == 3; }
  std::size_t num_copies() const noexcept { return has_copies() ? dst_rank.size(2) : 1; }
  std::size_t max_seqs() const noexcept { return dst_rank.size(1); }

  /// Tokens rank `rank`'s send buffer holds.
  std::int64_t send_tokens(std::int64_t rank) const;
  /// Tokens rank `rank`'s receive buffer must hold (see RankMetadata::output_tokens).
  std::int64_t output_tokens(std::int64_t rank) const;

  /// This rank's rows without padding.
  RankMetadata get_slice(std::int64_t rank) const;

  /// The dtypes GPU kernels consume; throws invalid_input naming the first
  /// value that does not fit.
  NormalizedMetadata normalize_dtype() const;

  /// Checks the invariants of the format (docs/plan-format.md): shapes,
  /// padding, conservation, offsets in bounds, destination regions that do
  /// not overlap and tile each receive buffer exactly. `name` prefixes
  /// messages (e.g. "kv_rev"). Throws invalid_input.
  void validate(std::string_view name = "metadata") const;
};

/// Metadata in the dtypes GPU kernels consume: int32 ranks, uint32 offsets
/// and lengths, uint64 counts, uint8 masks.
struct NormalizedMetadata {
  Tensor<std::int32_t> dst_rank;
  Tensor<std::uint32_t> dst_offset;
  Tensor<std::uint32_t> seq_len;
  Tensor<std::uint64_t> num_recv_tokens;
  std::optional<Tensor<std::uint8_t>> seq_recv_mask;
  std::optional<Tensor<std::uint32_t>> recv_seq_lens;
  Tensor<std::uint32_t> num_seqs;
  std::int64_t world_size = 0;
  std::vector<std::uint64_t> num_total_recv_tokens;
};

namespace detail {

/// A planner output of the given shape filled with `fill`, advised to huge
/// pages before any page is touched.
template <class T>
Tensor<T> output_tensor(const std::vector<std::size_t>& shape, T fill) {
  Tensor<T> t(shape);  // zero and untouched (calloc)
  advise_huge_pages(t);
  if (fill != T{}) std::fill(t.flat().begin(), t.flat().end(), fill);
  return t;
}

/// A copy of `src` as a planner output (see output_tensor).
template <class T>
Tensor<T> output_copy(const Tensor<T>& src) {
  Tensor<T> t = output_tensor<T>(src.shape(), T{});
  std::copy(src.flat().begin(), src.flat().end(), t.flat().begin());
  return t;
}

/// A zero [W][W+1] count matrix.
inline Tensor<std::int64_t> count_matrix(std::size_t W) { return output_tensor<std::int64_t>({W, W + 1}, 0); }

/// Makes `t` a planner output of `shape` filled with `fill`, reusing its
/// storage when it already has that shape (planning again into the same
/// metadata then touches no fresh memory).
template <class T>
void reuse_output(Tensor<T>& t, const std::vector<std::size_t>& shape, T fill) {
  if (t.shape() != shape) {
    t = output_tensor<T>(shape, fill);
    return;
  }
  std::fill(t.flat().begin(), t.flat().end(), fill);
}

/// Makes `t` a copy of `src`, reusing its storage when the shapes agree.
template <class T>
void reuse_copy(Tensor<T>& t, const Tensor<T>& src) {
  if (t.shape() != src.shape()) {
    t = output_copy(src);
    return;
  }
  std::copy(src.flat().begin(), src.flat().end(), t.flat().begin());
}

/// A [W][W+1] count matrix being filled row by row, its storage reused when
/// it already has that shape. Fresh storage is zero already (and untouched);
/// reused storage has each row zeroed just before it is filled, while the
/// row is in cache. Either way the matrix is written once.
class CountRows {
 public:
  CountRows(Tensor<std::int64_t>& counts, std::size_t W) : counts_(counts), fresh_(counts.shape() != std::vector<std::size_t>{W, W + 1}) {
    if (fresh_) counts = count_matrix(W);
  }
  /// Row `r`, all zero, to be filled now.
  std::span<std::int64_t> row(std::size_t r) {
    auto row = counts_.row(r);
    if (!fresh_) std::fill(row.begin(), row.end(), 0);
    return row;
  }

 private:
  Tensor<std::int64_t>& counts_;
  bool fresh_;
};

/// Converts an int64 tensor to `To`, refusing values outside its range.
template <class To>
Tensor<To> narrow_tensor(const Tensor<std::int64_t>& in, std::string_view field) {
  Tensor<To> out(in.shape());
  const auto shape = in.shape();
  for (std::size_t i = 0; i < in.numel(); ++i) {
    const std::int64_t v = in.flat()[i];
    const bool fits = v >= static_cast<std::int64_t>(std::numeric_limits<To>::min()) &&
                      (std::is_signed_v<To> || std::is_same_v<To, std::uint64_t> ||
                       static_cast<std::uint64_t>(v) <= static_cast<std::uint64_t>(std::numeric_limits<To>::max())) &&
                      (!std::is_signed_v<To> || v <= static_cast<std::int64_t>(std::numeric_limits<To>::max()));
    if (!fits) {
      std::string where;
      std::size_t rest = i;
      std::vector<std::size_t> ix(shape.size());
      for (std::size_t a = shape.size(); a-- > 0;) {
        ix[a] = rest % shape[a];
        rest /= shape[a];
      }
      for (std::size_t a : ix) {  // appended piecewise: "[" + std::to_string(a) trips GCC 12 -Wrestrict at -O3
        where += '[';
        where += std::to_string(a);
        where += ']';
      }
      fail("normalize_dtype: ", field, where, " = ", v, " does not fit the kernel dtype (range [",
           +std::numeric_limits<To>::min(), ", ", +std::numeric_limits<To>::max(), "])");
    }
    out.flat()[i] = static_cast<To>(v);
  }
  return out;
}

inline std::string shape_str(const std::vector<std::size_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- the rules of one entry, one row, one shard: shared by the global
// ---- metadata's checks and a rank's slice's, so both word them alike.

inline void check_seq_len(std::string_view name, const std::string& where, std::int64_t len) {
  if (len < 0) fail(name, ".seq_len", where, " = ", len, " is negative");
}

/// One copy's destination rank (-1: none) and offset.
inline void check_copy(std::string_view name, const std::string& where, std::int64_t dst, std::int64_t offset, std::int64_t W) {
  if (dst < -1 || dst >= W) fail(name, ".dst_rank", where, " = ", dst, " is outside [0, ", W, ") (-1 means no copy)");
  if (offset < 0) fail(name, ".dst_offset", where, " = ", offset, " is negative");
}

/// A num_recv_tokens row's last value against the sum of the others.
inline void check_row_total(std::string_view name, const std::string& where, std::int64_t value, std::int64_t total) {
  if (value != total) fail(name, ".num_recv_tokens", where, " = ", value, ", but the row sums to ", total);
}

inline void check_mask_pairing(std::string_view name, bool has_mask, bool has_lens) {
  if (has_mask != has_lens) fail(name, ": seq_recv_mask and recv_seq_lens must be both present or both absent");
}

/// One returning shard: its length and its copies' mask bits.
inline void check_recv_shard(std::string_view name, const std::string& where, std::int64_t len) {
  if (len < 0) fail(name, ".recv_seq_lens", where, " = ", len, " is negative");
}
inline void check_mask_bit(std::string_view name, const std::string& where, std::int64_t bit, std::int64_t len,
                           const std::string& len_where) {
  if (bit != 0 && bit != 1) fail(name, ".seq_recv_mask", where, " = ", bit, " is not 0 or 1");
  if (bit == 1 && len == 0) fail(name, ".seq_recv_mask", where, " = 1 but recv_seq_lens", len_where, " = 0");
}

/// The shape rules of the format; everything that indexes metadata checks them first.
inline void check_shapes(const Metadata& m, std::string_view name) {
  if (m.world_size <= 0) fail(name, ".world_size = ", m.world_size, " must be positive");
  const auto W = static_cast<std::size_t>(m.world_size);
  if (m.dst_rank.dim() != 2 && m.dst_rank.dim() != 3) {
    fail(name, ".dst_rank has ", m.dst_rank.dim(), " dimensions, expected 2 ([W][S]) or 3 ([W][S][C])");
  }
  if (m.dst_rank.size(0) != W) {
    fail(name, ".dst_rank has shape ", shape_str(m.dst_rank.shape()), ", expected ", W, " rows (world_size)");
  }
  if (m.dst_offset.shape() != m.dst_rank.shape()) {
    fail(name, ".dst_offset has shape ", shape_str(m.dst_offset.shape()), ", dst_rank has ", shape_str(m.dst_rank.shape()));
  }
  const std::size_t S = m.dst_rank.size(1);
  if (m.seq_len.dim() != 2 || m.seq_len.size(0) != W || m.seq_len.size(1) != S) {
    fail(name, ".seq_len has shape ", shape_str(m.seq_len.shape()), ", expected [", W, ", ", S, "]");
  }
  if (m.num_recv_tokens.dim() != 2 || m.num_recv_tokens.size(0) != W || m.num_recv_tokens.size(1) != W + 1) {
    fail(name, ".num_recv_tokens has shape ", shape_str(m.num_recv_tokens.shape()), ", expected [", W, ", ", W + 1, "]");
  }
  if (m.num_seqs.dim() != 1 || m.num_seqs.size(0) != W) {
    fail(name, ".num_seqs has shape ", shape_str(m.num_seqs.shape()), ", expected [", W, "]");
  }
  for (std::size_t r = 0; r < W; ++r) {
    if (m.num_seqs(r) < 0 || static_cast<std::size_t>(m.num_seqs(r)) > S) {
      fail(name, ".num_seqs[", r, "] = ", m.num_seqs(r), " is outside [0, ", S, "]");
    }
  }
  if (m.num_total_recv_tokens.size() != W) {
    fail(name, ".num_total_recv_tokens has ", m.num_total_recv_tokens.size(), " entries, expected ", W);
  }
  check_mask_pairing(name, m.seq_recv_mask.has_value(), m.recv_seq_lens.has_value());
  if (m.seq_recv_mask) {
    if (m.seq_recv_mask->dim() != 3 || m.seq_recv_mask->size(0) != W) {
      fail(name, ".seq_recv_mask has shape ", shape_str(m.seq_recv_mask->shape()), ", expected [", W, ", S, C]");
    }
    const std::size_t mask_s = m.seq_recv_mask->size(1);
    if (m.recv_seq_lens->dim() != 2 || m.recv_seq_lens->size(0) != W || m.recv_seq_lens->size(1) != mask_s) {
      fail(name, ".recv_seq_lens has shape ", shape_str(m.recv_seq_lens->shape()), ", expected [", W, ", ", mask_s, "]");
    }
  }
}

}  // namespace detail

inline std::int64_t Metadata::send_tokens(std::int64_t rank) const {
  return detail::token_sum(seq_len.row(static_cast<std::size_t>(rank)), "send_tokens");
}

inline std::int64_t Metadata::output_tokens(std::int64_t rank) const {
  const auto r = static_cast<std::size_t>(rank);
  if (recv_seq_lens) return detail::replica_tokens(rank, seq_recv_mask->size(2), detail::token_sum(recv_seq_lens->row(r), "output_tokens"));
  return num_recv_tokens(r, static_cast<std::size_t>(world_size));
}

inline RankMetadata Metadata::get_slice(std::int64_t rank) const {
  if (rank < 0 || rank >= world_size) {
    detail::fail("get_slice: rank ", rank, " is outside [0, ", world_size, ")");
  }
  detail::check_shapes(*this, "get_slice: metadata");  // num_seqs bounds the rows read below
  const auto r = static_cast<std::size_t>(rank);
  const std::size_t n = static_cast<std::size_t>(num_seqs(r));
  const std::size_t c = num_copies();
  RankMetadata s;
  s.rank = rank;
  s.world_size = world_size;
  s.has_copies = has_copies();
  s.num_copies = c;
  s.num_seqs = static_cast<std::int64_t>(n);
  auto ranks = dst_rank.row(r);
  auto offsets = dst_offset.row(r);
  s.dst_rank.assign(ranks.begin(), ranks.begin() + static_cast<std::ptrdiff_t>(n * c));
  s.dst_offset.assign(offsets.begin(), offsets.begin() + static_cast<std::ptrdiff_t>(n * c));
  auto lens = seq_len.row(r);
  s.seq_len.assign(lens.begin(), lens.begin() + static_cast<std::ptrdiff_t>(n));
  auto recv = num_recv_tokens.row(r);
  s.num_recv_tokens.assign(recv.begin(), recv.end());
  s.num_total_recv_tokens = recv.back();
  if (seq_recv_mask && recv_seq_lens) {
    // The mask rows describe this rank's own shards; padding shards have length 0.
    auto rl = recv_seq_lens->row(r);
    std::size_t shards = 0;
    while (shards < rl.size() && rl[shards] > 0) ++shards;
    s.mask_copies = seq_recv_mask->size(2);
    auto mask = seq_recv_mask->row(r);
    s.seq_recv_mask.emplace(mask.begin(), mask.begin() + static_cast<std::ptrdiff_t>(shards * s.mask_copies));
    s.recv_seq_lens.emplace(rl.begin(), rl.begin() + static_cast<std::ptrdiff_t>(shards));
  }
  return s;
}

inline NormalizedMetadata Metadata::normalize_dtype() const {
  NormalizedMetadata n;
  n.dst_rank = detail::narrow_tensor<std::int32_t>(dst_rank, "dst_rank");
  n.dst_offset = detail::narrow_tensor<std::uint32_t>(dst_offset, "dst_offset");
  n.seq_len = detail::narrow_tensor<std::uint32_t>(seq_len, "seq_len");
  n.num_recv_tokens = detail::narrow_tensor<std::uint64_t>(num_recv_tokens, "num_recv_tokens");
  if (seq_recv_mask) n.seq_recv_mask = detail::narrow_tensor<std::uint8_t>(*seq_recv_mask, "seq_recv_mask");
  if (recv_seq_lens) n.recv_seq_lens = detail::narrow_tensor<std::uint32_t>(*recv_seq_lens, "recv_seq_lens");
  n.num_seqs = detail::narrow_tensor<std::uint32_t>(num_seqs, "num_seqs");
  n.world_size = world_size;
  n.num_total_recv_tokens.reserve(num_total_recv_tokens.size());
  for (std::int64_t v : num_total_recv_tokens) n.num_total_recv_tokens.push_back(static_cast<std::uint64_t>(v));
  return n;
}

namespace detail {

/// Reads 2-D metadata as one copy per entry, so the checks below see [W][S][C].
struct EntryView {
  const Metadata& m;
  std::int64_t rank(std::size_t r, std::size_t j, std::size_t k) const { return m.has_copies() ? m.dst_rank(r, j, k) : m.dst_rank(r, j); }
  std::int64_t offset(std::size_t r, std::size_t j, std::size_t k) const { return m.has_copies() ? m.dst_offset(r, j, k) : m.dst_offset(r, j); }
  std::string where(std::size_t r, std::size_t j, std::size_t k) const { return m.has_copies() ? index_str(r, j, k) : index_str(r, j); }
};

/// Ranges and padding of every entry, and num_seqs; returns the tokens each
/// rank sends each destination ([d][s], flat).
inline std::vector<std::int64_t> check_entries(const Metadata& m, std::string_view name) {
  const EntryView v{m};
  const auto W = static_cast<std::size_t>(m.world_size);
  const std::size_t S = m.dst_rank.size(1), C = m.num_copies();
  std::vector<std::int64_t> sent(W * W, 0);
  for (std::size_t r = 0; r < W; ++r) {
    bool padding_seen = false;
    std::int64_t entries = 0;
    for (std::size_t j = 0; j < S; ++j) {
      const std::int64_t len = m.seq_len(r, j);
      check_seq_len(name, index_str(r, j), len);
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = v.rank(r, j, k), off = v.offset(r, j, k);
        check_copy(name, v.where(r, j, k), d, off, m.world_size);
        if (d < 0) {
          if (off != 0) fail(name, ".dst_offset", v.where(r, j, k), " = ", off, " but the copy has no destination (padding offset must be 0)");
          continue;
        }
        if (len == 0) fail(name, ".dst_rank", v.where(r, j, k), " = ", d, " but seq_len", index_str(r, j), " = 0 (padding has no destination)");
        auto& to_d = sent[static_cast<std::size_t>(d) * W + r];
        to_d = add_tokens(to_d, len, "validate");
      }
      if (len == 0) {
        padding_seen = true;
        continue;
      }
      if (padding_seen) fail(name, ".seq_len", index_str(r, j), " = ", len, " follows a padding entry (padding sits only at the end of a row)");
      // A real entry may have no destination and stay home: a KV shard no
      // query needs (section 2e), a head-parallel shard in q_fwd (section 2f).
      ++entries;
    }
    if (m.num_seqs(r) != entries) fail(name, ".num_seqs", index_str(r), " = ", m.num_seqs(r), ", but the row has ", entries, " non-padding entries");
  }
  return sent;
}

/// num_recv_tokens agrees with what the entries send, and its totals with the rows.
inline void check_conservation(const Metadata& m, std::string_view name, const std::vector<std::int64_t>& sent) {
  const auto W = static_cast<std::size_t>(m.world_size);
  for (std::size_t d = 0; d < W; ++d) {
    std::int64_t total = 0;
    for (std::size_t s = 0; s < W; ++s) {
      const std::int64_t got = m.num_recv_tokens(d, s);
      if (got != sent[d * W + s]) {
        fail(name, ".num_recv_tokens", index_str(d, s), " = ", got, ", but rank ", s, " sends ", sent[d * W + s], " tokens to rank ", d);
      }
      total = add_tokens(total, got, "validate");
    }
    check_row_total(name, index_str(d, W), m.num_recv_tokens(d, W), total);
    if (m.num_total_recv_tokens[d] != total) fail(name, ".num_total_recv_tokens", index_str(d), " = ", m.num_total_recv_tokens[d], ", expected ", total);
  }
}

/// The tokens each rank's receive buffer holds: everything received, or,
/// with a mask, the [C][T] replica buffer (checking the mask and lengths).
inline std::vector<std::int64_t> receive_capacity(const Metadata& m, std::string_view name) {
  const auto W = static_cast<std::size_t>(m.world_size);
  std::vector<std::int64_t> capacity(W);
  if (!m.seq_recv_mask) {
    for (std::size_t d = 0; d < W; ++d) capacity[d] = m.num_recv_tokens(d, W);
    return capacity;
  }
  const auto& mask = *m.seq_recv_mask;
  const auto& lens = *m.recv_seq_lens;
  const std::size_t mask_s = mask.size(1), mask_c = mask.size(2);
  for (std::size_t r = 0; r < W; ++r) {
    bool padding_seen = false;
    std::int64_t t = 0;
    for (std::size_t g = 0; g < mask_s; ++g) {
      const std::int64_t len = lens(r, g);
      check_recv_shard(name, index_str(r, g), len);
      if (len > 0 && padding_seen) fail(name, ".recv_seq_lens", index_str(r, g), " = ", len, " follows a padding entry");
      if (len == 0) padding_seen = true;
      t = add_tokens(t, len, "validate");
      for (std::size_t c = 0; c < mask_c; ++c) {
        check_mask_bit(name, index_str(r, g, c), mask(r, g, c), len, index_str(r, g));
      }
    }
    if (mask_c > 0 && t > std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(mask_c)) {
      fail(name, ".recv_seq_lens: rank ", r, "'s replica buffer (", mask_c, " x ", t, " tokens) overflows 64 bits");
    }
    capacity[r] = static_cast<std::int64_t>(mask_c) * t;
  }
  return capacity;
}

/// Where one copy lands: offset and length at its destination, and its entry.
struct Region {
  std::int64_t offset, len;
  std::size_t r, j, k;
};

/// Every copy's region, per destination, after checking it ends in bounds.
inline std::vector<std::vector<Region>> destination_regions(const Metadata& m, std::string_view name,
                                                           const std::vector<std::int64_t>& capacity) {
  const EntryView v{m};
  const auto W = static_cast<std::size_t>(m.world_size);
  const std::size_t S = m.dst_rank.size(1), C = m.num_copies();
  std::vector<std::vector<Region>> regions(W);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t j = 0; j < S; ++j) {
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = v.rank(r, j, k);
        if (d < 0) continue;
        const std::int64_t off = v.offset(r, j, k), len = m.seq_len(r, j);
        const std::int64_t cap = capacity[static_cast<std::size_t>(d)];
        if (off > cap - len) {
          fail(name, ".dst_offset", v.where(r, j, k), " = ", off, " with seq_len ", len, " ends past the ", cap, " tokens rank ", d, " receives");
        }
        regions[static_cast<std::size_t>(d)].push_back({off, len, r, j, k});
      }
    }
  }
  return regions;
}

/// Sorts one destination's regions by offset and refuses any overlap.
inline void check_disjoint(const Metadata& m, std::string_view name, std::size_t d, std::vector<Region>& regs) {
  const EntryView v{m};
  std::sort(regs.begin(), regs.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < regs.size(); ++i) {
    const Region &a = regs[i - 1], &b = regs[i];
    if (b.offset < a.offset + a.len) {
      fail(name, ".dst_offset", v.where(b.r, b.j, b.k), " = ", b.offset, " overlaps dst_offset", v.where(a.r, a.j, a.k), " = ", a.offset,
           " (length ", a.len, ") on rank ", d);
    }
  }
}

/// Reverse KV: rank d's sorted regions must be exactly the cells of its
/// [C][T] replica buffer that seq_recv_mask marks.
inline void check_replica_cells(const Metadata& m, std::string_view name, std::size_t d, const std::vector<Region>& regs) {
  const EntryView v{m};
  const auto& mask = *m.seq_recv_mask;
  const auto& lens = *m.recv_seq_lens;
  std::vector<std::pair<std::int64_t, std::int64_t>> cells;  // (offset, len), sorted: c major, g minor
  std::int64_t t = 0;
  for (std::size_t g = 0; g < mask.size(1); ++g) t += lens(d, g);
  for (std::size_t c = 0; c < mask.size(2); ++c) {
    std::int64_t p = 0;
    for (std::size_t g = 0; g < mask.size(1); ++g) {
      if (mask(d, g, c) == 1) cells.emplace_back(static_cast<std::int64_t>(c) * t + p, lens(d, g));
      p += lens(d, g);
    }
  }
  for (std::size_t i = 0; i < std::max(cells.size(), regs.size()); ++i) {
    if (i >= regs.size()) fail(name, ".seq_recv_mask marks ", cells.size(), " copies returning to rank ", d, " but only ", regs.size(), " arrive");
    if (i >= cells.size() || regs[i].offset != cells[i].first || regs[i].len != cells[i].second) {
      fail(name, ".dst_offset", v.where(regs[i].r, regs[i].j, regs[i].k), " = ", regs[i].offset, " (length ", regs[i].len,
           ") is not a copy that seq_recv_mask marks on rank ", d);
    }
  }
}

}  // namespace detail

inline void Metadata::validate(std::string_view name) const {
  detail::check_shapes(*this, name);
  detail::check_conservation(*this, name, detail::check_entries(*this, name));
  auto regions = detail::destination_regions(*this, name, detail::receive_capacity(*this, name));
  for (std::size_t d = 0; d < regions.size(); ++d) {
    detail::check_disjoint(*this, name, d, regions[d]);
    // Without a mask, conservation proved total == capacity; with regions in
    // bounds and disjoint, that means the buffer is tiled exactly.
    if (seq_recv_mask) detail::check_replica_cells(*this, name, d, regions[d]);
  }
}

namespace detail {

/// A slice's sizes against its own num_seqs, num_copies and world_size.
inline void check_slice_shapes(const RankMetadata& m, std::string_view name) {
  const std::size_t n = m.seq_len.size(), C = m.num_copies;
  if (m.world_size <= 0) fail(name, ".world_size = ", m.world_size, " must be positive");
  if (m.rank < 0 || m.rank >= m.world_size) fail(name, ".rank = ", m.rank, " is outside [0, ", m.world_size, ")");
  if (C == 0) fail(name, ".num_copies is 0");
  if (m.num_seqs != static_cast<std::int64_t>(n)) fail(name, ".num_seqs = ", m.num_seqs, " but seq_len has ", n, " entries");
  if (m.dst_rank.size() != n * C || m.dst_offset.size() != n * C) {
    fail(name, ".dst_rank and dst_offset have ", m.dst_rank.size(), " and ", m.dst_offset.size(), " values, expected ", n,
         " entries x ", C, " copies");
  }
  if (m.num_recv_tokens.size() != static_cast<std::size_t>(m.world_size) + 1) {
    fail(name, ".num_recv_tokens has ", m.num_recv_tokens.size(), " values, expected world_size + 1 = ", m.world_size + 1);
  }
  check_mask_pairing(name, m.seq_recv_mask.has_value(), m.recv_seq_lens.has_value());
  if (m.seq_recv_mask && m.seq_recv_mask->size() != m.recv_seq_lens->size() * m.mask_copies) {
    fail(name, ".seq_recv_mask has ", m.seq_recv_mask->size(), " values, expected ", m.recv_seq_lens->size(), " shards x ",
         m.mask_copies, " copies");
  }
}

/// A slice's values: entries, its num_recv_tokens row, its returning shards.
inline void check_slice_values(const RankMetadata& m, std::string_view name) {
  const std::size_t n = m.seq_len.size(), C = m.num_copies;
  const auto where = [&](std::size_t j, std::size_t k) { return m.has_copies ? index_str(j, k) : index_str(j); };
  for (std::size_t j = 0; j < n; ++j) {
    check_seq_len(name, index_str(j), m.seq_len[j]);
    for (std::size_t k = 0; k < C; ++k) check_copy(name, where(j, k), m.dst_rank[j * C + k], m.dst_offset[j * C + k], m.world_size);
  }
  const auto W = static_cast<std::size_t>(m.world_size);
  std::int64_t total = 0;
  for (std::size_t s = 0; s < W; ++s) {
    if (m.num_recv_tokens[s] < 0) fail(name, ".num_recv_tokens", index_str(s), " = ", m.num_recv_tokens[s], " is negative");
    total = add_tokens(total, m.num_recv_tokens[s], "validate");
  }
  check_row_total(name, index_str(W), m.num_recv_tokens[W], total);
  if (!m.recv_seq_lens) return;
  for (std::size_t g = 0; g < m.recv_seq_lens->size(); ++g) {
    const std::int64_t len = (*m.recv_seq_lens)[g];
    check_recv_shard(name, index_str(g), len);
    for (std::size_t c = 0; c < m.mask_copies; ++c) {
      check_mask_bit(name, index_str(g, c), (*m.seq_recv_mask)[g * m.mask_copies + c], len, index_str(g));
    }
  }
}

}  // namespace detail

inline void RankMetadata::validate(std::string_view name) const {
  detail::check_slice_shapes(*this, name);
  detail::check_slice_values(*this, name);
}

}  // namespace cpdispatch
