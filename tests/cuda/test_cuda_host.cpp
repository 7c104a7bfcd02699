// The host-side logic of the CUDA data path and the NCCL transport, on any
// CPU (no GPU needed, and none used): error
// messages from fake codes, the kernels' work split, metadata normalisation,
// type mapping, and the compile-time separation of host and device buffers.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/cuda/device_metadata.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/cuda/plan.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/transports/nccl.hpp"

namespace {

using cpdispatch::cuda::CombineChunk;
using cpdispatch::cuda::CopyChunk;
using cpdispatch::detail::CopyPiece;
using ::testing::HasSubstr;

// ---- errors ------------------------------------------------------------------

TEST(CudaErrors, MessageNamesTheCallFileLineAndCudasOwnError) {
  const cpdispatch::cuda_error e =
      cpdispatch::detail::make_cuda_error(cudaErrorInvalidValue, "cudaMemcpyAsync(dst, src, n, kind, stream)", "/src/include/cpdispatch/cuda/x.hpp", 42);
  EXPECT_EQ(std::string(e.what()), "cudaMemcpyAsync failed at x.hpp:42: cudaErrorInvalidValue (invalid argument)");
  EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidValue));
}

TEST(CudaErrors, CheckThrowsOnlyOnFailureAndBelongsToTheFamily) {
  EXPECT_NO_THROW(cpdispatch::detail::cuda_check(cudaSuccess, "cudaFree(p)", __FILE__, __LINE__));
  try {
    CPDISPATCH_CUDA_CHECK(cudaErrorMemoryAllocation);
    FAIL() << "no exception";
  } catch (const cpdispatch::backend_error& e) {
    EXPECT_NE(dynamic_cast<const cpdispatch::cuda_error*>(&e), nullptr);
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("cudaErrorMemoryAllocation failed at test_cuda_host.cpp:"));  // no call: the expression itself
    EXPECT_THAT(what, HasSubstr(": cudaErrorMemoryAllocation (out of memory)"));
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorMemoryAllocation));
  }
}

TEST(CudaErrors, AnUnknownCodeStillGivesAMessage) {
  // 12345: inside the enum's range (no UB), but no cudaError_t has it.
  const auto e = cpdispatch::detail::make_cuda_error(static_cast<cudaError_t>(12345), "cudaLaunchKernel()", "a.cu", 7);
  EXPECT_THAT(std::string(e.what()), HasSubstr("cudaLaunchKernel failed at a.cu:7: "));
  EXPECT_EQ(e.code(), 12345);
}

TEST(CudaErrors, CallAndFileNames) {
  using cpdispatch::detail::call_name_of;
  using cpdispatch::detail::file_name_of;
  static_assert(call_name_of("ncclSend(buf, n, type, peer, comm, stream)") == "ncclSend");
  static_assert(call_name_of("copy_chunks_kernel launch") == "copy_chunks_kernel launch");
  static_assert(call_name_of("f (x)") == "f");
  static_assert(file_name_of("/a/b/c.hpp") == "c.hpp");
  static_assert(file_name_of("c.hpp") == "c.hpp");
  EXPECT_EQ(cpdispatch::detail::backend_failure_message("g(1)", "/x/y.cpp", 3, "E", "text", "more"), "g failed at y.cpp:3: E (text); more");
}

TEST(NcclErrors, MessageNamesTheCallFileLineAndNcclsOwnError) {
  const cpdispatch::nccl_error e =
      cpdispatch::detail::make_nccl_error(ncclInvalidUsage, "ncclSend(buf, n, ncclUint8, peer, comm, stream)", "/x/dispatch.hpp", 120, "");
  const std::string what = e.what();
  EXPECT_EQ(what.rfind("ncclSend failed at dispatch.hpp:120: ncclInvalidUsage (", 0), 0u) << what;
  EXPECT_THAT(what, HasSubstr(ncclGetErrorString(ncclInvalidUsage)));
  EXPECT_EQ(e.code(), static_cast<int>(ncclInvalidUsage));
  const auto with_detail = cpdispatch::detail::make_nccl_error(ncclSystemError, "ncclGroupEnd()", "n.hpp", 9, "socket closed");
  EXPECT_THAT(std::string(with_detail.what()), HasSubstr("ncclGroupEnd failed at n.hpp:9: ncclSystemError ("));
  EXPECT_THAT(std::string(with_detail.what()), HasSubstr("); NCCL: socket closed"));
}

TEST(NcclErrors, EveryResultHasItsName) {
  using cpdispatch::detail::nccl_result_name;
  EXPECT_STREQ(nccl_result_name(ncclSuccess), "ncclSuccess");
  EXPECT_STREQ(nccl_result_name(ncclUnhandledCudaError), "ncclUnhandledCudaError");
  EXPECT_STREQ(nccl_result_name(ncclSystemError), "ncclSystemError");
  EXPECT_STREQ(nccl_result_name(ncclInternalError), "ncclInternalError");
  EXPECT_STREQ(nccl_result_name(ncclInvalidArgument), "ncclInvalidArgument");
  EXPECT_STREQ(nccl_result_name(ncclInvalidUsage), "ncclInvalidUsage");
  EXPECT_STREQ(nccl_result_name(ncclRemoteError), "ncclRemoteError");
  EXPECT_STREQ(nccl_result_name(ncclInProgress), "ncclInProgress");
  EXPECT_STREQ(nccl_result_name(1234), "ncclResult?");
}

TEST(NcclErrors, CheckThrowsNcclError) {
  EXPECT_NO_THROW(CPDISPATCH_NCCL_CHECK(ncclSuccess));
  EXPECT_THROW(CPDISPATCH_NCCL_CHECK(ncclInternalError), cpdispatch::nccl_error);
}

// ---- the NCCL transport's host side --------------------------------------------

static_assert(cpdispatch::Transport<cpdispatch::NcclTransport>);
static_assert(cpdispatch::NcclTransport::memory_space == cpdispatch::MemorySpace::device);
static_assert(!cpdispatch::PieceTransport<cpdispatch::NcclTransport>);
static_assert(!std::is_copy_constructible_v<cpdispatch::NcclTransport>);

TEST(NcclTransport, DataTypesMapToNcclsOwn) {
  using cpdispatch::ElementType;
  using cpdispatch::detail::nccl_data_type;
  static_assert(nccl_data_type(ElementType::bfloat16) == ncclBfloat16);
  static_assert(nccl_data_type(ElementType::float16) == ncclFloat16);
  static_assert(nccl_data_type(ElementType::float32) == ncclFloat32);
  static_assert(nccl_data_type(ElementType::float64) == ncclFloat64);
  static_assert(nccl_data_type(ElementType::int8) == ncclInt8);
  static_assert(nccl_data_type(ElementType::uint8) == ncclUint8);
  static_assert(nccl_data_type(ElementType::int32) == ncclInt32);
  static_assert(nccl_data_type(ElementType::int64) == ncclInt64);
  static_assert(cpdispatch::detail::nccl_reduce_op(cpdispatch::ReduceOp::sum) == ncclSum);
  EXPECT_EQ(nccl_data_type(ElementType::bfloat16), ncclBfloat16);
}

TEST(NcclTransport, NullCommunicatorIsInvalidInput) {
  try {
    cpdispatch::NcclTransport t(nullptr, nullptr);
    FAIL() << "no exception";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("NcclTransport: the communicator is null"));
  }
}

// ---- device spans: host memory does not convert --------------------------------

using cpdispatch::cuda::DeviceBytes;
using cpdispatch::cuda::DeviceConstBytes;
static_assert(!std::is_constructible_v<DeviceBytes, std::span<std::byte>>);
static_assert(!std::is_constructible_v<DeviceBytes, std::vector<std::byte>&>);
static_assert(!std::is_convertible_v<DeviceBytes, std::span<std::byte>>);
static_assert(!std::is_convertible_v<DeviceConstBytes, std::span<const std::byte>>);
static_assert(std::is_convertible_v<DeviceBytes, DeviceConstBytes>);
static_assert(!std::is_convertible_v<DeviceConstBytes, DeviceBytes>);

TEST(DeviceSpan, ViewsWithoutTouchingTheMemory) {
  auto* fake = reinterpret_cast<float*>(std::uintptr_t{0x1000});  // never dereferenced
  const cpdispatch::cuda::DeviceSpan<float> s(fake, 10);
  EXPECT_EQ(s.size_bytes(), 40u);
  EXPECT_EQ(s.first(4).size(), 4u);
  EXPECT_EQ(s.subspan(2, 8).data(), fake + 2);
  const auto b = cpdispatch::cuda::as_bytes(s);
  EXPECT_EQ(b.size(), 40u);
  EXPECT_THROW((void)s.first(11), cpdispatch::invalid_input);
  EXPECT_THROW((void)s.subspan(3, 8), cpdispatch::invalid_input);
  EXPECT_THROW((void)s.subspan(11, 0), cpdispatch::invalid_input);
}

// ---- work split ----------------------------------------------------------------

TEST(CopyChunks, SplitLongPiecesKeepOrderAndCoverEveryByteOnce) {
  const std::vector<CopyPiece> pieces{{0, 100, 10}, {7, 3, 40000}, {50000, 1, 16384}, {3, 5, 0}, {1, 2, 16385}};
  const auto chunks = cpdispatch::cuda::plan_copy_chunks(pieces, 16384);
  const std::vector<CopyChunk> expected{{0, 100, 10},       {7, 3, 16384},        {16391, 16387, 16384}, {32775, 32771, 7232},
                                        {50000, 1, 16384}, {1, 2, 16384},        {16385, 16386, 1}};
  EXPECT_EQ(chunks, expected);
  std::size_t total = 0;
  for (const CopyChunk& c : chunks) {
    EXPECT_GT(c.bytes, 0u);
    EXPECT_LE(c.bytes, 16384u);
    // Both offsets move together: a chunk is as aligned as its piece.
    total += c.bytes;
  }
  EXPECT_EQ(total, 10u + 40000u + 16384u + 16385u);
  EXPECT_TRUE(cpdispatch::cuda::plan_copy_chunks({}, 16).empty());
  EXPECT_THROW((void)cpdispatch::cuda::plan_copy_chunks(pieces, 0), cpdispatch::invalid_input);
}

TEST(CopyChunks, LaunchGeometry) {
  using cpdispatch::cuda::blocks_for;
  using cpdispatch::cuda::warps_per_block;
  static_assert(cpdispatch::cuda::block_threads % 32 == 0);
  EXPECT_EQ(blocks_for(0), 0u);
  EXPECT_EQ(blocks_for(1), 1u);
  EXPECT_EQ(blocks_for(warps_per_block), 1u);
  EXPECT_EQ(blocks_for(warps_per_block + 1), 2u);
  EXPECT_EQ(blocks_for(std::size_t{1} << 40), cpdispatch::cuda::max_blocks);  // the kernels loop beyond
}

TEST(CopyChunks, EveryPieceListOfADispatchPlanIsCovered) {
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(4, 64, 3, 4, 17));
  for (int r = 0; r < 4; ++r) {
    const auto plan = cpdispatch::detail::plan_dispatch(qkv.kv_fwd.get_slice(r), qkv.kv_rev.get_slice(r), 12, r, 4);
    for (const auto* ex : {&plan.forward, &plan.reverse}) {
      for (const auto* list : {&ex->send.copies, &ex->self, &ex->recv.copies}) {
        const auto chunks = cpdispatch::cuda::plan_copy_chunks(*list, 20);
        // Replaying the chunks as byte copies gives what the pieces give.
        std::size_t span = 0;
        for (const CopyPiece& p : *list) span = std::max({span, p.src + p.bytes, p.dst + p.bytes});
        std::vector<int> by_pieces(span, -1), by_chunks(span, -1);
        for (const CopyPiece& p : *list)
          for (std::size_t i = 0; i < p.bytes; ++i) by_pieces[p.dst + i] = static_cast<int>(p.src + i);
        for (const CopyChunk& c : chunks)
          for (std::size_t i = 0; i < c.bytes; ++i) by_chunks[c.dst + i] = static_cast<int>(c.src + i);
        EXPECT_EQ(by_chunks, by_pieces) << "rank " << r;
      }
    }
  }
}

// ---- metadata normalisation and the combine's work split -------------------------

TEST(NormalizeSlice, KernelDtypesOfARealPlan) {
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(4, 64, 3, 4, 5));
  const cpdispatch::RankMetadata rev = qkv.kv_rev.get_slice(2);
  const auto n = cpdispatch::cuda::normalize_slice(rev, "kv_rev");
  ASSERT_TRUE(n.has_mask);
  EXPECT_EQ(n.rank, 2);
  EXPECT_EQ(n.world_size, 4);
  ASSERT_EQ(n.seq_len.size(), rev.seq_len.size());
  for (std::size_t i = 0; i < rev.seq_len.size(); ++i) EXPECT_EQ(n.seq_len[i], static_cast<std::uint64_t>(rev.seq_len[i]));
  for (std::size_t i = 0; i < rev.dst_rank.size(); ++i) EXPECT_EQ(n.dst_rank[i], static_cast<std::int32_t>(rev.dst_rank[i]));
  ASSERT_EQ(n.seq_recv_mask.size(), rev.seq_recv_mask->size());
  for (std::size_t i = 0; i < n.seq_recv_mask.size(); ++i) EXPECT_EQ(n.seq_recv_mask[i], (*rev.seq_recv_mask)[i]);
  EXPECT_EQ(n.mask_copies, rev.mask_copies);
  EXPECT_EQ(n.num_recv_tokens.back(), static_cast<std::uint64_t>(rev.num_total_recv_tokens));
}

TEST(NormalizeSlice, ValuesOutsideTheKernelDtypesNameTheField) {
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(2, 16, 2, 2, 3));
  cpdispatch::RankMetadata m = qkv.kv_fwd.get_slice(0);
  m.dst_offset[1] = -1;
  try {
    (void)cpdispatch::cuda::normalize_slice(m, "kv_fwd");
    FAIL() << "no exception";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("kv_fwd.dst_offset[1] = -1 does not fit the kernel dtype (range [0, 9223372036854775807])"));
  }
  m = qkv.kv_fwd.get_slice(0);
  m.dst_rank[0] = 2;
  EXPECT_THROW((void)cpdispatch::cuda::normalize_slice(m, "kv_fwd"), cpdispatch::invalid_input);
  m = qkv.kv_rev.get_slice(1);
  (*m.seq_recv_mask)[0] = 2;
  try {
    (void)cpdispatch::cuda::normalize_slice(m, "kv_rev");
    FAIL() << "no exception";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("kv_rev.seq_recv_mask[0] = 2 does not fit"));
  }
}

TEST(NormalizeSlice, AcceptsOffsetsAndLengthsBeyond32BitsAsTheHostDoes) {
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(2, 16, 2, 2, 3));
  cpdispatch::RankMetadata m = qkv.kv_rev.get_slice(0);
  const std::int64_t big = (std::int64_t{1} << 32) + 7;
  m.dst_offset[0] = big;
  m.seq_len[0] = big;
  (*m.recv_seq_lens)[0] = big;
  const auto n = cpdispatch::cuda::normalize_slice(m, "kv_rev");
  EXPECT_EQ(n.dst_offset[0], static_cast<std::uint64_t>(big));
  EXPECT_EQ(n.seq_len[0], static_cast<std::uint64_t>(big));
  EXPECT_EQ(n.recv_seq_lens[0], static_cast<std::uint64_t>(big));
  // The combine's work split covers such a shard too (in chunks of at most combine_chunk_bytes).
  const auto plan = cpdispatch::cuda::plan_combine_chunks(n, 2);
  EXPECT_GE(plan.slab_bytes, static_cast<std::uint64_t>(big) * 2);
}

TEST(CombineChunks, CoverEveryShardInBytes) {
  cpdispatch::cuda::NormalizedRankMetadata rev;
  rev.has_mask = true;
  rev.mask_copies = 2;
  rev.recv_seq_lens = {3, 0, 5};
  rev.seq_recv_mask = {1, 0, 0, 0, 1, 1};
  const auto plan = cpdispatch::cuda::plan_combine_chunks(rev, 6, 16);
  EXPECT_EQ(plan.slab_bytes, 48u);
  const std::vector<CombineChunk> expected{{0, 16, 0}, {16, 2, 0}, {18, 16, 2}, {34, 14, 2}};
  EXPECT_EQ(plan.chunks, expected);
  EXPECT_THROW((void)cpdispatch::cuda::plan_combine_chunks(rev, 6, 24), cpdispatch::invalid_input);  // not a multiple of 16
  rev.has_mask = false;
  EXPECT_THROW((void)cpdispatch::cuda::plan_combine_chunks(rev, 6), cpdispatch::invalid_input);
}

TEST(CombineChunks, DefaultChunksKeepSixteenByteAlignmentWithinAShard) {
  static_assert(cpdispatch::cuda::combine_chunk_bytes % 16 == 0);
  static_assert(cpdispatch::cuda::copy_chunk_bytes % 16 == 0);
  const auto qkv = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(4, 4096, 4, 4, 23));
  const auto n = cpdispatch::cuda::normalize_slice(qkv.kv_rev.get_slice(0), "kv_rev");
  const auto plan = cpdispatch::cuda::plan_combine_chunks(n, 256);
  std::uint64_t covered = 0;
  for (const CombineChunk& c : plan.chunks) {
    EXPECT_EQ(c.start % 16, 0u);  // shards start on token boundaries, chunks at multiples of 16 inside
    covered += c.bytes;
  }
  EXPECT_EQ(covered, plan.slab_bytes);
  EXPECT_EQ(plan.slab_bytes, static_cast<std::uint64_t>(std::accumulate(n.recv_seq_lens.begin(), n.recv_seq_lens.end(), std::uint64_t{0})) * 256);
}

}  // namespace
