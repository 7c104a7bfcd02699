#pragma once
// Which parts of the attention layout the op attends in which round. Round 0
// needs only this rank's own queries and key-values; round g + 1 needs what
// the peers of stage group g send (execute/staged_exchange.hpp). A part is an entry's
// query rows against a run of its KV group's rows that all become available
// in the same round; parts stay in the layout's buffers, so a part keeps its
// entry's band (a band is on buffer rows). A kernel folds the parts of a
// query row within one call, so a round is one pass; for a kernel that
// cannot (attention_kernel_folds_shared_rows), a round's parts are cut into
// passes that share no query row (query_row_passes): pass k holds the k-th
// part of each entry.
// Either way every part holding a key row is attended in one pass (its KV
// shard arrives in one round, KV groups do not overlap, and entries sharing
// key rows reach only a kernel that folds them: ContextParallelAttention
// refuses them for one that cannot), so a pass writes its key rows' dk, dv
// whole. A query shard's entries are cut where its KV group's shards meet.

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

/// Colours entries into passes of which none holds a query row twice, as
/// few as the most entries on one row (an interval colouring): `by_start`
/// lists entries (`entry(i)` gives entry i) by first row, and each goes to the
/// first pass whose last entry ended at or before its first row; pass[i]
/// becomes entry i's pass. `ends` is scratch.
template <class Entry>
void query_row_passes(std::span<const std::size_t> by_start, Entry entry, std::span<std::size_t> pass, std::vector<std::int64_t>& ends) {
  ends.clear();
  for (const std::size_t i : by_start) {
    const AttentionEntry& e = entry(i);
    std::size_t p = 0;
    while (p < ends.size() && ends[p] > e.q_start) ++p;
    if (p == ends.size()) ends.push_back(0);
    ends[p] = e.q_start + e.q_len;
    pass[i] = p;
  }
}

/// The round in which each document of a rank's head-parallel layout
/// (`cu`: leading 0, total last) is whole: the latest `round_of(home)` of
/// its shards, which hp_rev lists in layout order with each one's home.
template <class RoundOf>
void document_rounds(std::span<const std::int64_t> cu, const RankMetadata& hp_rev, RoundOf round_of, std::vector<int>& rounds) {
  rounds.assign(cu.empty() ? 0 : cu.size() - 1, 0);
  std::size_t d = 0;
  std::int64_t at = 0;
  for (std::size_t j = 0; j < hp_rev.seq_len.size(); at += hp_rev.seq_len[j++]) {
    while (d + 1 < rounds.size() && cu[d + 1] <= at) ++d;  // the document holding row `at`
    if (d < rounds.size()) rounds[d] = std::max(rounds[d], round_of(hp_rev.dst_rank[j]));
  }
}

struct StagePass {
  int round = 0;
  std::size_t begin = 0, end = 0;  // into StagePlan::parts
};

class StagePlan {
 public:
  /// `groups` stage groups (0: everything in round 0). q_rev and kv_rev are
  /// this rank's reverse slices: query shard g came from home
  /// q_rev.dst_rank[g], its KV group [cu_kv[g], cu_kv[g + 1]) is kv_rev's
  /// shards back to back, and its entries are entries[entry_begin[g],
  /// entry_begin[g + 1]) (in buffer rows, inside its rows and its group).
  /// `fold_shared_rows`: the kernel folds a call's entries that share rows
  /// (then each round is one pass).
  void build(std::span<const AttentionEntry> entries, std::span<const std::size_t> entry_begin,
             std::span<const std::int64_t> cu_q, std::span<const std::int64_t> cu_kv, const RankMetadata& q_rev,
             const RankMetadata& kv_rev, int me, int world_size, int groups, bool fold_shared_rows, const char* who) {
    me_ = me, world_size_ = world_size, groups_ = groups, fold_shared_rows_ = fold_shared_rows;
    const std::size_t shards = cu_q.empty() ? 0 : cu_q.size() - 1;
    if (q_rev.seq_len.size() != shards) fail(who, ": q_rev has ", q_rev.seq_len.size(), " entries, the attention layout ", shards, " query shards");
    scratch_.clear();
    kv_ready_.assign(static_cast<std::size_t>(groups), 0);
    std::size_t m = 0;  // the next kv_rev entry
    for (std::size_t g = 0; g < shards; ++g) {
      if (q_rev.seq_len[g] != cu_q[g + 1] - cu_q[g]) {
        fail(who, ": q_rev.seq_len[", g, "] = ", q_rev.seq_len[g], " but the layout's query shard holds ", cu_q[g + 1] - cu_q[g]);
      }
      group_pieces(g, cu_kv, kv_rev, round_of(q_rev.dst_rank[g]), m, who);
      for (std::size_t e = entry_begin[g]; e < entry_begin[g + 1]; ++e) split_entry(e, entries[e]);
    }
    if (m != kv_rev.seq_len.size()) fail(who, ": kv_rev has ", kv_rev.seq_len.size(), " entries, the KV groups hold ", m);
    cut_passes();
  }

  /// Room for `parts` parts, so that later plans within it allocate nothing.
  void reserve(std::size_t parts) {
    for (auto* v : {&order_, &pass_}) v->reserve(parts);
    ends_.reserve(parts);
    scratch_.reserve(parts);
    pieces_.reserve(parts);
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
  /// Rows [at, at + len) of the current KV group, arriving in `round`.
  struct Piece {
    std::int64_t at, len;
    int round;
  };

  /// The kv_rev shards of KV group g (from kv_rev entry m on, m advanced
  /// past them) with the round each is attended in: the later of its own
  /// arrival and its queries' (q_round).
  void group_pieces(std::size_t g, std::span<const std::int64_t> cu_kv, const RankMetadata& kv_rev, int q_round, std::size_t& m,
                    const char* who) {
    pieces_.clear();
    std::int64_t at = cu_kv[g];
    const std::int64_t end = cu_kv[g + 1];
    while (at < end) {
      if (m >= kv_rev.seq_len.size()) fail(who, ": kv_rev's entries end inside KV group ", g);
      const int kv_round = round_of(kv_rev.dst_rank[m]);
      const int round = std::max(q_round, kv_round);
      if (kv_round > 0) {
        int& ready = kv_ready_[static_cast<std::size_t>(kv_round - 1)];
        ready = std::max(ready, round);
      }
      pieces_.push_back({at, kv_rev.seq_len[m], round});
      at += kv_rev.seq_len[m++];
    }
    if (at != end) fail(who, ": kv_rev's entries cross the end of KV group ", g);
  }

  /// Entry e's keys cut where the group's pieces meet, one part per piece it
  /// reaches (the band stays: parts keep the buffers' rows).
  void split_entry(std::size_t e, const AttentionEntry& entry) {
    const std::int64_t begin = entry.kv_start, end = entry.kv_start + entry.kv_len;
    for (const Piece& p : pieces_) {
      const std::int64_t from = std::max(begin, p.at), to = std::min(end, p.at + p.len);
      if (from < to) add_part(e, entry, from, to - from, p.round);
    }
  }

  /// Appends rows [at, at + len) of entry e's keys, merged with the entry's previous part when it runs on in the same round.
  void add_part(std::size_t e, const AttentionEntry& entry, std::int64_t at, std::int64_t len, int round) {
    if (!scratch_.empty()) {
      Part& last = scratch_.back();
      if (last.entry == e && last.round == round && last.part.kv_start + last.part.kv_len == at) {
        last.part.kv_len += len;
        return;
      }
    }
    scratch_.push_back({round, e, AttentionEntry{entry.q_start, entry.q_len, at, len, entry.band}});
  }

  /// Orders the parts by (round, pass, entry) and cuts passes: one per round,
  /// or (kernels that cannot fold) a round's parts coloured by query rows.
  void cut_passes() {
    order_.resize(scratch_.size());
    pass_.assign(scratch_.size(), 0);
    for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    const auto by = [&](auto key) {  // std::stable_sort would allocate
      std::sort(order_.begin(), order_.end(), [&](std::size_t x, std::size_t y) {
        if (scratch_[x].round != scratch_[y].round) return scratch_[x].round < scratch_[y].round;
        return key(x) != key(y) ? key(x) < key(y) : x < y;
      });
    };
    if (!fold_shared_rows_) {
      by([&](std::size_t x) { return scratch_[x].part.q_start; });
      for (std::size_t i = 0, j = 0; i < order_.size(); i = j) {
        while (j < order_.size() && scratch_[order_[j]].round == scratch_[order_[i]].round) ++j;
        query_row_passes(std::span(order_).subspan(i, j - i), [&](std::size_t x) -> const AttentionEntry& { return scratch_[x].part; },
                         pass_, ends_);
      }
    }
    by([&](std::size_t x) { return pass_[x]; });
    parts_.clear();
    passes_.clear();
    for (std::size_t i = 0; i < order_.size(); ++i) {
      const std::size_t x = order_[i];
      const bool fresh = i == 0 || scratch_[order_[i - 1]].round != scratch_[x].round || pass_[order_[i - 1]] != pass_[x];
      if (fresh) passes_.push_back({scratch_[x].round, parts_.size(), parts_.size()});
      parts_.push_back(scratch_[x].part);
      passes_.back().end = parts_.size();
    }
  }

  int me_ = 0, world_size_ = 1, groups_ = 0;
  bool fold_shared_rows_ = true;
  std::vector<Part> scratch_;
  std::vector<Piece> pieces_;  // the current KV group's
  std::vector<std::size_t> order_, pass_;
  std::vector<std::int64_t> ends_;
  std::vector<AttentionEntry> parts_;
  std::vector<StagePass> passes_;
  std::vector<int> kv_ready_;
};

}  // namespace cpdispatch::detail
