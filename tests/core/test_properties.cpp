// The seeds' properties on random plans: the query exchange round-trips,
// every KV copy in the attention layout equals its source shard, the
// gradient combine sums the copies (fp32 accumulation for 16-bit types),
// tokens are conserved, validate() accepts everything planned, regions tile
// the receive buffers, padding follows -1/0/0, get_slice drops padding, and
// normalize_dtype narrows to the kernel dtypes.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "reference.hpp"

namespace {

using cpdispatch::Metadata;
using cpdispatch::QkvMetadata;
using cpdispatch::Tensor;
using cptest::I;
using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

constexpr int kPlans = 250;
constexpr std::uint64_t kBase = 0xc0de0000;

// Simulations move real data, so the property plans are a little smaller
// than the reference-comparison ones (W up to 24, shards up to 12 tokens).
const cptest::QkvGenOptions kSmall{24, 3, 8, 12};

std::string seed_text(std::uint64_t seed) { return "seed " + std::to_string(seed); }

/// One local shard of a QKV plan, recomputed from the plan itself.
struct Shard {
  std::size_t r, j;  ///< rank, local index
  std::size_t base;  ///< local index of the document's first shard
  std::size_t k, n;  ///< index in the document, shards in the document
  I len, dst, start, context;
};

struct Layout {
  std::vector<std::vector<Shard>> local;               // [r][j]
  std::vector<std::vector<const Shard*>> arrivals;     // [d]: query shards in global order
  std::vector<I> tokens;                               // T_r
};

Layout layout_of(const ref::Plan& p) {
  Layout l;
  l.local.resize(static_cast<std::size_t>(p.W));
  l.arrivals.resize(static_cast<std::size_t>(p.W));
  l.tokens.assign(static_cast<std::size_t>(p.W), 0);
  for (std::size_t r = 0; r < l.local.size(); ++r) {
    for (const ref::Doc& d : p.ranks[r]) {
      const std::size_t base = l.local[r].size();
      I ctx = 0;
      for (std::size_t k = 0; k < d.len.size(); ++k) {
        l.local[r].push_back({r, base + k, base, k, d.len.size(), d.len[k], d.dst[k], l.tokens[r], ctx});
        ctx += d.len[k];
        l.tokens[r] += d.len[k];
      }
    }
  }
  for (auto& row : l.local)
    for (const Shard& s : row) l.arrivals[static_cast<std::size_t>(s.dst)].push_back(&s);
  return l;
}

// ------------------------------------------------------------ structural checks

std::size_t copies_of(const Metadata& m) { return m.dst_rank.dim() == 3 ? m.dst_rank.size(2) : 1; }
I rank_at(const Metadata& m, std::size_t r, std::size_t j, std::size_t k) {
  return m.dst_rank.dim() == 3 ? m.dst_rank(r, j, k) : m.dst_rank(r, j);
}
I offset_at(const Metadata& m, std::size_t r, std::size_t j, std::size_t k) {
  return m.dst_offset.dim() == 3 ? m.dst_offset(r, j, k) : m.dst_offset(r, j);
}

/// -1/0/0 padding only at row ends, num_seqs = the non-padding count, -1
/// copies have offset 0; with `tight`, the row width is the largest num_seqs.
AssertionResult padding_ok(const Metadata& m, const std::string& name, bool tight) {
  const auto W = static_cast<std::size_t>(m.world_size);
  const std::size_t S = m.dst_rank.size(1), C = copies_of(m);
  I widest = 0;
  for (std::size_t r = 0; r < W; ++r) {
    const I n = m.num_seqs(r);
    widest = std::max(widest, n);
    for (std::size_t j = 0; j < S; ++j) {
      const bool pad = static_cast<I>(j) >= n;
      const I len = m.seq_len(r, j);
      std::size_t dsts = 0;
      for (std::size_t k = 0; k < C; ++k) {
        const I d = rank_at(m, r, j, k), off = offset_at(m, r, j, k);
        if (d >= 0) ++dsts;
        if (d < 0 && (d != -1 || off != 0)) {
          return AssertionFailure() << name << " copy [" << r << "][" << j << "][" << k << "] has rank " << d << ", offset " << off
                                    << " (padding/no copy must be -1/0)";
        }
      }
      if (pad && (len != 0 || dsts != 0)) {
        return AssertionFailure() << name << " entry [" << r << "][" << j << "] is past num_seqs = " << n << " but has seq_len "
                                  << len << " and " << dsts << " destinations";
      }
      if (!pad && (len <= 0 || dsts == 0)) {
        return AssertionFailure() << name << " entry [" << r << "][" << j << "] is inside num_seqs = " << n << " but has seq_len "
                                  << len << " and " << dsts << " destinations";
      }
    }
  }
  if (tight && widest != static_cast<I>(S)) {
    return AssertionFailure() << name << " rows are padded to " << S << ", the most entries of a rank is " << widest;
  }
  if (m.recv_seq_lens) {
    for (std::size_t r = 0; r < W; ++r) {
      bool pad = false;
      for (std::size_t g = 0; g < m.recv_seq_lens->size(1); ++g) {
        const I len = (*m.recv_seq_lens)(r, g);
        if (len == 0) pad = true;
        if (pad && len != 0) return AssertionFailure() << name << ".recv_seq_lens[" << r << "][" << g << "] follows padding";
        for (std::size_t c = 0; c < m.seq_recv_mask->size(2); ++c)
          if (pad && (*m.seq_recv_mask)(r, g, c) != 0)
            return AssertionFailure() << name << ".seq_recv_mask[" << r << "][" << g << "][" << c << "] is set on padding";
      }
    }
  }
  return AssertionSuccess();
}

/// Destination regions tile each receive buffer: contiguous from 0 to the
/// buffer's size; for reverse metadata with a mask, they are exactly the
/// masked cells of the [C][T] replica buffer.
AssertionResult regions_tile(const Metadata& m, const std::string& name) {
  const auto W = static_cast<std::size_t>(m.world_size);
  struct Reg {
    I off, len;
  };
  std::vector<std::vector<Reg>> regs(W);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < m.dst_rank.size(1); ++j)
      for (std::size_t k = 0; k < copies_of(m); ++k)
        if (const I d = rank_at(m, r, j, k); d >= 0) regs[static_cast<std::size_t>(d)].push_back({offset_at(m, r, j, k), m.seq_len(r, j)});
  for (std::size_t d = 0; d < W; ++d) {
    auto& v = regs[d];
    std::sort(v.begin(), v.end(), [](const Reg& a, const Reg& b) { return a.off < b.off; });
    if (!m.seq_recv_mask) {
      I at = 0;
      for (const Reg& g : v) {
        if (g.off != at) return AssertionFailure() << name << ": rank " << d << "'s buffer has a region at " << g.off << ", expected " << at;
        at += g.len;
      }
      if (at != m.num_recv_tokens(d, W) || at != m.output_tokens(static_cast<I>(d))) {
        return AssertionFailure() << name << ": rank " << d << "'s regions end at " << at << ", buffer holds " << m.num_recv_tokens(d, W);
      }
    } else {
      std::vector<Reg> cells;
      const auto& lens = *m.recv_seq_lens;
      I t = 0;
      for (std::size_t g = 0; g < lens.size(1); ++g) t += lens(d, g);
      for (std::size_t c = 0; c < m.seq_recv_mask->size(2); ++c) {
        I p = 0;
        for (std::size_t g = 0; g < lens.size(1); ++g) {
          if ((*m.seq_recv_mask)(d, g, c)) cells.push_back({static_cast<I>(c) * t + p, lens(d, g)});
          p += lens(d, g);
        }
      }
      if (cells.size() != v.size()) return AssertionFailure() << name << ": rank " << d << " gets " << v.size() << " regions, mask marks " << cells.size();
      for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i].off != cells[i].off || v[i].len != cells[i].len)
          return AssertionFailure() << name << ": rank " << d << " region " << i << " is (" << v[i].off << ", " << v[i].len
                                    << "), the masked cell is (" << cells[i].off << ", " << cells[i].len << ")";
      if (m.output_tokens(static_cast<I>(d)) != static_cast<I>(m.seq_recv_mask->size(2)) * t) {
        return AssertionFailure() << name << ".output_tokens(" << d << ") is not C x T";
      }
    }
  }
  return AssertionSuccess();
}

/// get_slice(r) is row r without padding, flattened to [entries][copies].
AssertionResult slices_ok(const Metadata& m, const std::string& name) {
  const auto W = static_cast<std::size_t>(m.world_size);
  const std::size_t C = copies_of(m);
  for (std::size_t r = 0; r < W; ++r) {
    const auto s = m.get_slice(static_cast<I>(r));
    const auto n = static_cast<std::size_t>(m.num_seqs(r));
    const std::string at = name + ".get_slice(" + std::to_string(r) + ")";
    if (s.rank != static_cast<I>(r) || s.world_size != m.world_size || s.has_copies != (m.dst_rank.dim() == 3) || s.num_copies != C)
      return AssertionFailure() << at << ": rank/world_size/has_copies/num_copies";
    if (s.num_seqs != static_cast<I>(n) || s.num_entries() != n) return AssertionFailure() << at << ".num_seqs = " << s.num_seqs << ", expected " << n;
    for (std::size_t j = 0; j < n; ++j) {
      if (s.seq_len[j] != m.seq_len(r, j) || s.seq_len[j] <= 0) return AssertionFailure() << at << ".seq_len[" << j << "]";
      for (std::size_t k = 0; k < C; ++k) {
        if (s.dst_rank[j * C + k] != rank_at(m, r, j, k)) return AssertionFailure() << at << ".dst_rank[" << j * C + k << "]";
        if (s.dst_offset[j * C + k] != offset_at(m, r, j, k)) return AssertionFailure() << at << ".dst_offset[" << j * C + k << "]";
      }
    }
    if (s.dst_rank.size() != n * C || s.dst_offset.size() != n * C) return AssertionFailure() << at << " keeps padding copies";
    if (s.num_recv_tokens.size() != W + 1) return AssertionFailure() << at << ".num_recv_tokens has " << s.num_recv_tokens.size() << " entries";
    for (std::size_t d = 0; d <= W; ++d)
      if (s.num_recv_tokens[d] != m.num_recv_tokens(r, d)) return AssertionFailure() << at << ".num_recv_tokens[" << d << "]";
    if (s.num_total_recv_tokens != m.num_recv_tokens(r, W)) return AssertionFailure() << at << ".num_total_recv_tokens";
    if (s.send_tokens() != m.send_tokens(static_cast<I>(r))) return AssertionFailure() << at << ".send_tokens()";
    if (s.output_tokens() != m.output_tokens(static_cast<I>(r))) return AssertionFailure() << at << ".output_tokens()";
    if (s.seq_recv_mask.has_value() != m.seq_recv_mask.has_value() || s.recv_seq_lens.has_value() != m.recv_seq_lens.has_value())
      return AssertionFailure() << at << ": mask presence differs";
    if (m.seq_recv_mask) {
      const std::size_t mc = m.seq_recv_mask->size(2);
      std::size_t shards = 0;
      while (shards < m.recv_seq_lens->size(1) && (*m.recv_seq_lens)(r, shards) > 0) ++shards;
      if (s.mask_copies != mc || s.recv_seq_lens->size() != shards || s.seq_recv_mask->size() != shards * mc)
        return AssertionFailure() << at << ": mask/recv_seq_lens sizes";
      for (std::size_t g = 0; g < shards; ++g) {
        if ((*s.recv_seq_lens)[g] != (*m.recv_seq_lens)(r, g)) return AssertionFailure() << at << ".recv_seq_lens[" << g << "]";
        for (std::size_t c = 0; c < mc; ++c)
          if ((*s.seq_recv_mask)[g * mc + c] != (*m.seq_recv_mask)(r, g, c)) return AssertionFailure() << at << ".seq_recv_mask[" << g * mc + c << "]";
      }
    }
  }
  return AssertionSuccess();
}

AssertionResult structure_ok(const Metadata& m, const std::string& name, bool tight) {
  try {
    m.validate(name);
  } catch (const cpdispatch::error& e) {
    return AssertionFailure() << "validate: " << e.what();
  }
  for (auto res : {padding_ok(m, name, tight), regions_tile(m, name), slices_ok(m, name)})
    if (!res) return res;
  return AssertionSuccess();
}

TEST(CoreProperties, QkvMetadataIsWellFormed) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const ref::Plan p = cptest::random_qkv_plan(seed);
    const QkvMetadata m = cpdispatch::plan_qkv(cptest::to_plan(p));
    ASSERT_TRUE(structure_ok(m.q_fwd, "q_fwd", true));
    ASSERT_TRUE(structure_ok(m.q_rev, "q_rev", true));
    ASSERT_TRUE(structure_ok(m.kv_fwd, "kv_fwd", true));
    ASSERT_TRUE(structure_ok(m.kv_rev, "kv_rev", true));
  }
}

TEST(CoreProperties, QueryMetadataIsWellFormed) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const cptest::QueryCase q = cptest::random_query_plan(seed);
    const auto m = cpdispatch::plan_query(q.seq_len_tensor(), q.dispatch_tensor());
    ASSERT_TRUE(structure_ok(m.fwd, "fwd", false));  // fwd rows keep the caller's width
    ASSERT_TRUE(structure_ok(m.rev, "rev", true));
  }
}

TEST(CoreProperties, TokensAreConserved) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const ref::Plan p = cptest::random_qkv_plan(seed);
    const Layout l = layout_of(p);
    const QkvMetadata m = cpdispatch::plan_qkv(cptest::to_plan(p));
    const auto W = static_cast<std::size_t>(p.W);
    I all_q = 0, all_kv = 0, recv_q = 0, recv_kv = 0;
    for (std::size_t r = 0; r < W; ++r) {
      I kv_sent = 0;  // every KV shard goes out once per later-or-equal query shard
      for (const Shard& s : l.local[r]) kv_sent += s.len * static_cast<I>(s.n - s.k);
      I q_out = 0, kv_out = 0;
      for (std::size_t d = 0; d < W; ++d) {
        q_out += m.q_fwd.num_recv_tokens(d, r);
        kv_out += m.kv_fwd.num_recv_tokens(d, r);
        ASSERT_EQ(m.q_rev.num_recv_tokens(r, d), m.q_fwd.num_recv_tokens(d, r));
        ASSERT_EQ(m.kv_rev.num_recv_tokens(r, d), m.kv_fwd.num_recv_tokens(d, r));
      }
      ASSERT_EQ(q_out, l.tokens[r]) << "rank " << r << " sends all its query tokens exactly once";
      ASSERT_EQ(m.q_rev.num_recv_tokens(r, W), l.tokens[r]) << "and gets all of them back";
      ASSERT_EQ(kv_out, kv_sent);
      ASSERT_EQ(m.kv_rev.num_recv_tokens(r, W), kv_sent);
      ASSERT_EQ(m.q_fwd.send_tokens(static_cast<I>(r)), l.tokens[r]);
      all_q += l.tokens[r];
      all_kv += kv_sent;
      recv_q += m.q_fwd.num_recv_tokens(r, W);
      recv_kv += m.kv_fwd.num_recv_tokens(r, W);
      // the attention layout holds what arrived
      I sq = 0, skv = 0;
      for (I x : m.attn.seqlens_q[r]) sq += x;
      for (I x : m.attn.seqlens_kv[r]) skv += x;
      ASSERT_EQ(sq, m.q_fwd.num_recv_tokens(r, W));
      ASSERT_EQ(skv, m.kv_fwd.num_recv_tokens(r, W));
      ASSERT_EQ(m.attn.cu_seqlens_q[r].back(), sq);
      ASSERT_EQ(m.attn.cu_seqlens_kv[r].back(), skv);
    }
    ASSERT_EQ(recv_q, all_q);
    ASSERT_EQ(recv_kv, all_kv);
  }
}

// ------------------------------------------------------------------ simulation

constexpr std::size_t kE = 3;  // elements per token: deliberately not a power of two

/// A unique, exactly representable float for element e of token t on rank r.
float unique_value(std::size_t r, I t, std::size_t e) { return static_cast<float>(r * 100000 + static_cast<std::size_t>(t) * kE + e); }

std::vector<std::vector<float>> unique_inputs(const std::vector<I>& tokens) {
  std::vector<std::vector<float>> in(tokens.size());
  for (std::size_t r = 0; r < tokens.size(); ++r)
    for (I t = 0; t < tokens[r]; ++t)
      for (std::size_t e = 0; e < kE; ++e) in[r].push_back(unique_value(r, t, e));
  return in;
}

/// Tokens [from, from + n) of a per-rank buffer.
std::vector<float> tokens_of(const std::vector<float>& buf, I from, I n) {
  return {buf.begin() + from * static_cast<I>(kE), buf.begin() + (from + n) * static_cast<I>(kE)};
}

TEST(CoreProperties, QueryForwardThenReverseIsTheIdentity) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const ref::Plan p = cptest::random_qkv_plan(seed, kSmall);
    const Layout l = layout_of(p);
    const QkvMetadata m = cpdispatch::plan_qkv(cptest::to_plan(p));
    const auto src = unique_inputs(l.tokens);
    std::vector<std::vector<float>> attn, back;
    cpdispatch::simulate(m.q_fwd, src, attn, kE);
    cpdispatch::simulate(m.q_rev, attn, back, kE);
    ASSERT_EQ(back, src);
    // the attention layout: query shard i of rank d is the i-th arrival
    for (std::size_t d = 0; d < l.arrivals.size(); ++d) {
      const auto& cu = m.attn.cu_seqlens_q[d];
      ASSERT_EQ(cu.size(), l.arrivals[d].size() + 1);
      ASSERT_EQ(attn[d].size(), static_cast<std::size_t>(cu.back()) * kE);
      for (std::size_t a = 0; a < l.arrivals[d].size(); ++a) {
        const Shard& s = *l.arrivals[d][a];
        ASSERT_EQ(tokens_of(attn[d], cu[a], cu[a + 1] - cu[a]), tokens_of(src[s.r], s.start, s.len))
            << "rank " << d << " query group " << a;
      }
    }
  }
}

TEST(CoreProperties, QueryPlansRoundTripThroughTheReplicaBuffer) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const cptest::QueryCase q = cptest::random_query_plan(seed, 24, 12);
    const auto m = cpdispatch::plan_query(q.seq_len_tensor(), q.dispatch_tensor());
    const auto starts = cptest::shard_starts(q.seq_len_tensor());
    std::vector<I> tokens;
    for (const auto& row : starts) tokens.push_back(row.back());
    const auto src = unique_inputs(tokens);
    std::vector<std::vector<float>> attn, back;
    cpdispatch::simulate(m.fwd, src, attn, kE);
    cpdispatch::simulate(m.rev, attn, back, kE);
    if (!q.three_d) {
      ASSERT_EQ(back, src);
      continue;
    }
    // 3-D: copy k comes back into slab k of the [C][T_r] replica buffer; the
    // cells of copies that do not exist stay zero.
    for (std::size_t r = 0; r < src.size(); ++r) {
      ASSERT_EQ(back[r].size(), q.C * src[r].size());
      std::vector<float> want(back[r].size(), 0.0f);
      for (std::size_t j = 0; j < q.S; ++j)
        for (std::size_t k = 0; k < q.C; ++k)
          if (q.dispatch[r][j][k] >= 0)
            for (I t = starts[r][j]; t < starts[r][j + 1]; ++t)
              for (std::size_t e = 0; e < kE; ++e) want[(static_cast<std::size_t>(k) * static_cast<std::size_t>(tokens[r]) + static_cast<std::size_t>(t)) * kE + e] = unique_value(r, t, e);
      ASSERT_EQ(back[r], want) << "rank " << r;
    }
  }
}

TEST(CoreProperties, EveryKvCopyEqualsItsSourceShard) {
  for (int i = 0; i < kPlans; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const ref::Plan p = cptest::random_qkv_plan(seed, kSmall);
    const Layout l = layout_of(p);
    const QkvMetadata m = cpdispatch::plan_qkv(cptest::to_plan(p));
    const auto src = unique_inputs(l.tokens);
    std::vector<std::vector<float>> attn;
    cpdispatch::simulate(m.kv_fwd, src, attn, kE);
    // entry by entry, from the metadata
    for (const auto& row : l.local)
      for (const Shard& s : row)
        for (std::size_t c = 0; c < m.kv_fwd.dst_rank.size(2); ++c) {
          const I d = m.kv_fwd.dst_rank(s.r, s.j, c);
          ASSERT_EQ(d >= 0, c < s.n - s.k) << "copy " << c << " of shard [" << s.r << "][" << s.j << "]";
          if (d < 0) continue;
          ASSERT_EQ(tokens_of(attn[static_cast<std::size_t>(d)], m.kv_fwd.dst_offset(s.r, s.j, c), s.len), tokens_of(src[s.r], s.start, s.len))
              << "copy " << c << " of shard [" << s.r << "][" << s.j << "]";
        }
    // group by group, from the attention layout: the KV group of query
    // shard i holds the document's shards 0..i, which are contiguous at the source
    for (std::size_t d = 0; d < l.arrivals.size(); ++d) {
      const auto& cu = m.attn.cu_seqlens_kv[d];
      ASSERT_EQ(attn[d].size(), static_cast<std::size_t>(cu.back()) * kE);
      for (std::size_t a = 0; a < l.arrivals[d].size(); ++a) {
        const Shard& s = *l.arrivals[d][a];
        const I doc_start = s.start - s.context;
        ASSERT_EQ(tokens_of(attn[d], cu[a], cu[a + 1] - cu[a]), tokens_of(src[s.r], doc_start, s.context + s.len))
            << "rank " << d << " KV group " << a;
      }
    }
  }
}

// ---------------------------------------------------------------- the combine

/// Small integers, so every sum of up to 8 copies is exact in bf16/fp16.
float small_value(std::size_t r, I t, std::size_t e) { return static_cast<float>(static_cast<I>((r * 7 + static_cast<std::size_t>(t) * 3 + e * 5) % 9) - 4); }

template <class T>
AssertionResult combine_sums_copies(const ref::Plan& p, bool byte_level) {
  const Layout l = layout_of(p);
  const QkvMetadata m = cpdispatch::plan_qkv(cptest::to_plan(p));
  const auto W = static_cast<std::size_t>(p.W);
  std::vector<std::vector<T>> src(W), attn, replica;
  for (std::size_t r = 0; r < W; ++r)
    for (I t = 0; t < l.tokens[r]; ++t)
      for (std::size_t e = 0; e < kE; ++e) src[r].push_back(static_cast<T>(small_value(r, t, e)));
  cpdispatch::simulate(m.kv_fwd, src, attn, kE);
  cpdispatch::simulate(m.kv_rev, attn, replica, kE);
  for (std::size_t r = 0; r < W; ++r) {
    std::vector<T> grad(src[r].size(), static_cast<T>(99.0f));  // stale values must be overwritten
    if (byte_level) {
      constexpr auto type = std::is_same_v<T, float>    ? cpdispatch::ElementType::float32
                            : std::is_same_v<T, double> ? cpdispatch::ElementType::float64
                            : std::is_same_v<T, cpdispatch::bfloat16> ? cpdispatch::ElementType::bfloat16
                                                                      : cpdispatch::ElementType::float16;
      cpdispatch::combine_copies(m.kv_rev.get_slice(static_cast<I>(r)), std::as_bytes(std::span<const T>(replica[r])),
                                 std::as_writable_bytes(std::span<T>(grad)), kE * sizeof(T), type);
    } else {
      cpdispatch::combine_copies<T>(m.kv_rev, static_cast<I>(r), std::span<const T>(replica[r]), std::span<T>(grad), kE);
    }
    for (const Shard& s : l.local[r])
      for (I t = s.start; t < s.start + s.len; ++t)
        for (std::size_t e = 0; e < kE; ++e) {
          const float want = small_value(r, t, e) * static_cast<float>(s.n - s.k);
          const float got = static_cast<float>(grad[static_cast<std::size_t>(t) * kE + e]);
          if (got != want) {
            return AssertionFailure() << "rank " << r << " token " << t << " element " << e << ": combined " << got << ", expected "
                                      << small_value(r, t, e) << " x " << (s.n - s.k) << " copies = " << want;
          }
        }
  }
  return AssertionSuccess();
}

template <class T>
void combine_suite() {
  for (int i = 0; i < kPlans / 2; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const ref::Plan p = cptest::random_qkv_plan(seed, kSmall);
    ASSERT_TRUE(combine_sums_copies<T>(p, i % 2 == 1));  // typed and byte-level entry points alternate
  }
}

TEST(CoreCombine, SumsCopiesFloat32) { combine_suite<float>(); }
TEST(CoreCombine, SumsCopiesFloat64) { combine_suite<double>(); }
TEST(CoreCombine, SumsCopiesBfloat16) { combine_suite<cpdispatch::bfloat16>(); }
TEST(CoreCombine, SumsCopiesFloat16) { combine_suite<cpdispatch::float16>(); }

/// Reverse KV metadata of one rank holding one document of `n` one-token
/// shards, all attending on rank 0: shard 0 comes back in n copies.
cpdispatch::RankMetadata one_doc_slice(I n) {
  cpdispatch::QkvPlan p;
  p.world_size = 1;
  p.ranks.resize(1);
  p.ranks[0].docs.push_back({std::vector<I>(static_cast<std::size_t>(n), 1), std::vector<I>(static_cast<std::size_t>(n), 0)});
  return cpdispatch::plan_qkv(p).kv_rev.get_slice(0);
}

// Three copies 256, 1, 1 of one element. In fp32: 258 (representable in
// bf16, whose spacing at 256 is 2). Accumulating in bf16 would give
// bf16(256 + 1) = 256 (tie to even), then 256 again.
TEST(CoreCombine, Bfloat16AccumulatesInFloat32) {
  using cpdispatch::bfloat16;
  const auto s = one_doc_slice(3);  // T = 3 tokens, C = 3
  std::vector<bfloat16> replica(9, bfloat16(0.0f)), grad(3);
  replica[0] = bfloat16(256.0f);  // copy 0 of shard 0
  replica[3] = bfloat16(1.0f);    // copy 1 of shard 0
  replica[6] = bfloat16(1.0f);    // copy 2 of shard 0
  ASSERT_EQ(static_cast<float>(bfloat16(static_cast<float>(bfloat16(256.0f + 1.0f)) + 1.0f)), 256.0f);  // what 16-bit accumulation gives
  cpdispatch::combine_copies<bfloat16>(s, replica, grad, 1);
  EXPECT_EQ(static_cast<float>(grad[0]), 258.0f);
}

// The same for IEEE half: spacing 2 at 2048; 2048 + 1 + 1 = 2050 in fp32.
TEST(CoreCombine, Float16AccumulatesInFloat32) {
  using cpdispatch::float16;
  const auto s = one_doc_slice(3);
  std::vector<float16> replica(9, float16(0.0f)), grad(3);
  replica[0] = float16(2048.0f);
  replica[3] = float16(1.0f);
  replica[6] = float16(1.0f);
  ASSERT_EQ(static_cast<float>(float16(static_cast<float>(float16(2048.0f + 1.0f)) + 1.0f)), 2048.0f);
  cpdispatch::combine_copies<float16>(s, replica, grad, 1);
  EXPECT_EQ(static_cast<float>(grad[0]), 2050.0f);
  // and the byte-level entry point does the same
  std::vector<float16> grad2(3);
  cpdispatch::combine_copies(s, std::as_bytes(std::span<const float16>(replica)), std::as_writable_bytes(std::span<float16>(grad2)), 2,
                             cpdispatch::ElementType::float16);
  EXPECT_EQ(static_cast<float>(grad2[0]), 2050.0f);
}

// Float copies are summed in ascending copy order: (1e8 + 1) - 1e8 in fp32
// is 0, while 1 + (1e8 - 1e8) would be 1.
TEST(CoreCombine, FloatSumsInAscendingCopyOrder) {
  const auto s = one_doc_slice(3);
  std::vector<float> replica(9, 0.0f), grad(3, -7.0f);
  replica[0] = 1e8f;
  replica[3] = 1.0f;
  replica[6] = -1e8f;
  cpdispatch::combine_copies<float>(s, replica, grad, 1);
  volatile float a = 1e8f, b = 1.0f, c = -1e8f;
  EXPECT_EQ(grad[0], (a + b) + c);
  EXPECT_EQ(grad[0], 0.0f);
  // shard 1 has two copies (both zero), shard 2 one: stale values are overwritten
  EXPECT_EQ(grad[1], 0.0f);
  EXPECT_EQ(grad[2], 0.0f);
}

// Unmasked cells of the replica buffer are never read.
TEST(CoreCombine, IgnoresCellsTheMaskDoesNotMark) {
  const auto s = one_doc_slice(2);  // shard 0: copies 0, 1; shard 1: copy 0
  std::vector<double> replica{1.0, 2.0, 10.0, 1e300}, grad(2);
  cpdispatch::combine_copies<double>(s, replica, grad, 1);
  EXPECT_EQ(grad[0], 11.0);
  EXPECT_EQ(grad[1], 2.0);
}

// -------------------------------------------------------------- normalize_dtype

TEST(CoreNormalizeDtype, UsesTheKernelDtypes) {
  using N = cpdispatch::NormalizedMetadata;
  static_assert(std::is_same_v<decltype(N::dst_rank), Tensor<std::int32_t>>);
  static_assert(std::is_same_v<decltype(N::dst_offset), Tensor<std::uint32_t>>);
  static_assert(std::is_same_v<decltype(N::seq_len), Tensor<std::uint32_t>>);
  static_assert(std::is_same_v<decltype(N::num_recv_tokens), Tensor<std::uint64_t>>);
  static_assert(std::is_same_v<decltype(N::seq_recv_mask), std::optional<Tensor<std::uint8_t>>>);
  static_assert(std::is_same_v<decltype(N::recv_seq_lens), std::optional<Tensor<std::uint32_t>>>);
  static_assert(std::is_same_v<decltype(N::num_seqs), Tensor<std::uint32_t>>);
  static_assert(std::is_same_v<decltype(N::num_total_recv_tokens), std::vector<std::uint64_t>>);
  for (int i = 0; i < 50; ++i) {
    const std::uint64_t seed = kBase + static_cast<std::uint64_t>(i);
    SCOPED_TRACE(seed_text(seed));
    const QkvMetadata q = cpdispatch::plan_qkv(cptest::to_plan(cptest::random_qkv_plan(seed)));
    for (const Metadata* m : {&q.q_fwd, &q.q_rev, &q.kv_fwd, &q.kv_rev}) {
      const auto n = m->normalize_dtype();
      auto same = [](const auto& narrow, const Tensor<I>& wide) {
        if (narrow.shape() != wide.shape()) return false;
        for (std::size_t k = 0; k < wide.numel(); ++k)
          if (static_cast<I>(narrow.flat()[k]) != wide.flat()[k]) return false;
        return true;
      };
      EXPECT_TRUE(same(n.dst_rank, m->dst_rank));  // -1 survives as int32 -1
      EXPECT_TRUE(same(n.dst_offset, m->dst_offset));
      EXPECT_TRUE(same(n.seq_len, m->seq_len));
      EXPECT_TRUE(same(n.num_recv_tokens, m->num_recv_tokens));
      EXPECT_TRUE(same(n.num_seqs, m->num_seqs));
      ASSERT_EQ(n.seq_recv_mask.has_value(), m->seq_recv_mask.has_value());
      ASSERT_EQ(n.recv_seq_lens.has_value(), m->recv_seq_lens.has_value());
      if (m->seq_recv_mask) {
        EXPECT_TRUE(same(*n.seq_recv_mask, *m->seq_recv_mask));
        EXPECT_TRUE(same(*n.recv_seq_lens, *m->recv_seq_lens));
      }
      EXPECT_EQ(n.world_size, m->world_size);
      ASSERT_EQ(n.num_total_recv_tokens.size(), m->num_total_recv_tokens.size());
      for (std::size_t d = 0; d < n.num_total_recv_tokens.size(); ++d)
        EXPECT_EQ(n.num_total_recv_tokens[d], static_cast<std::uint64_t>(m->num_total_recv_tokens[d]));
    }
  }
}

Metadata spec_query_fwd() {
  return cpdispatch::plan_query(cpdispatch::make_tensor<I>({{5, 3, 4}, {2, 6, 1}, {8, 2, 5}}),
                                cpdispatch::make_tensor<I>({{0, 0, 1}, {2, 2, 2}, {1, 1, 0}}))
      .fwd;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(CoreNormalizeDtype, RejectsAValueThatDoesNotFit) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  Metadata m = spec_query_fwd();
  m.dst_offset(2, 1) = I{1} << 32;  // one past uint32
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), AllOf(HasSubstr("dst_offset[2][1]"), HasSubstr("4294967296")));
  m.dst_offset(2, 1) = (I{1} << 32) - 1;  // the largest that fits
  EXPECT_EQ(m.normalize_dtype().dst_offset(2, 1), 4294967295u);

  m = spec_query_fwd();
  m.dst_rank(1, 2) = I{1} << 31;
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), AllOf(HasSubstr("dst_rank[1][2]"), HasSubstr("2147483648")));
  m.dst_rank(1, 2) = -(I{1} << 31) - 1;
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), HasSubstr("dst_rank[1][2]"));

  m = spec_query_fwd();
  m.seq_len(0, 0) = -1;
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), AllOf(HasSubstr("seq_len[0][0]"), HasSubstr("-1")));

  m = spec_query_fwd();
  m.num_recv_tokens(1, 3) = -5;
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), AllOf(HasSubstr("num_recv_tokens[1][3]"), HasSubstr("-5")));

  m = spec_query_fwd();
  m.num_seqs(2) = I{1} << 40;
  EXPECT_THAT(error_of([&] { (void)m.normalize_dtype(); }), HasSubstr("num_seqs[2]"));

  QkvMetadata q = cpdispatch::plan_qkv(cptest::to_plan(cptest::random_qkv_plan(kBase)));
  (*q.kv_rev.seq_recv_mask)(0, 0, 0) = 256;
  EXPECT_THAT(error_of([&] { (void)q.kv_rev.normalize_dtype(); }), AllOf(HasSubstr("seq_recv_mask[0][0][0]"), HasSubstr("256")));
}

}  // namespace
