#pragma once
// Which parts of the attention layout the op attends in which round. Round 0
// needs only this rank's own queries and key-values; round g + 1 needs what
// the peers of stage group g send (execute/staged_exchange.hpp). A part is an entry's
// query rows against a run of its KV group's rows that all become available
// in the same round; its `diagonal` is shifted so the mask stays the
// document's. One kernel call may not see a query row twice, so a round's
// parts are cut into passes: pass k holds the k-th part of each entry.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/attention/kernel.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch::detail {

struct StagePass {
  int round = 0;
  std::size_t begin = 0, end = 0;  // into StagePlan::parts
};

class StagePlan {
 public:
  /// `groups` stage groups (0: everything in round 0). q_rev and kv_rev are
  /// this rank's reverse slices: entry m came from home dst_rank[m] and the
  /// entries lie back to back in the attention layout.
  void build(std::span<const AttentionEntry> entries, const RankMetadata& q_rev, const RankMetadata& kv_rev, int me, int world_size,
             int groups, const char* who) {
    me_ = me, world_size_ = world_size, groups_ = groups;
    if (q_rev.seq_len.size() != entries.size()) fail(who, ": q_rev has ", q_rev.seq_len.size(), " entries, the attention layout ", entries.size());
    scratch_.clear();
    kv_ready_.assign(static_cast<std::size_t>(groups), 0);
    std::size_t m = 0;
    std::int64_t at = 0;  // start of kv_rev entry m in the attention layout
    for (std::size_t e = 0; e < entries.size(); ++e) {
      const AttentionEntry& entry = entries[e];
      if (q_rev.seq_len[e] != entry.q_len) fail(who, ": q_rev.seq_len[", e, "] = ", q_rev.seq_len[e], " but the layout's entry holds ", entry.q_len);
      const int q_round = round_of(q_rev.dst_rank[e]);
      const std::int64_t end = entry.kv_start + entry.kv_len;
      if (at != entry.kv_start) fail(who, ": KV group ", e, " starts at ", entry.kv_start, " but kv_rev's entries reach ", at);
      while (at < end) {
        if (m >= kv_rev.seq_len.size()) fail(who, ": kv_rev's entries end inside KV group ", e);
        const int kv_round = round_of(kv_rev.dst_rank[m]);
        const int round = std::max(q_round, kv_round);
        if (kv_round > 0) {
          int& ready = kv_ready_[static_cast<std::size_t>(kv_round - 1)];
          ready = std::max(ready, round);
        }
        add_part(e, entry, at, kv_rev.seq_len[m], round);
        at += kv_rev.seq_len[m++];
      }
      if (at != end) fail(who, ": kv_rev's entries cross the end of KV group ", e);
    }
    if (m != kv_rev.seq_len.size()) fail(who, ": kv_rev has ", kv_rev.seq_len.size(), " entries, the KV groups hold ", m);
    cut_passes();
  }

  /// Room for `parts` parts, so that later plans within it allocate nothing.
  void reserve(std::size_t parts) {
    for (auto* v : {&rank_in_round_, &order_}) v->reserve(parts);
    scratch_.reserve(parts);
    parts_.reserve(parts);
    passes_.reserve(parts);
  }

  std::span<const AttentionEntry> parts() const noexcept { return parts_; }
  std::span<const StagePass> passes() const noexcept { return passes_; }
  int rounds() const noexcept { return groups_ + 1; }
  /// The round after which the KV gradients that go home in group g are complete.
  int kv_ready(int group) const noexcept { return kv_ready_[static_cast<std::size_t>(group)]; }

  /// The round in which what home rank `home` sends this rank arrives.
  int round_of(std::int64_t home) const {
    if (groups_ == 0 || home == me_) return 0;
    return 1 + stage_group(static_cast<int>(home), me_, world_size_, groups_);
  }

 private:
  struct Part {
    int round;
    std::size_t entry;
    AttentionEntry part;
  };

  /// Appends rows [at, at + len) of entry e's KV group, merged with the entry's previous part when it runs on in the same round.
  void add_part(std::size_t e, const AttentionEntry& entry, std::int64_t at, std::int64_t len, int round) {
    if (!scratch_.empty()) {
      Part& last = scratch_.back();
      if (last.entry == e && last.round == round && last.part.kv_start + last.part.kv_len == at) {
        last.part.kv_len += len;
        return;
      }
    }
    const std::int64_t diagonal = entry.diagonal - (at - entry.kv_start);
    scratch_.push_back({round, e, AttentionEntry{entry.q_start, entry.q_len, at, len, diagonal}});
  }

  /// Orders the parts by (round, k-th part of its entry in that round, entry) and cuts passes.
  void cut_passes() {
    rank_in_round_.assign(scratch_.size(), 0);
    for (std::size_t i = 1; i < scratch_.size(); ++i) {
      const Part& b = scratch_[i];
      std::size_t k = 0;
      for (std::size_t j = i; j-- > 0 && scratch_[j].entry == b.entry;) k += scratch_[j].round == b.round;
      rank_in_round_[i] = k;
    }
    order_.resize(scratch_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(), [&](std::size_t x, std::size_t y) {  // std::stable_sort would allocate
      if (scratch_[x].round != scratch_[y].round) return scratch_[x].round < scratch_[y].round;
      if (rank_in_round_[x] != rank_in_round_[y]) return rank_in_round_[x] < rank_in_round_[y];
      return x < y;
    });
    parts_.clear();
    passes_.clear();
    for (std::size_t i = 0; i < order_.size(); ++i) {
      const std::size_t x = order_[i];
      const bool fresh = i == 0 || scratch_[order_[i - 1]].round != scratch_[x].round || rank_in_round_[order_[i - 1]] != rank_in_round_[x];
      if (fresh) passes_.push_back({scratch_[x].round, parts_.size(), parts_.size()});
      parts_.push_back(scratch_[x].part);
      passes_.back().end = parts_.size();
    }
  }

  int me_ = 0, world_size_ = 1, groups_ = 0;
  std::vector<Part> scratch_;
  std::vector<std::size_t> rank_in_round_, order_;
  std::vector<AttentionEntry> parts_;
  std::vector<StagePass> passes_;
  std::vector<int> kv_ready_;
};

}  // namespace cpdispatch::detail
