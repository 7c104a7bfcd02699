// An independent brute-force model of planning documents that span ranks
// (docs/plan-format.md, section 2b), checked against plan_qkv on random
// cross-rank plans. The model computes each field from its definition with
// plain loops and quadratic scans over a flat list of shards; it shares no
// code with the planner. A failure prints the seed; rerun one case with
// CPDISPATCH_TEST_SEED=<seed>.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "helpers.hpp"
#include "reference.hpp"
#include "../common/sanitized.hpp"

namespace {

using I = std::int64_t;
using ref::Cube;
using ref::Mat;
using ref::Vec;

struct Piece {
  std::size_t doc, k;  // document and shard index in it
  I home, len, dst;
};

struct Model {
  std::size_t W = 0, S = 0, C = 0;
  std::vector<Piece> all;                                    // document order
  std::vector<std::size_t> doc_first;                        // index in `all` of each document's shard 0
  std::vector<std::vector<std::size_t>> mlp;                 // per home rank: indices into all
  std::vector<std::pair<std::size_t, std::size_t>> placed;   // per piece: (home rank, local index)
  std::vector<I> ctx;                                        // per piece: tokens of its document before it
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> arrived;  // per destination: (home, local), global order
  std::vector<I> group;                                      // per piece: start of its KV group at its destination

  const Piece& at(std::size_t r, std::size_t j) const { return all[mlp[r][j]]; }
  std::size_t doc_size(std::size_t doc) const {
    std::size_t n = 0;
    for (const Piece& p : all) n += p.doc == doc ? 1 : 0;
    return n;
  }
  std::size_t find(std::size_t doc, std::size_t k) const { return doc_first[doc] + k; }
  std::pair<std::size_t, std::size_t> place(std::size_t i) const { return placed[i]; }
  I P(std::size_t r, std::size_t j) const {
    I p = 0;
    for (std::size_t i = 0; i < j; ++i) p += at(r, i).len;
    return p;
  }
  I T(std::size_t r) const { return P(r, mlp[r].size()); }
  I context(const Piece& q) const { return ctx[find(q.doc, q.k)]; }
};

Model model_of(const cpdispatch::QkvDocumentsPlan& plan) {
  Model m;
  m.W = static_cast<std::size_t>(plan.world_size);
  std::size_t most = 0;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    most = std::max(most, shards.size());
    m.doc_first.push_back(m.all.size());
    for (std::size_t k = 0; k < shards.size(); ++k) m.all.push_back({i, k, shards[k].rank, shards[k].len, shards[k].dst});
  }
  m.C = plan.max_cp_degree ? static_cast<std::size_t>(*plan.max_cp_degree) : std::max<std::size_t>(most, 1);
  m.mlp.resize(m.W);
  for (std::size_t r = 0; r < m.W; ++r) {
    for (std::size_t i = 0; i < m.all.size(); ++i)
      if (m.all[i].home == static_cast<I>(r)) m.mlp[r].push_back(i);
    m.S = std::max(m.S, m.mlp[r].size());
  }
  m.placed.assign(m.all.size(), {0, 0});
  for (std::size_t r = 0; r < m.W; ++r)
    for (std::size_t j = 0; j < m.mlp[r].size(); ++j) m.placed[m.mlp[r][j]] = {r, j};
  for (const Piece& q : m.all) {
    I c = 0;
    for (const Piece& p : m.all)
      if (p.doc == q.doc && p.k < q.k) c += p.len;
    m.ctx.push_back(c);
  }
  // Arrivals at each destination in global order, and the KV group starts:
  // each group after the groups of the query shards that arrived before it.
  m.arrived.resize(m.W);
  m.group.assign(m.all.size(), 0);
  for (std::size_t r = 0; r < m.W; ++r) {
    for (std::size_t j = 0; j < m.mlp[r].size(); ++j) {
      const Piece& q = m.at(r, j);
      auto& list = m.arrived[static_cast<std::size_t>(q.dst)];
      I start = 0;
      for (auto [r2, j2] : list) start += m.context(m.at(r2, j2)) + m.at(r2, j2).len;
      m.group[m.mlp[r][j]] = start;
      list.emplace_back(r, j);
    }
  }
  return m;
}

/// Query shards arriving at d: (home, local) in global order.
const std::vector<std::pair<std::size_t, std::size_t>>& arrivals(const Model& m, std::size_t d) { return m.arrived[d]; }

/// Where the KV group of query shard (r, j) starts at its destination.
I group_start(const Model& m, std::size_t r, std::size_t j) { return m.group[m.mlp[r][j]]; }

ref::Meta query_fwd(const Model& m) {
  Mat dst(m.W, Vec(m.S, -1)), off(m.W, Vec(m.S, 0)), len(m.W, Vec(m.S, 0)), recv(m.W, Vec(m.W, 0));
  Vec nseq(m.W, 0), sent_so_far(m.W, 0);  // per destination: tokens of the entries before, in global order
  for (std::size_t r = 0; r < m.W; ++r) {
    for (std::size_t j = 0; j < m.mlp[r].size(); ++j) {
      const Piece& p = m.at(r, j);
      const auto d = static_cast<std::size_t>(p.dst);
      dst[r][j] = p.dst;
      len[r][j] = p.len;
      off[r][j] = sent_so_far[d];
      sent_so_far[d] += p.len;
      recv[d][r] += p.len;
      ++nseq[r];
    }
  }
  return {ref::arr(dst, m.S), ref::arr(off, m.S), ref::arr(len, m.S), ref::arr(ref::with_totals(recv), m.W + 1), ref::arr(nseq), {}, {}};
}

ref::Meta query_rev(const Model& m) {
  std::size_t M = 0;
  for (std::size_t d = 0; d < m.W; ++d) M = std::max(M, arrivals(m, d).size());
  Mat dst(m.W, Vec(M, -1)), off(m.W, Vec(M, 0)), len(m.W, Vec(M, 0)), recv(m.W, Vec(m.W, 0));
  Vec nseq(m.W, 0);
  for (std::size_t d = 0; d < m.W; ++d) {
    const auto in = arrivals(m, d);
    for (std::size_t e = 0; e < in.size(); ++e) {
      auto [r, j] = in[e];
      dst[d][e] = static_cast<I>(r);
      len[d][e] = m.at(r, j).len;
      off[d][e] = m.P(r, j);
      recv[r][d] += m.at(r, j).len;
    }
    nseq[d] = static_cast<I>(in.size());
  }
  return {ref::arr(dst, M), ref::arr(off, M), ref::arr(len, M), ref::arr(ref::with_totals(recv), m.W + 1), ref::arr(nseq), {}, {}};
}

ref::Meta kv_fwd(const Model& m, Cube& mask) {
  Cube dst(m.W, Mat(m.S, Vec(m.C, -1))), off(m.W, Mat(m.S, Vec(m.C, 0)));
  mask.assign(m.W, Mat(m.S, Vec(m.C, 0)));
  Mat len(m.W, Vec(m.S, 0)), recv(m.W, Vec(m.W, 0));
  Vec nseq(m.W, 0);
  for (std::size_t r = 0; r < m.W; ++r) {
    for (std::size_t j = 0; j < m.mlp[r].size(); ++j) {
      const Piece& kv = m.at(r, j);
      len[r][j] = kv.len;
      ++nseq[r];
      const std::size_t n = m.doc_size(kv.doc);
      for (std::size_t c = 0; kv.k + c < n; ++c) {
        const auto [qr, qj] = m.place(m.find(kv.doc, kv.k + c));
        const I d = m.at(qr, qj).dst;
        dst[r][j][c] = d;
        off[r][j][c] = group_start(m, qr, qj) + m.context(kv);
        mask[r][j][c] = 1;
        recv[static_cast<std::size_t>(d)][r] += kv.len;  // charged to the KV shard's home
      }
    }
  }
  return {ref::arr(dst, m.S, m.C), ref::arr(off, m.S, m.C), ref::arr(len, m.S), ref::arr(ref::with_totals(recv), m.W + 1), ref::arr(nseq), {}, {}};
}

ref::Meta kv_rev(const Model& m, const Cube& mask, const ref::Arr& lens) {
  struct Back {
    I home, len, off;
  };
  std::vector<std::vector<Back>> rows(m.W);
  Mat recv(m.W, Vec(m.W, 0));
  for (std::size_t d = 0; d < m.W; ++d) {
    for (auto [qr, qj] : arrivals(m, d)) {
      const Piece& q = m.at(qr, qj);
      for (std::size_t k = 0; k <= q.k; ++k) {
        const auto [h, g] = m.place(m.find(q.doc, k));
        const I len = m.at(h, g).len;
        rows[d].push_back({static_cast<I>(h), len, static_cast<I>(q.k - k) * m.T(h) + m.P(h, g)});
        recv[h][d] += len;
      }
    }
  }
  std::size_t M = 0;
  for (const auto& row : rows) M = std::max(M, row.size());
  Mat dst(m.W, Vec(M, -1)), off(m.W, Vec(M, 0)), len(m.W, Vec(M, 0));
  Vec nseq(m.W, 0);
  for (std::size_t d = 0; d < m.W; ++d) {
    for (std::size_t e = 0; e < rows[d].size(); ++e) {
      dst[d][e] = rows[d][e].home;
      len[d][e] = rows[d][e].len;
      off[d][e] = rows[d][e].off;
    }
    nseq[d] = static_cast<I>(rows[d].size());
  }
  return {ref::arr(dst, M), ref::arr(off, M), ref::arr(len, M), ref::arr(ref::with_totals(recv), m.W + 1), ref::arr(nseq),
          ref::arr(mask, m.S, m.C), lens};
}

ref::Attn attention(const Model& m) {
  ref::Attn a;
  for (std::size_t d = 0; d < m.W; ++d) {
    Vec q, kv, cq{0}, ckv{0};
    for (auto [r, j] : arrivals(m, d)) {
      q.push_back(m.at(r, j).len);
      kv.push_back(m.context(m.at(r, j)) + m.at(r, j).len);
      cq.push_back(cq.back() + q.back());
      ckv.push_back(ckv.back() + kv.back());
    }
    a.max_seqlen_q.push_back(q.empty() ? 0 : *std::max_element(q.begin(), q.end()));
    a.max_seqlen_kv.push_back(kv.empty() ? 0 : *std::max_element(kv.begin(), kv.end()));
    a.seqlens_q.push_back(q);
    a.seqlens_kv.push_back(kv);
    a.cu_seqlens_q.push_back(cq);
    a.cu_seqlens_kv.push_back(ckv);
  }
  return a;
}

ref::Qkv brute_force(const cpdispatch::QkvDocumentsPlan& plan) {
  const Model m = model_of(plan);
  ref::Qkv out;
  out.q_fwd = query_fwd(m);
  out.q_rev = query_rev(m);
  Cube mask;
  out.kv_fwd = kv_fwd(m, mask);
  out.kv_rev = kv_rev(m, mask, out.kv_fwd.seq_len);
  out.attn = attention(m);
  return out;
}

/// A cross-rank plan: W in 1..64 (mostly small), up to 16 shards a
/// document, homes that pack a document across consecutive ranks or scatter
/// it, destinations often repeated, some ranks empty.
cpdispatch::QkvDocumentsPlan random_plan(std::uint64_t seed) {
  cptest::TestRng rng(seed);
  cpdispatch::QkvDocumentsPlan p;
  p.world_size = 1 + static_cast<I>(rng.below(rng.chance(20) ? 64 : 12));
  const I W = p.world_size;
  const I docs = rng.between(0, 12);
  std::size_t most = 0;
  for (I i = 0; i < docs; ++i) {
    cpdispatch::PackedDocument doc;
    const auto n = static_cast<std::size_t>(rng.between(1, rng.chance(50) ? 16 : 4));
    const bool packed = rng.chance(60);
    I home = rng.between(0, W - 1), dst = rng.between(0, W - 1);
    for (std::size_t k = 0; k < n; ++k) {
      if (k > 0 && packed && rng.chance(50)) home = std::min(home + 1, W - 1);
      if (k > 0 && !packed) home = rng.between(0, W - 1);
      if (k > 0 && rng.chance(60)) dst = rng.between(0, W - 1);
      doc.shards.push_back({home, rng.between(1, rng.chance(20) ? 1 : 30), dst});
    }
    most = std::max(most, n);
    p.documents.push_back(doc);
  }
  if (rng.chance(25)) p.max_cp_degree = static_cast<I>(std::max<std::size_t>(most, 1)) + rng.between(0, 3);
  return p;
}

std::optional<std::uint64_t> seed_override() {
  if (const char* s = std::getenv("CPDISPATCH_TEST_SEED")) return std::strtoull(s, nullptr, 0);
  return std::nullopt;
}

TEST(CoreDocumentsReference, ModelAgreesWithSection2bExample) {
  cpdispatch::QkvDocumentsPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.documents = {{{{0, 3, 1}, {1, 2, 0}, {1, 4, 1}}}, {{{0, 5, 0}}}, {{{1, 1, 1}}}};
  const ref::Qkv r = brute_force(p);
  EXPECT_EQ(r.kv_fwd.dst_offset.v, (Vec{0, 5, 3, 0, 0, 0, 0, 0, 0, 8, 6, 0, 8, 0, 0, 12, 0, 0}));
  EXPECT_EQ(r.kv_fwd.num_recv_tokens.v, (Vec{8, 2, 10, 6, 7, 13}));
  EXPECT_EQ(r.kv_rev.dst_offset.v, (Vec{3, 8, 0, 0, 0, 0, 16, 7, 2, 6}));
  EXPECT_TRUE(cptest::same_qkv(cpdispatch::plan_qkv(p), r));
}

TEST(CoreDocumentsReference, PlannerAgreesOnRandomCrossRankPlans) {
  const auto one = seed_override();
  const std::uint64_t first = one ? *one : 1, last = one ? *one : cptest::cases<std::uint64_t>(1000, 400);
  std::size_t spanning = 0;
  for (std::uint64_t seed = first; seed <= last; ++seed) {
    const cpdispatch::QkvDocumentsPlan plan = random_plan(seed);
    for (const auto& doc : plan.documents) {
      bool spans = false;
      for (const auto& s : doc.shards) spans = spans || s.rank != doc.shards[0].rank;
      spanning += spans ? 1 : 0;
    }
    const auto result = cptest::same_qkv(cpdispatch::plan_qkv(plan), brute_force(plan));
    ASSERT_TRUE(result) << "seed " << seed << " (CPDISPATCH_TEST_SEED=" << seed << ")";
  }
  if (!one) {
    EXPECT_GT(spanning, 800u);  // the plans really do span ranks
  }
}

}  // namespace
