// Device checksums: the CRC32C kernel, and the pack fused with it, against
// the host's crc32c on segments of every shape, and DeviceChecksummedTransport over the device sim and
// NcclTransport: clean exchanges (blocking and posted) arrive unchanged and
// are counted; a flipped byte, or a sender's byte count changed in transit,
// is a corruption_error in every rank's check() (with agreement; only the
// receiving rank's without), naming the segment and its source. Without a
// CUDA device every test skips; NCCL needs a GPU a rank.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "all_to_all_case.hpp"
#include "corrupting_transport.hpp"
#include "cpdispatch/cuda/checksummed.hpp"
#include "cpdispatch/crc32c.hpp"
#include "cpdispatch/cuda/crc32c.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cuda_test_util.hpp"
#include "nccl_world.hpp"

namespace {

using cpdispatch::ChecksumOptions;
using cpdispatch::corruption_error;
using cpdispatch::DeviceChecksummedTransport;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::cuda::CrcRange;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::SegmentCrc;
using cptest::AllToAllCase;
using cptest::Bytes;

TEST(DeviceCrc32c, EverySegmentMatchesTheHostCrc32c) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Bytes data = cptest::pattern(300000, 17);
  const auto device = cptest::to_device(data);
  // (offset, bytes): empty, shorter than a word, unaligned starts, around a chunk's size, many chunks, the whole buffer.
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> shapes = {
      {0, 0},     {5, 0},    {0, 1},     {3, 7},      {8, 8},       {1, 9},        {0, 1023},      {7, 1024},
      {0, 1025},  {13, 2048}, {6, 4097}, {1, 100000}, {99, 150001}, {0, 300000},   {299999, 1},    {4096, 65536}};
  std::vector<CrcRange> ranges;
  std::vector<SegmentCrc> sums;
  std::uint64_t chunks = 0;
  for (const auto& [offset, bytes] : shapes) {
    ranges.push_back({offset, bytes, chunks});
    sums.push_back({cpdispatch::cuda::crc_start(bytes), 0, bytes});
    chunks += cpdispatch::cuda::crc_chunks(bytes);
  }
  DeviceBuffer<CrcRange> d_ranges(ranges.size());
  DeviceBuffer<SegmentCrc> d_sums(sums.size());
  DeviceBuffer<std::uint32_t> tables(cpdispatch::cuda::crc_table_words);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_ranges.data(), ranges.data(), ranges.size() * sizeof(CrcRange), cudaMemcpyHostToDevice));
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_sums.data(), sums.data(), sums.size() * sizeof(SegmentCrc), cudaMemcpyHostToDevice));
  const auto& host_tables = cpdispatch::cuda::crc_tables();
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(tables.data(), host_tables.data(), host_tables.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
  cpdispatch::cuda::launch_segment_crc(device.data(), d_ranges.data(), static_cast<std::uint32_t>(ranges.size()), chunks, tables.data(), d_sums.data(),
                                       nullptr);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(sums.data(), d_sums.data(), sums.size() * sizeof(SegmentCrc), cudaMemcpyDeviceToHost));
  for (std::size_t s = 0; s < shapes.size(); ++s) {
    const auto [offset, bytes] = shapes[s];
    EXPECT_EQ(~sums[s].crc, cpdispatch::crc32c(data.data() + offset, bytes)) << "segment " << s << ": " << bytes << " bytes at " << offset;
    EXPECT_EQ(sums[s].bytes, bytes);
  }
}

/// A pack fused with the checksum: pieces of every alignment, some running
/// from one segment into the next (in two launches sharing one target, as a
/// pack of two tensors does), copy their bytes unchanged and leave each
/// segment's sum equal to the host's crc32c of what the segment holds,
/// empty segments included.
TEST(DeviceCrc32c, APackFusedWithTheChecksumCopiesAndSumsEverySegment) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Bytes source = cptest::pattern(60000, 23);
  const std::vector<std::uint64_t> sizes = {0, 3001, 0, 40000, 7, 16385};  // segments back to back
  std::vector<CrcRange> segments;
  std::vector<SegmentCrc> sums;
  std::vector<cpdispatch::detail::CopyPiece> lists[2];
  Bytes want;
  std::mt19937_64 rng(5);
  std::uint64_t total = 0;
  for (const std::uint64_t size : sizes) {
    segments.push_back({total, size, 0});
    sums.push_back({cpdispatch::cuda::crc_start(size), 0, size});
    total += size;
  }
  while (want.size() < total) {  // pieces cut regardless of the segments: some run on into the next, as merged pieces do
    const std::uint64_t n = std::min<std::uint64_t>(total - want.size(), 1 + rng() % 5000), from = rng() % (source.size() - n);
    lists[rng() % 2].push_back({from, want.size(), n});
    want.insert(want.end(), source.begin() + static_cast<std::ptrdiff_t>(from), source.begin() + static_cast<std::ptrdiff_t>(from + n));
  }
  const auto d_source = cptest::to_device(source);
  const auto staging = cptest::to_device(Bytes(want.size(), std::byte{0}));
  DeviceBuffer<CrcRange> d_segments(segments.size());
  DeviceBuffer<SegmentCrc> d_sums(sums.size());
  DeviceBuffer<std::uint32_t> tables(cpdispatch::cuda::crc_table_words);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_segments.data(), segments.data(), segments.size() * sizeof(CrcRange), cudaMemcpyHostToDevice));
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_sums.data(), sums.data(), sums.size() * sizeof(SegmentCrc), cudaMemcpyHostToDevice));
  const auto& host_tables = cpdispatch::cuda::crc_tables();
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(tables.data(), host_tables.data(), host_tables.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
  const cpdispatch::cuda::CrcTarget target{d_segments.data(), static_cast<std::uint32_t>(segments.size()), tables.data(), d_sums.data()};
  for (const auto& pieces : lists) {
    const auto chunks = cpdispatch::cuda::plan_copy_chunks(pieces);
    DeviceBuffer<cpdispatch::cuda::CopyChunk> d_chunks(std::max<std::size_t>(chunks.size(), 1));
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(d_chunks.data(), chunks.data(), chunks.size() * sizeof(chunks[0]), cudaMemcpyHostToDevice));
    cpdispatch::cuda::launch_copy_crc(d_source.data(), staging.data(), d_chunks.data(), chunks.size(), target, nullptr);
  }
  EXPECT_EQ(cptest::to_host(staging.data(), want.size()), want);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(sums.data(), d_sums.data(), sums.size() * sizeof(SegmentCrc), cudaMemcpyDeviceToHost));
  for (std::size_t s = 0; s < segments.size(); ++s) {
    EXPECT_EQ(~sums[s].crc, cpdispatch::crc32c(want.data() + segments[s].offset, segments[s].bytes)) << "segment " << s;
  }
}

/// Runs f(transport) on every rank of a device sim world of W ranks.
struct SimRanks {
  int W;
  template <class F>
  void run(F&& f) {
    DeviceSimWorld world(W);
    world.run(f);
  }
};
struct NcclRanks {
  int W;
  template <class F>
  void run(F&& f) {
    cptest::run_nccl(W, f);
  }
};

/// GPUs for NCCL ranks (at most 3), or 0 when fewer than two.
int nccl_ranks() {
  int devices = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  return devices < 2 ? 0 : std::min(devices, 3);
}

/// Per rank: what check() returned, or the corruption_error it threw.
struct Outcome {
  std::optional<std::uint64_t> checked;
  std::string error;
  int source = -1, receiving = -1;
};

/// One blocking exchange, then two posted ones waited for in reverse
/// order, each rank's transport wrapped in a CorruptingTransport (`flip`,
/// none when nth = 0) under DeviceChecksummedTransport; then check() on
/// every rank. Also checks what each rank received, where nothing was flipped.
template <class Ranks>
std::vector<Outcome> exchange_and_check(Ranks ranks, int W, cptest::Flip flip, ChecksumOptions options) {
  const AllToAllCase a(W, 1500, 3), b(W, 2100, 4), c(W, 40, 5);
  auto sa = a.sends(), ra = a.receives(), sb = b.sends(), rb = b.receives(), sc = c.sends(), rc = c.receives();
  std::vector<Outcome> outcomes(static_cast<std::size_t>(W));
  ranks.run([&](auto& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    cptest::CorruptingTransport corrupting(t, flip);
    DeviceChecksummedTransport checked(corrupting, options);
    checked.all_to_all_v(sa[r].data(), a.counts, a.displs, ra[r].data(), a.counts, a.displs);
    const cpdispatch::Request pb = b.post(checked, sb[r], rb[r]), pc = c.post(checked, sc[r], rc[r]);
    checked.wait(pc);
    checked.wait(pb);
    try {
      outcomes[r].checked = checked.check();
    } catch (const corruption_error& e) {
      outcomes[r].error = e.what();
      outcomes[r].source = e.source_rank();
      outcomes[r].receiving = e.receiving_rank();
    }
    if (flip.nth == 0) {
      EXPECT_EQ(cptest::to_host(ra[r].data(), a.bytes()), a.expected(t.rank())) << "rank " << r;
      EXPECT_EQ(cptest::to_host(rb[r].data(), b.bytes()), b.expected(t.rank())) << "rank " << r;
      EXPECT_EQ(cptest::to_host(rc[r].data(), c.bytes()), c.expected(t.rank())) << "rank " << r;
    }
  });
  return outcomes;
}

template <class Ranks>
void expect_clean(Ranks ranks, int W) {
  SCOPED_TRACE("W = " + std::to_string(W));
  for (const bool agree : {true, false}) {
    const auto outcomes = exchange_and_check(ranks, W, {.receiver = 0, .source = 1, .nth = 0, .offset = 0}, {.agree = agree});
    for (const Outcome& o : outcomes) {
      EXPECT_EQ(o.error, "");
      EXPECT_EQ(o.checked, std::optional<std::uint64_t>(3 * static_cast<std::uint64_t>(W - 1)));  // three exchanges, W - 1 peers each
    }
  }
}

TEST(DeviceChecksummed, CleanExchangesArriveUnchangedAndEverySegmentIsChecked) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (int W = 2; W <= 4; ++W) expect_clean(SimRanks{W}, W);
  if (const int W = nccl_ranks()) expect_clean(NcclRanks{W}, W);
}

/// Exchange `data_exchange` (1: the blocking one, 2 and 3: the posted ones)
/// flipped on rank 0, from rank W-1: every rank's check throws (agreement),
/// rank 0's naming the segment, the others naming rank 0 as the reporter.
template <class Ranks>
void expect_caught_everywhere(Ranks ranks, int W, std::uint64_t data_exchange, std::size_t offset) {
  SCOPED_TRACE("W = " + std::to_string(W) + ", exchange " + std::to_string(data_exchange));
  // The transport under the check counts its checksum exchanges too: data exchange n is its exchange 2n - 1.
  const cptest::Flip flip{.receiver = 0, .source = W - 1, .nth = 2 * data_exchange - 1, .offset = offset};
  const auto outcomes = exchange_and_check(ranks, W, flip, {});
  const std::string source = std::to_string(W - 1), of = " of " + std::to_string(W);
  EXPECT_THAT(outcomes[0].error, ::testing::HasSubstr("rank 0" + of + ": the segment from rank " + source + " in exchange #" + std::to_string(data_exchange)));
  EXPECT_THAT(outcomes[0].error, ::testing::HasSubstr("fails its CRC32C check: rank " + source + " sent 0x"));
  for (int r = 0; r < W; ++r) {
    const Outcome& o = outcomes[static_cast<std::size_t>(r)];
    EXPECT_EQ(o.source, W - 1) << "rank " << r;
    EXPECT_EQ(o.receiving, 0) << "rank " << r;
    if (r > 0) {
      EXPECT_THAT(o.error, ::testing::HasSubstr("rank " + std::to_string(r) + of + ": exchange #" + std::to_string(data_exchange) +
                                                " failed on rank 0: the segment it received from rank " + source));
    }
  }
}

TEST(DeviceChecksummed, AFlippedByteIsAnErrorInEveryRanksCheck) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (int W = 2; W <= 4; ++W) {
    expect_caught_everywhere(SimRanks{W}, W, 1, 0);
    expect_caught_everywhere(SimRanks{W}, W, 2, 2099);  // the last byte of a posted exchange's segment
    expect_caught_everywhere(SimRanks{W}, W, 3, 17);
  }
  if (const int W = nccl_ranks()) {
    expect_caught_everywhere(NcclRanks{W}, W, 1, 700);
    expect_caught_everywhere(NcclRanks{W}, W, 2, 1);
  }
}

TEST(DeviceChecksummed, WithoutAgreementOnlyTheReceivingRankThrows) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 3;
  const auto outcomes = exchange_and_check(SimRanks{W}, W, {.receiver = 1, .source = 0, .nth = 1, .offset = 9}, {.agree = false});
  EXPECT_THAT(outcomes[1].error, ::testing::HasSubstr("rank 1 of 3: the segment from rank 0 in exchange #1 (1500 bytes at byte 0 of the receive buffer)"));
  for (const std::size_t r : {0u, 2u}) EXPECT_EQ(outcomes[r].checked, std::optional<std::uint64_t>(6)) << "rank " << r;
}

/// A sender's byte count changed on its way (the checksum message of the
/// first exchange): the receiver reports a short or long delivery.
TEST(DeviceChecksummed, AByteCountThatDiffersFromTheSendersIsAnError) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 3;
  // Exchange 2 is the first exchange's checksums: 16 bytes a peer, the count at byte 8.
  const auto outcomes = exchange_and_check(SimRanks{W}, W, {.receiver = 2, .source = 1, .nth = 2, .offset = 8}, {});
  EXPECT_THAT(outcomes[2].error, ::testing::HasSubstr("rank 2 of 3: the segment from rank 1 in exchange #1"));
  EXPECT_THAT(outcomes[2].error, ::testing::HasSubstr("was expected to hold 1500 bytes, but rank 1 sent 1532 (short or long delivery)"));
  EXPECT_THAT(outcomes[0].error, ::testing::HasSubstr("failed on rank 2"));
}

/// After a check that threw, the record starts again: the next clean exchange checks clean.
TEST(DeviceChecksummed, TheCheckAfterAFailedOneStartsAfresh) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = 2;
  const AllToAllCase a(W, 300, 8);
  auto send = a.sends(), recv = a.receives();
  DeviceSimWorld world(W);
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    cptest::CorruptingTransport corrupting(t, {.receiver = 1, .source = 0, .nth = 1, .offset = 5});
    DeviceChecksummedTransport checked(corrupting);
    checked.all_to_all_v(send[r].data(), a.counts, a.displs, recv[r].data(), a.counts, a.displs);
    EXPECT_THROW(checked.check(), corruption_error) << "rank " << r;
    checked.all_to_all_v(send[r].data(), a.counts, a.displs, recv[r].data(), a.counts, a.displs);
    EXPECT_EQ(checked.check(), 1u) << "rank " << r;
    EXPECT_EQ(cptest::to_host(recv[r].data(), a.bytes()), a.expected(t.rank())) << "rank " << r;
  });
}

}  // namespace
