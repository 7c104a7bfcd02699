// Wire planning of the deduplicated KV exchange (spec section 2c): the worked
// example number for number, an independent model on random and zig-zag
// plans, the global-view round trip against the section 2 exchange, and the
// errors.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "../core/helpers.hpp"
#include "dedup_cases.hpp"

namespace {

using cpdispatch::KvWireMetadata;
using cpdispatch::Metadata;
using cpdispatch::make_tensor;
using cpdispatch::Tensor;
using I = std::int64_t;
using cptest::M2;
using cptest::M3;
using cptest::t1;
using cptest::t2;
using cptest::t3;

// kv_fwd of section 2b's worked example (documents spanning ranks), as the spec prints it.
Metadata spec_2b_kv_fwd() {
  Metadata m;
  m.world_size = 2;
  m.dst_rank = t3({{{1, 0, 1}, {0, -1, -1}, {-1, -1, -1}}, {{0, 1, -1}, {1, -1, -1}, {1, -1, -1}}});
  m.dst_offset = t3({{{0, 5, 3}, {0, 0, 0}, {0, 0, 0}}, {{8, 6, 0}, {8, 0, 0}, {12, 0, 0}}});
  m.seq_len = t2({{3, 5, 0}, {2, 4, 1}});
  m.num_recv_tokens = t2({{8, 2, 10}, {6, 7, 13}});
  m.num_seqs = t1({2, 3});
  m.num_total_recv_tokens = {10, 13};
  return m;
}

void expect_spec_2c(const KvWireMetadata& w) {
  EXPECT_EQ(w.fwd.dst_rank, t3({{{1, 0, -1}, {0, -1, -1}, {-1, -1, -1}}, {{0, 1, -1}, {1, -1, -1}, {1, -1, -1}}}));
  EXPECT_EQ(w.dispatch, w.fwd.dst_rank);
  EXPECT_EQ(w.fwd.dst_offset, t3({{{0, 0, 0}, {3, 0, 0}, {0, 0, 0}}, {{8, 3, 0}, {5, 0, 0}, {9, 0, 0}}}));
  EXPECT_EQ(w.fwd.num_recv_tokens, t2({{8, 2, 10}, {3, 7, 10}}));
  EXPECT_EQ(w.fwd.num_seqs, t1({2, 3}));
  EXPECT_EQ(w.rev.dst_rank, t2({{0, 0, 1, -1}, {0, 1, 1, 1}}));
  EXPECT_EQ(w.rev.dst_offset, t2({{8, 3, 0, 0}, {0, 7, 2, 6}}));
  EXPECT_EQ(w.rev.seq_len, t2({{3, 5, 2, 0}, {3, 2, 4, 1}}));
  EXPECT_EQ(w.rev.num_recv_tokens, t2({{8, 3, 11}, {2, 7, 9}}));
  EXPECT_EQ(w.rev.num_seqs, t1({3, 4}));
  ASSERT_TRUE(w.rev.seq_recv_mask.has_value());
  EXPECT_EQ(*w.rev.seq_recv_mask, t3({{{1, 1, 0}, {1, 0, 0}, {0, 0, 0}}, {{1, 1, 0}, {1, 0, 0}, {1, 0, 0}}}));
  // Fan-out: rank 1 gets doc0.0 (3 tokens) once and copies it into the KV
  // groups of doc0's query shards 0 and 2, at 0 and 3.
  ASSERT_EQ(w.fan.size(), 2u);
  EXPECT_EQ(w.fan[1].seq_len, (std::vector<I>{3, 2, 4, 1}));
  EXPECT_EQ(w.fan[1].wire_offset, (std::vector<I>{0, 3, 5, 9}));
  EXPECT_EQ(w.fan[1].copy_splits, (std::vector<std::size_t>{0, 2, 3, 4, 5}));
  EXPECT_EQ(w.fan[1].attn_offset, (std::vector<I>{0, 3, 6, 8, 12}));
  EXPECT_EQ(w.fan[1].wire_tokens, 10);
  EXPECT_EQ(w.fan[1].attention_tokens, 13);
  EXPECT_EQ(w.fan[0].attn_offset, (std::vector<I>{5, 0, 8}));
}

TEST(DedupPlan, Section2cWorkedExampleFromTheSpecsKvFwd) { expect_spec_2c(cpdispatch::plan_kv_wire(spec_2b_kv_fwd())); }

// The same through the planner: section 2b's documents plan.
TEST(DedupPlan, Section2cWorkedExampleFromTheDocumentsPlan) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.max_cp_degree = 3;
  plan.documents = {{{{0, 3, 1}, {1, 2, 0}, {1, 4, 1}}}, {{{0, 5, 0}}}, {{{1, 1, 1}}}};
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
  const Metadata spec = spec_2b_kv_fwd();
  EXPECT_EQ(meta.kv_fwd.dst_rank, spec.dst_rank);
  EXPECT_EQ(meta.kv_fwd.dst_offset, spec.dst_offset);
  expect_spec_2c(cpdispatch::plan_kv_wire(meta));
}

/// The model's prediction as tensors, compared field by field.
void expect_matches_model(const cpdispatch::QkvMetadata& meta, const KvWireMetadata& w, const dedup_test::Model& m) {
  const auto W = static_cast<std::size_t>(meta.kv_fwd.world_size);
  const std::size_t S = meta.kv_fwd.max_seqs(), C = meta.kv_fwd.num_copies();
  Tensor<I> dispatch({W, S, C}, -1), offset({W, S, C}, 0), fwd_recv({W, W + 1}, 0), rev_recv({W, W + 1}, 0), mask({W, S, C}, 0);
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < m.dispatch[r].size(); ++g) {
      for (std::size_t u = 0; u < C; ++u) {
        dispatch(r, g, u) = m.dispatch[r][g][u];
        offset(r, g, u) = m.fwd_offset[r][g][u];
        mask(r, g, u) = m.dispatch[r][g][u] >= 0;
      }
    }
    for (std::size_t s = 0; s < W; ++s) {
      fwd_recv(r, s) = m.fwd_recv[r][s];
      fwd_recv(r, W) += m.fwd_recv[r][s];
      rev_recv(r, s) = m.rev_recv[r][s];
      rev_recv(r, W) += m.rev_recv[r][s];
    }
  }
  EXPECT_EQ(w.dispatch, dispatch);
  EXPECT_EQ(w.fwd.dst_rank, dispatch);
  EXPECT_EQ(w.fwd.dst_offset, offset);
  EXPECT_EQ(w.fwd.seq_len, meta.kv_fwd.seq_len);
  EXPECT_EQ(w.fwd.num_recv_tokens, fwd_recv);
  EXPECT_EQ(w.rev.num_recv_tokens, rev_recv);
  EXPECT_EQ(*w.rev.seq_recv_mask, mask);
  EXPECT_EQ(*w.rev.recv_seq_lens, meta.kv_fwd.seq_len);
  for (std::size_t d = 0; d < W; ++d) {
    const std::size_t n = m.rev_rank[d].size();
    EXPECT_EQ(w.rev.num_seqs(d), static_cast<I>(n)) << "rank " << d;
    for (std::size_t e = 0; e < w.rev.max_seqs(); ++e) {
      EXPECT_EQ(w.rev.dst_rank(d, e), e < n ? m.rev_rank[d][e] : -1) << d << "," << e;
      EXPECT_EQ(w.rev.dst_offset(d, e), e < n ? m.rev_offset[d][e] : 0) << d << "," << e;
      EXPECT_EQ(w.rev.seq_len(d, e), e < n ? m.rev_len[d][e] : 0) << d << "," << e;
    }
    EXPECT_EQ(w.fan[d], m.fan[d]) << "fan list of rank " << d;
  }
  w.fwd.validate("kv_wire_fwd");
  w.rev.validate("kv_wire_rev");
}

void expect_round_trip(const cpdispatch::QkvMetadata& meta, const KvWireMetadata& w);

std::string describe(const cpdispatch::QkvPlan& plan) {
  std::string s = "W=" + std::to_string(plan.world_size) + ":";
  for (const auto& r : plan.ranks) {
    s += " [";
    for (const auto& d : r.docs) {
      s += "(";
      for (std::size_t i = 0; i < d.shard_len.size(); ++i) s += std::to_string(d.shard_len[i]) + "->" + std::to_string(d.dst[i]) + " ";
      s += ")";
    }
    s += "]";
  }
  return s;
}

TEST(DedupPlan, MatchesAnIndependentModelOnRandomPerRankPlans) {
  cpdispatch::Rng rng(2026);
  for (int i = 0; i < 1200; ++i) {
    const cpdispatch::QkvPlan plan = dedup_test::random_plan(rng, i % 2 == 0);
    SCOPED_TRACE(describe(plan));
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    const KvWireMetadata w = cpdispatch::plan_kv_wire(meta);
    expect_matches_model(meta, w, dedup_test::model_of(plan.world_size, meta.kv_fwd.num_copies(), dedup_test::docs_of(plan)));
    if (HasFailure()) return;
  }
}

std::string describe(const cpdispatch::QkvDocumentsPlan& plan) {
  std::string s = "W=" + std::to_string(plan.world_size) + ":";
  for (const auto& d : plan.documents) {
    s += " (";
    for (const auto& x : d.shards) s += std::to_string(x.len) + "@" + std::to_string(x.rank) + "->" + std::to_string(x.dst) + " ";
    s += ")";
  }
  return s;
}

TEST(DedupPlan, MatchesTheModelOnRandomCrossRankPlans) {
  cpdispatch::Rng rng(4711);
  for (int i = 0; i < 1200; ++i) {
    const cpdispatch::QkvDocumentsPlan plan = i % 50 == 0 ? dedup_test::zigzag_documents_plan(1 + i % 7, 1 + i % 3)
                                                          : dedup_test::random_documents_plan(rng, rng.between(1, 6), i % 2 == 0);
    SCOPED_TRACE(describe(plan));
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    const KvWireMetadata w = cpdispatch::plan_kv_wire(meta);
    expect_matches_model(meta, w, dedup_test::model_of(plan.world_size, meta.kv_fwd.num_copies(), dedup_test::docs_of(plan)));
    if (i % 4 == 0) expect_round_trip(meta, w);
    if (HasFailure()) return;
  }
}

TEST(DedupPlan, MatchesTheModelOnZigzagPlans) {
  for (I W : {1, 2, 3, 4, 8}) {
    const cpdispatch::QkvPlan plan = dedup_test::zigzag_plan(W, 2, 8 * W);
    SCOPED_TRACE("W = " + std::to_string(W));
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    const KvWireMetadata w = cpdispatch::plan_kv_wire(meta);
    expect_matches_model(meta, w, dedup_test::model_of(W, meta.kv_fwd.num_copies(), dedup_test::docs_of(plan)));
    // Every rank attends two chunks of each document: all but the last KV
    // chunk's destinations repeat, so the wire is strictly smaller.
    if (W > 1) {
      EXPECT_LT(cpdispatch::off_rank_tokens(w.fwd), cpdispatch::off_rank_tokens(meta.kv_fwd));
    }
  }
}

// Without repeated destinations the wire is kv_fwd itself and the fan-out is one copy per entry.
TEST(DedupPlan, DistinctDestinationsGiveTheSectionTwoExchange) {
  cpdispatch::QkvPlan plan;
  plan.world_size = 3;
  plan.ranks = {{{{{4, 2, 3}, {1, 0, 2}}}}, {{{{5}, {1}}}}, {{{{1, 6}, {2, 0}}}}};
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
  const KvWireMetadata w = cpdispatch::plan_kv_wire(meta);
  EXPECT_EQ(w.fwd.dst_rank, meta.kv_fwd.dst_rank);
  EXPECT_EQ(w.fwd.num_recv_tokens, meta.kv_fwd.num_recv_tokens);
  for (const auto& fan : w.fan) EXPECT_EQ(fan.attn_offset.size(), fan.num_entries());
}

/// Global view: wire simulate + fan-out == the section 2 forward, for every
/// rank's whole attention layout; fan-in + wire reverse + combine == the
/// section 2 reverse + combine (integers: exact).
void expect_round_trip(const cpdispatch::QkvMetadata& meta, const KvWireMetadata& w) {
  const auto W = static_cast<std::size_t>(meta.kv_fwd.world_size);
  const std::size_t te = 3;
  std::vector<std::vector<std::int32_t>> mlp(W), attn_ref, wire, replica_ref, replica;
  for (std::size_t r = 0; r < W; ++r) {
    mlp[r].resize(static_cast<std::size_t>(meta.kv_fwd.send_tokens(static_cast<I>(r))) * te);
    for (std::size_t i = 0; i < mlp[r].size(); ++i) mlp[r][i] = static_cast<std::int32_t>(1000 * r + i + 1);
  }
  cpdispatch::simulate(meta.kv_fwd, mlp, attn_ref, te);
  cpdispatch::simulate(w.fwd, mlp, wire, te);
  for (std::size_t d = 0; d < W; ++d) {
    std::vector<std::int32_t> attn(attn_ref[d].size(), -7);
    const auto& fan = w.fan[d];
    for (std::size_t e = 0; e < fan.num_entries(); ++e)
      for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i)
        std::memcpy(attn.data() + fan.attn_offset[i] * te, wire[d].data() + fan.wire_offset[e] * te, fan.seq_len[e] * te * 4);
    EXPECT_EQ(attn, attn_ref[d]) << "attention layout of rank " << d;
  }
  // Backward with integer gradients: the attention layout's values themselves.
  std::vector<std::vector<std::int32_t>> wire_grad(W);
  for (std::size_t d = 0; d < W; ++d) {
    const auto& fan = w.fan[d];
    wire_grad[d].assign(static_cast<std::size_t>(fan.wire_tokens) * te, 0);
    for (std::size_t e = 0; e < fan.num_entries(); ++e)
      for (std::size_t i = fan.copy_splits[e]; i < fan.copy_splits[e + 1]; ++i)
        for (std::size_t x = 0; x < fan.seq_len[e] * te; ++x) wire_grad[d][fan.wire_offset[e] * te + x] += attn_ref[d][fan.attn_offset[i] * te + x];
  }
  cpdispatch::simulate(meta.kv_rev, attn_ref, replica_ref, te);
  cpdispatch::simulate(w.rev, wire_grad, replica, te);
  for (std::size_t r = 0; r < W; ++r) {
    const std::size_t T = mlp[r].size();
    std::vector<std::int32_t> g_ref(T), g(T);
    cpdispatch::combine_copies<std::int32_t>(meta.kv_rev, static_cast<I>(r), replica_ref[r], g_ref, te);
    cpdispatch::combine_copies<std::int32_t>(w.rev, static_cast<I>(r), replica[r], g, te);
    EXPECT_EQ(g, g_ref) << "KV gradient of rank " << r;
  }
}

TEST(DedupPlan, GlobalRoundTripEqualsTheSectionTwoExchange) {
  cpdispatch::Rng rng(77);
  for (int i = 0; i < 300; ++i) {
    const cpdispatch::QkvPlan plan = i % 10 == 0 ? dedup_test::zigzag_plan(1 + i % 5, 1 + i % 3, 4 + i) : dedup_test::random_plan(rng, i % 2);
    SCOPED_TRACE(describe(plan));
    const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
    expect_round_trip(meta, cpdispatch::plan_kv_wire(meta));
    if (HasFailure()) return;
  }
}

std::string invalid_message(const Metadata& m) {
  try {
    (void)cpdispatch::plan_kv_wire(m);
  } catch (const cpdispatch::invalid_input& e) {
    return e.what();
  }
  return "no invalid_input";
}

TEST(DedupPlan, QueryMetadataIsRefused) {
  const auto q = cpdispatch::plan_query(t2({{2, 3}}), t2({{0, 0}}));
  EXPECT_NE(invalid_message(q.fwd).find("plan_kv_wire: kv_fwd.dst_rank has shape [1, 2]"), std::string::npos) << invalid_message(q.fwd);
}

TEST(DedupPlan, CopiesOutsideTheAttentionLayoutAreRefused) {
  Metadata m = spec_2b_kv_fwd();
  m.dst_offset(1, 2, 0) = 13;  // 1 token at 13 of rank 1's 13
  EXPECT_NE(invalid_message(m).find("kv_fwd.dst_offset[1][2][0] = 13 with seq_len 1 falls outside the 13 KV tokens rank 1 receives"),
            std::string::npos)
      << invalid_message(m);
  m = spec_2b_kv_fwd();
  m.dst_rank(0, 0, 2) = 2;
  EXPECT_NE(invalid_message(m).find("kv_fwd.dst_rank[0][0][2] = 2 is outside [0, 2)"), std::string::npos) << invalid_message(m);
  m = spec_2b_kv_fwd();
  m.seq_len(0, 1) = -5;
  EXPECT_NE(invalid_message(m).find("kv_fwd.seq_len[0][1] = -5 is negative"), std::string::npos) << invalid_message(m);
}

TEST(DedupPlan, OffRankTokensCountOnlyTrafficBetweenRanks) {
  EXPECT_EQ(cpdispatch::off_rank_tokens(spec_2b_kv_fwd()), 2 + 6);
  EXPECT_EQ(cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(spec_2b_kv_fwd()).fwd), 2 + 3);
}

}  // namespace
