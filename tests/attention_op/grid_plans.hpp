#pragma once
// Plans for the invariant mode's tests: one batch of documents packed in
// order and cut over W ranks on a grid (attended at home, anywhere, or cut
// further on the grid), and a run's results gathered in packed order to
// compare bit for bit.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace attention_test {

inline constexpr std::int64_t grid = 8;
inline const std::vector<std::int64_t> lengths = {37, 100, 5, 64, 90, 3, 21};  // 320 tokens, packed in this order

enum class Placement { home, anywhere, cut_further };

/// The batch packed in document order and cut into W contiguous MLP layouts
/// at multiples of the grid (rank r from `first(r)`); each document's pieces
/// attended at home, on random ranks, or also cut at random grid points.
/// Slices (section 2e) for documents 1 and 4 of `lengths`: a prompt of 40 and
/// two responses of 30 (a shared prefix); a prefix of 30 seen whole, then
/// causal (prefix-LM). Their bounds are the batch's, off the grid.
inline std::vector<cpdispatch::AttentionSlice> grid_slices(std::size_t doc) {
  using cpdispatch::SliceType;
  if (doc == 1) {
    return {{0, 40, 0, 40, SliceType::causal}, {40, 70, 0, 40, SliceType::full}, {40, 70, 40, 70, SliceType::causal},
            {70, 100, 0, 40, SliceType::full}, {70, 100, 70, 100, SliceType::causal}};
  }
  if (doc == 4) return {{0, 30, 0, 30, SliceType::full}, {30, 90, 0, 30, SliceType::full}, {30, 90, 30, 90, SliceType::causal}};
  return {};
}

inline cpdispatch::QkvDocumentsPlan grid_plan(int W, Placement placement, std::uint64_t seed, const cpdispatch::AttentionMask& mask, bool dedup, std::int64_t off_grid = 0,
                                             bool slices = false) {
  std::int64_t total = 0;
  for (std::int64_t L : lengths) total += L;
  std::vector<std::int64_t> first;
  for (int r = 0; r < W; ++r) first.push_back(r == 0 ? 0 : r * total / W / grid * grid + off_grid);
  first.push_back(total);
  std::mt19937_64 rng(seed);
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  plan.mask = mask;
  plan.dedup = dedup;
  std::int64_t at = 0;
  for (std::int64_t L : lengths) {
    std::vector<std::int64_t> cuts{at, at + L};
    for (int r = 1; r < W; ++r) {
      if (first[static_cast<std::size_t>(r)] > at && first[static_cast<std::size_t>(r)] < at + L) cuts.push_back(first[static_cast<std::size_t>(r)]);
    }
    if (placement == Placement::cut_further) {
      for (std::int64_t x = (at / grid + 1) * grid; x < at + L; x += grid) {
        if (rng() % 3 == 0) cuts.push_back(x);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    cpdispatch::PackedDocument doc;
    if (slices) doc.slices = grid_slices(plan.documents.size());
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const auto home = static_cast<std::int64_t>(std::upper_bound(first.begin(), first.end() - 1, cuts[i]) - first.begin()) - 1;
      const std::int64_t dst = placement == Placement::home ? home : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(W));
      doc.shards.push_back({home, cuts[i + 1] - cuts[i], dst});
    }
    plan.documents.push_back(doc);
    at += L;
  }
  return plan;
}

/// `plan` with head-parallel degree u and every document whose shards lie in one group head-parallel.
inline cpdispatch::QkvDocumentsPlan head_parallel_on_grid(cpdispatch::QkvDocumentsPlan plan, std::int64_t u) {
  plan.head_parallel_degree = u;
  for (cpdispatch::PackedDocument& doc : plan.documents) {
    doc.head_parallel = true;
    for (const cpdispatch::DocumentShard& x : doc.shards) doc.head_parallel = doc.head_parallel && x.rank / u == doc.shards.front().rank / u;
  }
  return plan;
}

/// A run's results in packed order (lse: [heads_q][tokens]).
struct Packed {
  std::vector<float> out, dq, dk, dv, lse;
};

inline Packed packed(const std::vector<RankResult>& results, const cpdispatch::AttentionShape& s) {
  Packed p;
  std::vector<std::int64_t> first{0};
  for (const RankResult& r : results) {
    for (auto [to, from] : {std::pair{&p.out, &r.out}, std::pair{&p.dq, &r.dq}, std::pair{&p.dk, &r.dk}, std::pair{&p.dv, &r.dv}}) {
      to->insert(to->end(), from->begin(), from->end());
    }
    first.push_back(first.back() + static_cast<std::int64_t>(r.out.size()) / (s.heads_q * s.head_dim));
  }
  const std::int64_t T = first.back();
  p.lse.assign(static_cast<std::size_t>(s.heads_q * T), 0.0f);
  for (const RankResult& r : results) {
    const std::int64_t tq = static_cast<std::int64_t>(r.lse.size()) / s.heads_q;
    std::int64_t row = 0;
    for (std::size_t m = 0; m < r.q_rev.seq_len.size(); ++m) {
      const std::int64_t at = first[static_cast<std::size_t>(r.q_rev.dst_rank[m])] + r.q_rev.dst_offset[m];
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        for (std::int64_t j = 0; j < r.q_rev.seq_len[m]; ++j) {
          p.lse[static_cast<std::size_t>(h * T + at + j)] = r.lse[static_cast<std::size_t>(h * tq + row + j)];
        }
      }
      row += r.q_rev.seq_len[m];
    }
    // Head-parallel documents, whole on each rank of their group, for its share of the query heads.
    if (r.hp.degree == 0) continue;
    const std::int64_t heads = s.heads_q / r.hp.degree, n = r.hp.tokens();
    for (std::size_t i = 0; i < r.hp.documents.size(); ++i) {
      std::int64_t start = 0;
      for (std::int64_t d = 0; d < r.hp.documents[i]; ++d) start += lengths[static_cast<std::size_t>(d)];
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t j = 0; j < r.hp.seqlens[i]; ++j) {
          p.lse[static_cast<std::size_t>((r.hp.group_rank * heads + h) * T + start + j)] = r.hp_lse[static_cast<std::size_t>(h * n + r.hp.cu_seqlens[i] + j)];
        }
      }
    }
  }
  return p;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void expect_same_bits(const Packed& got, const Packed& want, const std::string& run) {
  EXPECT_TRUE(same_bits(got.out, want.out)) << run << ": out";
  EXPECT_TRUE(same_bits(got.lse, want.lse)) << run << ": lse";
  EXPECT_TRUE(same_bits(got.dq, want.dq)) << run << ": dq";
  EXPECT_TRUE(same_bits(got.dk, want.dk)) << run << ": dk";
  EXPECT_TRUE(same_bits(got.dv, want.dv)) << run << ": dv";
}

/// Each rank's error of a step with a NaN in one rank's v (the forward: the
/// rank whose kernel met it names the row, the others that rank) or dout (the
/// backward: every rank's bounds name it).
inline void expect_refused_on_every_rank(const std::vector<std::string>& errors, bool in_dout) {
  int naming_the_row = 0;
  for (const std::string& e : errors) {
    if (in_dout) {
      EXPECT_NE(e.find("bounds.max_abs_dout is nan"), std::string::npos) << e;
    } else {
      naming_the_row += e.find("is not finite") != std::string::npos;
      EXPECT_TRUE(e.find("is not finite") != std::string::npos || e.find("'s kernel refused the step") != std::string::npos) << e;
    }
  }
  if (!in_dout) {
    EXPECT_GE(naming_the_row, 1);
  }
}

inline cpdispatch::CpAttentionOptions invariant_options(bool dedup, int stages) {
  cpdispatch::CpAttentionOptions o;
  o.dedup = dedup;
  o.stages = stages;
  o.invariant = true;
  o.grid = grid;
  return o;
}

/// One rank's results against a packed run's: its rows of out, dq, dk and
/// dv, and its attention layout's lse (placed through its q_rev).
inline void expect_rank_same_bits(const Packed& want, const RankResult& mine, std::size_t rank, const cpdispatch::QkvDocumentsPlan& plan,
                                  const cpdispatch::AttentionShape& s) {
  std::vector<std::int64_t> first(static_cast<std::size_t>(plan.world_size) + 1, 0);
  for (const cpdispatch::PackedDocument& d : plan.documents) {
    for (const cpdispatch::DocumentShard& x : d.shards) first[static_cast<std::size_t>(x.rank) + 1] += x.len;
  }
  for (std::size_t r = 1; r < first.size(); ++r) first[r] += first[r - 1];
  const auto rows = [&](const std::vector<float>& all, std::int64_t heads) {
    const auto w = static_cast<std::size_t>(heads * s.head_dim);
    return std::vector<float>(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first[rank]) * w),
                              all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first[rank + 1]) * w));
  };
  EXPECT_TRUE(same_bits(mine.out, rows(want.out, s.heads_q))) << "rank " << rank << ": out";
  EXPECT_TRUE(same_bits(mine.dq, rows(want.dq, s.heads_q))) << "rank " << rank << ": dq";
  EXPECT_TRUE(same_bits(mine.dk, rows(want.dk, s.heads_kv))) << "rank " << rank << ": dk";
  EXPECT_TRUE(same_bits(mine.dv, rows(want.dv, s.heads_kv))) << "rank " << rank << ": dv";
  const std::int64_t T = first.back(), tq = static_cast<std::int64_t>(mine.lse.size()) / s.heads_q;
  std::vector<float> lse(mine.lse.size());
  std::int64_t row = 0;
  for (std::size_t m = 0; m < mine.q_rev.seq_len.size(); ++m) {
    const std::int64_t at = first[static_cast<std::size_t>(mine.q_rev.dst_rank[m])] + mine.q_rev.dst_offset[m];
    for (std::int64_t h = 0; h < s.heads_q; ++h) {
      for (std::int64_t j = 0; j < mine.q_rev.seq_len[m]; ++j) {
        lse[static_cast<std::size_t>(h * tq + row + j)] = want.lse[static_cast<std::size_t>(h * T + at + j)];
      }
    }
    row += mine.q_rev.seq_len[m];
  }
  EXPECT_TRUE(same_bits(mine.lse, lse)) << "rank " << rank << ": lse";
}

}  // namespace attention_test
