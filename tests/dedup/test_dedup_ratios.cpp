// The deduplicated exchange's saving on zig-zag plans, as docs/dedup.md and
// benchmarks/RESULTS.md print it: the wire carries 0.735x (W = 8), 0.742x
// (W = 16) and 0.748x (W = 64) of the KV tokens the section 2 exchange sends
// off-rank. Counted as bench_dedup's BM_WireTokens counts them
// (off_rank_tokens of kv_fwd and of plan_kv_wire's fwd), on its plans where
// they are cheap, and checked against a count by hand.
//
// The count: a document of home r cut into 2W chunks of L tokens, chunk i
// attended on rank min(i, 2W-1-i). Section 2 sends query chunk i the chunks
// 0..i, off-rank unless it attends on r; the ranks r and 2W-1-r drop
// (r+1) + (2W-r) = 2W+1 chunks of the W(2W+1) in all, so the W homes send
// L * W(W-1)(2W+1) tokens per document per rank. The wire sends every rank
// t != r the chunks up to its later query chunk 2W-1-t once: 2W-t chunks,
// L * (W-1) * W(3W+1)/2 over the homes. The ratio (3W+1) / (2(2W+1)) depends
// on neither L nor the documents per rank: 25/34, 49/66, 193/258.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "dedup_cases.hpp"

namespace {

using I = std::int64_t;

struct WireCount {
  I kv = 0;    ///< section 2: KV tokens off-rank
  I wire = 0;  ///< deduplicated
  double ratio() const { return static_cast<double>(wire) / static_cast<double>(kv); }
};

/// The zig-zag plan of W ranks, each with `docs` documents of 2W chunks of
/// `chunk` tokens, counted both ways.
WireCount count_zigzag(I W, I docs, I chunk) {
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(dedup_test::zigzag_plan(W, docs, 2 * W * chunk));
  return {cpdispatch::off_rank_tokens(meta.kv_fwd), cpdispatch::off_rank_tokens(cpdispatch::plan_kv_wire(meta).fwd)};
}

/// The count by hand (see the top of this file).
WireCount by_hand(I W, I docs, I chunk) {
  const I scale = docs * chunk * (W - 1) * W;
  return {scale * (2 * W + 1), scale * (3 * W + 1) / 2};
}

// bench_dedup's plans at W = 8 and 16 (2 documents of 128W tokens a rank), whose token counts RESULTS.md prints.
TEST(DedupRatios, ZigzagWireTokensAsTheBenchmarkPrintsThem) {
  const WireCount w8 = count_zigzag(8, 2, 64), w16 = count_zigzag(16, 2, 64);
  EXPECT_EQ(w8.kv, 121'856);
  EXPECT_EQ(w8.wire, 89'600);
  EXPECT_EQ(w16.kv, 1'013'760);
  EXPECT_EQ(w16.wire, 752'640);
}

// The ratios docs/dedup.md gives, to the precision it prints them. At
// W = 64 one token per chunk and one document per rank (bench_dedup's plan
// holds 64 times the tokens and takes about a second to plan): the ratio is
// the same, as the count by hand shows.
TEST(DedupRatios, ZigzagRatiosAreTheDocumentedOnes) {
  struct Row {
    I W, docs, chunk;
    double documented;
  };
  for (const Row& row : {Row{8, 2, 64, 0.735}, Row{16, 2, 64, 0.742}, Row{64, 1, 1, 0.748}}) {
    SCOPED_TRACE("W = " + std::to_string(row.W));
    const WireCount got = count_zigzag(row.W, row.docs, row.chunk), want = by_hand(row.W, row.docs, row.chunk);
    EXPECT_EQ(got.kv, want.kv);
    EXPECT_EQ(got.wire, want.wire);
    EXPECT_NEAR(got.ratio(), row.documented, 0.0005);
    std::printf("zig-zag W = %lld: deduplicated / section 2 KV tokens off-rank = %lld / %lld = %.4f\n", static_cast<long long>(row.W),
                static_cast<long long>(got.wire), static_cast<long long>(got.kv), got.ratio());
  }
}

// The count by hand holds for every chunk length and document count, so the
// W = 64 row above stands for bench_dedup's plan.
TEST(DedupRatios, ZigzagCountByHandHoldsForAnyChunkAndDocuments) {
  for (I W : {1, 2, 3, 5, 8})
    for (I docs : {1, 3})
      for (I chunk : {1, 2, 7}) {
        SCOPED_TRACE("W = " + std::to_string(W) + ", " + std::to_string(docs) + " documents, chunks of " + std::to_string(chunk));
        const WireCount got = count_zigzag(W, docs, chunk), want = by_hand(W, docs, chunk);
        EXPECT_EQ(got.kv, want.kv);
        EXPECT_EQ(got.wire, want.wire);
      }
}

}  // namespace
