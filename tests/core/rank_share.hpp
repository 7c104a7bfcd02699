#pragma once
// Each rank's share (plan_qkv_for_rank) against the global plan: the
// global layout keeps the mask and covers every allowed pair once
// (verify_coverage); each rank's slices, attention row (mask and entries
// included) and dedup wire equal the global plan's.

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "../common/same_slice.hpp"

namespace cptest {

inline ::testing::AssertionResult same_attention(const cpdispatch::RankAttentionLayout& mine, const cpdispatch::AttentionLayout& a, std::size_t r) {
  if (mine.seqlens_q != a.seqlens_q[r] || mine.seqlens_kv != a.seqlens_kv[r] || mine.cu_seqlens_q != a.cu_seqlens_q[r] ||
      mine.cu_seqlens_kv != a.cu_seqlens_kv[r] || mine.max_seqlen_q != a.max_seqlen_q[r] || mine.max_seqlen_kv != a.max_seqlen_kv[r] ||
      mine.mask != a.mask) {
    return ::testing::AssertionFailure() << "attention layout differs";
  }
  if (mine.entries != (a.entries.empty() ? std::vector<std::vector<cpdispatch::AttentionEntry>>{} : a.entries[r])) {
    return ::testing::AssertionFailure() << "entries differ";
  }
  return ::testing::AssertionSuccess();
}

/// Rank r's share against the global plan's slices and dedup wire.
template <class Plan>
::testing::AssertionResult rank_matches(const Plan& plan, const cpdispatch::QkvMetadata& global, const cpdispatch::KvWireMetadata& wire,
                                        const cpdispatch::RankQkvMetadata& mine, std::int64_t r) {
  const std::string at = "rank " + std::to_string(r) + ": ";
  for (auto [got, want, name] : {std::tuple{&mine.q_fwd, &global.q_fwd, "q_fwd"}, std::tuple{&mine.q_rev, &global.q_rev, "q_rev"},
                                 std::tuple{&mine.kv_fwd, &global.kv_fwd, "kv_fwd"}, std::tuple{&mine.kv_rev, &global.kv_rev, "kv_rev"}}) {
    auto same = same_slice(*got, want->get_slice(r), at + name);
    if (!same) return same;
  }
  auto attn = same_attention(mine.attn, global.attn, static_cast<std::size_t>(r));
  if (!attn) return attn << " at " << at;
  if (mine.kv_wire.has_value() != plan.dedup) return ::testing::AssertionFailure() << at << "kv_wire present = " << mine.kv_wire.has_value();
  if (!plan.dedup) return ::testing::AssertionSuccess();
  const cpdispatch::RankKvWire want = wire.get_slice(r);
  for (auto [got, w, name] : {std::tuple{&mine.kv_wire->fwd, &want.fwd, "kv_wire_fwd"}, std::tuple{&mine.kv_wire->rev, &want.rev, "kv_wire_rev"}}) {
    auto same = same_slice(*got, *w, at + name);
    if (!same) return same;
  }
  if (!(mine.kv_wire->fan == want.fan)) return ::testing::AssertionFailure() << at << "fan list differs";
  return ::testing::AssertionSuccess();
}

/// The global plan is covered and keeps the mask; every rank's share equals it.
template <class Plan>
::testing::AssertionResult every_rank_matches(const Plan& plan) {
  const cpdispatch::QkvMetadata global = cpdispatch::plan_qkv(plan);
  if (global.attn.mask != plan.mask) return ::testing::AssertionFailure() << "the global layout lost the mask";
  try {
    cpdispatch::verify_coverage(plan, global);
  } catch (const cpdispatch::invalid_input& e) {
    return ::testing::AssertionFailure() << e.what();
  }
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(global);
  cpdispatch::RankQkvMetadata mine;
  cpdispatch::RankPlanWorkspace workspace;  // reused across ranks, as a job reuses it across steps
  for (std::int64_t r = 0; r < plan.world_size; ++r) {
    cpdispatch::plan_qkv_for_rank(plan, r, mine, workspace);
    auto same = rank_matches(plan, global, wire, mine, r);
    if (!same) return same;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace cptest
