#pragma once
// What the exchanges of a documents-form plan must do, checked on one rank
// from the plan itself (not from the metadata): every token carries its
// document and its position in the document, so after the forward
// exchanges each query shard at its attention rank must sit next to exactly
// its document's causal KV context, wherever that context's home is. Shared
// by the sim and MPI tests, which run it on every rank.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cptest {

/// Rank `rank`'s MLP layout as int32 pairs (document, position in the
/// document): its shards in (document, shard) order.
inline std::vector<std::int32_t> document_tokens(const cpdispatch::QkvDocumentsPlan& plan, std::int64_t rank) {
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < plan.documents.size(); ++i) {
    std::int64_t position = 0;
    for (const cpdispatch::DocumentShard& s : plan.documents[i].shards) {
      for (std::int64_t t = 0; s.rank == rank && t < s.len; ++t) {
        out.push_back(static_cast<std::int32_t>(i));
        out.push_back(static_cast<std::int32_t>(position + t));
      }
      position += s.len;
    }
  }
  return out;
}

/// Whether document `doc` has a shard starting at `start`, `len` tokens long,
/// whose queries attend on `rank`.
inline bool attends_on(const cpdispatch::QkvDocumentsPlan& plan, std::int32_t doc, std::int64_t start, std::int64_t len, int rank) {
  if (doc < 0 || static_cast<std::size_t>(doc) >= plan.documents.size()) return false;
  std::int64_t position = 0;
  for (const cpdispatch::DocumentShard& s : plan.documents[static_cast<std::size_t>(doc)].shards) {
    if (position == start && s.len == len && s.dst == rank) return true;
    position += s.len;
  }
  return false;
}

/// The KV gradient each of rank `rank`'s MLP tokens must get back when every
/// attention rank d sends gradient 1 + d for every KV token it holds: the
/// sum over the query shards k.. of its document of 1 + their destination.
inline std::vector<float> expected_kv_gradient(const cpdispatch::QkvDocumentsPlan& plan, std::int64_t rank) {
  std::vector<float> out;
  for (const cpdispatch::PackedDocument& doc : plan.documents) {
    for (std::size_t k = 0; k < doc.shards.size(); ++k) {
      float sum = 0;
      for (std::size_t q = k; q < doc.shards.size(); ++q) sum += static_cast<float>(1 + doc.shards[q].dst);
      for (std::int64_t t = 0; doc.shards[k].rank == rank && t < doc.shards[k].len; ++t) out.insert(out.end(), {sum, sum});
    }
  }
  return out;
}

/// Checks the attention layout at `rank` after the forward exchanges: query
/// group i is a shard of one document that attends here, and KV group i is
/// that document's tokens 0.. up to the end of the shard.
inline void expect_attention_layout(const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::RankAttentionLayout& attn, int rank,
                                    const std::vector<std::int32_t>& q, const std::vector<std::int32_t>& kv) {
  ASSERT_EQ(q.size(), 2 * static_cast<std::size_t>(attn.cu_seqlens_q.back())) << "rank " << rank;
  ASSERT_EQ(kv.size(), 2 * static_cast<std::size_t>(attn.cu_seqlens_kv.back())) << "rank " << rank;
  for (std::size_t i = 0; i < attn.seqlens_q.size(); ++i) {
    const auto q0 = static_cast<std::size_t>(attn.cu_seqlens_q[i]), kv0 = static_cast<std::size_t>(attn.cu_seqlens_kv[i]);
    const std::int64_t len = attn.seqlens_q[i], context = attn.seqlens_kv[i] - len;
    const std::int32_t doc = q[2 * q0];
    ASSERT_TRUE(attends_on(plan, doc, context, len, rank)) << "rank " << rank << " group " << i << ": document " << doc << " tokens "
                                                           << context << ".." << context + len << " do not attend here";
    for (std::int64_t t = 0; t < len; ++t) {
      const std::size_t at = 2 * (q0 + static_cast<std::size_t>(t));
      ASSERT_EQ(q[at], doc) << "rank " << rank << " query group " << i << " token " << t;
      ASSERT_EQ(q[at + 1], context + t) << "rank " << rank << " query group " << i << " token " << t;
    }
    for (std::int64_t t = 0; t < context + len; ++t) {
      const std::size_t at = 2 * (kv0 + static_cast<std::size_t>(t));
      ASSERT_EQ(kv[at], doc) << "rank " << rank << " KV group " << i << " token " << t;
      ASSERT_EQ(kv[at + 1], t) << "rank " << rank << " KV group " << i << " token " << t;
    }
  }
}

/// Forward Q and KV, reverse Q (the identity) and the KV combine on this
/// rank, with dispatchers built from `q_fwd`/`q_rev` and `kv_fwd`/`kv_rev`
/// (global Metadata or this rank's slices), each checked against the plan.
template <class Transport, class M>
void check_exchanges(Transport& t, const cpdispatch::QkvDocumentsPlan& plan, const M& q_fwd, const M& q_rev, const M& kv_fwd, const M& kv_rev,
                     const cpdispatch::RankAttentionLayout& attn) {
  const int rank = t.rank();
  const std::size_t token_bytes = 2 * sizeof(std::int32_t);
  const std::vector<std::int32_t> mlp = document_tokens(plan, rank);
  cpdispatch::Dispatcher q(t, q_fwd, q_rev, token_bytes), kv(t, kv_fwd, kv_rev, token_bytes);
  ASSERT_EQ(q.required_bytes().mlp_bytes, mlp.size() * sizeof(std::int32_t)) << "rank " << rank;
  std::vector<std::int32_t> q_attn(q.required_bytes().attention_bytes / sizeof(std::int32_t), -7);
  std::vector<std::int32_t> kv_attn(kv.required_bytes().attention_bytes / sizeof(std::int32_t), -7);
  q.forward(std::as_bytes(std::span(mlp)), std::as_writable_bytes(std::span(q_attn)));
  kv.forward(std::as_bytes(std::span(mlp)), std::as_writable_bytes(std::span(kv_attn)));
  expect_attention_layout(plan, attn, rank, q_attn, kv_attn);

  std::vector<std::int32_t> back(q.required_bytes().replica_bytes / sizeof(std::int32_t), -7);
  q.reverse(std::as_bytes(std::span(q_attn)), std::as_writable_bytes(std::span(back)));
  EXPECT_EQ(back, mlp) << "reverse Q is not the identity on rank " << rank;

  std::vector<float> grads(kv_attn.size(), static_cast<float>(1 + rank));
  std::vector<float> replica(kv.required_bytes().replica_bytes / sizeof(float)), grad(mlp.size(), -1.0f);
  kv.reverse_combine(std::as_bytes(std::span(grads)), std::as_writable_bytes(std::span(replica)), std::as_writable_bytes(std::span(grad)),
                     cpdispatch::ElementType::float32);
  EXPECT_EQ(grad, expected_kv_gradient(plan, rank)) << "KV combine on rank " << rank;
}

/// The exchanges with dispatchers built from the global metadata `m`.
template <class Transport>
void check_documents_exchange(Transport& t, const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::QkvMetadata& m) {
  const auto r = static_cast<std::size_t>(t.rank());
  const cpdispatch::RankAttentionLayout attn{m.attn.seqlens_q[r],    m.attn.seqlens_kv[r],   m.attn.cu_seqlens_q[r],
                                             m.attn.cu_seqlens_kv[r], m.attn.max_seqlen_q[r], m.attn.max_seqlen_kv[r], m.attn.mask};
  check_exchanges(t, plan, m.q_fwd, m.q_rev, m.kv_fwd, m.kv_rev, attn);
}

/// The exchanges with dispatchers built from this rank's own plan
/// (plan_qkv_for_rank): no global metadata anywhere.
template <class Transport>
void check_documents_exchange_per_rank(Transport& t, const cpdispatch::QkvDocumentsPlan& plan) {
  const cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, t.rank());
  check_exchanges(t, plan, mine.q_fwd, mine.q_rev, mine.kv_fwd, mine.kv_rev, mine.attn);
}

}  // namespace cptest
