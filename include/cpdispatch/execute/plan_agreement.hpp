#pragma once
// Plan agreement: before the first exchange of a plan, the ranks check that
// the plans they were handed belong together (the same world, configuration
// and mask; every pair of ranks agreeing on what one sends the other), so
// that ranks handed different plans (a data loader bug, a seed that differs
// by rank) get an error on every rank instead of garbage or a collective that
// never completes.
//
// Each rank holds only its share, so what is compared is what must agree:
// - header fields every rank must hold alike: the plan's world size, the
//   owner's configuration (token widths, options), the mask, the document
//   layout fields global to the plan (key-value copies, head-parallel degree);
// - per pair (s, d) and per exchanged tensor ("slot"): the tokens s's forward
//   slice sends d and the tokens d's reverse slice says it receives from s;
// - per pair, a 64-bit digest of where those pieces land: the sender sums a
//   hash of (slot, dst_offset, length) over its pieces for d, the receiver of
//   (slot, position in its attention layout, length) over its entries from s
//   (back to back, the planner's convention), so equal digests mean the same
//   pieces at the same places (a sum: no sort, no allocation).
// Every rank sends every other its record (one all_to_all_v of H + W(2S + 2)
// words, the same bytes to each peer: an all-gather), so every rank holds
// every record and reaches the same verdict from the same words. A rank whose
// share it could not plan still takes part (its record says so), so its
// peers throw too rather than wait in the next exchange.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/memory_space.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// splitmix64's finalizer: every input bit reaches every output bit.
constexpr std::uint64_t agreement_mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// An ordered hash of a few words (the header fields).
inline std::uint64_t agreement_hash(std::initializer_list<std::uint64_t> words) noexcept {
  std::uint64_t h = 0x6370646973706174ull;
  for (std::uint64_t w : words) h = agreement_mix(h ^ agreement_mix(w));
  return h;
}

/// One tensor's slices (forward: what this rank sends; reverse: what it receives), named for messages.
struct AgreementSlot {
  const char* name;
  const RankMetadata* fwd;
  const RankMetadata* rev;
};

/// The header fields every rank must hold alike.
struct AgreementHeader {
  std::int64_t world_size = 0;  ///< the plan's (the share's), not the transport's
  std::uint64_t config = 0;     ///< the owner's: token widths, options
  std::uint64_t mask = 0;
  std::uint64_t layout = 0;  ///< the plan's global layout fields (copies, head-parallel degree)
};

/// Records exchanged by a transport of memory space Space; the device one
/// (staging through device memory) is in cpdispatch/cuda/data_path.hpp.
template <MemorySpace Space>
struct AgreementExchange;

template <>
struct AgreementExchange<MemorySpace::host> {
  template <class T>
  static void run(T& t, const std::byte* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, std::byte* recv,
                  std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    t.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
};

class PlanAgreement {
 public:
  /// What an owner's replan does with it: runs plan() (this rank's own
  /// planning, which may throw), then agree(refused) on every rank, the
  /// rank whose plan() threw included, and rethrows that rank's own error.
  /// agree() exchanges the records and, where this rank planned, checks them
  /// before anything is committed.
  template <class Plan, class Agree>
  static void run(Plan&& plan, Agree&& agree) {
    std::exception_ptr refused;
    try {
      plan();
    } catch (...) {
      refused = std::current_exception();
    }
    agree(refused != nullptr);
    if (refused) std::rethrow_exception(refused);
  }

  static constexpr std::size_t header_words = 6;
  static constexpr std::uint64_t ok = 0x706c616e2d6f6b31ull, refused = 0x706c616e2d6e6f31ull;

  /// Sizes the records for `world_size` ranks and `slots` tensors (once: the sizes depend on nothing else).
  void size(int world_size, std::size_t slots) {
    W_ = static_cast<std::size_t>(std::max(world_size, 1));
    slots_ = slots;
    per_peer_ = 2 + 2 * slots_;
    words_ = header_words + W_ * per_peer_;
    mine_.assign(words_, 0);
    all_.assign(W_ * words_, 0);
    counts_.assign(W_, 0);
    send_displs_.assign(W_, 0);
    recv_counts_.assign(W_, 0);
    recv_displs_.assign(W_, 0);
    pairs_of_.assign(W_, 0);
  }

  /// Writes this rank's record: its header and, per peer, what it sends and expects.
  /// Reads the slices defensively (they may be the ones this rank refused).
  void build(int me, const AgreementHeader& h, std::span<const AgreementSlot> slots, bool refused_here) {
    std::fill(mine_.begin(), mine_.end(), 0);
    mine_[0] = refused_here ? refused : ok;
    mine_[1] = static_cast<std::uint64_t>(h.world_size);
    mine_[2] = h.config;
    mine_[3] = h.mask;
    mine_[4] = h.layout;
    mine_[5] = static_cast<std::uint64_t>(me);
    for (std::size_t t = 0; t < slots.size() && t < slots_; ++t) {
      if (slots[t].fwd) add_sends(t, *slots[t].fwd);
      if (slots[t].rev) add_receives(t, *slots[t].rev);
    }
  }

  /// Every rank's record to every rank: one all_to_all_v (nothing when alone).
  template <class T>
  void exchange(T& transport) {
    const auto me = static_cast<std::size_t>(transport.rank());
    const std::size_t bytes = words_ * sizeof(std::uint64_t);
    for (std::size_t p = 0; p < W_; ++p) {
      counts_[p] = recv_counts_[p] = p == me ? 0 : bytes;
      recv_displs_[p] = p * bytes;
    }
    if (W_ > 1) {
      AgreementExchange<T::memory_space>::run(transport, reinterpret_cast<const std::byte*>(mine_.data()), counts_, send_displs_,
                                              reinterpret_cast<std::byte*>(all_.data()), recv_counts_, recv_displs_);
    }
    std::memcpy(all_.data() + me * words_, mine_.data(), bytes);  // after: a device path copies back the whole range
  }

  /// The verdict, the same on every rank: throws invalid_input, "<who>
  /// (rank r of W)" in front, naming the first field that differs and the
  /// ranks that disagree. `slot_names` name the tensors as build() took them.
  /// Allocates nothing when the records agree.
  void check(const char* who, int rank, std::span<const char* const> slot_names) const {
    std::string first;
    std::vector<int> named;
    if (verdict(slot_names, first, named)) return;
    fail(who, " (rank ", rank, " of ", W_, "): the ranks were handed plans that disagree: ", first, "; rank(s) ", list(named),
         " disagree with the rest. Every rank throws this (plan agreement; turn it off with check_plan_agreement = false only where "
         "every rank is known to get the same plan)");
  }

  std::span<std::uint64_t> record() noexcept { return mine_; }
  std::span<const std::uint64_t> records() const noexcept { return all_; }

 private:
  std::uint64_t* block(std::size_t p) noexcept { return mine_.data() + header_words + p * per_peer_; }
  const std::uint64_t* block_of(std::size_t r, std::size_t p) const noexcept { return all_.data() + r * words_ + header_words + p * per_peer_; }
  static std::uint64_t piece(std::size_t slot, std::int64_t pos, std::int64_t len) noexcept {
    return agreement_mix(agreement_mix(agreement_mix(slot + 1) ^ static_cast<std::uint64_t>(pos)) ^ static_cast<std::uint64_t>(len));
  }

  void add_sends(std::size_t t, const RankMetadata& m) noexcept {
    const std::size_t C = std::max<std::size_t>(m.num_copies, 1);
    for (std::size_t j = 0; j < m.seq_len.size(); ++j) {
      for (std::size_t k = 0; k < C; ++k) {
        const std::size_t i = j * C + k;
        if (i >= m.dst_rank.size() || i >= m.dst_offset.size()) return;
        const std::int64_t d = m.dst_rank[i];
        if (d < 0 || static_cast<std::size_t>(d) >= W_) continue;
        std::uint64_t* b = block(static_cast<std::size_t>(d));
        b[0] += piece(t, m.dst_offset[i], m.seq_len[j]);
        b[2 + 2 * t] += static_cast<std::uint64_t>(m.seq_len[j]);
      }
    }
  }

  void add_receives(std::size_t t, const RankMetadata& m) noexcept {
    std::int64_t at = 0;
    for (std::size_t e = 0; e < m.seq_len.size() && e < m.dst_rank.size(); ++e) {
      const std::int64_t s = m.dst_rank[e];
      if (s >= 0 && static_cast<std::size_t>(s) < W_) {
        std::uint64_t* b = block(static_cast<std::size_t>(s));
        b[1] += piece(t, at, m.seq_len[e]);
        b[3 + 2 * t] += static_cast<std::uint64_t>(m.seq_len[e]);
      }
      at += m.seq_len[e];  // wraps only on slices this rank refused
    }
  }

  std::uint64_t field(std::size_t r, std::size_t i) const noexcept { return all_[r * words_ + i]; }

  /// The ranks whose header field i differs from the value most ranks hold (ties: the lowest rank's).
  std::vector<int> odd_ones(std::size_t i, std::uint64_t& common) const {
    std::size_t best = 0;
    common = field(0, i);
    for (std::size_t r = 0; r < W_; ++r) {
      std::size_t n = 0;
      for (std::size_t q = 0; q < W_; ++q) n += field(q, i) == field(r, i);
      if (n > best) {
        best = n;
        common = field(r, i);
      }
    }
    std::vector<int> odd;
    for (std::size_t r = 0; r < W_; ++r) {
      if (field(r, i) != common) odd.push_back(static_cast<int>(r));
    }
    return odd;
  }

  static std::string list(const std::vector<int>& ranks) {
    std::string s;
    for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  }

  /// True when every record agrees; else the first difference and the ranks to name.
  bool verdict(std::span<const char* const> names, std::string& first, std::vector<int>& named) const {
    std::uint64_t common = W_;  // the transport's world size: the one every rank knows
    for (std::size_t r = 0; r < W_; ++r) {
      if (field(r, 1) != common) named.push_back(static_cast<int>(r));
    }
    if (!named.empty()) {
      const std::size_t r = static_cast<std::size_t>(named.front());
      first = concat("rank(s) ", list(named), " were handed a plan of world_size ", static_cast<std::int64_t>(field(r, 1)),
                     " (the first of them), but the transport has ", W_, " ranks");
      return false;
    }
    for (std::size_t r = 0; r < W_; ++r) {
      if (field(r, 0) != ok) named.push_back(static_cast<int>(r));
    }
    if (!named.empty()) {
      first = concat("rank(s) ", list(named), " could not plan their share (each names why in its own error)");
      return false;
    }
    static constexpr const char* header_names[] = {"", "", "configuration (token widths, options)", "attention mask",
                                                   "document layout (key-value copies, head-parallel degree)"};
    for (std::size_t i = 2; i < 5; ++i) {
      named = odd_ones(i, common);
      if (!named.empty()) {
        first = concat("rank(s) ", list(named), " hold another ", header_names[i], " than rank(s) ", list(others(named)));
        return false;
      }
    }
    std::vector<std::size_t>& pairs_of = pairs_of_;
    std::fill(pairs_of.begin(), pairs_of.end(), 0);
    std::size_t bad_pairs = 0;
    for (std::size_t s = 0; s < W_; ++s) {
      for (std::size_t d = 0; d < W_; ++d) {
        if (s == d) continue;
        const std::uint64_t *out = block_of(s, d), *in = block_of(d, s);
        std::string here;
        for (std::size_t t = 0; t < slots_ && here.empty(); ++t) {
          if (out[2 + 2 * t] != in[3 + 2 * t]) {
            const char* name = t < names.size() ? names[t] : "";
            here = concat("rank ", s, " sends ", static_cast<std::int64_t>(out[2 + 2 * t]), " ", name, *name ? " " : "", "tokens to rank ", d,
                          ", which expects ", static_cast<std::int64_t>(in[3 + 2 * t]));
          }
        }
        if (here.empty() && out[0] != in[1]) {
          here = concat("rank ", s, " sends rank ", d, " the tokens it expects, but not to the places it expects them (another document layout)");
        }
        if (here.empty()) continue;
        if (first.empty()) first = here;
        ++bad_pairs;
        ++pairs_of[s];
        ++pairs_of[d];
      }
    }
    if (bad_pairs == 0) return true;
    // A rank handed another plan disagrees with most of its peers; its peers only with it.
    const std::size_t most = *std::max_element(pairs_of.begin(), pairs_of.end());
    named.clear();
    for (std::size_t r = 0; r < W_; ++r) {
      if (pairs_of[r] == most) named.push_back(static_cast<int>(r));
    }
    first += concat(" (", bad_pairs, " of ", W_ * (W_ - 1), " sender-receiver pairs differ)");
    return false;
  }

  std::vector<int> others(const std::vector<int>& named) const {
    std::vector<int> rest;
    for (std::size_t r = 0; r < W_; ++r) {
      if (std::find(named.begin(), named.end(), static_cast<int>(r)) == named.end()) rest.push_back(static_cast<int>(r));
    }
    return rest;
  }

  std::size_t W_ = 1, slots_ = 0, per_peer_ = 2, words_ = header_words;
  std::vector<std::uint64_t> mine_, all_;
  std::vector<std::size_t> counts_, send_displs_, recv_counts_, recv_displs_;
  mutable std::vector<std::size_t> pairs_of_;  // the verdict's scratch: mismatched pairs per rank
};

}  // namespace cpdispatch::detail
