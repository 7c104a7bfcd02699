#pragma once
// A world for the op's tests: a documents-form plan, random Q, K, V per whole
// document, every rank's MLP layout cut from them, and the double-precision
// reference attention over each whole document to compare against (under the
// document's slices where it has them, section 2e).

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention_kernel/attention_case.hpp"
#include "common/max_error.hpp"
#include "common/reference_attention.hpp"
#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/attention/detail/lse_merge.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace attention_test {

/// One shard of the MLP layout: document `doc`, positions [start, start + len).
struct Piece {
  std::size_t doc;
  std::int64_t start, len;
};

/// The tensors of one rank, in its MLP layout (float copies of E values).
struct RankTensors {
  std::vector<float> q, k, v, dout;
};

/// What a rank's op returned.
struct RankResult {
  std::vector<float> out, dq, dk, dv, lse;  // lse: attention layout [heads_q][q tokens]
  cpdispatch::RankMetadata q_rev;
  std::vector<float> hp_lse = {};              // the head-parallel documents', [heads_q / u][their tokens]
  cpdispatch::RankHeadParallelLayout hp = {};  // ... and their layout
};

class CpWorld {
 public:
  CpWorld(cpdispatch::QkvDocumentsPlan plan, const cpdispatch::AttentionShape& shape, const cpdispatch::AttentionMask& mask,
          std::uint64_t seed, float (*round)(float))
      : plan_(std::move(plan)), shape_(shape), mask_(mask) {
    const auto W = static_cast<std::size_t>(plan_.world_size);
    pieces_.resize(W);
    for (std::size_t d = 0; d < plan_.documents.size(); ++d) {
      std::int64_t at = 0;
      for (const cpdispatch::DocumentShard& s : plan_.documents[d].shards) {
        pieces_[static_cast<std::size_t>(s.rank)].push_back({d, at, s.len});
        at += s.len;
      }
      lengths_.push_back(at);
    }
    draw(seed, round);
    reference();
  }

  const cpdispatch::QkvDocumentsPlan& plan() const { return plan_; }
  const std::vector<Piece>& pieces(std::size_t rank) const { return pieces_[rank]; }

  /// Rank r's q, k, v and dout in its MLP layout.
  RankTensors tensors(std::size_t rank) const {
    RankTensors t;
    for (const Piece& p : pieces_[rank]) {
      append(t.q, docs_[p.doc].q, p, shape_.heads_q);
      append(t.k, docs_[p.doc].k, p, shape_.heads_kv);
      append(t.v, docs_[p.doc].v, p, shape_.heads_kv);
      append(t.dout, docs_[p.doc].dout, p, shape_.heads_q);
    }
    return t;
  }

  /// Compares every rank's results with the reference: the largest error of
  /// each tensor relative to its largest reference magnitude must be <= tol.
  void expect_equal(const std::vector<RankResult>& results, double tol, std::size_t first_rank = 0) const {
    const std::array<double, 5> rel = relative_errors(results, first_rank);
    const char* names[5] = {"out", "dq", "dk", "dv", "lse"};
    for (int i = 0; i < 5; ++i) EXPECT_LE(rel[static_cast<std::size_t>(i)], tol) << names[i] << ": largest error relative to the largest magnitude";
  }

  /// Each tensor's largest error over its largest reference magnitude: out, dq, dk, dv, lse
  /// (infinite on a NaN or a tensor of the wrong size: common/max_error.hpp).
  /// results[i] is rank first_rank + i's (a process that runs one rank passes only its own).
  std::array<double, 5> relative_errors(const std::vector<RankResult>& results, std::size_t first_rank = 0) const {
    using cpdispatch::testing::max_error;
    std::array<cpdispatch::testing::MaxError, 5> e{};
    for (std::size_t i = 0; i < results.size(); ++i) {
      const std::size_t r = first_rank + i;
      SCOPED_TRACE("rank " + std::to_string(r));
      e[0].add(max_error(results[i].out, expected(r, [](const Doc& d) { return &d.ref.out; }, shape_.heads_q)));
      e[1].add(max_error(results[i].dq, expected(r, [](const Doc& d) { return &d.grads.dq; }, shape_.heads_q)));
      e[2].add(max_error(results[i].dk, expected(r, [](const Doc& d) { return &d.grads.dk; }, shape_.heads_kv)));
      e[3].add(max_error(results[i].dv, expected(r, [](const Doc& d) { return &d.grads.dv; }, shape_.heads_kv)));
      e[4].add(max_error(results[i].lse, expected_lse(results[i].q_rev)));
      e[4].add(max_error(results[i].hp_lse, expected_head_parallel_lse(results[i].hp)));
    }
    std::array<double, 5> rel{};
    for (std::size_t i = 0; i < 5; ++i) rel[i] = e[i].relative();
    return rel;
  }

  /// The same documents and data as one rank holding every document whole (the unsharded run).
  static cpdispatch::QkvDocumentsPlan unsharded(const cpdispatch::QkvDocumentsPlan& plan) {
    cpdispatch::QkvDocumentsPlan one;
    one.world_size = 1;
    for (const cpdispatch::PackedDocument& d : plan.documents) {
      std::int64_t L = 0;
      for (const cpdispatch::DocumentShard& s : d.shards) L += s.len;
      one.documents.push_back({{{0, L, 0}}});
    }
    return one;
  }

 private:
  struct Doc {
    std::vector<double> q, k, v, dout;
    cpdispatch::testing::ReferenceForward ref;
    cpdispatch::testing::ReferenceGradients grads;
  };

  void draw(std::uint64_t seed, float (*round)(float)) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](std::vector<double>& x, std::int64_t n) {
      x.resize(static_cast<std::size_t>(n));
      for (double& e : x) e = round(u(rng));
    };
    for (std::int64_t L : lengths_) {
      Doc d;
      fill(d.q, L * shape_.heads_q * shape_.head_dim);
      fill(d.k, L * shape_.heads_kv * shape_.head_dim);
      fill(d.v, L * shape_.heads_kv * shape_.head_dim);
      fill(d.dout, L * shape_.heads_q * shape_.head_dim);
      docs_.push_back(std::move(d));
    }
  }

  void reference() {
    const cpdispatch::testing::ReferenceShape s{shape_.heads_q, shape_.heads_kv, shape_.head_dim, static_cast<double>(shape_.softmax_scale)};
    for (std::size_t i = 0; i < docs_.size(); ++i) {
      Doc& d = docs_[i];
      if (!plan_.documents[i].slices.empty()) {
        sliced_reference(d, plan_.documents[i].slices);
        continue;
      }
      d.ref = cpdispatch::testing::reference_attention_forward(d.q, d.k, d.v, lengths_[i], s, mask_);
      d.grads = cpdispatch::testing::reference_attention_backward(d.q, d.k, d.v, d.dout, lengths_[i], s, mask_);
    }
  }

  /// A document with slices: each slice an entry over the document's own
  /// positions (its band on t - p as is), brute force.
  void sliced_reference(Doc& d, const std::vector<cpdispatch::AttentionSlice>& slices) const {
    std::vector<cpdispatch::AttentionEntry> entries;
    for (const cpdispatch::AttentionSlice& sl : slices) {
      entries.push_back({sl.q_begin, sl.q_end - sl.q_begin, sl.k_begin, sl.k_end - sl.k_begin, sl.band()});
    }
    auto r = cpdispatch::testing::reference_by_entries(d.q, d.k, d.v, d.dout, shape_, entries);
    d.ref = {std::move(r.out), std::move(r.lse)};
    d.grads = {std::move(r.dq), std::move(r.dk), std::move(r.dv)};
  }

  template <class T>
  void append(std::vector<T>& to, const std::vector<double>& from, const Piece& p, std::int64_t heads) const {
    const auto width = static_cast<std::size_t>(heads * shape_.head_dim);
    for (std::size_t i = static_cast<std::size_t>(p.start) * width; i < static_cast<std::size_t>(p.start + p.len) * width; ++i) {
      to.push_back(static_cast<T>(from[i]));
    }
  }

  /// Rank r's reference rows of one tensor (*of(doc) for each document), in its MLP layout.
  template <class Of>
  std::vector<double> expected(std::size_t r, Of of, std::int64_t heads) const {
    std::vector<double> want;
    for (const Piece& p : pieces_[r]) append(want, *of(docs_[p.doc]), p, heads);
    return want;
  }

  /// The reference lse in a rank's attention layout, [heads_q][q tokens]:
  /// entry m of q_rev came from rank dst_rank[m], at dst_offset[m] there.
  std::vector<double> expected_lse(const cpdispatch::RankMetadata& q_rev) const {
    std::int64_t tq = 0;
    for (const std::int64_t n : q_rev.seq_len) tq += n;
    std::vector<double> want(static_cast<std::size_t>(shape_.heads_q * tq));
    std::int64_t row = 0;
    for (std::size_t m = 0; m < q_rev.seq_len.size(); ++m) {
      const Piece& p = piece_at(static_cast<std::size_t>(q_rev.dst_rank[m]), q_rev.dst_offset[m]);
      const std::int64_t L = lengths_[p.doc];
      for (std::int64_t h = 0; h < shape_.heads_q; ++h) {
        for (std::int64_t j = 0; j < p.len; ++j) {
          want[static_cast<std::size_t>(h * tq + row + j)] = docs_[p.doc].ref.lse[static_cast<std::size_t>(h * L + p.start + j)];
        }
      }
      row += q_rev.seq_len[m];
    }
    return want;
  }

  /// The reference lse of a rank's head-parallel documents, [heads_q / u][their tokens]: group rank c holds query heads [c * heads_q / u, + heads_q / u).
  std::vector<double> expected_head_parallel_lse(const cpdispatch::RankHeadParallelLayout& a) const {
    if (a.degree == 0) return {};
    const std::int64_t heads = shape_.heads_q / a.degree, n = a.tokens(), first = a.group_rank * heads;
    std::vector<double> want(static_cast<std::size_t>(heads * n));
    for (std::size_t i = 0; i < a.documents.size(); ++i) {
      const std::int64_t L = a.seqlens[i];
      const Doc& d = docs_[static_cast<std::size_t>(a.documents[i])];
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t p = 0; p < L; ++p) want[static_cast<std::size_t>(h * n + a.cu_seqlens[i] + p)] = d.ref.lse[static_cast<std::size_t>((first + h) * L + p)];
      }
    }
    return want;
  }

  const Piece& piece_at(std::size_t home, std::int64_t offset) const {
    std::int64_t at = 0;
    for (const Piece& p : pieces_[home]) {
      if (at == offset) return p;
      at += p.len;
    }
    throw std::runtime_error("no shard starts at offset " + std::to_string(offset) + " of rank " + std::to_string(home));
  }

  cpdispatch::QkvDocumentsPlan plan_;
  cpdispatch::AttentionShape shape_;
  cpdispatch::AttentionMask mask_;
  std::vector<std::vector<Piece>> pieces_;
  std::vector<std::int64_t> lengths_;
  std::vector<Doc> docs_;
};

/// A random plan of W ranks for the op's cases: W + 2 documents, each in up
/// to 4 shards of up to 5 tokens, under `mask`, planned with dedup or not.
inline cpdispatch::QkvDocumentsPlan random_plan(int W, std::uint64_t seed, const cpdispatch::AttentionMask& mask, bool dedup) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = W + 2;
  o.max_shards = 4;
  o.max_len = 5;
  cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, seed);
  plan.mask = mask;
  plan.dedup = dedup;
  return plan;
}

/// One case of a pairwise table over world size, heads, mask, dedup and stages.
struct OpCase {
  const char* name;
  int world_size;
  std::int64_t heads_q, heads_kv;
  cpdispatch::AttentionMask mask;
  bool dedup;
  int stages;
  std::uint64_t seed;
};

inline void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

inline cpdispatch::AttentionShape shape_of(const OpCase& c) { return {c.heads_q, c.heads_kv, 4, 0.45f}; }

/// The case's random plan (random_plan).
inline cpdispatch::QkvDocumentsPlan plan_of(const OpCase& c) { return random_plan(c.world_size, c.seed, c.mask, c.dedup); }

/// f() must throw invalid_input whose message holds `words`.
template <class F>
void expect_error(F&& f, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming \"" << words << "\"";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

}  // namespace attention_test
