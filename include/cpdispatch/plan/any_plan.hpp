#pragma once
// The plan kinds a JSON document may hold (docs/plan-format.md): a query
// plan, or a QKV plan in its per-rank or documents form, and the metadata
// planning any of them gives. Needs no JSON library; io/json.hpp reads
// and writes them.

#include <cstdint>
#include <variant>

#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

/// A query-level plan (docs/plan-format.md, section 1): shard lengths [W][S] and destinations
/// [W][S] or [W][S][C].
struct QueryPlan {
  std::int64_t world_size = 0;
  Tensor<std::int64_t> seq_len;
  Tensor<std::int64_t> dispatch;
};

/// Any plan a JSON document may hold: a query plan, or a QKV plan in its
/// per-rank (`ranks`) or documents (`documents`) form.
using Plan = std::variant<QueryPlan, QkvPlan, QkvDocumentsPlan>;

/// What planning a Plan gives: QueryMetadata for a query plan, QkvMetadata
/// for a QKV plan.
using PlanMetadata = std::variant<QueryMetadata, QkvMetadata>;

/// "query" or "qkv".
inline const char* plan_kind(const Plan& plan) noexcept { return plan.index() == 0 ? "query" : "qkv"; }

/// Plans any kind within `limits`; errors come from plan_query / plan_qkv.
inline PlanMetadata plan_metadata(const Plan& plan, const PlanLimits& limits = {}) {
  if (const auto* q = std::get_if<QueryPlan>(&plan)) return plan_query(q->seq_len, q->dispatch, limits);
  if (const auto* d = std::get_if<QkvDocumentsPlan>(&plan)) return plan_qkv(*d, limits);
  return plan_qkv(std::get<QkvPlan>(plan), limits);
}

/// What per-rank planning of a Plan gives: RankQueryMetadata for a query
/// plan, RankQkvMetadata for a QKV plan.
using RankPlanMetadata = std::variant<RankQueryMetadata, RankQkvMetadata>;

/// Plans rank `rank`'s share of any kind (plan_query_for_rank / plan_qkv_for_rank).
inline RankPlanMetadata plan_metadata_for_rank(const Plan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  if (const auto* q = std::get_if<QueryPlan>(&plan)) return plan_query_for_rank(q->seq_len, q->dispatch, rank, limits);
  if (const auto* d = std::get_if<QkvDocumentsPlan>(&plan)) return plan_qkv_for_rank(*d, rank, limits);
  return plan_qkv_for_rank(std::get<QkvPlan>(plan), rank, limits);
}

}  // namespace cpdispatch
