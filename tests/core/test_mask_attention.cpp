// A planned layout means what it says, under every mask: random Q, K, V per
// document token move to the attention layout with the planned metadata
// (simulate), each attention entry is attended with the kernel's mask
// (mask.allows with diagonal lk - lq, bottom-right aligned), and outputs and
// gradients move back (q_rev; kv_rev and the copy combine; and the dedup
// wire with its fan-out and fan-in). The results must equal attention over
// each whole document (tests/common/reference_attention.hpp), forward and
// backward, for W = 1..8 and documents spanning ranks.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "../common/reference_attention.hpp"

namespace {

using cpdispatch::AttentionMask;
using I = std::int64_t;
using Buffers = std::vector<std::vector<double>>;

constexpr std::size_t D = 2;  // head_dim; a KV token is [k (D), v (D)]

/// Per document: q, k, v, dout [L][D] and their reference results.
struct DocumentData {
  I L = 0;
  std::vector<double> q, k, v, dout;
  cpdispatch::testing::ReferenceForward fwd;
  cpdispatch::testing::ReferenceGradients grad;
};

std::vector<DocumentData> document_data(const cpdispatch::QkvDocumentsPlan& plan, cpdispatch::Rng& rng) {
  const cpdispatch::testing::ReferenceShape shape{1, 1, static_cast<I>(D), 0.5};
  std::vector<DocumentData> docs;
  for (const auto& doc : plan.documents) {
    DocumentData d;
    for (const auto& s : doc.shards) d.L += s.len;
    for (auto* v : {&d.q, &d.k, &d.v, &d.dout}) {
      v->resize(static_cast<std::size_t>(d.L) * D);
      for (double& x : *v) x = static_cast<double>(rng.below(2001)) / 1000.0 - 1.0;
    }
    d.fwd = cpdispatch::testing::reference_attention_forward(d.q, d.k, d.v, d.L, shape, plan.mask);
    d.grad = cpdispatch::testing::reference_attention_backward(d.q, d.k, d.v, d.dout, d.L, shape, plan.mask);
    docs.push_back(std::move(d));
  }
  return docs;
}

/// Calls f(home rank, document, document position) for every token of the
/// MLP layout, rank by rank, in layout order (documents, then shards).
template <class F>
void each_home_token(const cpdispatch::QkvDocumentsPlan& plan, F&& f) {
  for (I r = 0; r < plan.world_size; ++r) {
    for (std::size_t i = 0; i < plan.documents.size(); ++i) {
      I at = 0;
      for (const auto& s : plan.documents[i].shards) {
        if (s.rank == r)
          for (I t = 0; t < s.len; ++t) f(static_cast<std::size_t>(r), i, at + t);
        at += s.len;
      }
    }
  }
}

/// One entry's attention, forward and backward, in double: queries
/// q[lq][D] against keys/values kv[lk][2D]; writes out, dq, and dkv.
void attend_entry(const AttentionMask& mask, const double* q, const double* kv, const double* dout, I lq, I lk, double* out, double* dq,
                  double* dkv) {
  const double scale = 0.5;
  const I diagonal = lk - lq;
  std::vector<double> p(static_cast<std::size_t>(lk));
  for (I j = 0; j < lq; ++j) {
    double m = -INFINITY, sum = 0;
    for (I t = 0; t < lk; ++t) {
      double s = 0;
      for (std::size_t d = 0; d < D; ++d) s += q[j * I{D} + static_cast<I>(d)] * kv[t * 2 * I{D} + static_cast<I>(d)];
      p[static_cast<std::size_t>(t)] = mask.allows(j, t, diagonal) ? s * scale : -INFINITY;
      m = std::max(m, p[static_cast<std::size_t>(t)]);
    }
    for (double& x : p) sum += x == -INFINITY ? 0.0 : std::exp(x - m);
    for (double& x : p) x = x == -INFINITY ? 0.0 : std::exp(x - m) / sum;
    // out = P V; dP = dout V^T; dS = P (dP - sum P dP); dq = scale dS K; dk = scale dS^T q; dv = P^T dout.
    double row = 0;
    std::vector<double> dp(static_cast<std::size_t>(lk), 0.0);
    for (I t = 0; t < lk; ++t) {
      const double* vt = kv + t * 2 * I{D} + I{D};
      for (std::size_t d = 0; d < D; ++d) {
        out[j * I{D} + static_cast<I>(d)] += p[static_cast<std::size_t>(t)] * vt[d];
        dp[static_cast<std::size_t>(t)] += dout[j * I{D} + static_cast<I>(d)] * vt[d];
      }
      row += p[static_cast<std::size_t>(t)] * dp[static_cast<std::size_t>(t)];
    }
    for (I t = 0; t < lk; ++t) {
      const double pt = p[static_cast<std::size_t>(t)], ds = pt * (dp[static_cast<std::size_t>(t)] - row) * scale;
      for (std::size_t d = 0; d < D; ++d) {
        dq[j * I{D} + static_cast<I>(d)] += ds * kv[t * 2 * I{D} + static_cast<I>(d)];
        dkv[t * 2 * I{D} + static_cast<I>(d)] += ds * q[j * I{D} + static_cast<I>(d)];
        dkv[t * 2 * I{D} + I{D} + static_cast<I>(d)] += pt * dout[j * I{D} + static_cast<I>(d)];
      }
    }
  }
}

/// Every rank's attention layout attended entry by entry: out, dq [Q][D], dkv [K][2D].
void attend_layout(const cpdispatch::AttentionLayout& attn, const Buffers& q, const Buffers& kv, const Buffers& dout, Buffers& out,
                   Buffers& dq, Buffers& dkv) {
  const std::size_t W = attn.seqlens_q.size();
  out.assign(W, {});
  dq.assign(W, {});
  dkv.assign(W, {});
  for (std::size_t d = 0; d < W; ++d) {
    out[d].assign(q[d].size(), 0.0);
    dq[d].assign(q[d].size(), 0.0);
    dkv[d].assign(kv[d].size(), 0.0);
    for (std::size_t i = 0; i < attn.seqlens_q[d].size(); ++i) {
      const auto qa = static_cast<std::size_t>(attn.cu_seqlens_q[d][i]) * D, ka = static_cast<std::size_t>(attn.cu_seqlens_kv[d][i]) * 2 * D;
      attend_entry(attn.mask, q[d].data() + qa, kv[d].data() + ka, dout[d].data() + qa, attn.seqlens_q[d][i], attn.seqlens_kv[d][i],
                   out[d].data() + qa, dq[d].data() + qa, dkv[d].data() + ka);
    }
  }
}

/// The home ranks' KV gradients: the reverse exchange into [C][T] replica
/// buffers, then the copy combine.
Buffers kv_gradients_home(const cpdispatch::Metadata& rev, const Buffers& from) {
  Buffers replica, grad(from.size());
  cpdispatch::simulate(rev, from, replica, 2 * D);
  for (std::size_t r = 0; r < from.size(); ++r) {
    const auto slice = rev.get_slice(static_cast<I>(r));
    std::size_t tokens = 0;
    for (I len : *slice.recv_seq_lens) tokens += static_cast<std::size_t>(len);
    grad[r].assign(tokens * 2 * D, 0.0);
    cpdispatch::combine_copies<double>(slice, replica[r], grad[r], 2 * D);
  }
  return grad;
}

::testing::AssertionResult near(double got, double want, const std::string& what) {
  if (std::abs(got - want) <= 1e-9 * (1 + std::abs(want))) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": got " << got << ", want " << want;
}

/// Forward and backward over the planned exchange equal whole-document attention.
::testing::AssertionResult check_plan(const cpdispatch::QkvDocumentsPlan& plan, std::uint64_t seed) {
  cpdispatch::Rng rng(seed);
  const std::vector<DocumentData> docs = document_data(plan, rng);
  const auto W = static_cast<std::size_t>(plan.world_size);
  Buffers q_home(W), kv_home(W), dout_home(W);
  each_home_token(plan, [&](std::size_t r, std::size_t i, I p) {
    const DocumentData& d = docs[i];
    for (std::size_t e = 0; e < D; ++e) {
      q_home[r].push_back(d.q[static_cast<std::size_t>(p) * D + e]);
      dout_home[r].push_back(d.dout[static_cast<std::size_t>(p) * D + e]);
    }
    for (std::size_t e = 0; e < D; ++e) kv_home[r].push_back(d.k[static_cast<std::size_t>(p) * D + e]);
    for (std::size_t e = 0; e < D; ++e) kv_home[r].push_back(d.v[static_cast<std::size_t>(p) * D + e]);
  });
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
  Buffers q_att, kv_att, dout_att, out_att, dq_att, dkv_att, out_home, dq_home;
  cpdispatch::simulate(meta.q_fwd, q_home, q_att, D);
  cpdispatch::simulate(meta.q_fwd, dout_home, dout_att, D);
  cpdispatch::simulate(meta.kv_fwd, kv_home, kv_att, 2 * D);
  attend_layout(meta.attn, q_att, kv_att, dout_att, out_att, dq_att, dkv_att);
  cpdispatch::simulate(meta.q_rev, out_att, out_home, D);
  cpdispatch::simulate(meta.q_rev, dq_att, dq_home, D);
  const Buffers dkv_home = kv_gradients_home(meta.kv_rev, dkv_att);

  // The deduplicated path: the wire, the fan-out into the same layout, the fan-in back.
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  Buffers wire_in, wire_grad(W);
  cpdispatch::simulate(wire.fwd, kv_home, wire_in, 2 * D);
  for (std::size_t d = 0; d < W; ++d) {
    const cpdispatch::KvFanList& fan = wire.fan[d];
    std::vector<double> fanned(kv_att[d].size(), 0.0);
    for (std::size_t e = 0; e < fan.num_entries(); ++e)
      for (std::size_t c = fan.copy_splits[e]; c < fan.copy_splits[e + 1]; ++c)
        for (std::size_t x = 0; x < static_cast<std::size_t>(fan.seq_len[e]) * 2 * D; ++x) {
          fanned[static_cast<std::size_t>(fan.attn_offset[c]) * 2 * D + x] = wire_in[d][static_cast<std::size_t>(fan.wire_offset[e]) * 2 * D + x];
        }
    if (fanned != kv_att[d]) return ::testing::AssertionFailure() << "the dedup fan-out differs from the plain layout at rank " << d;
    wire_grad[d].assign(static_cast<std::size_t>(fan.wire_tokens) * 2 * D, 0.0);
    cpdispatch::detail::fan_in<double>(fan, reinterpret_cast<const std::byte*>(dkv_att[d].data()), reinterpret_cast<std::byte*>(wire_grad[d].data()),
                                       2 * D);
  }
  const Buffers dkv_wire_home = kv_gradients_home(wire.rev, wire_grad);

  std::vector<std::size_t> at(W, 0);
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  each_home_token(plan, [&](std::size_t r, std::size_t i, I p) {
    const DocumentData& d = docs[i];
    const std::size_t t = at[r]++, pu = static_cast<std::size_t>(p);
    const std::string where = "rank " + std::to_string(r) + " document " + std::to_string(i) + " position " + std::to_string(p);
    for (std::size_t e = 0; e < D && result; ++e) {
      for (auto check : {near(out_home[r][t * D + e], d.fwd.out[pu * D + e], "out at " + where),
                         near(dq_home[r][t * D + e], d.grad.dq[pu * D + e], "dq at " + where),
                         near(dkv_home[r][t * 2 * D + e], d.grad.dk[pu * D + e], "dk at " + where),
                         near(dkv_home[r][t * 2 * D + D + e], d.grad.dv[pu * D + e], "dv at " + where),
                         near(dkv_wire_home[r][t * 2 * D + e], d.grad.dk[pu * D + e], "dk (dedup) at " + where),
                         near(dkv_wire_home[r][t * 2 * D + D + e], d.grad.dv[pu * D + e], "dv (dedup) at " + where)}) {
        if (!check) result = check;
      }
    }
  });
  return result;
}

AttentionMask mask_of(std::uint64_t n) {
  switch (n % 4) {
    case 0: return AttentionMask::causal();
    case 1: return AttentionMask::full();
    case 2: return AttentionMask::sliding_window(1 + static_cast<I>(n % 3));  // windows inside one shard
    default: return AttentionMask::sliding_window(2 + static_cast<I>(n * 5 % 13));  // windows across shards
  }
}

TEST(MaskAttention, PlannedLayoutsEqualWholeDocumentAttention) {
  for (I W = 1; W <= 8; ++W) {
    for (std::uint64_t n = 0; n < 8; ++n) {
      cpdispatch::RandomDocumentsOptions o;
      o.world_size = W;
      o.num_documents = 1 + static_cast<I>(n % 4);
      o.max_shards = 1 + static_cast<I>((n + static_cast<std::uint64_t>(W)) % 5);
      o.max_len = 1 + static_cast<I>(n % 6);
      cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, static_cast<std::uint64_t>(W) * 100 + n);
      plan.mask = mask_of(n + static_cast<std::uint64_t>(W));
      ASSERT_TRUE(check_plan(plan, n)) << "W " << W << " plan " << n << " mask " << to_string(plan.mask);
    }
  }
}

TEST(MaskAttention, ADocumentAcrossEveryRank) {
  // One long document packed over all W ranks, attended out of order.
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(3), AttentionMask::sliding_window(7)}) {
    cpdispatch::QkvDocumentsPlan plan;
    plan.world_size = 5;
    plan.mask = mask;
    plan.documents.resize(2);
    for (I k = 0; k < 6; ++k) plan.documents[0].shards.push_back({k % 5, 1 + k % 3, (3 * k + 1) % 5});
    plan.documents[1].shards = {{4, 3, 4}, {0, 2, 4}};
    ASSERT_TRUE(check_plan(plan, 7)) << to_string(mask);
  }
}

}  // namespace
