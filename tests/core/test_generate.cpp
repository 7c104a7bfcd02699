// The seeded generators (gen_seq_lens, create_qkv_dispatch, random_documents_plan).
// Fixed seeds give fixed, checked-in values: they were produced once by our
// own portable generator and pin it across compilers and platforms (GCC and
// Clang agree). Then the generators' properties and argument errors.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "helpers.hpp"

namespace {

using cpdispatch::create_qkv_dispatch;
using cpdispatch::gen_seq_lens;
using cpdispatch::invalid_input;
using cpdispatch::make_tensor;
using cpdispatch::Tensor;
using cptest::I;
using cptest::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Docs = std::vector<cpdispatch::Document>;

// ------------------------------------------------------------- fixed values

TEST(CoreGenerators, RngIsTheStandardMt19937_64) {
  // Rng draws the sequence the C++ standard fixes for mt19937_64, whatever the library.
  for (std::uint64_t seed : {0ull, 1ull, 5489ull, 2024ull, 0xffffffffffffffffull}) {
    cpdispatch::Rng rng(seed);
    std::mt19937_64 std_engine(seed);
    for (int i = 0; i < 100; ++i) ASSERT_EQ(rng.next(), std_engine()) << "seed " << seed << " draw " << i;
  }
  std::mt19937_64 e;  // the standard's own check value: the 10000th draw from the default seed
  e.discard(9999);
  EXPECT_EQ(e(), 9981545732273789042ull);
}

TEST(CoreGenerators, RngFixedDraws) {
  cpdispatch::Rng r(2024);
  EXPECT_EQ(r.next(), 11302035004393361974ull);
  EXPECT_EQ(r.below(1000), 969u);
  EXPECT_EQ(r.between(-5, 5), 0);
  EXPECT_EQ(r.below(1), 0u);
  EXPECT_EQ(r.between(-3, -3), -3);
  EXPECT_EQ(r.below(3), 0u);
  EXPECT_THAT(message_of<invalid_input>([&] { r.below(0); }), HasSubstr("empty range"));
}

TEST(CoreGenerators, GenSeqLensFixedValues) {
  EXPECT_EQ(gen_seq_lens(4, 5, 100, 42),
            make_tensor<I>({{43, 12, 37, 5, 3}, {7, 47, 4, 3, 39}, {23, 5, 16, 2, 54}, {3, 11, 11, 9, 66}}));
  EXPECT_EQ(gen_seq_lens(2, 3, 1000000, 1), make_tensor<I>({{568993, 69438, 361569}, {524026, 136681, 339293}}));
  EXPECT_EQ(gen_seq_lens(3, 1, 17, 0), make_tensor<I>(std::vector<std::vector<I>>{{17}, {17}, {17}}));
  EXPECT_EQ(gen_seq_lens(1, 8, 8, 123), make_tensor<I>(std::vector<std::vector<I>>{{1, 1, 1, 1, 1, 1, 1, 1}}));
}

TEST(CoreGenerators, CreateQkvDispatchFixedValues) {
  {
    const auto p = create_qkv_dispatch(4, 64, 3, 4, 7);
    EXPECT_EQ(p.world_size, 4);
    EXPECT_EQ(p.max_cp_degree, 4);
    ASSERT_EQ(p.ranks.size(), 4u);
    const std::vector<std::vector<std::pair<std::vector<I>, std::vector<I>>>> want{
        {{{4}, {2}}, {{2, 2}, {0, 1}}, {{28, 28}, {1, 0}}},
        {{{4}, {2}}, {{24}, {1}}, {{9, 9, 9, 9}, {1, 3, 2, 0}}},
        {{{20}, {0}}, {{24}, {0}}, {{20}, {2}}},
        {{{6, 6}, {1, 0}}, {{7, 7, 7, 7}, {1, 3, 2, 0}}, {{24}, {0}}},
    };
    for (std::size_t r = 0; r < 4; ++r) {
      ASSERT_EQ(p.ranks[r].docs.size(), want[r].size()) << "rank " << r;
      for (std::size_t i = 0; i < want[r].size(); ++i) {
        EXPECT_EQ(p.ranks[r].docs[i].shard_len, want[r][i].first) << "rank " << r << " doc " << i;
        EXPECT_EQ(p.ranks[r].docs[i].dst, want[r][i].second) << "rank " << r << " doc " << i;
      }
    }
  }
  {
    const auto p = create_qkv_dispatch(8, 1024, 2, 8, 99);
    const std::vector<std::vector<std::pair<std::vector<I>, std::vector<I>>>> want{
        {{std::vector<I>(8, 38), {5, 6, 7, 0, 2, 4, 1, 3}}, {std::vector<I>(4, 180), {5, 2, 1, 0}}},
        {{{468, 468}, {0, 3}}, {std::vector<I>(8, 11), {0, 3, 6, 2, 4, 5, 1, 7}}},
        {{std::vector<I>(4, 206), {7, 6, 2, 0}}, {{200}, {5}}},
        {{{456, 456}, {1, 0}}, {{112}, {5}}},
        {{std::vector<I>(8, 119), {4, 1, 7, 0, 2, 6, 3, 5}}, {{36, 36}, {2, 6}}},
        {{std::vector<I>(4, 188), {4, 2, 6, 1}}, {std::vector<I>(4, 68), {0, 3, 6, 4}}},
        {{std::vector<I>(8, 116), {2, 1, 0, 7, 6, 4, 5, 3}}, {{48, 48}, {4, 1}}},
        {{std::vector<I>(4, 198), {3, 4, 1, 2}}, {{116, 116}, {7, 0}}},
    };
    ASSERT_EQ(p.ranks.size(), 8u);
    for (std::size_t r = 0; r < 8; ++r) {
      ASSERT_EQ(p.ranks[r].docs.size(), want[r].size()) << "rank " << r;
      for (std::size_t i = 0; i < want[r].size(); ++i) {
        EXPECT_EQ(p.ranks[r].docs[i].shard_len, want[r][i].first) << "rank " << r << " doc " << i;
        EXPECT_EQ(p.ranks[r].docs[i].dst, want[r][i].second) << "rank " << r << " doc " << i;
      }
    }
  }
}

TEST(CoreGenerators, SameSeedSameOutputDifferentSeedDifferentOutput) {
  EXPECT_EQ(gen_seq_lens(8, 6, 4096, 5), gen_seq_lens(8, 6, 4096, 5));
  EXPECT_NE(gen_seq_lens(8, 6, 4096, 5), gen_seq_lens(8, 6, 4096, 6));
  const auto a = create_qkv_dispatch(8, 512, 4, 4, 11), b = create_qkv_dispatch(8, 512, 4, 4, 11);
  const auto c = create_qkv_dispatch(8, 512, 4, 4, 12);
  bool differs = false;
  for (std::size_t r = 0; r < 8; ++r) {
    ASSERT_EQ(a.ranks[r].docs.size(), b.ranks[r].docs.size());
    for (std::size_t i = 0; i < a.ranks[r].docs.size(); ++i) {
      EXPECT_EQ(a.ranks[r].docs[i].shard_len, b.ranks[r].docs[i].shard_len);
      EXPECT_EQ(a.ranks[r].docs[i].dst, b.ranks[r].docs[i].dst);
      differs |= a.ranks[r].docs[i].shard_len != c.ranks[r].docs[i].shard_len || a.ranks[r].docs[i].dst != c.ranks[r].docs[i].dst;
    }
  }
  EXPECT_TRUE(differs);
}

// ---------------------------------------------------------------- properties

TEST(CoreGenerators, GenSeqLensArePositiveAndSumToTheTotal) {
  cptest::TestRng pick(77);
  for (std::uint64_t seed = 0; seed < 300; ++seed) {
    const I W = pick.between(1, 16), n = pick.between(1, 20);
    const I total = n + pick.between(0, pick.chance(50) ? 5 : 100000);
    SCOPED_TRACE("seed " + std::to_string(seed) + " W " + std::to_string(W) + " n " + std::to_string(n) + " total " + std::to_string(total));
    const auto t = gen_seq_lens(W, n, total, seed);
    ASSERT_EQ(t.shape(), (std::vector<std::size_t>{static_cast<std::size_t>(W), static_cast<std::size_t>(n)}));
    for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
      I sum = 0;
      for (I x : t.row(r)) {
        ASSERT_GT(x, 0);
        sum += x;
      }
      ASSERT_EQ(sum, total) << "rank " << r;
    }
  }
}

TEST(CoreGenerators, CreateQkvDispatchProperties) {
  cptest::TestRng pick(78);
  std::set<I> degrees_seen;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    const I W = pick.between(1, 24);
    I C = 1;
    const I want_c = pick.between(1, std::min<I>(W, 8));
    while (C * 2 <= want_c) C *= 2;
    const I n = pick.between(1, 5);
    const I total = C * (n + pick.between(0, 200));
    SCOPED_TRACE("seed " + std::to_string(seed) + " W " + std::to_string(W) + " C " + std::to_string(C) + " n " + std::to_string(n) +
                 " total " + std::to_string(total));
    const auto p = create_qkv_dispatch(W, total, n, C, seed);
    ASSERT_EQ(p.world_size, W);
    ASSERT_EQ(p.max_cp_degree, C);
    ASSERT_EQ(p.ranks.size(), static_cast<std::size_t>(W));
    for (std::size_t r = 0; r < p.ranks.size(); ++r) {
      ASSERT_EQ(p.ranks[r].docs.size(), static_cast<std::size_t>(n)) << "rank " << r;
      I sum = 0;
      for (const auto& d : p.ranks[r].docs) {
        const auto degree = static_cast<I>(d.shard_len.size());
        degrees_seen.insert(degree);
        ASSERT_GE(degree, 1);
        ASSERT_LE(degree, C);
        ASSERT_EQ(degree & (degree - 1), 0) << "degree " << degree << " is a power of two";
        ASSERT_EQ(d.dst.size(), d.shard_len.size());
        ASSERT_EQ(std::set<I>(d.dst.begin(), d.dst.end()).size(), d.dst.size()) << "distinct destinations per document";
        I doc_len = 0;
        for (std::size_t k = 0; k < d.shard_len.size(); ++k) {
          ASSERT_GT(d.shard_len[k], 0);
          ASSERT_EQ(d.shard_len[k], d.shard_len[0]) << "equal shards";
          ASSERT_GE(d.dst[k], 0);
          ASSERT_LT(d.dst[k], W);
          doc_len += d.shard_len[k];
        }
        ASSERT_EQ(doc_len % degree, 0) << "the document length is divisible by its degree";
        ASSERT_EQ(doc_len % C, 0) << "document lengths are multiples of max_cp_degree";
        sum += doc_len;
      }
      ASSERT_EQ(sum, total) << "rank " << r << " holds total_seq_len tokens";
    }
    const auto m = cpdispatch::plan_qkv(p);  // and it plans and validates
    ASSERT_NO_THROW(m.kv_rev.validate("kv_rev"));
    ASSERT_NO_THROW(m.kv_fwd.validate("kv_fwd"));
  }
  EXPECT_EQ(degrees_seen, (std::set<I>{1, 2, 4, 8}));
}

// ------------------------------------------------------------ argument errors

TEST(CoreGenerators, GenSeqLensArgumentErrors) {
  EXPECT_THAT(message_of<invalid_input>([] { gen_seq_lens(0, 3, 10, 1); }), HasSubstr("world_size = 0"));
  EXPECT_THAT(message_of<invalid_input>([] { gen_seq_lens(-2, 3, 10, 1); }), HasSubstr("world_size = -2"));
  EXPECT_THAT(message_of<invalid_input>([] { gen_seq_lens(2, 0, 10, 1); }), HasSubstr("num_seqs = 0"));
  EXPECT_THAT(message_of<invalid_input>([] { gen_seq_lens(2, -1, 10, 1); }), HasSubstr("num_seqs = -1"));
  EXPECT_THAT(message_of<invalid_input>([] { gen_seq_lens(2, 5, 4, 1); }),
              AllOf(HasSubstr("total_len = 4"), HasSubstr("5 positive lengths")));
}

TEST(CoreGenerators, CreateQkvDispatchArgumentErrors) {
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(0, 64, 2, 1, 1); }), HasSubstr("world_size = 0"));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 64, 2, 3, 1); }),
              AllOf(HasSubstr("max_cp_degree = 3"), HasSubstr("power of two")));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 64, 2, 0, 1); }), HasSubstr("max_cp_degree = 0"));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 64, 2, -4, 1); }), HasSubstr("max_cp_degree = -4"));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(2, 64, 2, 4, 1); }),
              AllOf(HasSubstr("max_cp_degree = 4"), HasSubstr("world_size = 2")));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 66, 2, 4, 1); }),
              AllOf(HasSubstr("total_seq_len = 66"), HasSubstr("max_cp_degree = 4")));
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 64, 0, 4, 1); }), HasSubstr("num_seqs = 0"));
  // 8 documents cannot share 16 / 4 = 4 units of 4 tokens
  EXPECT_THAT(message_of<invalid_input>([] { create_qkv_dispatch(8, 16, 8, 4, 1); }), HasSubstr("8 positive lengths"));
}

// ------------------------------------------------------------ random_documents_plan

TEST(CoreGenerators, RandomDocumentsPlanIsReproducibleAndSeeded) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = 6;
  o.num_documents = 10;
  o.max_shards = 6;
  const auto a = cpdispatch::random_documents_plan(o, 42), b = cpdispatch::random_documents_plan(o, 42);
  const auto c = cpdispatch::random_documents_plan(o, 43);
  EXPECT_EQ(a.documents, b.documents);
  EXPECT_NE(a.documents, c.documents);
}

TEST(CoreGenerators, RandomDocumentsPlanKeepsItsShapeAndSpansRanks) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = 16;
  o.num_documents = 4;  // few documents over many ranks: some ranks stay empty
  o.max_shards = 12;
  o.max_len = 5;
  o.max_cp_degree = 12;
  std::size_t spanning = 0, repeated_dst = 0, plans_with_empty_ranks = 0;
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    const auto p = cpdispatch::random_documents_plan(o, seed);
    ASSERT_EQ(p.world_size, 16);
    ASSERT_EQ(p.max_cp_degree, 12);
    ASSERT_EQ(p.documents.size(), 4u);
    std::set<I> homes;
    for (const auto& doc : p.documents) {
      ASSERT_GE(doc.shards.size(), 1u);
      ASSERT_LE(doc.shards.size(), 12u);
      std::set<I> doc_homes, doc_dsts;
      for (const auto& s : doc.shards) {
        ASSERT_TRUE(s.rank >= 0 && s.rank < 16 && s.dst >= 0 && s.dst < 16 && s.len >= 1 && s.len <= 5) << "seed " << seed;
        doc_homes.insert(s.rank);
        doc_dsts.insert(s.dst);
        homes.insert(s.rank);
      }
      spanning += doc_homes.size() > 1 ? 1 : 0;
      repeated_dst += doc_dsts.size() < doc.shards.size() ? 1 : 0;
    }
    plans_with_empty_ranks += homes.size() < 16 ? 1 : 0;
    EXPECT_NO_THROW((void)cpdispatch::plan_qkv(p)) << "seed " << seed;
  }
  EXPECT_GT(spanning, 50u);
  EXPECT_GT(repeated_dst, 50u);
  EXPECT_GT(plans_with_empty_ranks, 25u);
}

TEST(CoreGenerators, RandomDocumentsPlanArgumentErrors) {
  auto error = [](auto edit) {
    cpdispatch::RandomDocumentsOptions o;
    edit(o);
    return message_of<invalid_input>([&] { (void)cpdispatch::random_documents_plan(o, 1); });
  };
  EXPECT_THAT(error([](auto& o) { o.world_size = 0; }), HasSubstr("world_size = 0"));
  EXPECT_THAT(error([](auto& o) { o.num_documents = -1; }), HasSubstr("num_documents = -1"));
  EXPECT_THAT(error([](auto& o) { o.max_shards = 0; }), HasSubstr("max_shards = 0"));
  EXPECT_THAT(error([](auto& o) { o.max_len = 0; }), HasSubstr("max_len = 0"));
}

}  // namespace
