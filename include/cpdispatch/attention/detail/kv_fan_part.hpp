#pragma once
// The key-value fan part of the attention op with dedup (docs/plan-format.md,
// section 2c): each key-value shard crosses the wire once per destination
// rank, into the place of its first copy in the attention layout. Per round
// (the stage its key-values arrive in) the fan-out then copies it to its
// other places, and backward the fan-in sums its copies' gradients at the
// first, whence the wire's reverse takes them home.
//
// The part owns the wire's plan, its reverse slice (the home combine's), the
// fan list and the per-round lists it registers with the op's data path;
// the op's key-value exchanges run the wire's plans in place of kv_fwd and
// kv_rev while it is active.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace cpdispatch::detail {

template <class Path>
class KvFanPart {
 public:
  /// Plans the wire of `share` when `dedup` (its kv_wire checked present by the caller); inactive otherwise.
  void plan(const RankQkvMetadata& share, bool dedup, std::size_t token_bytes, int me, int W) {
    active_ = dedup;
    token_bytes_ = token_bytes;
    if (!dedup) return;
    planner_.plan(share.kv_wire->fwd, share.kv_wire->rev, share.kv_wire->fan, token_bytes, me, W, plan_);
    rev_ = share.kv_wire->rev;
    fan_ = share.kv_wire->fan;
  }

  bool active() const noexcept { return active_; }
  /// The wire's forward: each shard once per destination, at its first copy.
  const ExchangePlan& forward() const noexcept { return plan_.forward; }
  /// The wire's reverse from each shard's first copy (after the fan-in).
  const ExchangePlan& reverse() const noexcept { return plan_.reverse_in_place; }
  std::int64_t replica_tokens() const noexcept { return plan_.replica_tokens; }
  /// The wire's reverse slice: which copies of each home shard come back (the home combine's).
  const RankMetadata& reverse_slice() const noexcept { return rev_; }
  /// Per round, the shards with several copies as in-place fan lists.
  std::span<const KvFanList> round_fans() const noexcept { return round_fans_; }

  /// Room for plans of up to `shards` fan entries and `copies` copies in each round seen so far.
  void reserve(std::size_t shards, std::size_t copies) {
    for (KvFanList& f : round_fans_) {
      for (auto* v : {&f.seq_len, &f.src_rank, &f.src_shard, &f.wire_offset}) v->reserve(shards);
      f.attn_offset.reserve(copies);
      f.copy_splits.reserve(shards + 1);
    }
    for (std::vector<CopyPiece>& list : round_copies_) list.reserve(copies);
  }

  /// Per round of `stages`, the fan list's shards with several copies: their
  /// fan-out and fan-in, registered with `path` (nothing while inactive).
  void lay_out(Path& path, const StagePlan& stages) {
    fan_out_ids_.clear();
    fan_in_ids_.clear();
    if (!active_) return;
    const auto rounds = static_cast<std::size_t>(stages.rounds());
    if (round_fans_.size() < rounds) round_fans_.resize(rounds);
    if (round_copies_.size() < rounds) round_copies_.resize(rounds);
    for (std::size_t r = 0; r < rounds; ++r) {
      clear_fan_list(round_fans_[r]);
      round_copies_[r].clear();
    }
    for (std::size_t e = 0; e < fan_.num_entries(); ++e) {
      if (fan_.copies(e).size() < 2) continue;
      const auto r = static_cast<std::size_t>(stages.round_of(fan_.src_rank[e]));
      append_fan_in_place(round_fans_[r], fan_, e);  // summed in place, at the first copy
      append_fan_out(round_copies_[r], fan_, e, token_bytes_);
    }
    for (std::size_t r = 0; r < rounds; ++r) {
      round_fans_[r].attention_tokens = fan_.attention_tokens;
      fan_out_ids_.push_back(path.add_copies(round_copies_[r]));
      fan_in_ids_.push_back(path.add_fan_in_place(round_fans_[r], token_bytes_));
    }
  }

  /// Round `round`'s fan-out in one attention-layout key or value buffer.
  void fan_out(Path& path, int round, std::byte* buffer) const { path.copy(fan_out_ids_[static_cast<std::size_t>(round)], buffer, buffer); }
  /// Round `round`'s fan-in in one attention-layout gradient buffer.
  void fan_in(Path& path, int round, ElementType type, std::byte* buffer) const {
    path.fan_in(fan_in_ids_[static_cast<std::size_t>(round)], type, buffer);
  }

 private:
  bool active_ = false;
  std::size_t token_bytes_ = 0;
  WirePlanner planner_;  // its storage, kept between plans
  WirePlan plan_;
  RankMetadata rev_;
  KvFanList fan_;
  std::vector<KvFanList> round_fans_;               // per round: shards with several copies
  std::vector<std::vector<CopyPiece>> round_copies_;  // ... and their fan-out
  std::vector<std::size_t> fan_out_ids_, fan_in_ids_;  // the path's lists, per round
};

}  // namespace cpdispatch::detail
