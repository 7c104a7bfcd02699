#pragma once
// Plans for the deduplicated KV exchange tests, and an independent model of
// section 2c's wire metadata computed from the documents themselves (not from
// kv_fwd, which is what plan_kv_wire reads).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace dedup_test {

using cpdispatch::Document;
using cpdispatch::KvFanList;
using cpdispatch::QkvPlan;
using cpdispatch::RankDocuments;
using cpdispatch::Rng;

/// A shard of a document as the model sees it: home rank, length, attention rank.
struct Shard {
  std::int64_t home, len, dst;
};
using Docs = std::vector<std::vector<Shard>>;

/// The per-rank plan as a document list: rank 0's documents, then rank 1's, ...
inline Docs docs_of(const QkvPlan& plan) {
  Docs docs;
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const Document& d : plan.ranks[r].docs) {
      std::vector<Shard> shards;
      for (std::size_t i = 0; i < d.shard_len.size(); ++i) shards.push_back({static_cast<std::int64_t>(r), d.shard_len[i], d.dst[i]});
      docs.push_back(shards);
    }
  }
  return docs;
}

/// Megatron-LM / TransformerEngine causal load balancing: each document is
/// cut into 2W chunks, chunk i attends on rank min(i, 2W-1-i). `doc_len`
/// tokens per document (rounded up to a multiple of 2W), documents round
/// robin over the home ranks.
inline QkvPlan zigzag_plan(std::int64_t W, std::int64_t docs_per_rank, std::int64_t doc_len) {
  QkvPlan plan;
  plan.world_size = W;
  plan.ranks.resize(static_cast<std::size_t>(W));
  const std::int64_t chunks = 2 * W, chunk_len = std::max<std::int64_t>(1, (doc_len + chunks - 1) / chunks);
  for (std::int64_t r = 0; r < W; ++r) {
    for (std::int64_t k = 0; k < docs_per_rank; ++k) {
      Document d;
      for (std::int64_t i = 0; i < chunks; ++i) {
        d.shard_len.push_back(chunk_len);
        d.dst.push_back(std::min(i, chunks - 1 - i));
      }
      plan.ranks[static_cast<std::size_t>(r)].docs.push_back(d);
    }
  }
  return plan;
}

/// A small random per-rank plan of W ranks; `repeat` makes repeated
/// destinations within a document likely.
inline QkvPlan random_plan(Rng& rng, std::int64_t W, bool repeat) {
  QkvPlan plan;
  plan.world_size = W;
  const std::int64_t most = rng.between(1, 5);
  plan.ranks.resize(static_cast<std::size_t>(W));
  for (auto& rank : plan.ranks) {
    const std::int64_t docs = rng.between(0, 4);
    for (std::int64_t k = 0; k < docs; ++k) {
      Document d;
      const std::int64_t n = rng.between(1, most);
      const std::int64_t spread = repeat ? std::min<std::int64_t>(W, 2) : W;
      const std::int64_t first = rng.between(0, W - 1);
      for (std::int64_t i = 0; i < n; ++i) {
        d.shard_len.push_back(rng.between(1, 9));
        d.dst.push_back((first + rng.between(0, spread - 1)) % W);
      }
      rank.docs.push_back(d);
    }
  }
  if (rng.below(4) == 0) plan.max_cp_degree = most + rng.between(0, 2);
  return plan;
}

/// The same with a random world size in [1, 6].
inline QkvPlan random_plan(Rng& rng, bool repeat) {
  const std::int64_t W = rng.between(1, 6);
  return random_plan(rng, W, repeat);
}

/// A documents-form plan as the model's document list.
inline Docs docs_of(const cpdispatch::QkvDocumentsPlan& plan) {
  Docs docs;
  for (const auto& d : plan.documents) {
    std::vector<Shard> shards;
    for (const auto& s : d.shards) shards.push_back({s.rank, s.len, s.dst});
    docs.push_back(shards);
  }
  return docs;
}

/// A random documents-form plan of W ranks: documents packed end to end over
/// the home ranks (a document may continue on the next ones), random
/// attention ranks; `repeat` makes repeated destinations within a document likely.
inline cpdispatch::QkvDocumentsPlan random_documents_plan(Rng& rng, std::int64_t W, bool repeat) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  const std::int64_t docs = rng.between(0, 8), most = rng.between(1, 5);
  std::int64_t home = 0;
  for (std::int64_t i = 0; i < docs; ++i) {
    cpdispatch::PackedDocument d;
    const std::int64_t n = rng.between(1, most);
    const std::int64_t spread = repeat ? std::min<std::int64_t>(W, 2) : W, first = rng.between(0, W - 1);
    for (std::int64_t k = 0; k < n; ++k) {
      if (rng.below(3) == 0) home = std::min(home + 1, W - 1);  // packed: the next shard may start the next rank
      d.shards.push_back({home, rng.between(1, 9), (first + rng.between(0, spread - 1)) % W});
    }
    plan.documents.push_back(d);
  }
  if (rng.below(4) == 0) plan.max_cp_degree = most + rng.between(0, 2);
  return plan;
}

/// One document of 2W chunks packed over all W ranks (chunks 2r and 2r+1 on
/// rank r), zig-zag balanced: chunk i attends on min(i, 2W-1-i).
inline cpdispatch::QkvDocumentsPlan zigzag_documents_plan(std::int64_t W, std::int64_t chunk_len) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  cpdispatch::PackedDocument d;
  for (std::int64_t i = 0; i < 2 * W; ++i) d.shards.push_back({i / 2, chunk_len, std::min(i, 2 * W - 1 - i)});
  plan.documents.push_back(d);
  return plan;
}

/// What the model predicts for section 2c, field by field.
struct Model {
  std::vector<std::vector<std::vector<std::int64_t>>> dispatch;     // [r][g][u]
  std::vector<std::vector<std::vector<std::int64_t>>> fwd_offset;   // [r][g][u]
  std::vector<std::vector<std::int64_t>> fwd_recv;                  // [d][s]
  std::vector<std::vector<std::int64_t>> rev_rank, rev_offset, rev_len;  // [d][m]
  std::vector<std::vector<std::int64_t>> rev_recv;                  // [r][d]
  std::vector<cpdispatch::KvFanList> fan;                           // [d]
};

/// Section 2c from the documents: homes, local indices, query arrival order,
/// KV groups and distinct destinations, each computed directly.
inline Model model_of(std::int64_t W_, std::size_t C, const Docs& docs) {
  const auto W = static_cast<std::size_t>(W_);
  // Local index, P_r(g), T_r, and each shard's context in its document.
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> local(W);  // [r][g] = (doc, shard)
  std::map<std::pair<std::size_t, std::size_t>, std::size_t> index_of;
  std::vector<std::vector<std::int64_t>> P(W);
  std::vector<std::int64_t> T(W, 0);
  for (std::size_t i = 0; i < docs.size(); ++i) {
    for (std::size_t k = 0; k < docs[i].size(); ++k) {
      const auto r = static_cast<std::size_t>(docs[i][k].home);
      index_of[{i, k}] = local[r].size();
      local[r].push_back({i, k});
      P[r].push_back(T[r]);
      T[r] += docs[i][k].len;
    }
  }
  auto ctx = [&](std::size_t i, std::size_t k) {
    std::int64_t c = 0;
    for (std::size_t x = 0; x < k; ++x) c += docs[i][x].len;
    return c;
  };
  // KV groups at each destination, query shards in (home, local index) order.
  std::map<std::pair<std::size_t, std::size_t>, std::int64_t> group_start;  // (doc, query shard)
  std::vector<std::int64_t> attention(W, 0);
  for (std::size_t r = 0; r < W; ++r) {
    for (auto [i, k] : local[r]) {
      const auto d = static_cast<std::size_t>(docs[i][k].dst);
      group_start[{i, k}] = attention[d];
      attention[d] += ctx(i, k) + docs[i][k].len;
    }
  }
  Model m;
  m.fwd_recv.assign(W, std::vector<std::int64_t>(W, 0));
  m.rev_recv.assign(W, std::vector<std::int64_t>(W, 0));
  m.rev_rank.resize(W);
  m.rev_offset.resize(W);
  m.rev_len.resize(W);
  m.fan.resize(W);
  m.dispatch.resize(W);
  m.fwd_offset.resize(W);
  std::vector<std::int64_t> wire_at(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    m.fan[d].copy_splits = {0};
    m.fan[d].attention_tokens = attention[d];
  }
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < local[r].size(); ++g) {
      const auto [i, k] = local[r][g];
      const std::int64_t len = docs[i][k].len;
      std::vector<std::int64_t> distinct;
      for (std::size_t q = k; q < docs[i].size(); ++q) {
        if (std::find(distinct.begin(), distinct.end(), docs[i][q].dst) == distinct.end()) distinct.push_back(docs[i][q].dst);
      }
      std::vector<std::int64_t> offsets;
      for (std::size_t u = 0; u < distinct.size(); ++u) {
        const auto d = static_cast<std::size_t>(distinct[u]);
        offsets.push_back(wire_at[d]);
        KvFanList& fan = m.fan[d];
        fan.wire_offset.push_back(wire_at[d]);
        fan.seq_len.push_back(len);
        fan.src_rank.push_back(static_cast<std::int64_t>(r));
        fan.src_shard.push_back(static_cast<std::int64_t>(g));
        for (std::size_t q = k; q < docs[i].size(); ++q) {
          if (docs[i][q].dst == distinct[u]) fan.attn_offset.push_back(group_start[{i, q}] + ctx(i, k));
        }
        fan.copy_splits.push_back(fan.attn_offset.size());
        wire_at[d] += len;
        fan.wire_tokens = wire_at[d];
        m.fwd_recv[d][r] += len;
        m.rev_recv[r][d] += len;
        m.rev_rank[d].push_back(static_cast<std::int64_t>(r));
        m.rev_len[d].push_back(len);
        m.rev_offset[d].push_back(static_cast<std::int64_t>(u) * T[r] + P[r][g]);
      }
      distinct.resize(C, -1);
      offsets.resize(C, 0);
      m.dispatch[r].push_back(distinct);
      m.fwd_offset[r].push_back(offsets);
    }
  }
  return m;
}
}  // namespace dedup_test
