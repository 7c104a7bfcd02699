// cudnn/mapping.hpp: entries -> cuDNN sequences, bands, bounds, metadata,
// the lse layout; all pure, checked against AttentionEntry::allows (the
// entry's band) by brute force.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpdispatch/cudnn/mapping.hpp"

namespace {

using cpdispatch::AttentionEntry;
using cpdispatch::AttentionMask;
using namespace cpdispatch::cudnn;
using Bounds = cpdispatch::Band;  // cudnn::Band is the execution's kind of mask

/// The entry attending query rows [q0, +lq) to key rows [k0, +lk) under
/// `mask`, its query row 0 at document position `diagonal` counted from key
/// row 0: the mask's band moved into buffer rows.
AttentionEntry part(const AttentionMask& mask, std::int64_t q0, std::int64_t lq, std::int64_t k0, std::int64_t lk,
                    std::int64_t diagonal) {
  return {q0, lq, k0, lk, mask.band().shifted(diagonal + k0 - q0)};
}

std::vector<AttentionMask> masks() {
  return {AttentionMask::causal(), AttentionMask::full(), AttentionMask::sliding_window(1),
          AttentionMask::sliding_window(3), AttentionMask::sliding_window(6), AttentionMask::sliding_window(1000)};
}

bool in(const std::vector<RowRange>& ranges, std::int64_t row) {
  for (const RowRange& r : ranges) {
    if (row >= r.start && row < r.start + r.len) return true;
  }
  return false;
}

// Every (row, key) of one entry: cuDNN's rule on the entry's sequence (with the
// group's bounds) allows exactly what the entry's band allows; dead rows and
// keys are exactly those that see / are seen by nothing.
void check_entry(const AttentionEntry& e) {
  SCOPED_TRACE(::testing::Message() << "entry q[" << e.q_start << ", +" << e.q_len << ") kv[" << e.kv_start << ", +"
                                    << e.kv_len << ") band [" << e.band.lo << ", " << e.band.hi << "]");
  const std::vector<AttentionEntry> one{e};
  const EntryMap m = map_entries(one);
  ASSERT_LE(m.groups.size(), 1u);
  const Group* g = m.groups.empty() ? nullptr : &m.groups[0];
  if (g) {
    ASSERT_EQ(g->sequences.size(), 1u);
    EXPECT_GE(g->shift, 0);
  }
  const Sequence s = g ? g->sequences[0] : Sequence{};
  const BandBounds b = g ? band_bounds(*g) : BandBounds{};
  for (std::int64_t j = 0; j < e.q_len; ++j) {
    bool row_sees = false;
    for (std::int64_t t = 0; t < e.kv_len; ++t) {
      const bool want = e.allows(e.q_start + j, e.kv_start + t);
      row_sees |= want;
      const bool got = g && cudnn_sees(g->band, b, s.q_len, s.kv_len, e.q_start + j - s.q_start, e.kv_start + t - s.kv_start);
      ASSERT_EQ(got, want) << "row " << j << " key " << t;
    }
    EXPECT_EQ(in(m.dead_q, e.q_start + j), !row_sees) << "row " << j;
    if (g) { EXPECT_EQ(row_sees, e.q_start + j >= s.q_start && e.q_start + j < s.q_start + s.q_len) << "row " << j; }
  }
  for (std::int64_t t = 0; t < e.kv_len; ++t) {
    bool seen = false;
    for (std::int64_t j = 0; j < e.q_len; ++j) seen |= e.allows(e.q_start + j, e.kv_start + t);
    EXPECT_EQ(in(m.dead_kv, e.kv_start + t), !seen) << "key " << t;
    if (g) { EXPECT_EQ(seen, e.kv_start + t >= s.kv_start && e.kv_start + t < s.kv_start + s.kv_len) << "key " << t; }
  }
}

TEST(CudnnMapping, EveryMaskEntryAndDiagonalMatchesTheMaskExactly) {
  for (const AttentionMask& mask : masks()) {
    for (std::int64_t lq = 0; lq <= 7; ++lq) {
      for (std::int64_t lk = 0; lk <= 7; ++lk) {
        for (std::int64_t d = -10; d <= 16; ++d) check_entry(part(mask, 5, lq, 3, lk, d));
      }
    }
  }
}

/// Bands of every shape, open or bounded at either end, empty ones included:
/// inverse causal (lower end only), bi-causal and narrow bands, on entries
/// whose rows and keys start apart.
TEST(CudnnMapping, EveryBandMatchesExactly) {
  const std::int64_t open_lo = Bounds::unbounded_lo, open_hi = Bounds::unbounded_hi;
  for (std::int64_t lq = 0; lq <= 6; ++lq) {
    for (std::int64_t lk = 0; lk <= 6; ++lk) {
      for (std::int64_t lo = -9; lo <= 9; ++lo) {
        check_entry({4, lq, 1, lk, {lo, open_hi}});
        for (std::int64_t hi = lo - 1; hi <= 9; ++hi) check_entry({4, lq, 1, lk, {lo, hi}});
      }
      for (std::int64_t hi = -9; hi <= 9; ++hi) check_entry({4, lq, 1, lk, {open_lo, hi}});
      check_entry({4, lq, 1, lk, {}});
    }
  }
}

TEST(CudnnMapping, HugeBandEndsSaturate) {
  const std::int64_t big = std::int64_t{1} << 62;
  for (const Bounds band : {Bounds{Bounds::unbounded_lo, big}, Bounds{Bounds::unbounded_lo, -big}, Bounds{1 - big, big},
                            Bounds{-big, -big + 3}, Bounds{big - 3, big}, Bounds{-big, Bounds::unbounded_hi},
                            Bounds{big, Bounds::unbounded_hi}, Bounds{-2, big}}) {
    check_entry({0, 5, 0, 4, band});
    check_entry({3, 5, 9, 4, band});
  }
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(big)}) check_entry(part(mask, 0, 5, 0, 4, big));
  check_entry(part(AttentionMask::sliding_window(3), 0, 5, 0, 4, big));
}

TEST(CudnnMapping, WholeKvGroupsAreOneCausalGroupWithShiftZero) {
  const std::vector<std::int64_t> cu_q{0, 3, 7, 12}, cu_kv{0, 5, 9, 20};
  const auto entries = cpdispatch::layout_entries(cu_q, cu_kv, AttentionMask::causal());
  const EntryMap m = map_entries(entries);
  ASSERT_EQ(m.groups.size(), 1u);
  EXPECT_EQ(m.groups[0].band, Band::causal);
  EXPECT_EQ(m.groups[0].shift, 0);
  EXPECT_EQ(m.groups[0].max_q, 5);
  EXPECT_EQ(m.groups[0].max_kv, 11);
  EXPECT_EQ(m.groups[0].sequences, (std::vector<Sequence>{{0, 3, 0, 5}, {3, 4, 5, 4}, {7, 5, 9, 11}}));
  EXPECT_TRUE(m.dead_q.empty());
  EXPECT_TRUE(m.dead_kv.empty());
  const EntryMap full = map_entries(cpdispatch::layout_entries(cu_q, cu_kv, AttentionMask::full()));
  ASSERT_EQ(full.groups.size(), 1u);
  EXPECT_EQ(full.groups[0].band, Band::full);
}

TEST(CudnnMapping, PartsOfADocumentGroupByBand) {
  // Query part at positions [8, 12) against key parts [0, 4) (all visible: full),
  // [4, 8) (all visible) and [8, 12) (the diagonal: causal, shift 0), and a key
  // part [12, 16) after the queries (nothing visible: dead).
  auto entries_under = [](const AttentionMask& mask) {
    return std::vector<AttentionEntry>{
        part(mask, 0, 4, 8, 4, 0),     // local part, diagonal 0
        part(mask, 4, 4, 0, 4, 8),     // another query part (rows 4..7) against keys 0..3 of its document, diagonal 8
        part(mask, 8, 4, 4, 4, 4),     // rows 8..11 against keys 4..7 seen whole
        part(mask, 12, 4, 12, 4, -4),  // queries before their keys: nothing seen
    };
  };
  const EntryMap m = map_entries(entries_under(AttentionMask::causal()));
  ASSERT_EQ(m.groups.size(), 2u);
  EXPECT_EQ(m.groups[0].band, Band::full);
  EXPECT_EQ(m.groups[0].sequences.size(), 2u);
  EXPECT_EQ(m.groups[1].band, Band::causal);
  EXPECT_EQ(m.groups[1].shift, 0);
  EXPECT_EQ(m.dead_q, (std::vector<RowRange>{{12, 4}}));
  EXPECT_EQ(m.dead_kv, (std::vector<RowRange>{{12, 4}}));
  // a window of 6: entry 1 keeps one row and one key (full), entry 0's left
  // bound never binds (causal), entry 2's does (window, shift 4)
  const auto entries = entries_under(AttentionMask::sliding_window(6));
  const EntryMap w = map_entries(entries);
  ASSERT_EQ(w.groups.size(), 3u);
  EXPECT_EQ(w.groups[0].band, Band::full);
  EXPECT_EQ(w.groups[0].sequences, (std::vector<Sequence>{{4, 1, 3, 1}}));
  EXPECT_EQ(w.groups[1].band, Band::causal);
  EXPECT_EQ(w.groups[1].shift, 0);
  EXPECT_EQ(w.groups[2].band, Band::window);
  EXPECT_EQ(w.groups[2].shift, 4);
  EXPECT_EQ(w.dead_q, (std::vector<RowRange>{{5, 3}, {12, 4}}));
  EXPECT_EQ(w.dead_kv, (std::vector<RowRange>{{0, 3}, {12, 4}}));
  for (const AttentionEntry& e : entries) check_entry(e);
}

TEST(CudnnMapping, ShiftsSplitGroupsSortedByBandThenShift) {
  const AttentionMask causal = AttentionMask::causal();
  const std::vector<AttentionEntry> entries{part(causal, 0, 6, 0, 4, 1), part(causal, 6, 4, 4, 4, 0), part(causal, 10, 6, 8, 4, 2),
                                            part(causal, 16, 6, 12, 4, 1)};
  const EntryMap m = map_entries(entries);
  ASSERT_EQ(m.groups.size(), 3u);
  EXPECT_EQ(m.groups[0].shift, 0);
  EXPECT_EQ(m.groups[1].shift, 3);  // diagonal 1 - (4 - 6)
  EXPECT_EQ(m.groups[1].sequences.size(), 2u);
  EXPECT_EQ(m.groups[1].sequences[0].q_start, 0);
  EXPECT_EQ(m.groups[1].sequences[1].q_start, 16);
  EXPECT_EQ(m.groups[2].shift, 4);
  EntryMap reused = m;  // storage reused: same result
  map_entries(entries, reused);
  EXPECT_EQ(reused.groups.size(), 3u);
  EXPECT_EQ(reused.groups[1].sequences, m.groups[1].sequences);
}

TEST(CudnnMapping, BandBoundsFitInt32) {
  // window 10, diagonal 2 past bottom-right: R = 2, L = 8
  const std::vector<AttentionEntry> e1{part(AttentionMask::sliding_window(10), 0, 20, 0, 20, 2)};
  EntryMap m = map_entries(e1);
  ASSERT_EQ(m.groups.size(), 1u);
  EXPECT_EQ(band_bounds(m.groups[0]), (BandBounds{2, 8}));
  // a huge window is causal (its left bound binds nothing)
  m = map_entries(std::vector<AttentionEntry>{part(AttentionMask::sliding_window(std::int64_t{1} << 40), 0, 20, 0, 20, 2)});
  EXPECT_EQ(m.groups[0].band, Band::causal);
  EXPECT_EQ(band_bounds(m.groups[0]), (BandBounds{2, 0}));
  // a huge diagonal whose right bound binds nothing: R clamped, L exact
  const std::int64_t big = std::int64_t{1} << 50;
  const std::vector<AttentionEntry> e2{part(AttentionMask::sliding_window(big + 2), 0, 8, 0, 8, big)};
  m = map_entries(e2);
  ASSERT_EQ(m.groups.size(), 1u);
  EXPECT_EQ(m.groups[0].band, Band::window);
  EXPECT_EQ(band_bounds(m.groups[0]).right, free_shift);
  check_entry(e2[0]);
  // an inverse causal band (lower end only): a window whose right bound is free, R clamped
  const std::vector<AttentionEntry> e3{{0, 8, 0, 8, {-2, Bounds::unbounded_hi}}};
  m = map_entries(e3);
  ASSERT_EQ(m.groups.size(), 1u);
  EXPECT_EQ(m.groups[0].band, Band::window);
  EXPECT_EQ(band_bounds(m.groups[0]), (BandBounds{static_cast<std::int32_t>(free_shift), 3}));
  check_entry(e3[0]);
  Group g;
  g.band = Band::full;
  EXPECT_EQ(band_bounds(g), (BandBounds{0, 0}));
}

TEST(CudnnMapping, BucketsArePowersOfTwo) {
  EXPECT_EQ(bucket(0), 1);
  EXPECT_EQ(bucket(1), 1);
  EXPECT_EQ(bucket(5), 8);
  EXPECT_EQ(bucket(64), 64);
  EXPECT_EQ(bucket(65), 128);
  EXPECT_EQ(bucket(3, 64), 64);
}

TEST(CudnnMapping, MetadataHoldsLengthsAndRaggedOffsetsInElements) {
  Group g;
  g.sequences = {{0, 3, 0, 5}, {10, 2, 7, 4}};
  std::vector<std::int32_t> v{42};  // something before: the arrays start on 16 bytes
  const GroupMetadata m = append_metadata(g, 4, /*heads_q=*/4, /*heads_kv=*/2, /*head_dim=*/8, v);
  EXPECT_EQ(m.batch, 4);
  for (std::size_t at : {m.seq_q, m.seq_kv, m.offset_q, m.offset_kv, m.offset_stats}) EXPECT_EQ(at % 4, 0u);
  auto arr = [&](std::size_t at, std::size_t n) { return std::vector<std::int32_t>(v.begin() + at, v.begin() + at + n); };
  EXPECT_EQ(arr(m.seq_q, 4), (std::vector<std::int32_t>{3, 2, 0, 0}));
  EXPECT_EQ(arr(m.seq_kv, 4), (std::vector<std::int32_t>{5, 4, 0, 0}));
  EXPECT_EQ(arr(m.offset_q, 5), (std::vector<std::int32_t>{0, 10 * 32, 12 * 32, 12 * 32, 12 * 32}));
  EXPECT_EQ(arr(m.offset_kv, 5), (std::vector<std::int32_t>{0, 7 * 16, 11 * 16, 11 * 16, 11 * 16}));
  EXPECT_EQ(arr(m.offset_stats, 5), (std::vector<std::int32_t>{0, 10, 12, 12, 12}));
  EXPECT_EQ(v.size() % 4, 0u);
  Group huge;
  huge.sequences = {{std::int64_t{1} << 28, 1, 0, 1}};
  EXPECT_THROW(append_metadata(huge, 1, 32, 8, 128, v), cpdispatch::capacity_error);
}

// The lse layout. cuDNN addresses the statistics of sequence b, head h, row s
// at offset_stats[b] + h * pitch + s (dims {B, Hq, Sq, 1}, strides {Sq, pitch,
// 1, 1}, the ragged offset in rows). The kernel copies each run of a group's
// rows from that [Hq][pitch] buffer into the caller's [Hq][T] lse (one 2-d
// copy per run); nothing else of lse changes.
TEST(CudnnMapping, StatisticsLayoutConvertsToOurLse) {
  const std::int64_t Hq = 3, T = 20, pitch = 32;
  Group g;
  g.sequences = {{1, 4, 0, 4}, {5, 3, 4, 3}, {12, 5, 7, 5}};
  std::vector<std::int32_t> v;
  const GroupMetadata m = append_metadata(g, 4, Hq, 1, 8, v);
  std::vector<float> stats(static_cast<std::size_t>(Hq * pitch), NAN);
  auto value = [](std::int64_t h, std::int64_t row) { return static_cast<float>(100 * h + row); };
  for (std::int64_t b = 0; b < 4; ++b) {  // what cuDNN writes
    const std::int32_t len = v[m.seq_q + static_cast<std::size_t>(b)], off = v[m.offset_stats + static_cast<std::size_t>(b)];
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t s = 0; s < len; ++s) stats[static_cast<std::size_t>(off + h * pitch + s)] = value(h, off + s);
    }
  }
  std::vector<RowRange> runs;
  query_runs(g, runs);
  EXPECT_EQ(runs, (std::vector<RowRange>{{1, 7}, {12, 5}}));
  std::vector<float> lse(static_cast<std::size_t>(Hq * T), -1.0f);
  for (const RowRange& r : runs) {  // cudaMemcpy2DAsync(lse + start, T, stats + start, pitch, len, Hq)
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t i = 0; i < r.len; ++i) {
        lse[static_cast<std::size_t>(h * T + r.start + i)] = stats[static_cast<std::size_t>(h * pitch + r.start + i)];
      }
    }
  }
  for (std::int64_t h = 0; h < Hq; ++h) {
    for (std::int64_t row = 0; row < T; ++row) {
      const bool mine = in(runs, row);
      EXPECT_EQ(lse[static_cast<std::size_t>(h * T + row)], mine ? value(h, row) : -1.0f) << h << " " << row;
    }
  }
}

TEST(CudnnMapping, RandomCallsKeepRowsDisjointAndCoverEveryEntry) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<AttentionEntry> entries;
    std::vector<std::int64_t> diagonals;
    std::int64_t q = 0, kv = 0;
    const int n = static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      const std::int64_t lq = rng() % 9, lk = rng() % 9, d = static_cast<std::int64_t>(rng() % 25) - 10;
      entries.push_back({q + static_cast<std::int64_t>(rng() % 2), lq, kv, lk, {}});
      diagonals.push_back(d);
      q = entries.back().q_start + lq;
      kv += lk + static_cast<std::int64_t>(rng() % 2);
    }
    for (const AttentionMask& mask : masks()) {
      for (std::size_t i = 0; i < entries.size(); ++i) {
        entries[i] = part(mask, entries[i].q_start, entries[i].q_len, entries[i].kv_start, entries[i].kv_len, diagonals[i]);
      }
      const EntryMap m = map_entries(entries);
      std::vector<int> q_cover(static_cast<std::size_t>(q + 2)), kv_cover(static_cast<std::size_t>(kv + 2));
      for (const Group& g : m.groups) {
        for (std::size_t s = 1; s < g.sequences.size(); ++s) EXPECT_LT(g.sequences[s - 1].q_start, g.sequences[s].q_start);
        for (const Sequence& s : g.sequences) {
          EXPECT_GT(s.q_len, 0);
          EXPECT_GT(s.kv_len, 0);
          for (std::int64_t r = 0; r < s.q_len; ++r) ++q_cover[static_cast<std::size_t>(s.q_start + r)];
          for (std::int64_t r = 0; r < s.kv_len; ++r) ++kv_cover[static_cast<std::size_t>(s.kv_start + r)];
        }
      }
      for (const RowRange& r : m.dead_q) for (std::int64_t i = 0; i < r.len; ++i) ++q_cover[static_cast<std::size_t>(r.start + i)];
      for (const RowRange& r : m.dead_kv) for (std::int64_t i = 0; i < r.len; ++i) ++kv_cover[static_cast<std::size_t>(r.start + i)];
      for (const AttentionEntry& e : entries) {
        for (std::int64_t r = 0; r < e.q_len; ++r) EXPECT_EQ(q_cover[static_cast<std::size_t>(e.q_start + r)], 1);
        for (std::int64_t r = 0; r < e.kv_len; ++r) EXPECT_EQ(kv_cover[static_cast<std::size_t>(e.kv_start + r)], 1);
      }
    }
  }
}

}  // namespace
