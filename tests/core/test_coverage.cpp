// verify_coverage (docs/plan-format.md, section 2e): it accepts every planned
// layout of section 2d's masks, with the implicit entries or explicit ones cut
// from them, and section 2e's worked example built by hand; it rejects seeded
// corruptions, naming the document and the entry; and on small random cases
// with random entry sets its verdict equals brute force, which enumerates
// every pair. verify_coverage_for_rank passes every rank's share of those
// layouts, rejects the same corruptions on one rank, and all shares passing
// equals brute force too.

#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/check/coverage.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "helpers.hpp"

namespace {

using namespace cptest;
using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionSlice;
using cpdispatch::Band;
using cpdispatch::invalid_input;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::QkvMetadata;
using cpdispatch::RankQkvMetadata;
using cpdispatch::Rng;
using cpdispatch::SliceType;
using cpdispatch::verify_coverage;
using cpdispatch::verify_coverage_for_rank;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

using Entries = std::vector<std::vector<std::vector<AttentionEntry>>>;  // [rank][query shard][entry]
constexpr I open_lo = Band::unbounded_lo, open_hi = Band::unbounded_hi;

/// Section 2e's spelling [q0, q1, k0, k1, lo, hi].
AttentionEntry entry(I q0, I q1, I k0, I k1, I lo, I hi) {
  return {.q_start = q0, .q_len = q1 - q0, .kv_start = k0, .kv_len = k1 - k0, .band = {lo, hi}};
}

bool accepted(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  try {
    verify_coverage(plan, m);
    return true;
  } catch (const invalid_input&) {
    return false;
  }
}

std::string rejection(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  return message_of<invalid_input>([&] { verify_coverage(plan, m); });
}

/// Causal, full, and windows from one token to past most documents.
AttentionMask mask_of(std::uint64_t seed) {
  switch (seed % 4) {
    case 0: return AttentionMask::causal();
    case 1: return AttentionMask::full();
    default: return AttentionMask::sliding_window(1 + static_cast<I>(seed * 7 % 40));
  }
}

// ------------------------------------------------ the layout, as tests read it

/// One shard: its document and positions [start, start + len).
struct ShardInfo {
  std::size_t doc = 0;
  I start = 0, len = 0;
};

/// A KV copy in a group: columns [c0, c1) hold document positions from `pos`.
struct Run {
  I c0 = 0, c1 = 0, pos = 0;
  friend bool operator<(const Run& a, const Run& b) { return a.c0 < b.c0; }
};

/// A query shard of the layout: whose queries, and its KV copies by column.
struct Group {
  ShardInfo query;
  std::vector<Run> runs;
};
using Layout = std::vector<std::vector<Group>>;  // [rank][query shard]

/// The MLP layout: rank r's shards, ordered by (document, shard).
std::vector<std::vector<ShardInfo>> mlp_layout(const QkvDocumentsPlan& plan) {
  std::vector<std::vector<ShardInfo>> out(static_cast<std::size_t>(plan.world_size));
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    I at = 0;
    for (const auto& s : plan.documents[i].shards) {
      out[static_cast<std::size_t>(s.rank)].push_back({i, at, s.len});
      at += s.len;
    }
  }
  return out;
}

I document_length(const QkvDocumentsPlan& plan, std::size_t doc) {
  I length = 0;
  for (const auto& s : plan.documents[doc].shards) length += s.len;
  return length;
}

/// A planned (valid) layout read from q_fwd and kv_fwd (which head-parallel
/// shards do not use).
Layout read_layout(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  const auto mlp = mlp_layout(plan);
  Layout out(mlp.size());
  for (std::size_t d = 0; d < out.size(); ++d) out[d].resize(m.attn.seqlens_q[d].size());
  for (std::size_t r = 0; r < mlp.size(); ++r) {
    for (std::size_t j = 0; j < mlp[r].size(); ++j) {
      if (plan.documents[mlp[r][j].doc].head_parallel) continue;
      const auto d = static_cast<std::size_t>(m.q_fwd.dst_rank(r, j));
      const auto& cu = m.attn.cu_seqlens_q[d];
      out[d][static_cast<std::size_t>(std::find(cu.begin(), cu.end(), m.q_fwd.dst_offset(r, j)) - cu.begin())].query = mlp[r][j];
      for (std::size_t c = 0; c < m.kv_fwd.num_copies(); ++c) {
        const I dst = m.kv_fwd.dst_rank(r, j, c), col = m.kv_fwd.dst_offset(r, j, c);
        if (dst < 0) continue;
        const auto& kv = m.attn.cu_seqlens_kv[static_cast<std::size_t>(dst)];
        const auto g = static_cast<std::size_t>(std::upper_bound(kv.begin(), kv.end(), col) - kv.begin()) - 1;
        out[static_cast<std::size_t>(dst)][g].runs.push_back({col - kv[g], col - kv[g] + mlp[r][j].len, mlp[r][j].start});
      }
    }
  }
  for (auto& rank : out)
    for (auto& group : rank) std::sort(group.runs.begin(), group.runs.end());
  return out;
}

/// A document's allowed regions: its slices, or the plan's mask over all of it.
struct Region {
  I qa, qb, ka, kb;
  Band band;
};

std::vector<Region> allowed_regions(const QkvDocumentsPlan& plan, std::size_t doc) {
  const auto& slices = plan.documents[doc].slices;
  const I length = document_length(plan, doc);
  if (slices.empty()) return {{0, length, 0, length, plan.mask.band()}};
  std::vector<Region> out;
  for (const AttentionSlice& s : slices) out.push_back({s.q_begin, s.q_end, s.k_begin, s.k_end, s.band()});
  return out;
}

/// A group's KV copies as spans whose columns map to positions by one
/// offset: each copy alone, or (merge) neighbours that continue each other.
std::vector<Run> column_spans(const std::vector<Run>& runs, bool merge) {
  std::vector<Run> out;
  for (const Run& run : runs) {
    if (merge && !out.empty() && out.back().c1 == run.c0 && out.back().pos + (out.back().c1 - out.back().c0) == run.pos) {
      out.back().c1 = run.c1;
    } else {
      out.push_back(run);
    }
  }
  return out;
}

/// Section 2e's entries: per allowed region and column span of the group,
/// the region's part there, in the query shard's rows and the group's
/// columns. Merged spans give the spec's entries; unmerged, one per KV copy.
Entries exact_entries(const QkvDocumentsPlan& plan, const Layout& layout, bool merge) {
  Entries out(layout.size());
  for (std::size_t d = 0; d < layout.size(); ++d) {
    for (const Group& g : layout[d]) {
      auto& list = out[d].emplace_back();
      const I a = g.query.start, b = a + g.query.len;
      for (const Region& region : allowed_regions(plan, g.query.doc)) {
        for (const Run& run : column_spans(g.runs, merge)) {
          const I p0 = std::max(region.qa, a), p1 = std::min(region.qb, b);
          const I k0 = std::max(region.ka, run.pos), k1 = std::min(region.kb, run.pos + run.c1 - run.c0);
          if (!cpdispatch::band_meets(p0, p1, k0, k1, region.band)) continue;
          const Band band = region.band.shifted(run.c0 - run.pos + a);
          list.push_back(entry(p0 - a, p1 - a, k0 - run.pos + run.c0, k1 - run.pos + run.c0, band.lo, band.hi));
        }
      }
    }
  }
  return out;
}

/// The implicit entries written out: [0, lq, 0, lk] with attn.mask
/// bottom-right aligned.
Entries implicit_entries(const QkvMetadata& m) {
  Entries out(m.attn.seqlens_q.size());
  for (std::size_t d = 0; d < out.size(); ++d) {
    for (std::size_t g = 0; g < m.attn.seqlens_q[d].size(); ++g) {
      const I lq = m.attn.seqlens_q[d][g], lk = m.attn.seqlens_kv[d][g];
      const Band band = m.attn.mask.band().shifted(lk - lq);
      out[d].push_back({entry(0, lq, 0, lk, band.lo, band.hi)});
    }
  }
  return out;
}

// ------------------------------------------------------------- brute force

/// Section 2e's table, written out on its own.
bool slice_sees(const AttentionSlice& s, I p, I t) {
  if (p < s.q_begin || p >= s.q_end || t < s.k_begin || t >= s.k_end) return false;
  const bool below = t - p <= s.k_end - s.q_end, above = t - p >= s.k_begin - s.q_begin;
  switch (s.type) {
    case SliceType::causal: return below;
    case SliceType::inv_causal: return above;
    case SliceType::bi_causal: return below && above;
    case SliceType::full: break;
  }
  return true;
}

bool allowed_pair(const QkvDocumentsPlan& plan, std::size_t doc, I p, I t) {
  const auto& slices = plan.documents[doc].slices;
  if (slices.empty()) return plan.mask.sees(p, t);
  return std::any_of(slices.begin(), slices.end(), [&](const AttentionSlice& s) { return slice_sees(s, p, t); });
}

using Column = std::optional<std::pair<std::size_t, I>>;  // (document, position) a KV column holds
using Columns = std::vector<std::vector<std::vector<Column>>>;       // [rank][query shard][column]

/// Which shard fills each query shard; false when q_fwd is not one shard per query shard.
bool brute_rows(const QkvDocumentsPlan& plan, const QkvMetadata& m, std::vector<std::vector<ShardInfo>>& out) {
  const auto mlp = mlp_layout(plan);
  std::vector<std::vector<std::optional<ShardInfo>>> rows(mlp.size());
  for (std::size_t d = 0; d < mlp.size(); ++d) rows[d].resize(m.attn.seqlens_q[d].size());
  for (std::size_t r = 0; r < mlp.size(); ++r) {
    for (std::size_t j = 0; j < mlp[r].size(); ++j) {
      if (plan.documents[mlp[r][j].doc].head_parallel) continue;  // attended through hp_attn: brute_head_parallel
      const auto d = static_cast<std::size_t>(m.q_fwd.dst_rank(r, j));
      const auto& cu = m.attn.cu_seqlens_q[d];
      std::size_t g = 0;
      while (g < rows[d].size() && (cu[g] != m.q_fwd.dst_offset(r, j) || m.attn.seqlens_q[d][g] != mlp[r][j].len)) ++g;
      if (g == rows[d].size() || rows[d][g]) return false;
      rows[d][g] = mlp[r][j];
    }
  }
  out.assign(rows.size(), {});
  for (std::size_t d = 0; d < rows.size(); ++d)
    for (const auto& row : rows[d]) {
      if (!row) return false;
      out[d].push_back(*row);
    }
  return true;
}

/// What each KV column of each group holds; false when copies overlap or cross groups.
bool brute_columns(const QkvDocumentsPlan& plan, const QkvMetadata& m, Columns& cols) {
  const auto mlp = mlp_layout(plan);
  cols.assign(mlp.size(), {});
  for (std::size_t d = 0; d < mlp.size(); ++d)
    for (I lk : m.attn.seqlens_kv[d]) cols[d].emplace_back(static_cast<std::size_t>(lk));
  for (std::size_t r = 0; r < mlp.size(); ++r) {
    for (std::size_t j = 0; j < mlp[r].size(); ++j) {
      for (std::size_t c = 0; c < m.kv_fwd.num_copies(); ++c) {
        const I dst = m.kv_fwd.dst_rank(r, j, c), col = m.kv_fwd.dst_offset(r, j, c);
        if (dst < 0) continue;
        const auto& cu = m.attn.cu_seqlens_kv[static_cast<std::size_t>(dst)];
        std::size_t g = 0;
        while (g + 1 < cu.size() && !(cu[g] <= col && col + mlp[r][j].len <= cu[g + 1])) ++g;
        if (g + 1 == cu.size()) return false;
        for (I x = 0; x < mlp[r][j].len; ++x) {
          Column& slot = cols[static_cast<std::size_t>(dst)][g][static_cast<std::size_t>(col - cu[g] + x)];
          if (slot) return false;
          slot = std::pair{mlp[r][j].doc, mlp[r][j].start + x};
        }
      }
    }
  }
  return true;
}

/// Every pair enumerated, independently of the verifier's counting: true
/// when each allowed pair is attended exactly once and nothing else is.
bool brute_force_covers(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  std::vector<std::vector<ShardInfo>> rows;
  Columns cols;
  if (!brute_rows(plan, m, rows) || !brute_columns(plan, m, cols)) return false;
  const Entries written = m.attn.entries.empty() ? implicit_entries(m) : m.attn.entries;
  std::vector<std::vector<int>> count(plan.documents.size());
  for (std::size_t i = 0; i < count.size(); ++i) count[i].assign(static_cast<std::size_t>(document_length(plan, i) * document_length(plan, i)), 0);
  for (std::size_t d = 0; d < rows.size(); ++d) {
    for (std::size_t g = 0; g < rows[d].size(); ++g) {
      const ShardInfo q = rows[d][g];
      const auto& column = cols[d][g];
      const I length = document_length(plan, q.doc);
      for (const AttentionEntry& e : written[d][g]) {
        if (e.q_start < 0 || e.q_len < 0 || e.q_start + e.q_len > q.len) return false;
        if (e.kv_start < 0 || e.kv_len < 0 || e.kv_start + e.kv_len > static_cast<I>(column.size())) return false;
        for (I j = e.q_start; j < e.q_start + e.q_len; ++j) {
          for (I t = e.kv_start; t < e.kv_start + e.kv_len; ++t) {
            if (!e.band.contains(t - j)) continue;
            const Column& key = column[static_cast<std::size_t>(t)];
            if (!key || key->first != q.doc) return false;
            ++count[q.doc][static_cast<std::size_t>((q.start + j) * length + key->second)];
          }
        }
      }
    }
  }
  for (std::size_t i = 0; i < count.size(); ++i) {
    if (plan.documents[i].head_parallel) continue;
    const I length = document_length(plan, i);
    for (I p = 0; p < length; ++p)
      for (I t = 0; t < length; ++t)
        if (count[i][static_cast<std::size_t>(p * length + t)] != (allowed_pair(plan, i, p, t) ? 1 : 0)) return false;
  }
  return true;
}

// ------------------------------------------------------------ random inputs

/// Disjoint slices on a grid of the document's positions, each with pairs.
std::vector<AttentionSlice> random_slices(I length, Rng& rng) {
  const auto cuts = [&] {
    std::vector<I> at{0, length};
    for (int n = 0; n < 2 && length > 1; ++n) at.push_back(rng.between(1, length - 1));
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
    return at;
  };
  const std::vector<I> rows = cuts(), keys = cuts();
  std::vector<AttentionSlice> out;
  for (std::size_t a = 0; a + 1 < rows.size(); ++a) {
    for (std::size_t b = 0; b + 1 < keys.size(); ++b) {
      if (rng.below(3) == 0) continue;
      const AttentionSlice s{rows[a], rows[a + 1], keys[b], keys[b + 1], static_cast<SliceType>(rng.below(4))};
      if (cpdispatch::band_meets(s.q_begin, s.q_end, s.k_begin, s.k_end, s.band())) out.push_back(s);
    }
  }
  if (out.empty()) out.push_back({0, length, 0, length, SliceType::causal});
  return out;
}

/// A random documents-form plan of up to `most` ranks, documents and
/// shards a document, and shards of up to `longest` tokens, its sizes drawn
/// from `rng`.
QkvDocumentsPlan random_plan(Rng& rng, std::uint64_t seed, I most, I longest) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = rng.between(1, most);
  o.num_documents = rng.between(1, most);
  o.max_shards = rng.between(1, most);
  o.max_len = rng.between(1, longest);
  return cpdispatch::random_documents_plan(o, seed);
}

/// A small plan with its planned layout and exact explicit entries. With
/// slices, planning runs under the full mask (every group holds every KV
/// shard), then slices are added to some documents.
std::pair<QkvDocumentsPlan, QkvMetadata> small_case(std::uint64_t seed, bool with_slices) {
  Rng rng(seed);
  QkvDocumentsPlan plan = random_plan(rng, seed, 4, 6);
  plan.mask = with_slices ? AttentionMask::full() : mask_of(rng.next());
  QkvMetadata m = cpdispatch::plan_qkv(plan);
  if (with_slices) {
    plan.mask = mask_of(rng.next());  // for the documents left without slices
    for (std::size_t i = 0; i < plan.documents.size(); ++i)
      if (rng.below(3) != 0) plan.documents[i].slices = random_slices(document_length(plan, i), rng);
  }
  m.attn.entries = exact_entries(plan, read_layout(plan, m), rng.below(2) == 0);
  return {plan, m};
}

/// One random edit of an entry set: some keep the cover (cutting an entry in
/// two), most break it.
void mutate(Entries& entries, Rng& rng) {
  std::vector<std::pair<std::size_t, std::size_t>> used;
  for (std::size_t d = 0; d < entries.size(); ++d)
    for (std::size_t g = 0; g < entries[d].size(); ++g)
      if (!entries[d][g].empty()) used.emplace_back(d, g);
  if (used.empty()) return;
  const auto [d, g] = used[rng.below(used.size())];
  auto& list = entries[d][g];
  const std::size_t e = rng.below(list.size());
  AttentionEntry x = list[e];
  const I step = rng.below(2) ? 1 : -1;
  switch (rng.below(10)) {
    case 0: list.erase(list.begin() + static_cast<std::ptrdiff_t>(e)); return;
    case 1: list.push_back(x); return;
    case 2:
      if (x.q_len < 2) return;
      list[e].q_len = rng.between(1, x.q_len - 1);
      x.q_start += list[e].q_len;
      x.q_len -= list[e].q_len;
      list.push_back(x);
      return;
    case 3:
      if (x.kv_len < 2) return;
      list[e].kv_len = rng.between(1, x.kv_len - 1);
      x.kv_start += list[e].kv_len;
      x.kv_len -= list[e].kv_len;
      list.push_back(x);
      return;
    case 4: list[e].band.lo = x.band.bounded_below() ? x.band.lo + step : rng.between(-4, 1); return;
    case 5: list[e].band.hi = x.band.bounded_above() ? x.band.hi + step : rng.between(-1, 4); return;
    case 6: list[e].kv_start += step; return;
    case 7: (rng.below(2) ? list[e].q_start : list[e].q_len) += step; return;
    case 8: {  // to another query shard of the same rank
      const std::size_t to = rng.below(entries[d].size());
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(e));
      entries[d][to].push_back(x);
      return;
    }
    default:  // the same pairs, one column over
      list[e].kv_start += step;
      list[e].band = x.band.shifted(step);
      return;
  }
}

// ------------------------------------------------------- section 2e's example

/// Section 2e's worked example: a shared-prefix document (prompt 3, responses
/// 2 and 3) and a causal document of two 2-token shards.
QkvDocumentsPlan example_plan() {
  QkvDocumentsPlan p;
  p.world_size = 2;
  p.documents = {{{{0, 3, 1}, {0, 2, 0}, {1, 3, 1}},
                  {{0, 3, 0, 3, SliceType::causal},
                   {3, 5, 0, 3, SliceType::full},
                   {3, 5, 3, 5, SliceType::causal},
                   {5, 8, 0, 3, SliceType::full},
                   {5, 8, 5, 8, SliceType::causal}}},
                 {{{1, 2, 1}, {1, 2, 0}}}};
  return p;
}

/// Its metadata by hand: kv_fwd, kv_rev and attn as the spec gives them;
/// q_fwd and q_rev from the shards by section 2b (MLP layout rank 0 =
/// [doc0.0 (3), doc0.1 (2)], rank 1 = [doc0.2 (3), doc1.0 (2), doc1.1 (2)]).
QkvMetadata example_metadata() {
  QkvMetadata m;
  const Tensor<I> seq_len = t2({{3, 2, 0}, {3, 2, 2}});
  m.q_fwd = {t2({{1, 0, -1}, {1, 1, 0}}), t2({{0, 0, 0}, {3, 6, 2}}), seq_len, t2({{2, 2, 4}, {3, 5, 8}}), std::nullopt, std::nullopt,
             t1({2, 3}), 2, {4, 8}};
  m.q_rev = {t2({{0, 1, -1}, {0, 1, 1}}), t2({{3, 5, 0}, {0, 0, 3}}), t2({{2, 2, 0}, {3, 3, 2}}), t2({{2, 3, 5}, {2, 5, 7}}), std::nullopt,
             std::nullopt, t1({2, 3}), 2, {5, 7}};
  m.kv_fwd = {t3({{{1, 0, 1}, {0, -1, -1}, {-1, -1, -1}}, {{1, -1, -1}, {1, 0, -1}, {0, -1, -1}}}),
              t3({{{0, 0, 3}, {3, 0, 0}, {0, 0, 0}}, {{6, 0, 0}, {9, 5, 0}, {7, 0, 0}}}), seq_len, t2({{5, 4, 9}, {6, 5, 11}}), std::nullopt,
              std::nullopt, t1({2, 3}), 2, {9, 11}};
  m.kv_rev = {t2({{0, 0, 1, 1}, {0, 0, 1, 1}}), t2({{5, 3, 10, 5}, {0, 10, 0, 3}}), t2({{3, 2, 2, 2}, {3, 3, 3, 2}}), t2({{5, 6, 11}, {4, 5, 9}}),
              t3({{{1, 1, 1}, {1, 0, 0}, {0, 0, 0}}, {{1, 0, 0}, {1, 1, 0}, {1, 0, 0}}}), seq_len, t1({4, 4}), 2, {11, 9}};
  m.attn.seqlens_q = {{2, 2}, {3, 3, 2}};
  m.attn.seqlens_kv = {{5, 4}, {3, 6, 2}};
  m.attn.cu_seqlens_q = {{0, 2, 4}, {0, 3, 6, 8}};
  m.attn.cu_seqlens_kv = {{0, 5, 9}, {0, 3, 9, 11}};
  m.attn.max_seqlen_q = {2, 3};
  m.attn.max_seqlen_kv = {5, 6};
  m.attn.entries = {{{entry(0, 2, 0, 3, open_lo, open_hi), entry(0, 2, 3, 5, open_lo, 3)}, {entry(0, 2, 0, 4, open_lo, 2)}},
                    {{entry(0, 3, 0, 3, open_lo, 0)}, {entry(0, 3, 0, 3, open_lo, open_hi), entry(0, 3, 3, 6, open_lo, 3)}, {entry(0, 2, 0, 2, open_lo, 0)}}};
  return m;
}

TEST(Coverage, WorkedExampleOfSlicesIsAnExactCover) {
  const QkvDocumentsPlan plan = example_plan();
  const QkvMetadata m = example_metadata();
  for (const auto* meta : {&m.q_fwd, &m.q_rev, &m.kv_fwd, &m.kv_rev}) EXPECT_NO_THROW(meta->validate());  // the hand-built numbers hold together
  EXPECT_NO_THROW(verify_coverage(plan, m));
  EXPECT_TRUE(brute_force_covers(plan, m));
  EXPECT_EQ(m.attn.entries, exact_entries(plan, read_layout(plan, m), true));  // the tests' own entry builder agrees with the spec
}

TEST(Coverage, WorkedExampleCorruptionsAreNamed) {
  const QkvDocumentsPlan plan = example_plan();
  QkvMetadata m = example_metadata();
  m.attn.entries[0][0].pop_back();  // the response's own causal part
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("documents[0]: no entry attends 3 allowed pairs (3 in slices[2])"), HasSubstr("query 3 key 3")));
  m = example_metadata();
  m.attn.entries[0][0].push_back(m.attn.entries[0][0][1]);
  EXPECT_THAT(rejection(plan, m), HasSubstr("documents[0]: query 3 key 3 and 2 more pairs attended twice, by rank 0 query shard 0 (documents[0].shards[1]) "
                                            "entries[1] and by rank 0 query shard 0 (documents[0].shards[1]) entries[2]"));
  m = example_metadata();
  m.attn.entries[0][0][1].band.hi = 4;
  EXPECT_THAT(rejection(plan, m), HasSubstr("documents[0]: rank 0 query shard 0 (documents[0].shards[1]) entries[1] attends 1 pair the mask does not allow, "
                                            "e.g. query 3 key 4"));
  m = example_metadata();
  m.attn.entries[1][1][0] = entry(0, 3, 3, 6, open_lo, open_hi);  // the prompt entry moved onto the response's columns
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("rank 1 query shard 1 (documents[0].shards[2]) entries[0]"), HasSubstr("does not allow")));
  m = example_metadata();
  m.kv_fwd.dst_offset(1, 1, 1) = 6;  // doc1.0's copy to rank 0, one column on
  EXPECT_THAT(rejection(plan, m), HasSubstr("rank 0 KV group 1: copy 1 of documents[1].shards[0] fills columns [1, 3) and copy 0 of "
                                            "documents[1].shards[1] fills [2, 4); they overlap"));
  m = example_metadata();
  m.kv_fwd.dst_offset(0, 1, 0) = 5;  // doc0.1's copy into doc1.1's group
  EXPECT_THAT(rejection(plan, m), HasSubstr("copy 0 of documents[0].shards[1] (kv_fwd.dst_offset[0][1][0]) lands in the KV group of rank 0 query shard 1, "
                                            "which holds documents[1].shards[1] (another document)"));
  m = example_metadata();
  m.kv_fwd.dst_offset(0, 0, 2) = 9;  // doc0.0's third copy (3 tokens) into doc1.0's group of 2
  EXPECT_THAT(rejection(plan, m), HasSubstr("copy 2 of documents[0].shards[0] (kv_fwd.dst_offset[0][0][2]) fills rank 1 columns [9, 12), which cross the end of "
                                            "KV group 2 at 11"));
  m = example_metadata();
  std::swap(m.q_fwd.dst_rank(1, 1), m.q_fwd.dst_rank(1, 2));  // doc1's two query shards trade places
  std::swap(m.q_fwd.dst_offset(1, 1), m.q_fwd.dst_offset(1, 2));
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("documents[1]: rank 0 query shard 1 (documents[1].shards[0]) entries[0]"), HasSubstr("does not allow")));
  m = example_metadata();
  std::swap(m.q_fwd.dst_offset(0, 0), m.q_fwd.dst_offset(1, 0));  // doc0.0 and doc0.2, both 3 tokens on rank 1
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("documents[0]: rank 1 query shard 1 (documents[0].shards[0])"), HasSubstr("does not allow")));
  m = example_metadata();
  m.attn.entries.clear();  // every KV group ends with its own shard, so causal bottom-right alignment happens to fit
  EXPECT_NO_THROW(verify_coverage(plan, m));
  EXPECT_TRUE(brute_force_covers(plan, m));
  m.attn.mask = AttentionMask::full();  // but the full mask lets the prompt see the response
  EXPECT_THAT(rejection(plan, m), HasSubstr("documents[0]: rank 1 query shard 0 (documents[0].shards[0]) implicit entry attends 3 pairs the mask does not allow"));
}

// ------------------------------------------------------------ planned layouts

/// Every form of a planned layout passes: implicit entries, one explicit
/// entry per query shard, section 2e's entries and one entry per KV copy.
::testing::AssertionResult every_form_passes(const QkvDocumentsPlan& plan) {
  QkvMetadata m = cpdispatch::plan_qkv(plan);
  const auto passes = [&](const char* form) -> ::testing::AssertionResult {
    try {
      verify_coverage(plan, m);
    } catch (const invalid_input& e) {
      return ::testing::AssertionFailure() << form << ": " << e.what();
    }
    return ::testing::AssertionSuccess();
  };
  if (auto ok = passes("implicit entries"); !ok) return ok;
  m.attn.entries = implicit_entries(m);
  if (auto ok = passes("one entry per query shard"); !ok) return ok;
  const Layout layout = read_layout(plan, m);
  m.attn.entries = exact_entries(plan, layout, true);
  if (auto ok = passes("section 2e's entries"); !ok) return ok;
  m.attn.entries = exact_entries(plan, layout, false);
  return passes("one entry per KV copy");
}

TEST(Coverage, AcceptsEveryPlannedLayoutOfTheDocumentsForm) {
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = 1 + static_cast<I>(seed % 8);  // W = 1..8; documents span up to min(shards, W) ranks
    o.num_documents = static_cast<I>(seed % 10);
    o.max_shards = 1 + static_cast<I>(seed % 7);
    o.max_len = 1 + static_cast<I>(seed % 25);
    QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
    plan.mask = mask_of(seed / 8);
    ASSERT_TRUE(every_form_passes(plan)) << "seed " << seed << " mask " << to_string(plan.mask);
  }
}

TEST(Coverage, AcceptsEveryPlannedLayoutOfThePerRankForm) {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    cpdispatch::QkvPlan plan = to_plan(random_qkv_plan(seed, {8, 3, 8, 20}));
    plan.mask = mask_of(seed);
    EXPECT_NO_THROW(verify_coverage(plan, cpdispatch::plan_qkv(plan))) << "seed " << seed;
    ASSERT_TRUE(every_form_passes(cpdispatch::to_documents(plan))) << "seed " << seed << " mask " << to_string(plan.mask);
  }
  for (std::uint64_t seed = 0; seed < 40; ++seed) {  // create_qkv_dispatch: power-of-two degrees, equal shards
    const I W = 1 + static_cast<I>(seed % 8), C = W >= 4 ? 4 : (W >= 2 ? 2 : 1);
    const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(W, 32 * C, 1 + static_cast<I>(seed % 3), C, seed);
    EXPECT_NO_THROW(verify_coverage(plan, cpdispatch::plan_qkv(plan))) << "seed " << seed;
  }
}

TEST(Coverage, EmptyRanksAndEmptyPlansPass) {
  QkvDocumentsPlan plan;
  plan.world_size = 3;
  EXPECT_NO_THROW(verify_coverage(plan, cpdispatch::plan_qkv(plan)));
  plan.documents = {{{{2, 5, 2}}}};
  EXPECT_NO_THROW(verify_coverage(plan, cpdispatch::plan_qkv(plan)));
}

/// Up to 5 ranks, documents and shards under a random mask; with `slices`,
/// about two documents in three get random slices.
QkvDocumentsPlan random_slice_plan(std::uint64_t seed, bool slices) {
  Rng rng(seed);
  QkvDocumentsPlan plan = random_plan(rng, seed, 5, 8);
  plan.mask = mask_of(rng.next());
  for (std::size_t i = 0; i < plan.documents.size() && slices; ++i)
    if (rng.below(3) != 0) plan.documents[i].slices = random_slices(document_length(plan, i), rng);
  return plan;
}

TEST(Coverage, AcceptsPlannedSliceLayouts) {
  const QkvMetadata example = cpdispatch::plan_qkv(example_plan());
  EXPECT_EQ(example.attn.entries, example_metadata().attn.entries);
  EXPECT_NO_THROW(verify_coverage(example_plan(), example));
  int sliced = 0;
  for (std::uint64_t seed = 0; seed < 600; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed, true);
    sliced += plan.documents[0].slices.empty() ? 0 : 1;
    QkvMetadata m;
    ASSERT_NO_THROW(m = cpdispatch::plan_qkv(plan)) << "seed " << seed;
    ASSERT_TRUE(accepted(plan, m)) << "seed " << seed << ": " << rejection(plan, m);
    ASSERT_TRUE(brute_force_covers(plan, m)) << "seed " << seed;
  }
  EXPECT_GT(sliced, 300);
}

// ----------------------------------------------------------- seeded corruptions

/// An entry with pairs, by a seeded pick: (rank, query shard, entry).
std::optional<std::tuple<std::size_t, std::size_t, std::size_t>> entry_with_pairs(const Entries& entries, Rng& rng) {
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> found;
  for (std::size_t d = 0; d < entries.size(); ++d)
    for (std::size_t g = 0; g < entries[d].size(); ++g)
      for (std::size_t e = 0; e < entries[d][g].size(); ++e) {
        const AttentionEntry& x = entries[d][g][e];
        if (cpdispatch::band_meets(x.q_start, x.q_start + x.q_len, x.kv_start, x.kv_start + x.kv_len, x.band)) found.emplace_back(d, g, e);
      }
  if (found.empty()) return std::nullopt;
  return found[rng.below(found.size())];
}

I entry_pairs(const AttentionEntry& x) { return cpdispatch::band_pairs(x.q_start, x.q_start + x.q_len, x.kv_start, x.kv_start + x.kv_len, x.band); }

/// Widens one end of the entry's band by a token where that admits more
/// pairs; false when no end can (an open band).
bool widen(AttentionEntry& x) {
  const I before = entry_pairs(x);
  for (const bool upper : {true, false}) {
    AttentionEntry wider = x;
    if (upper && x.band.bounded_above()) ++wider.band.hi;
    if (!upper && x.band.bounded_below()) --wider.band.lo;
    if (entry_pairs(wider) > before) {
      x = wider;
      return true;
    }
  }
  return false;
}

/// The plans the corruptions below start from: slices on every document of
/// even seeds (drawn from `rng`), section 2d's masks otherwise.
QkvDocumentsPlan corruption_plan(std::uint64_t seed, Rng& rng) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = 1 + static_cast<I>(seed % 6);
  o.num_documents = 1 + static_cast<I>(seed % 5);
  o.max_shards = 1 + static_cast<I>(seed % 4);
  o.max_len = 1 + static_cast<I>(seed % 9);
  QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
  plan.mask = mask_of(seed / 3);
  for (std::size_t i = 0; i < plan.documents.size() && seed % 2 == 0; ++i) plan.documents[i].slices = random_slices(document_length(plan, i), rng);
  return plan;
}

/// Each corruption provably breaks the cover of a planned layout, 2d or with
/// slices: a dropped entry with pairs leaves them unattended; a widened band
/// admits pairs that are disallowed or already attended; an entry's pairs one
/// column over are other keys (a group holds each KV shard once); a KV copy
/// one column on overlaps its neighbour or leaves its group (copies tile
/// the groups); two documents' query shards swapped land beside the other
/// document's keys.
TEST(Coverage, RejectsSeededCorruptionsOfPlannedLayouts) {
  int dropped = 0, widened = 0, moved = 0, shifted_copies = 0, swapped = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    Rng rng(seed);
    const QkvDocumentsPlan plan = corruption_plan(seed, rng);
    const QkvMetadata planned = cpdispatch::plan_qkv(plan);
    QkvMetadata exact = planned;
    exact.attn.entries = exact_entries(plan, read_layout(plan, planned), false);
    const auto pick = entry_with_pairs(exact.attn.entries, rng);
    ASSERT_TRUE(pick) << "seed " << seed;
    const auto [d, g, e] = *pick;
    SCOPED_TRACE("seed " + std::to_string(seed) + " entry [" + std::to_string(d) + "][" + std::to_string(g) + "][" + std::to_string(e) + "]");

    QkvMetadata m = exact;
    m.attn.entries[d][g].erase(m.attn.entries[d][g].begin() + static_cast<std::ptrdiff_t>(e));
    EXPECT_THAT(rejection(plan, m), HasSubstr("no entry attends"));
    ++dropped;

    m = exact;
    if (widen(m.attn.entries[d][g][e])) {
      EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("rank " + std::to_string(d) + " query shard " + std::to_string(g)),
                                            AnyOf(HasSubstr("does not allow"), HasSubstr("attended twice"))));
      ++widened;
    }

    m = exact;
    AttentionEntry& x = m.attn.entries[d][g][e];
    const I step = x.kv_start + x.kv_len < m.attn.seqlens_kv[d][g] ? 1 : -1;
    if (x.kv_start + step >= 0) {  // the same pairs one column over: other keys
      x.kv_start += step;
      x.band = x.band.shifted(step);
      EXPECT_FALSE(accepted(plan, m));
      EXPECT_FALSE(brute_force_covers(plan, m));
      ++moved;
    }

    m = planned;  // a KV copy one column on: it overlaps its neighbour or leaves its group
    const std::size_t r = rng.below(planned.kv_fwd.dst_rank.size(0));
    if (planned.kv_fwd.dst_rank(r, 0, 0) >= 0) {
      ++m.kv_fwd.dst_offset(r, 0, 0);
      EXPECT_THAT(rejection(plan, m), HasSubstr("copy 0 of "));
      ++shifted_copies;
    }

    m = planned;  // two documents' first query shards trade destinations
    if (plan.documents.size() >= 2) {
      const auto place = [&](std::size_t doc) {
        const auto rank = static_cast<std::size_t>(plan.documents[doc].shards[0].rank);
        std::size_t j = 0;
        for (std::size_t i = 0; i < doc; ++i)
          for (const auto& s : plan.documents[i].shards) j += static_cast<std::size_t>(s.rank) == rank ? 1 : 0;
        return std::pair{rank, j};
      };
      const auto [r0, j0] = place(0);
      const auto [r1, j1] = place(1);
      std::swap(m.q_fwd.dst_rank(r0, j0), m.q_fwd.dst_rank(r1, j1));
      std::swap(m.q_fwd.dst_offset(r0, j0), m.q_fwd.dst_offset(r1, j1));
      EXPECT_FALSE(accepted(plan, m));
      ++swapped;
    }
  }
  EXPECT_EQ(dropped, 300);
  EXPECT_GT(widened, 60);
  EXPECT_GT(moved, 100);
  EXPECT_GT(shifted_copies, 100);
  EXPECT_GT(swapped, 200);
}

TEST(Coverage, RejectsImplicitLayoutsThatDisagreeWithThePlan) {
  QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 3, 1}, {0, 2, 0}, {1, 4, 1}, {1, 3, 0}}}, {{{1, 2, 1}}}};  // section 2d's example
  plan.mask = AttentionMask::sliding_window(4);
  QkvMetadata m = cpdispatch::plan_qkv(plan);
  EXPECT_NO_THROW(verify_coverage(plan, m));
  m.attn.mask = AttentionMask::sliding_window(5);  // the kernel would see one key too many
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("implicit entry"), HasSubstr("does not allow")));
  m.attn.mask = AttentionMask::sliding_window(3);
  EXPECT_THAT(rejection(plan, m), HasSubstr("no entry attends"));
  m = cpdispatch::plan_qkv(plan);
  m.kv_fwd.dst_rank(0, 0, 2) = -1;  // doc0.0's copy for query shard 2 is gone
  EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("rank 1 query shard 1 (documents[0].shards[2]) implicit entry attends columns [0, 3)"),
                                        HasSubstr("which no KV copy fills")));
  m = cpdispatch::plan_qkv(plan);
  m.q_fwd.dst_rank(0, 0) = 0;  // doc0.0's queries to rank 0 row 0, where doc0.1's are
  EXPECT_THAT(rejection(plan, m), HasSubstr("q_fwd[0][0] (documents[0].shards[0]) lands at rank 0 row 0, which does not start a query shard of 3 rows"));
}

TEST(Coverage, RejectsMalformedInputsByName) {
  QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.documents = {{{{0, 3, 1}, {1, 2, 0}}}};
  const QkvMetadata good = cpdispatch::plan_qkv(plan);
  QkvMetadata m = good;
  m.attn.entries = implicit_entries(m);
  m.attn.entries[0][0][0].q_len = 3;
  EXPECT_THAT(rejection(plan, m), HasSubstr("rank 0 query shard 0 (documents[0].shards[1]) entries[0] has q_start = 0, q_len = 3, rows outside"));
  m = good;
  m.attn.cu_seqlens_kv[1][1] = 4;
  EXPECT_THAT(rejection(plan, m), HasSubstr("attn.cu_seqlens_kv[1][1] = 4, expected 3"));
  m = good;
  m.attn.seqlens_q.pop_back();
  EXPECT_THAT(rejection(plan, m), HasSubstr("attn.seqlens_q has 1 ranks, but world_size = 2"));
  m = good;
  m.kv_fwd.seq_len(1, 0) = 1;
  EXPECT_THAT(rejection(plan, m), HasSubstr("kv_fwd.seq_len[1][0] (documents[0].shards[1]) = 1"));
  m = good;
  m.kv_fwd.dst_rank(1, 0, 0) = 7;
  EXPECT_THAT(rejection(plan, m), HasSubstr("kv_fwd.dst_rank[1][0][0] (documents[0].shards[1]) = 7 is outside [0, 2)"));
  m = good;
  m.attn.entries = {{}};
  EXPECT_THAT(rejection(plan, m), HasSubstr("attn.entries has 1 ranks"));
  QkvDocumentsPlan long_document = plan;
  long_document.documents[0].shards[0].len = cpdispatch::max_verified_document_tokens;
  EXPECT_THAT(rejection(long_document, good), HasSubstr("documents[0] is longer than 2147483648 tokens"));
  QkvDocumentsPlan sliced = plan;
  sliced.documents[0].slices = {{0, 5, 0, 5, SliceType::causal}, {2, 5, 0, 5, SliceType::inv_causal}};
  m = good;
  m.attn.entries = exact_entries(sliced, read_layout(sliced, m), false);
  EXPECT_THAT(rejection(sliced, m), HasSubstr("documents[0].slices[0] and slices[1] share 9 pairs, e.g. query 2 key 0"));
  sliced.documents[0].slices = {{0, 6, 0, 5, SliceType::full}};
  EXPECT_THAT(rejection(sliced, m), HasSubstr("documents[0].slices[0] (q [0, 6), k [0, 5)) is empty or leaves the document's 5 positions"));
  EXPECT_THAT(message_of<invalid_input>([&] { verify_coverage(plan, good, cpdispatch::PlanLimits{.max_bytes = 64}); }), HasSubstr("PlanLimits::max_bytes"));
}

/// Every value of some tensors, rows and entry lists, for the fuzz tests to
/// overwrite with edges of the 64-bit range or small values.
struct Cells {
  std::vector<I*> at;
  void add(Tensor<I>& t) {
    for (I& v : t.flat()) at.push_back(&v);
  }
  void add(std::vector<I>& row) {
    for (I& v : row) at.push_back(&v);
  }
  void add(std::vector<std::vector<I>>& rows) {
    for (auto& row : rows) add(row);
  }
  void add(std::vector<std::vector<AttentionEntry>>& lists) {
    for (auto& list : lists)
      for (AttentionEntry& x : list)
        for (I* v : {&x.q_start, &x.q_len, &x.kv_start, &x.kv_len, &x.band.lo, &x.band.hi}) at.push_back(v);
  }
  void add(Entries& entries) {
    for (auto& rank : entries) add(rank);
  }
  /// Overwrites 1 to 3 values drawn from `rng`.
  void poke(Rng& rng) {
    constexpr std::array<I, 8> edges = {-1, 0, 1, 5, std::numeric_limits<I>::max(), std::numeric_limits<I>::min(), I{1} << 62, -(I{1} << 40)};
    for (std::uint64_t n = 1 + rng.below(3); n > 0 && !at.empty(); --n) {
      const I value = rng.below(2) ? edges[rng.below(edges.size())] : rng.between(-2, 12);
      *at[rng.below(at.size())] = value;
    }
  }
};

TEST(Coverage, ArbitraryCorruptionIsInvalidInputOrPasses) {
  for (std::uint64_t seed = 0; seed < 3000; ++seed) {
    Rng rng(seed);
    auto [plan, m] = small_case(seed, seed % 2 == 0);
    Cells cells;
    for (Tensor<I>* t : {&m.q_fwd.dst_rank, &m.q_fwd.dst_offset, &m.q_fwd.seq_len, &m.kv_fwd.dst_rank, &m.kv_fwd.dst_offset, &m.kv_fwd.seq_len}) cells.add(*t);
    for (auto* rows : {&m.attn.seqlens_q, &m.attn.seqlens_kv, &m.attn.cu_seqlens_q, &m.attn.cu_seqlens_kv}) cells.add(*rows);
    cells.add(m.attn.entries);
    cells.poke(rng);
    try {
      verify_coverage(plan, m);
    } catch (const invalid_input&) {
    }
  }
}

// ------------------------------------------------------------ one rank's share

/// Rank r's row of hp_attn.
cpdispatch::RankHeadParallelLayout head_parallel_row(const cpdispatch::HeadParallelLayout& a, I r) {
  if (a.empty()) return {};
  const auto d = static_cast<std::size_t>(r);
  return {.degree = a.degree, .documents = a.documents[d], .seqlens = a.seqlens[d], .cu_seqlens = a.cu_seqlens[d], .max_seqlen = a.max_seqlen[d],
          .group_rank = a.group_rank[d], .mask = a.mask, .entries = a.entries.empty() ? Entries::value_type{} : a.entries[d]};
}

/// Rank r's share of global metadata, as plan_qkv_for_rank gives it.
RankQkvMetadata share_of(const QkvMetadata& m, I r) {
  RankQkvMetadata mine{m.q_fwd.get_slice(r), m.q_rev.get_slice(r), m.kv_fwd.get_slice(r), m.kv_rev.get_slice(r), cpdispatch::attention_of(m.attn, r),
                       std::nullopt};
  if (m.hp_attn.empty()) return mine;
  mine.hp_fwd = m.hp_fwd.get_slice(r);
  mine.hp_rev = m.hp_rev.get_slice(r);
  mine.hp_attn = head_parallel_row(m.hp_attn, r);
  return mine;
}

std::string rank_rejection(const QkvDocumentsPlan& plan, I r, const RankQkvMetadata& mine) {
  return message_of<invalid_input>([&] { verify_coverage_for_rank(plan, r, mine); });
}

/// Whether every rank's share of `m` passes; the first rejection in `why`.
bool every_share_accepted(const QkvDocumentsPlan& plan, const QkvMetadata& m, std::string* why = nullptr) {
  for (I r = 0; r < plan.world_size; ++r) {
    try {
      verify_coverage_for_rank(plan, r, share_of(m, r));
    } catch (const invalid_input& e) {
      if (why) *why = e.what();
      return false;
    }
  }
  return true;
}

TEST(CoverageForRank, AcceptsEveryRanksShareOfPlannedLayouts) {
  int sliced = 0;
  for (std::uint64_t seed = 0; seed < 300; ++seed) {
    const QkvDocumentsPlan plan = random_slice_plan(seed, seed % 3 != 0);
    sliced += plan.documents[0].slices.empty() ? 0 : 1;
    for (I r = 0; r < plan.world_size; ++r) {
      const RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, r);
      ASSERT_NO_THROW(verify_coverage_for_rank(plan, r, mine)) << "seed " << seed << " rank " << r << ": " << rank_rejection(plan, r, mine);
    }
    QkvMetadata m = cpdispatch::plan_qkv(plan);
    m.attn.entries = exact_entries(plan, read_layout(plan, m), false);  // one entry per KV copy
    std::string why;
    ASSERT_TRUE(every_share_accepted(plan, m, &why)) << "seed " << seed << ": " << why;
  }
  EXPECT_GT(sliced, 100);
  for (std::uint64_t seed = 0; seed < 40; ++seed) {  // the per-rank plan form
    const I W = 1 + static_cast<I>(seed % 8), C = W >= 4 ? 4 : (W >= 2 ? 2 : 1);
    cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(W, 32 * C, 1 + static_cast<I>(seed % 3), C, seed);
    plan.mask = mask_of(seed);
    for (I r = 0; r < W; ++r) EXPECT_NO_THROW(verify_coverage_for_rank(plan, r, cpdispatch::plan_qkv_for_rank(plan, r))) << "seed " << seed;
  }
}

/// The corruptions of RejectsSeededCorruptionsOfPlannedLayouts on one rank's
/// share: a dropped entry, a widened band, an entry's pairs one column over.
/// The other ranks' shares still pass, and only this rank's check sees it.
TEST(CoverageForRank, RejectsSeededCorruptionsOnOneRank) {
  int widened = 0, moved = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    Rng rng(seed);
    const QkvDocumentsPlan plan = corruption_plan(seed, rng);
    QkvMetadata exact = cpdispatch::plan_qkv(plan);
    exact.attn.entries = exact_entries(plan, read_layout(plan, exact), false);
    const auto pick = entry_with_pairs(exact.attn.entries, rng);
    ASSERT_TRUE(pick) << "seed " << seed;
    const auto [d, g, e] = *pick;
    const auto r = static_cast<I>(d);
    SCOPED_TRACE("seed " + std::to_string(seed) + " entry [" + std::to_string(d) + "][" + std::to_string(g) + "][" + std::to_string(e) + "]");
    ASSERT_TRUE(every_share_accepted(plan, exact));

    RankQkvMetadata mine = share_of(exact, r);
    mine.attn.entries[g].erase(mine.attn.entries[g].begin() + static_cast<std::ptrdiff_t>(e));
    EXPECT_THAT(rank_rejection(plan, r, mine), HasSubstr("no entry attends"));

    mine = share_of(exact, r);
    if (widen(mine.attn.entries[g][e])) {
      EXPECT_THAT(rank_rejection(plan, r, mine), AllOf(HasSubstr("rank " + std::to_string(d) + " query shard " + std::to_string(g)),
                                                       AnyOf(HasSubstr("does not allow"), HasSubstr("attended twice"))));
      ++widened;
    }

    mine = share_of(exact, r);
    AttentionEntry& x = mine.attn.entries[g][e];
    const I step = x.kv_start + x.kv_len < mine.attn.seqlens_kv[g] ? 1 : -1;
    if (x.kv_start + step >= 0) {
      x.kv_start += step;
      x.band = x.band.shifted(step);
      EXPECT_FALSE(rank_rejection(plan, r, mine).empty());
      QkvMetadata global = exact;  // the global check agrees
      global.attn.entries[d] = mine.attn.entries;
      EXPECT_FALSE(accepted(plan, global));
      ++moved;
    }
  }
  EXPECT_GT(widened, 60);
  EXPECT_GT(moved, 100);
}

/// What only the per-rank reading has: rows named by where q_rev and kv_rev
/// send them home, and the plan's dst.
TEST(CoverageForRank, RejectsReturnRowsThatDisagreeWithThePlan) {
  const QkvDocumentsPlan plan = example_plan();
  const QkvMetadata m = example_metadata();
  for (I r = 0; r < 2; ++r) EXPECT_NO_THROW(verify_coverage_for_rank(plan, r, share_of(m, r))) << "rank " << r;
  RankQkvMetadata mine = share_of(m, 1);
  mine.q_rev.dst_offset[0] = 1;  // rank 1's first query shard (doc0.0, 3 tokens at rank 0 offset 0) named one token on
  EXPECT_THAT(rank_rejection(plan, 1, mine), HasSubstr("verify_coverage_for_rank: q_rev[1][0] returns 3 tokens to rank 0 offset 1, where no shard of 3 tokens starts"));
  mine = share_of(m, 1);
  std::swap(mine.q_rev.dst_rank[0], mine.q_rev.dst_rank[1]);  // doc0.0 and doc0.2 (3 tokens each) trade rows
  std::swap(mine.q_rev.dst_offset[0], mine.q_rev.dst_offset[1]);
  EXPECT_THAT(rank_rejection(plan, 1, mine), HasSubstr("does not allow"));
  mine = share_of(m, 0);
  mine.kv_rev.dst_offset[1] = 0;  // doc0.0 (3 tokens) where doc0.1 (2 tokens) sits
  EXPECT_THAT(rank_rejection(plan, 0, mine), HasSubstr("kv_rev[0][1] returns 2 tokens to rank 0 offset 0, where no shard of 2 tokens starts"));
  mine = share_of(m, 0);
  mine.q_rev.seq_len.pop_back();
  EXPECT_THAT(rank_rejection(plan, 0, mine), HasSubstr("q_rev has 2 dst_rank, 2 dst_offset and 1 seq_len entries"));
  mine.q_rev = share_of(m, 0).q_rev;
  mine.q_rev.dst_rank.pop_back();
  mine.q_rev.dst_offset.pop_back();
  mine.q_rev.seq_len.pop_back();
  EXPECT_THAT(rank_rejection(plan, 0, mine), HasSubstr("rank 0 query shard 1 receives no document shard's queries (q_rev returns none from there)"));
  QkvDocumentsPlan moved = plan;
  moved.documents[1].shards[1].dst = 1;  // the plan now attends doc1.1 on rank 1; rank 0's share still does
  EXPECT_THAT(rank_rejection(moved, 0, share_of(m, 0)), HasSubstr("documents[1].shards[1].dst = 1, but rank 0 attends its queries (q_rev)"));
  EXPECT_THAT(rank_rejection(moved, 1, share_of(m, 1)), HasSubstr("documents[1].shards[1].dst = 1, yet rank 1 does not attend its queries (q_rev)"));
  EXPECT_THAT(rank_rejection(plan, 2, share_of(m, 1)), HasSubstr("rank = 2 is outside [0, 2)"));
  EXPECT_THAT(rank_rejection(plan, 0, share_of(m, 1)), HasSubstr("q_rev.rank = 1, expected 0"));
}

// --------------------------------------------------------------- brute force

TEST(Coverage, VerdictEqualsBruteForceOnRandomEntrySets) {
  int accepts = 0, rejects = 0;
  for (std::uint64_t seed = 0; seed < 4000; ++seed) {
    auto [plan, m] = small_case(seed, seed % 2 == 0);
    Rng rng(seed ^ 0x9e3779b97f4a7c15ULL);
    const std::uint64_t edits = rng.below(4);  // 0: the exact entries themselves
    for (std::uint64_t k = 0; k < edits; ++k) mutate(m.attn.entries, rng);
    const bool brute = brute_force_covers(plan, m), verdict = accepted(plan, m);
    ASSERT_EQ(verdict, brute) << "seed " << seed << " edits " << edits << (verdict ? std::string() : ": " + rejection(plan, m));
    ASSERT_EQ(every_share_accepted(plan, m), brute) << "seed " << seed << " edits " << edits << ": every rank's share";
    if (edits == 0) {
      ASSERT_TRUE(verdict) << "seed " << seed << ": " << rejection(plan, m);
    }
    (verdict ? accepts : rejects) += 1;
  }
  EXPECT_GT(accepts, 1000);
  EXPECT_GT(rejects, 1000);
}

// ---------------------------------------------- head-parallel documents (2f)

/// A random plan (slices on some documents for even seeds) with u a random
/// divisor of W or 0 (the world), in which two in three of the documents
/// living in one group are head-parallel; dedup on every third seed.
QkvDocumentsPlan head_parallel_plan(std::uint64_t seed) {
  QkvDocumentsPlan plan = random_slice_plan(seed, seed % 2 == 0);
  Rng rng(seed ^ 0x5bd1e995ULL);
  const I W = plan.world_size;
  std::vector<I> divisors;
  for (I u = 1; u <= W; ++u)
    if (W % u == 0) divisors.push_back(u);
  plan.head_parallel_degree = rng.below(4) == 0 ? 0 : divisors[rng.below(divisors.size())];
  const I u = plan.head_parallel_degree == 0 ? W : plan.head_parallel_degree;
  for (auto& doc : plan.documents) {
    const I group = doc.shards[0].rank / u;
    const bool one_group = std::all_of(doc.shards.begin(), doc.shards.end(), [&](const auto& x) { return x.rank / u == group; });
    doc.head_parallel = one_group && rng.below(3) != 0;
  }
  plan.dedup = seed % 3 == 0;
  return plan;
}

/// hp_attn's whole-document entries written out, as a layout without
/// hp_attn.entries implies them: [0, len) x [0, len) under hp_attn.mask.
Entries whole_document_entries(const cpdispatch::HeadParallelLayout& a) {
  Entries out(a.seqlens.size());
  const Band band = a.mask.band();
  for (std::size_t d = 0; d < out.size(); ++d)
    for (const I len : a.seqlens[d]) out[d].push_back({entry(0, len, 0, len, band.lo, band.hi)});
  return out;
}

/// Every pair of every document each rank's hp_attn lists, enumerated:
/// true when each rank attends every allowed pair of it once and nothing
/// else. Reads hp_attn only (the listing is taken as planned).
bool brute_head_parallel(const QkvDocumentsPlan& plan, const QkvMetadata& m) {
  if (m.hp_attn.empty()) return true;
  const Entries written = m.hp_attn.entries.empty() ? whole_document_entries(m.hp_attn) : m.hp_attn.entries;
  for (std::size_t d = 0; d < written.size(); ++d) {
    for (std::size_t i = 0; i < written[d].size(); ++i) {
      const auto doc = static_cast<std::size_t>(m.hp_attn.documents[d][i]);
      const I length = document_length(plan, doc);
      std::vector<int> count(static_cast<std::size_t>(length * length), 0);
      for (const AttentionEntry& e : written[d][i]) {
        if (e.q_start < 0 || e.q_len < 0 || e.q_start + e.q_len > length || e.kv_start < 0 || e.kv_len < 0 || e.kv_start + e.kv_len > length) return false;
        for (I p = e.q_start; p < e.q_start + e.q_len; ++p)
          for (I t = e.kv_start; t < e.kv_start + e.kv_len; ++t)
            if (e.band.contains(t - p)) ++count[static_cast<std::size_t>(p * length + t)];
      }
      for (I p = 0; p < length; ++p)
        for (I t = 0; t < length; ++t)
          if (count[static_cast<std::size_t>(p * length + t)] != (allowed_pair(plan, doc, p, t) ? 1 : 0)) return false;
    }
  }
  return true;
}

/// The plan's metadata with every entry written out: one per KV copy for
/// the dispatched documents, the whole-document ones where hp_attn has none.
QkvMetadata explicit_metadata(const QkvDocumentsPlan& plan) {
  QkvMetadata m = cpdispatch::plan_qkv(plan);
  m.attn.entries = exact_entries(plan, read_layout(plan, m), false);
  if (m.hp_attn.entries.empty() && !m.hp_attn.empty()) m.hp_attn.entries = whole_document_entries(m.hp_attn);
  return m;
}

TEST(CoverageHeadParallel, AcceptsPlannedLayouts) {
  int head_parallel = 0, sliced = 0, narrow = 0;
  for (std::uint64_t seed = 0; seed < 240; ++seed) {
    const QkvDocumentsPlan plan = head_parallel_plan(seed);
    if (!cpdispatch::detail::has_head_parallel(plan)) continue;
    SCOPED_TRACE("seed " + std::to_string(seed));
    ++head_parallel;
    sliced += std::any_of(plan.documents.begin(), plan.documents.end(), [](const auto& d) { return d.head_parallel && !d.slices.empty(); }) ? 1 : 0;
    narrow += plan.head_parallel_degree != 0 && plan.head_parallel_degree < plan.world_size ? 1 : 0;
    const QkvMetadata planned = cpdispatch::plan_qkv(plan);
    ASSERT_TRUE(accepted(plan, planned)) << rejection(plan, planned);
    for (I r = 0; r < plan.world_size; ++r) {
      const RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, r);
      ASSERT_NO_THROW(verify_coverage_for_rank(plan, r, mine)) << "rank " << r << ": " << rank_rejection(plan, r, mine);
    }
    const QkvMetadata m = explicit_metadata(plan);
    ASSERT_TRUE(accepted(plan, m)) << rejection(plan, m);
    std::string why;
    ASSERT_TRUE(every_share_accepted(plan, m, &why)) << why;
    ASSERT_TRUE(brute_force_covers(plan, m) && brute_head_parallel(plan, m));
  }
  EXPECT_GT(head_parallel, 120);  // the draw exercises what it names
  EXPECT_GT(sliced, 30);
  EXPECT_GT(narrow, 30);
}

/// Takes hp_attn.documents[r][i] off rank r, its length and entries with it.
void unlist(cpdispatch::HeadParallelLayout& a, std::size_t r, std::size_t i) {
  const auto at = static_cast<std::ptrdiff_t>(i);
  a.documents[r].erase(a.documents[r].begin() + at);
  a.seqlens[r].erase(a.seqlens[r].begin() + at);
  if (!a.entries.empty()) a.entries[r].erase(a.entries[r].begin() + at);
  a.cu_seqlens[r].assign(1, 0);
  for (const I len : a.seqlens[r]) a.cu_seqlens[r].push_back(a.cu_seqlens[r].back() + len);
}

/// Appends hp_attn.documents[from][i] to rank r's list.
void list_also(cpdispatch::HeadParallelLayout& a, std::size_t from, std::size_t i, std::size_t r) {
  a.documents[r].push_back(a.documents[from][i]);
  a.seqlens[r].push_back(a.seqlens[from][i]);
  a.cu_seqlens[r].push_back(a.cu_seqlens[r].back() + a.seqlens[from][i]);
  if (!a.entries.empty()) a.entries[r].push_back(a.entries[from][i]);
}

/// Both checks reject `m` and name `what`: globally, and on rank r.
::testing::AssertionResult both_reject(const QkvDocumentsPlan& plan, const QkvMetadata& m, I r, const std::string& what) {
  const std::string global = rejection(plan, m), mine = rank_rejection(plan, r, share_of(m, r));
  if (global.find(what) != std::string::npos && mine.find(what) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected \"" << what << "\"; verify_coverage: \"" << global << "\"; rank " << r << ": \"" << mine << "\"";
}

/// Each corruption breaks section 2f's contract on planned head-parallel
/// layouts: a document left off one rank of its group or listed twice on
/// one, a shard placed one row on (hp_fwd) or two returned rows swapped
/// (hp_rev), a document listed on a rank outside its group, a dropped entry
/// with pairs (dispatched or head-parallel), a widened head-parallel band.
TEST(CoverageHeadParallel, RejectsSeededCorruptions) {
  int unlisted = 0, swapped = 0, outside = 0, dropped = 0, dropped_hp = 0, widened = 0;
  for (std::uint64_t seed = 0; seed < 240; ++seed) {
    const QkvDocumentsPlan plan = head_parallel_plan(seed);
    if (!cpdispatch::detail::has_head_parallel(plan)) continue;
    SCOPED_TRACE("seed " + std::to_string(seed));
    Rng rng(seed);
    const QkvMetadata exact = explicit_metadata(plan);
    const std::size_t W = exact.hp_attn.documents.size(), u = static_cast<std::size_t>(exact.hp_attn.degree);
    std::vector<std::size_t> holding;  // ranks whose hp_attn lists some document
    for (std::size_t r = 0; r < W; ++r)
      if (!exact.hp_attn.documents[r].empty()) holding.push_back(r);
    const std::size_t r = holding[rng.below(holding.size())], i = rng.below(exact.hp_attn.documents[r].size());
    const I doc = exact.hp_attn.documents[r][i], R = static_cast<I>(r);

    QkvMetadata m = exact;
    unlist(m.hp_attn, r, i);
    EXPECT_TRUE(both_reject(plan, m, R, "hp_attn.documents[" + std::to_string(r) + "] lacks documents[" + std::to_string(doc) + "]"));
    ++unlisted;

    m = exact;  // listed twice on the same rank (hp_fwd fills one place only)
    list_also(m.hp_attn, r, i, r);
    EXPECT_TRUE(both_reject(plan, m, R, "lists documents[" + std::to_string(doc) + "] a second time"));

    m = exact;  // a copy of the document's first shard one row on
    const auto& first = plan.documents[static_cast<std::size_t>(doc)].shards[0];
    const auto home = static_cast<std::size_t>(first.rank);
    std::size_t j = 0;
    for (I x = 0; x < doc; ++x)
      for (const auto& s : plan.documents[static_cast<std::size_t>(x)].shards) j += s.rank == first.rank ? 1 : 0;
    const std::size_t c = rng.below(u);
    ++m.hp_fwd.dst_offset(home, j, c);
    EXPECT_THAT(rejection(plan, m), HasSubstr("(hp_fwd.dst_offset[" + std::to_string(home) + "][" + std::to_string(j) + "][" + std::to_string(c) +
                                              "]) lands at rank " + std::to_string(m.hp_fwd.dst_rank(home, j, c)) + " head-parallel row"));

    m = exact;  // rank r returns two of its rows in each other's place
    RankQkvMetadata mine = share_of(m, R);
    if (mine.hp_rev.seq_len.size() >= 2) {
      const std::size_t x = rng.below(mine.hp_rev.seq_len.size() - 1);
      for (auto* v : {&mine.hp_rev.dst_rank, &mine.hp_rev.dst_offset, &mine.hp_rev.seq_len}) std::swap((*v)[x], (*v)[x + 1]);
      EXPECT_THAT(rank_rejection(plan, R, mine),
                  AllOf(HasSubstr("hp_rev[" + std::to_string(r) + "][" + std::to_string(x) + "]"), HasSubstr("head-parallel row")));
      ++swapped;
    }

    if (u < W) {  // listed on a rank of the next group too
      m = exact;
      const std::size_t other = (r / u * u + u + rng.below(u)) % W;
      list_also(m.hp_attn, r, i, other);
      EXPECT_TRUE(both_reject(plan, m, static_cast<I>(other), "hp_attn.documents[" + std::to_string(other) + "][" +
                                                                  std::to_string(m.hp_attn.documents[other].size() - 1) + "] = " + std::to_string(doc) +
                                                                  ", but documents[" + std::to_string(doc) + "] is head-parallel on ranks"));
      ++outside;
    }

    if (const auto pick = entry_with_pairs(exact.attn.entries, rng)) {
      const auto [d, g, e] = *pick;
      m = exact;
      m.attn.entries[d][g].erase(m.attn.entries[d][g].begin() + static_cast<std::ptrdiff_t>(e));
      EXPECT_TRUE(both_reject(plan, m, static_cast<I>(d), "no entry attends"));
      ++dropped;
    }

    if (const auto pick = entry_with_pairs(exact.hp_attn.entries, rng)) {
      const auto [d, k, e] = *pick;
      const std::string where = "rank " + std::to_string(d) + " (hp_attn.documents[" + std::to_string(d) + "][" + std::to_string(k) + "])";
      m = exact;
      m.hp_attn.entries[d][k].erase(m.hp_attn.entries[d][k].begin() + static_cast<std::ptrdiff_t>(e));
      EXPECT_TRUE(both_reject(plan, m, static_cast<I>(d), "allowed pair")) << where;
      EXPECT_THAT(rejection(plan, m), HasSubstr(where));
      ++dropped_hp;
      m = exact;
      if (widen(m.hp_attn.entries[d][k][e])) {
        EXPECT_THAT(rejection(plan, m), AllOf(HasSubstr("rank " + std::to_string(d) + " head-parallel document " + std::to_string(k)),
                                              AnyOf(HasSubstr("does not allow"), HasSubstr("attended twice"))));
        EXPECT_FALSE(rank_rejection(plan, static_cast<I>(d), share_of(m, static_cast<I>(d))).empty());
        ++widened;
      }
    }
  }
  EXPECT_GT(unlisted, 120);
  EXPECT_GT(swapped, 60);
  EXPECT_GT(outside, 30);
  EXPECT_GT(dropped, 60);
  EXPECT_GT(dropped_hp, 120);
  EXPECT_GT(widened, 40);
}

/// Any value in hp_fwd, hp_rev or hp_attn gives invalid_input or a pass,
/// globally and on one rank: no crash, no other exception.
TEST(CoverageHeadParallel, ArbitraryCorruptionIsInvalidInputOrPasses) {
  int runs = 0;
  for (std::uint64_t seed = 0; seed < 1500; ++seed) {
    const QkvDocumentsPlan plan = head_parallel_plan(seed);
    if (!cpdispatch::detail::has_head_parallel(plan)) continue;
    Rng rng(seed);
    QkvMetadata m = explicit_metadata(plan);
    const I r = rng.between(0, plan.world_size - 1);
    RankQkvMetadata mine = share_of(m, r);
    Cells global, rank;
    for (Tensor<I>* t : {&m.hp_fwd.dst_rank, &m.hp_fwd.dst_offset, &m.hp_fwd.seq_len}) global.add(*t);
    for (auto* rows : {&m.hp_attn.documents, &m.hp_attn.seqlens, &m.hp_attn.cu_seqlens}) global.add(*rows);
    global.add(m.hp_attn.group_rank);
    global.add(m.hp_attn.entries);
    for (auto* row : {&mine.hp_rev.dst_rank, &mine.hp_rev.dst_offset, &mine.hp_rev.seq_len, &mine.hp_attn.documents, &mine.hp_attn.seqlens,
                      &mine.hp_attn.cu_seqlens})
      rank.add(*row);
    rank.add(mine.hp_attn.entries);
    global.poke(rng);
    rank.poke(rng);
    try {
      verify_coverage(plan, m);
    } catch (const invalid_input&) {
    }
    try {
      verify_coverage_for_rank(plan, r, mine);
    } catch (const invalid_input&) {
    }
    ++runs;
  }
  EXPECT_GT(runs, 700);
}

TEST(CoverageHeadParallel, VerdictEqualsBruteForceOnRandomEntrySets) {
  int accepts = 0, rejects = 0;
  for (std::uint64_t seed = 0; seed < 1500; ++seed) {
    const QkvDocumentsPlan plan = head_parallel_plan(seed);
    if (!cpdispatch::detail::has_head_parallel(plan)) continue;
    QkvMetadata m = explicit_metadata(plan);
    Rng rng(seed ^ 0x9e3779b97f4a7c15ULL);
    const std::uint64_t edits = rng.below(4);  // 0: the planned entries themselves
    for (std::uint64_t k = 0; k < edits; ++k) mutate(m.hp_attn.entries, rng);
    const bool brute = brute_force_covers(plan, m) && brute_head_parallel(plan, m), verdict = accepted(plan, m);
    ASSERT_EQ(verdict, brute) << "seed " << seed << " edits " << edits << (verdict ? std::string() : ": " + rejection(plan, m));
    ASSERT_EQ(every_share_accepted(plan, m), brute) << "seed " << seed << " edits " << edits << ": every rank's share";
    (verdict ? accepts : rejects) += 1;
  }
  EXPECT_GT(accepts, 300);
  EXPECT_GT(rejects, 300);
}

}  // namespace
