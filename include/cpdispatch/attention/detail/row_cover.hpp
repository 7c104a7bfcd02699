#pragma once
// Which entries of a kernel call cover which rows. The entries of one call
// may share query rows (the row's softmax runs over all of them) and key
// rows (their gradients add up), so a kernel that gives each output row to
// one thread needs each row's entries. RowCover cuts the rows some entry
// covers into segments over which the covering entries do not change (a cut
// at every entry's first and one-past-last row) and lists each segment's
// entries in increasing index: the fixed order in which a row's entries are
// folded, whatever the threads.
//
// A call whose entries share no row has one segment per entry with rows.
// Host code; the CUDA kernel uploads what it builds.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "cpdispatch/plan/mask.hpp"

namespace cpdispatch::detail::attention {

/// Rows [begin, end), covered by the entries ids[first, first + count) of
/// its RowCover; `offset` counts the covered rows of the segments before it
/// (where the segment starts when the covered rows are laid end to end).
struct RowSegment {
  std::int64_t begin = 0, end = 0;
  std::int64_t first = 0, count = 0;
  std::int64_t offset = 0;
};

/// Which rows of an entry a cover follows.
enum class CoverSide { query, key };

class RowCover {
 public:
  /// The segments of `entries`' query or key rows. Storage is kept between
  /// calls, so a call no larger than an earlier one allocates nothing.
  void build(std::span<const AttentionEntry> entries, CoverSide side) {
    spans_.clear();
    cuts_.clear();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const auto [start, len] = rows_of(entries[i], side);
      if (len <= 0) continue;
      spans_.push_back({start, start + len, static_cast<std::int64_t>(i)});
      cuts_.push_back(start);
      cuts_.push_back(start + len);
    }
    std::sort(spans_.begin(), spans_.end(), [](const Span& a, const Span& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.id < b.id;
    });
    std::sort(cuts_.begin(), cuts_.end());
    cuts_.erase(std::unique(cuts_.begin(), cuts_.end()), cuts_.end());
    sweep();
  }

  std::span<const RowSegment> segments() const noexcept { return segments_; }
  /// Entry indices, segment after segment (RowSegment::first, count).
  std::span<const std::int64_t> ids() const noexcept { return ids_; }
  std::span<const std::int64_t> entries_of(const RowSegment& s) const noexcept {
    return std::span<const std::int64_t>(ids_).subspan(static_cast<std::size_t>(s.first), static_cast<std::size_t>(s.count));
  }
  /// Rows some entry covers.
  std::int64_t rows() const noexcept { return segments_.empty() ? 0 : segments_.back().offset + (segments_.back().end - segments_.back().begin); }
  /// One past the last covered row (0 when none is).
  std::int64_t end() const noexcept { return segments_.empty() ? 0 : segments_.back().end; }

 private:
  struct Span {
    std::int64_t begin, end, id;
  };

  static std::pair<std::int64_t, std::int64_t> rows_of(const AttentionEntry& e, CoverSide side) noexcept {
    return side == CoverSide::query ? std::pair{e.q_start, e.q_len} : std::pair{e.kv_start, e.kv_len};
  }

  /// Walks the cuts in order, keeping the entries covering the rows after
  /// each one (in index order) and emitting a segment wherever some do.
  void sweep() {
    segments_.clear();
    ids_.clear();
    active_.clear();
    std::size_t next = 0;  // the first span not yet started
    std::int64_t covered = 0;
    for (std::size_t c = 0; c + 1 < cuts_.size(); ++c) {
      const std::int64_t at = cuts_[c];
      std::erase_if(active_, [&](const Span& s) { return s.end <= at; });
      for (; next < spans_.size() && spans_[next].begin == at; ++next) {
        const auto pos = std::upper_bound(active_.begin(), active_.end(), spans_[next].id,
                                          [](std::int64_t id, const Span& s) { return id < s.id; });
        active_.insert(pos, spans_[next]);
      }
      if (active_.empty()) continue;
      const std::int64_t end = cuts_[c + 1];
      segments_.push_back({at, end, static_cast<std::int64_t>(ids_.size()), static_cast<std::int64_t>(active_.size()), covered});
      for (const Span& s : active_) ids_.push_back(s.id);
      covered += end - at;
    }
  }

  std::vector<Span> spans_, active_;
  std::vector<std::int64_t> cuts_;
  std::vector<RowSegment> segments_;
  std::vector<std::int64_t> ids_;
};

}  // namespace cpdispatch::detail::attention
