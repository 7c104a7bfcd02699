// CRC32C: the fast path (the crc32 instruction, three interleaved streams)
// and the portable table give Boost.CRC's values for every length, offset
// and split, including lengths around the interleaved block (3 x 4 KiB).

#include <gtest/gtest.h>

#include <boost/crc.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

#include "cpdispatch/crc32c.hpp"

namespace {

using Reference = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

std::uint32_t reference(const unsigned char* p, std::size_t n) {
  Reference crc;
  crc.process_bytes(p, n);
  return crc.checksum();
}

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32c, CheckValueOfTheStandard) {
  constexpr std::string_view digits = "123456789";
  EXPECT_EQ(cpdispatch::crc32c(digits.data(), digits.size()), reference(reinterpret_cast<const unsigned char*>(digits.data()), digits.size()));
  EXPECT_EQ(cpdispatch::crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, FastAndPortablePathsEqualBoostCrc) {
  const auto buf = random_bytes(3 * 12288 + 64, 1);
  for (std::size_t n : {0, 1, 7, 8, 9, 15, 16, 63, 4095, 4096, 4097, 12287, 12288, 12289, 24576, 24583, 36864}) {
    for (std::size_t offset : {0, 1, 3, 8, 13}) {
      SCOPED_TRACE(testing::Message() << "n = " << n << ", offset = " << offset);
      const std::uint32_t want = reference(buf.data() + offset, n);
      EXPECT_EQ(cpdispatch::crc32c(buf.data() + offset, n), want);
      EXPECT_EQ(cpdispatch::crc32c_portable(buf.data() + offset, n), want);
    }
  }
}

TEST(Crc32c, ContinuingAChecksumEqualsTheChecksumOfTheWhole) {
  const auto buf = random_bytes(40000, 2);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t n = rng() % buf.size(), split = n ? rng() % n : 0;
    const std::uint32_t head = cpdispatch::crc32c(buf.data(), split);
    EXPECT_EQ(cpdispatch::crc32c(buf.data() + split, n - split, head), reference(buf.data(), n)) << n << " split at " << split;
    EXPECT_EQ(cpdispatch::crc32c_portable(buf.data() + split, n - split, cpdispatch::crc32c_portable(buf.data(), split)),
              reference(buf.data(), n));
  }
}

TEST(Crc32c, EverySingleBitFlipChangesTheChecksum) {
  auto buf = random_bytes(12288 + 100, 4);
  const std::uint32_t clean = cpdispatch::crc32c(buf.data(), buf.size());
  for (std::size_t byte : {std::size_t{0}, std::size_t{4095}, std::size_t{4096}, std::size_t{8200}, buf.size() - 1}) {
    for (int bit = 0; bit < 8; ++bit) {
      buf[byte] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(cpdispatch::crc32c(buf.data(), buf.size()), clean) << "byte " << byte << " bit " << bit;
      buf[byte] ^= static_cast<unsigned char>(1u << bit);
    }
  }
}

}  // namespace
