#pragma once
// The piece lists of one tensor's two exchanges (MLP layout -> attention
// layout, and back into the MLP layout or the [C][T] replica buffer), from
// this rank's forward and reverse slices, written into storage kept between
// plans: once a plan fits what an earlier one needed, planning allocates
// nothing. The wire order is the Dispatcher's (execute/dispatcher.hpp):
// between two ranks, pieces travel in ascending order of their position in
// the attention layout, both ways, so sender and receiver agree unasked.

#include <algorithm>  // std::sort, not std::stable_sort: the latter allocates
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/detail/dispatch_plan.hpp"
#include "cpdispatch/plan/metadata.hpp"

namespace cpdispatch::detail {

class ExchangeLayout {
 public:
  /// Fills `plan` for rank `me` of `world_size`; `who` prefixes errors.
  void build(const RankMetadata& fwd, const RankMetadata& rev, std::size_t token_bytes, int me, int world_size, DispatchPlan& plan,
             const char* who) {
    tb_ = token_bytes, me_ = me, W_ = static_cast<std::size_t>(world_size);
    positions(fwd, rev, who);
    const std::size_t C = fwd.num_copies;
    for (Side* s : {&plan.forward.send, &plan.forward.recv, &plan.reverse.send, &plan.reverse.recv}) s->pieces.clear();
    plan.forward.self.clear();
    plan.reverse.self.clear();
    items_.clear();  // forward send, reverse receive: this rank's shard copies
    for (std::size_t j = 0; j < fwd.seq_len.size(); ++j) {
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = fwd.dst_rank[j * C + k], at = fwd.dst_offset[j * C + k];
        if (d < 0) continue;
        if (d >= world_size || at < 0) fail(who, ": fwd.dst_rank/dst_offset[", j, "][", k, "] = ", d, "/", at, " is out of range");
        const std::int64_t replica = (fwd.has_copies ? static_cast<std::int64_t>(k) * T_ : 0) + P_[j];
        if (d == me) {
          if (at + fwd.seq_len[j] > A_) fail(who, ": fwd.dst_offset[", j, "][", k, "] = ", at, " runs past this rank's ", A_, " attention tokens");
          add_self(plan.forward.self, P_[j], at, fwd.seq_len[j]);
          add_self(plan.reverse.self, at, replica, fwd.seq_len[j]);
          continue;
        }
        items_.push_back({static_cast<std::size_t>(d), at, P_[j], replica, fwd.seq_len[j]});
      }
    }
    std::sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) { return a.peer != b.peer ? a.peer < b.peer : a.key < b.key; });
    lay_out(plan.forward.send, [](const Item& i) { return i.a; });
    lay_out(plan.reverse.recv, [](const Item& i) { return i.b; });
    items_.clear();  // forward receive, reverse send: the entries of this rank's attention layout, already in order
    for (std::size_t m = 0; m < rev.seq_len.size(); ++m) {
      const std::int64_t h = rev.dst_rank[m];
      if (h < 0 || h >= world_size) fail(who, ": rev.dst_rank[", m, "] = ", h, " is outside [0, ", world_size, ")");
      if (h != me) items_.push_back({static_cast<std::size_t>(h), Q_[m], Q_[m], Q_[m], rev.seq_len[m]});
    }
    std::sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) { return a.peer != b.peer ? a.peer < b.peer : a.key < b.key; });
    lay_out(plan.forward.recv, [](const Item& i) { return i.a; });
    lay_out(plan.reverse.send, [](const Item& i) { return i.a; });
    plan.forward.input_tokens = plan.reverse.output_tokens = T_;
    plan.forward.output_tokens = plan.reverse.input_tokens = A_;
    plan.reverse.output_tokens = fwd.has_copies ? static_cast<std::int64_t>(C) * T_ : T_;
  }

  /// Room for plans of up to `pieces` shard copies or entries each way, so that they allocate nothing.
  void reserve(DispatchPlan& plan, std::size_t pieces, int world_size) {
    const auto W = static_cast<std::size_t>(world_size);
    for (Side* s : {&plan.forward.send, &plan.forward.recv, &plan.reverse.send, &plan.reverse.recv}) {
      s->pieces.reserve(pieces);
      s->counts.reserve(W);
      s->splits.reserve(W + 1);
    }
    plan.forward.self.reserve(pieces);
    plan.reverse.self.reserve(pieces);
    P_.reserve(pieces);
    Q_.reserve(pieces);
    items_.reserve(pieces);
  }

  std::int64_t mlp_tokens() const noexcept { return T_; }
  std::int64_t attention_tokens() const noexcept { return A_; }

 private:
  struct Item {
    std::size_t peer;
    std::int64_t key;  // position in the attention layout: the wire order
    std::int64_t a, b;  // where the piece is on either side of this rank's two exchanges
    std::int64_t len;
  };

  void positions(const RankMetadata& fwd, const RankMetadata& rev, const char* who) {
    if (fwd.world_size != static_cast<std::int64_t>(W_) || rev.world_size != static_cast<std::int64_t>(W_)) {
      fail(who, ": the slices are of world_size ", fwd.world_size, " / ", rev.world_size, " but the transport's is ", W_);
    }
    if (fwd.rank != me_ || rev.rank != me_) fail(who, ": the slices are rank ", fwd.rank, " / ", rev.rank, "'s, the transport is rank ", me_);
    if (fwd.dst_rank.size() != fwd.seq_len.size() * fwd.num_copies || rev.dst_rank.size() != rev.seq_len.size()) {
      fail(who, ": the slices' dst_rank do not match their seq_len and copies");
    }
    P_.resize(fwd.seq_len.size());
    Q_.resize(rev.seq_len.size());
    T_ = A_ = 0;
    for (std::size_t j = 0; j < P_.size(); ++j) {
      if (fwd.seq_len[j] < 0) fail(who, ": fwd.seq_len[", j, "] = ", fwd.seq_len[j], " is negative");
      P_[j] = T_, T_ += fwd.seq_len[j];
    }
    for (std::size_t m = 0; m < Q_.size(); ++m) {
      if (rev.seq_len[m] < 0) fail(who, ": rev.seq_len[", m, "] = ", rev.seq_len[m], " is negative");
      Q_[m] = A_, A_ += rev.seq_len[m];
    }
  }

  void add_self(std::vector<CopyPiece>& self, std::int64_t from, std::int64_t to, std::int64_t len) const {
    append_piece(self, static_cast<std::size_t>(from) * tb_, static_cast<std::size_t>(to) * tb_, static_cast<std::size_t>(len) * tb_);
  }

  /// One side from items_ (sorted by peer, then wire order), the piece at `where(item)`.
  template <class Where>
  void lay_out(Side& side, Where where) {
    side.counts.assign(W_, 0);
    side.splits.assign(W_ + 1, 0);
    std::size_t i = 0;
    for (std::size_t p = 0; p < W_; ++p) {
      for (; i < items_.size() && items_[i].peer == p; ++i) {
        const std::size_t at = static_cast<std::size_t>(where(items_[i])) * tb_, n = static_cast<std::size_t>(items_[i].len) * tb_;
        side.counts[p] += n;
        if (n == 0) continue;
        if (side.pieces.size() > side.splits[p] && side.pieces.back().offset + side.pieces.back().bytes == at) {
          side.pieces.back().bytes += n;
        } else {
          side.pieces.push_back({at, n});
        }
      }
      side.splits[p + 1] = side.pieces.size();
    }
  }

  std::size_t tb_ = 0, W_ = 0;
  int me_ = 0;
  std::vector<std::int64_t> P_, Q_;
  std::int64_t T_ = 0, A_ = 0;
  std::vector<Item> items_;
};

}  // namespace cpdispatch::detail
