#pragma once
// The invariant mode's part of the attention op (docs/invariant-attention.md):
// what the op needs beyond its default path so that out, lse, dq, dk and dv
// are the same bits for every world size, plan and stage count.
//
// - The grid: every rank learns where each rank's MLP tokens start in the
//   packed sequence (one small all-gather a plan), gives each kernel entry
//   its UnitPhase, and refuses shards cut off the grid (every rank then
//   throws: the verdicts are gathered too).
// - The key-value gradients' way home as exact sums (8-byte integers a
//   value, the same shards and fan-in as the default path's), summed over
//   copies as integers and rounded once at home, at one scale for the batch
//   from bounds the ranks agree on each backward (one small all-gather).
//
// The op owns one; its exchanges ride the op's (execute/staged_exchange.hpp).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cpdispatch/attention/detail/share_entries.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/plan_agreement.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cpdispatch::detail {

/// Every rank's `n` values of X (this rank's at rank * n): one all_to_all_v
/// (through device memory on a device transport, as the plan agreement's).
template <class X, class T>
void all_gather_values(T& transport, std::span<const X> mine, std::vector<X>& all) {
  static_assert(std::is_trivially_copyable_v<X>);
  const auto W = static_cast<std::size_t>(transport.world_size()), me = static_cast<std::size_t>(transport.rank());
  const std::size_t bytes = mine.size() * sizeof(X);
  all.resize(W * mine.size());
  if (W > 1) {
    std::vector<std::size_t> send_counts(W, bytes), send_displs(W, 0), recv_counts(W, bytes), recv_displs(W, 0);
    send_counts[me] = recv_counts[me] = 0;
    for (std::size_t p = 0; p < W; ++p) recv_displs[p] = p * bytes;
    AgreementExchange<T::memory_space>::run(transport, reinterpret_cast<const std::byte*>(mine.data()), send_counts, send_displs,
                                            reinterpret_cast<std::byte*>(all.data()), recv_counts, recv_displs);
  }
  // After: a device transport copies back the whole range, this rank's slot included.
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(me * mine.size()));
}

template <class Path>
class InvariantPart {
 public:
  template <class U>
  using owned = typename Path::template buffer<U>;
  using Exchange = StagedExchange<Path>;

  /// Plans the exact gradients' way home: the key-values' reverse (or, with
  /// dedup, the wire's from each shard's first copy) at 8 bytes a value.
  void plan(const RankQkvMetadata& share, std::size_t token_values, bool dedup, int me, int W, const char* who) {
    token_bytes_ = token_values * sizeof(std::int64_t);
    dedup_ = dedup;
    kv_planner_.plan(share.kv_fwd, share.kv_rev, token_bytes_, me, W, who, kv_plan_);
    if (dedup) wire_planner_.plan(share.kv_wire->fwd, share.kv_wire->rev, share.kv_wire->fan, token_bytes_, me, W, wire_plan_);
  }

  std::size_t token_bytes() const noexcept { return token_bytes_; }
  const ExchangePlan* reverse() const noexcept { return dedup_ ? &wire_plan_.reverse_in_place : &kv_plan_.reverse; }

  void size(std::size_t kv_values, std::size_t mlp_values) {
    const std::int64_t replica = dedup_ ? std::max(kv_plan_.reverse.output_tokens, wire_plan_.replica_tokens) : kv_plan_.reverse.output_tokens;
    const auto replica_values = static_cast<std::size_t>(replica) * (token_bytes_ / sizeof(std::int64_t));
    for (owned<std::int64_t>* b : {&dk_, &dv_}) b->resize(kv_values);
    for (owned<std::int64_t>* b : {&replica_k_, &replica_v_}) b->resize(replica_values);
    for (owned<std::int64_t>* b : {&home_k_, &home_v_}) b->resize(mlp_values);
  }

  /// The fan-in lists (per round, with dedup), the home sum over copies and the exchange home.
  void lay_out(Path& path, std::span<const KvFanList> round_fans, std::size_t rounds, const RankMetadata& combine_rev, int me, int W) {
    fan_in_ids_.clear();
    if (dedup_) {
      for (std::size_t r = 0; r < rounds; ++r) fan_in_ids_.push_back(path.add_fan_in_place(round_fans[r], token_bytes_));
    }
    combine_id_ = path.add_combine(combine_rev, token_bytes_);
    home_.lay_out(path, exact_home(), me, W, 0, false);
  }

  /// The exact key-value gradients' way home (home()'s tensors).
  std::array<StagedTensor, 2> exact_home() {
    const auto bytes = [](owned<std::int64_t>& b) { return reinterpret_cast<std::byte*>(b.data()); };
    return {{{reverse(), bytes(dk_), bytes(replica_k_)}, {reverse(), bytes(dv_), bytes(replica_v_)}}};
  }

  /// Gives each entry its phase (entries_of_shard: where query shard g's
  /// entries start in `entries`, one past the last at the end) from every
  /// rank's MLP token count, and checks the cuts this rank's share shows:
  /// a key-value shard that does not start its KV group, and (causal and
  /// window masks without slices) a query shard whose KV group starts before
  /// it, i.e. one that starts inside its document, must start on the grid.
  /// A collective: every rank throws when some rank's check fails.
  template <class T>
  void lay_out_grid(T& transport, std::int64_t grid, std::int64_t mlp_tokens, const RankAttentionLayout& layout,
                    std::span<const AttentionEntry> entries, std::span<const std::size_t> entries_of_shard, const RankMetadata& q_rev,
                    const RankMetadata& kv_rev, const char* who) {
    grid_ = grid;
    const std::int64_t mine[] = {mlp_tokens};
    all_gather_values<std::int64_t>(transport, mine, counts_);
    starts_.assign(1, 0);
    for (std::int64_t c : counts_) starts_.push_back(starts_.back() + c);
    agree_on(
        transport, [&] { unit_phases(grid, starts_, layout, entries, entries_of_shard, q_rev, kv_rev, who, phases_, kv_at_); },
        [&](std::size_t r) { fail(who, ": options.invariant: rank ", r, "'s share has a cut off the grid of ", grid, " tokens (its error names it)"); });
  }

  /// Runs f on every rank and agrees on the outcome (a collective): where f
  /// threw invalid_input on some rank, that rank rethrows its error and
  /// every other one calls refused(r) (which throws) for the first such rank
  /// r, so no rank goes on to wait in an exchange a refusing rank will not join.
  template <class T, class F, class Refused>
  void agree_on(T& transport, F&& f, Refused&& refused) {
    std::string refusal;
    try {
      f();
    } catch (const invalid_input& e) {
      refusal = e.what();
    }
    const std::int64_t verdict[] = {refusal.empty() ? 0 : 1};
    all_gather_values<std::int64_t>(transport, verdict, verdicts_);
    if (!refusal.empty()) throw invalid_input(refusal);
    for (std::size_t r = 0; r < verdicts_.size(); ++r) {
      if (verdicts_[r] != 0) refused(r);
    }
  }

  InvariantGrid grid() const noexcept { return {grid_, phases_}; }
  InvariantGrid head_parallel_grid() const noexcept { return {grid_, hp_phases_}; }

  /// The phases of the head-parallel part's entries (whole documents, in
  /// layout rows): each document's packed start, read from hp_rev (entry m
  /// returns to c * T + P on its home, c this rank's group rank), after
  /// lay_out_grid has learnt every rank's token count.
  void lay_out_head_parallel(const RankHeadParallelLayout& hp, std::span<const AttentionEntry> entries, const RankMetadata& hp_rev) {
    hp_phases_.clear();
    if (hp.degree == 0) return;
    const std::size_t step = hp_rev.has_copies ? hp_rev.num_copies : 1;
    std::vector<std::int64_t>& doc_start = hp_doc_start_;  // the packed start of each document
    doc_start.clear();
    std::int64_t at = 0;
    std::size_t m = 0;
    for (std::size_t d = 0; d + 1 < hp.cu_seqlens.size(); ++d) {
      for (; m < hp_rev.seq_len.size() && at < hp.cu_seqlens[d]; ++m) at += hp_rev.seq_len[m];
      if (m >= hp_rev.seq_len.size()) fail("head-parallel layout: hp_rev's entries end before document ", d);
      const auto home = static_cast<std::size_t>(hp_rev.dst_rank[m * step]);
      doc_start.push_back(starts_[home] + hp_rev.dst_offset[m * step] - hp.group_rank * counts_[home]);
    }
    for (const AttentionEntry& e : entries) {
      const auto d = static_cast<std::size_t>(std::upper_bound(hp.cu_seqlens.begin() + 1, hp.cu_seqlens.end(), e.q_start) - hp.cu_seqlens.begin() - 1);
      const std::int64_t first = d < doc_start.size() ? doc_start[d] - hp.cu_seqlens[d] : 0;
      hp_phases_.push_back({(first + e.q_start) % grid_, (first + e.kv_start) % grid_});
    }
  }

  /// The batch's bounds, the same on every rank: the largest of every
  /// rank's maxima and the sum of their tokens (a collective).
  template <class T>
  InvariantBounds agree_bounds(T& transport, double max_q, double max_v, double max_dout, std::int64_t tokens) {
    const double mine[] = {max_q, max_v, max_dout, static_cast<double>(tokens)};
    all_gather_values<double>(transport, mine, bounds_);
    InvariantBounds b;
    double queries = 0;
    for (std::size_t r = 0; r < bounds_.size() / 4; ++r) {
      const double* x = bounds_.data() + 4 * r;
      for (auto [field, value] : {std::pair{&b.max_abs_q, x[0]}, std::pair{&b.max_abs_v, x[1]}, std::pair{&b.max_abs_dout, x[2]}}) {
        *field = attention::max_keeping_nan(*field, value);  // kv_gradient_exponents names a NaN
      }
      queries += x[3];
    }
    b.queries = static_cast<std::int64_t>(queries);
    return b;
  }

  Exchange& home() noexcept { return home_; }
  std::span<const std::size_t> fan_in_ids() const noexcept { return fan_in_ids_; }
  std::size_t combine_id() const noexcept { return combine_id_; }
  owned<std::int64_t>& dk() noexcept { return dk_; }
  owned<std::int64_t>& dv() noexcept { return dv_; }
  owned<std::int64_t>& replica_k() noexcept { return replica_k_; }
  owned<std::int64_t>& replica_v() noexcept { return replica_v_; }
  owned<std::int64_t>& home_k() noexcept { return home_k_; }
  owned<std::int64_t>& home_v() noexcept { return home_v_; }

 private:
  std::size_t token_bytes_ = 0;
  bool dedup_ = false;
  std::int64_t grid_ = 64;
  DispatchPlanner kv_planner_;
  DispatchPlan kv_plan_;
  WirePlanner wire_planner_;
  WirePlan wire_plan_;
  Exchange home_;
  std::vector<std::size_t> fan_in_ids_;
  std::size_t combine_id_ = 0;
  std::vector<std::int64_t> counts_, starts_, verdicts_, kv_at_;
  std::vector<double> bounds_;
  std::vector<UnitPhase> phases_, hp_phases_;
  std::vector<std::int64_t> hp_doc_start_;
  owned<std::int64_t> dk_, dv_, replica_k_, replica_v_, home_k_, home_v_;
};

}  // namespace cpdispatch::detail
