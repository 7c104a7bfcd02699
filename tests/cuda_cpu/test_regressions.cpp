// Regression tests of the device code that need the cuda-cpu harness's
// doubles (freed-memory checks, allocation counts, NCCL failure injection,
// non-blocking communicators): the device sim's buffers outliving captured
// graphs, launch_sum's accumulator check, what the device data path
// uploads, the integer combine, and NcclTransport's timeouts, asynchronous
// errors, failed groups and device checks.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::NcclTransport;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cptest::Bytes;
using ::testing::HasSubstr;

using DeviceBytesBuffer = DeviceBuffer<std::byte>;

std::vector<float> iota_floats(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

DeviceBuffer<float> device_floats(const std::vector<float>& v) {
  DeviceBuffer<float> d(v.size());
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(d.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> host_floats(const DeviceBuffer<float>& d) {
  std::vector<float> v(d.size());
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(v.data(), d.data(), v.size() * 4, cudaMemcpyDeviceToHost));
  return v;
}

// ---- the device sim: a graph captured before a larger collective --------------------

/// Captures an all_reduce of `small` floats, then runs one of `large` floats
/// (the world's per-rank scratch, and with W > 8 its accumulators, grow),
/// then replays the graph: it must still find the memory it was recorded with.
void replay_after_growth(int W) {
  const auto U = static_cast<std::size_t>(W);
  const std::size_t small = 64, large = 4096;
  DeviceSimWorld world(W, cpdispatch::DeviceSimOptions{std::chrono::milliseconds(60000), -1});
  std::vector<DeviceBuffer<float>> a, b;
  for (std::size_t r = 0; r < U; ++r) {
    a.push_back(device_floats(iota_floats(small, static_cast<float>(r))));
    b.push_back(device_floats(iota_floats(large, 1.0f)));
  }
  world.run([&](DeviceSimTransport& t) { t.all_reduce(a[static_cast<std::size_t>(t.rank())].data(), small, ElementType::float32, {}); });
  world.synchronize();
  const auto graph = world.capture([&](DeviceSimTransport& t) {
    t.all_reduce(a[static_cast<std::size_t>(t.rank())].data(), small, ElementType::float32, {});
  });
  world.run([&](DeviceSimTransport& t) { t.all_reduce(b[static_cast<std::size_t>(t.rank())].data(), large, ElementType::float32, {}); });
  world.synchronize();
  for (std::size_t r = 0; r < U; ++r) {
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(a[r].data(), iota_floats(small, static_cast<float>(r)).data(), small * 4, cudaMemcpyHostToDevice));
  }
  const cpdispatch::cuda::Stream stream;
  graph.launch(stream.get());
  stream.synchronize();
  EXPECT_THAT(cuda_harness::take_violations(), ::testing::IsEmpty());
  std::vector<float> expect(small, 0.0f);
  for (std::size_t r = 0; r < U; ++r) {
    const auto in = iota_floats(small, static_cast<float>(r));
    for (std::size_t i = 0; i < small; ++i) expect[i] += in[i];
  }
  for (std::size_t r = 0; r < U; ++r) EXPECT_EQ(host_floats(a[r]), expect) << "rank " << r;
}

TEST(DeviceSimGraphBuffers, ReplayAfterALargerAllReduceStillFindsItsScratch) { replay_after_growth(2); }
TEST(DeviceSimGraphBuffers, ReplayAfterALargerAllReduceStillFindsItsAccumulators) { replay_after_growth(9); }

TEST(DeviceSimSizes, ElementCountsThatOverflowAreInvalidInput) {
  DeviceSimWorld world(2, cpdispatch::DeviceSimOptions{std::chrono::milliseconds(60000), -1});
  const std::string what = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](DeviceSimTransport& t) { t.all_gather(nullptr, nullptr, std::size_t{1} << 62, ElementType::int64); });
  });
  EXPECT_THAT(what, HasSubstr("all_gather"));
  EXPECT_THAT(what, HasSubstr("overflow the size type"));
}

// ---- launch_sum: more sources than one pass takes need an accumulator ----------------

TEST(LaunchSum, MoreSourcesThanOnePassWithoutAnAccumulatorIsInvalidInput) {
  const std::size_t count = 100;
  std::vector<DeviceBuffer<float>> in;
  std::vector<const void*> sources;
  for (int s = 0; s < 9; ++s) {
    in.push_back(device_floats(iota_floats(count, static_cast<float>(s))));
    sources.push_back(in.back().data());
  }
  DeviceBuffer<float> out(count);
  const std::string what = cptest::message_of<cpdispatch::invalid_input>(
      [&] { cpdispatch::cuda::launch_sum(ElementType::float32, out.data(), nullptr, sources, count, nullptr); });
  EXPECT_THAT(what, HasSubstr("9 sources take several passes and need an accumulator buffer, but acc_buffer is null"));
  // With eight, one pass: no accumulator needed.
  sources.resize(8);
  cpdispatch::cuda::launch_sum(ElementType::float32, out.data(), nullptr, sources, count, nullptr);
  const std::vector<float> got = host_floats(out);
  for (std::size_t i = 0; i < count; ++i) EXPECT_EQ(got[i], 8.0f * static_cast<float>(i) + 28.0f);
}

// ---- the device data path uploads what the kernels read ------------------------------

TEST(DeviceDataPath, UploadsTheChunksTheMaskAndTheStagingOnly) {
  const auto qkv = cptest::random_qkv(2, 17, 64, 4);
  const std::size_t tb = 16;
  DeviceSimWorld world(2, cpdispatch::DeviceSimOptions{std::chrono::milliseconds(60000), -1});
  std::vector<std::pair<std::size_t, std::size_t>> added(2);
  std::vector<std::size_t> expected(2);
  std::mutex one_at_a_time;  // the ranks' constructions one after another, so that the counts are each rank's own
  world.run([&](DeviceSimTransport& t) {
    const int r = t.rank();
    const auto fwd = qkv.kv_fwd.get_slice(r), rev = qkv.kv_rev.get_slice(r);
    const auto plan = cpdispatch::detail::plan_dispatch(fwd, rev, tb, r, 2);
    std::size_t chunks = 0;
    for (const auto* ex : {&plan.forward, &plan.reverse}) {
      for (const auto* list : {&ex->send.copies, &ex->self, &ex->recv.copies}) chunks += cpdispatch::cuda::plan_copy_chunks(*list).size();
    }
    const auto combine = cpdispatch::cuda::plan_combine_chunks(cpdispatch::cuda::normalize_slice(rev), tb);
    std::lock_guard lock(one_at_a_time);
    const auto before = cuda_harness::live_allocations();
    Dispatcher d(t, qkv.kv_fwd, qkv.kv_rev, tb);
    const auto after = cuda_harness::live_allocations();
    const auto me = static_cast<std::size_t>(r);
    added[me] = {after.first - before.first, after.second - before.second};
    expected[me] = chunks * sizeof(cpdispatch::cuda::CopyChunk) + combine.chunks.size() * sizeof(cpdispatch::cuda::CombineChunk) +
                   rev.seq_recv_mask->size() + d.required_bytes().staging_bytes;
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_LE(added[r].first, 4u) << "rank " << r << ": copy chunks, combine chunks, mask, staging";
    EXPECT_EQ(added[r].second, expected[r]) << "rank " << r;
  }
}

TEST(DeviceDataPath, IntegerCombineWrapsAsTheHostCombine) {
  const int W = 3;
  const auto U = static_cast<std::size_t>(W);
  DeviceSimWorld world(W, cpdispatch::DeviceSimOptions{std::chrono::milliseconds(60000), -1});
  for (const auto& c : cptest::pair_cases(W, 6)) {
    if (!c.kv) continue;
    for (ElementType type : {ElementType::int8, ElementType::uint8, ElementType::int32, ElementType::int64}) {
      for (std::size_t elems : {3u, 16u}) {
        const std::size_t tb = elems * cpdispatch::element_size(type);
        SCOPED_TRACE(c.name + " " + cpdispatch::element_name(type) + " token_bytes " + std::to_string(tb));
        std::vector<Bytes> grads;
        for (int r = 0; r < W; ++r) grads.push_back(cptest::pattern(static_cast<std::size_t>(c.rev.send_tokens(r)) * tb, 90 + static_cast<std::uint64_t>(r)));
        const auto replica = cptest::simulate_bytes(c.rev, grads, tb, std::byte{0});
        std::vector<DeviceBytesBuffer> d_grads, d_replica(U), d_grad(U);
        std::vector<Bytes> expect(U);
        for (std::size_t r = 0; r < U; ++r) {
          expect[r].assign(static_cast<std::size_t>(c.fwd.send_tokens(static_cast<std::int64_t>(r))) * tb, std::byte{0});
          cpdispatch::combine_copies(c.rev.get_slice(static_cast<std::int64_t>(r)), replica[r], expect[r], tb, type);
          d_grads.push_back(cptest::to_device(grads[r]));
          d_replica[r] = cptest::to_device(Bytes(replica[r].size(), std::byte{0}));
          d_grad[r] = cptest::to_device(Bytes(expect[r].size(), std::byte{0x77}));
        }
        world.run([&](DeviceSimTransport& t) {
          const auto r = static_cast<std::size_t>(t.rank());
          Dispatcher d(t, c.fwd, c.rev, tb);
          d.reverse_combine(cptest::cbytes(d_grads[r]), cptest::mbytes(d_replica[r]), cptest::mbytes(d_grad[r]), type);
        });
        world.synchronize();
        for (std::size_t r = 0; r < U; ++r) EXPECT_EQ(cptest::to_host(d_grad[r].data(), expect[r].size()), expect[r]) << "rank " << r;
      }
    }
  }
}

// ---- NcclTransport: timeouts, asynchronous errors, failed groups, devices ----------

/// Two communicators of one clique, made on this thread (device 0).
std::vector<ncclComm_t> two_comms(bool blocking) {
  ncclUniqueId id;
  CPDISPATCH_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<ncclComm_t> comms(2);
  for (int r = 0; r < 2; ++r) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    CPDISPATCH_NCCL_CHECK(ncclCommInitRankConfig(&comms[static_cast<std::size_t>(r)], 2, id, r, &config));
  }
  return comms;
}

TEST(NcclTransportTimeout, ACallAPeerNeverMatchesAbortsAndThrowsTimeoutError) {
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const auto comms = two_comms(false);
  const cpdispatch::cuda::Stream stream;
  NcclTransport t(comms[0], stream.get(), cpdispatch::NcclTransportOptions{std::chrono::milliseconds(50)});
  DeviceBuffer<float> buf(16);
  const std::string what = cptest::message_of<cpdispatch::timeout_error>(  // rank 1 never calls: a dead peer
      [&] { t.all_reduce(buf.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum); });
  EXPECT_THAT(what, HasSubstr("NcclTransport: ncclAllReduce on rank 0 of 2: not complete after 50 ms (NcclTransportOptions::timeout)"));
  EXPECT_THAT(what, HasSubstr("the communicator was aborted"));
  EXPECT_TRUE(t.broken());
  const std::string later = cptest::message_of<cpdispatch::nccl_error>([&] { t.barrier(); });
  EXPECT_THAT(later, HasSubstr("NcclTransport: barrier on rank 0 of 2: the communicator was aborted (ncclAllReduce timed out)"));
  stream.synchronize();  // the aborted communicator's work was dropped: nothing hangs
  (void)ncclCommDestroy(comms[1]);
}

TEST(NcclTransportTimeout, ACallBothRanksMakeCompletesWithinTheTimeout) {
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const auto comms = two_comms(false);
  const cpdispatch::cuda::Stream s0, s1;
  const cpdispatch::NcclTransportOptions options{std::chrono::milliseconds(10000)};
  NcclTransport t0(comms[0], s0.get(), options);
  NcclTransport t1(comms[1], s1.get(), options);
  auto a = device_floats(iota_floats(16, 1.0f)), b = device_floats(iota_floats(16, 2.0f));
  std::thread other([&] {
    CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
    t1.all_reduce(b.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);
  });
  t0.all_reduce(a.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);
  other.join();
  s0.synchronize();
  s1.synchronize();
  EXPECT_EQ(host_floats(a), host_floats(b));
  EXPECT_EQ(host_floats(a)[3], 4.0f + 5.0f);
  EXPECT_NO_THROW(t0.check_async());
  EXPECT_FALSE(t0.broken());
  for (ncclComm_t c : comms) (void)ncclCommDestroy(c);
}

TEST(NcclTransportAsyncErrors, CheckAsyncReportsAMismatchAndAborts) {
  ncclComm_t comms[2];
  const int devices[2] = {0, 1};
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(comms, 2, devices));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const cpdispatch::cuda::Stream s0;
  NcclTransport t0(comms[0], s0.get());
  DeviceBuffer<float> a(16);
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(1));
  const cpdispatch::cuda::Stream s1;
  NcclTransport t1(comms[1], s1.get());
  DeviceBuffer<float> b(16);
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  t0.all_reduce(a.data(), 4, ElementType::float32, cpdispatch::ReduceOp::sum);
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(1));
  t1.all_reduce(b.data(), 8, ElementType::float32, cpdispatch::ReduceOp::sum);  // a count the other rank does not use
  EXPECT_EQ(cudaStreamSynchronize(s1.get()), cudaErrorIllegalAddress);  // the double reports the mismatch
  const auto violations = cuda_harness::take_violations();
  ASSERT_EQ(violations.size(), 1u);
  EXPECT_THAT(violations[0], HasSubstr("does not match"));
  const std::string what = cptest::message_of<cpdispatch::nccl_error>([&] { t1.check_async(); });
  EXPECT_THAT(what, HasSubstr("NcclTransport: check_async on rank 1 of 2: NCCL reports the asynchronous error ncclInvalidUsage"));
  EXPECT_TRUE(t1.broken());
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  EXPECT_THROW(t0.check_async(), cpdispatch::nccl_error);
}

TEST(NcclTransportGroups, RequestsOfAGroupThatFailedToIssueFailTheirWait) {
  ncclComm_t comm;
  const int device = 0;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm, 1, &device));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const cpdispatch::cuda::Stream stream;
  NcclTransport t(comm, stream.get());
  DeviceBytesBuffer a(64), b(64);
  const auto recv = t.irecv(b.data(), 64, 0, 1);
  const auto send = t.isend(a.data(), 64, 0, 1);
  nccl_harness::fail_next_group_end = ncclInternalError;
  EXPECT_THAT(cptest::message_of<cpdispatch::nccl_error>([&] { t.wait(send); }), HasSubstr("ncclGroupEnd"));
  EXPECT_THAT(cptest::message_of<cpdispatch::nccl_error>([&] { t.wait(recv); }),
              HasSubstr("NcclTransport: wait on rank 0 of 1: request 1 was never issued: the NCCL group that carried it failed"));
  // Both were waited for once: they are gone.
  EXPECT_THROW(t.wait(recv), cpdispatch::invalid_input);
  stream.synchronize();
  (void)ncclCommDestroy(comm);
}

TEST(NcclTransportDevices, TheCommunicatorsDeviceMustBeCurrent) {
  ncclComm_t comm;
  const int device = 1;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm, 1, &device));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const cpdispatch::cuda::Stream stream;
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { NcclTransport t(comm, stream.get()); }),
              HasSubstr("NcclTransport: NcclTransport on rank 0 of 1: the current device is 0, but the communicator's is 1"));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(1));
  const cpdispatch::cuda::Stream stream1;
  NcclTransport t(comm, stream1.get());
  EXPECT_EQ(t.device(), 1);
  DeviceBuffer<float> buf(16);
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { t.all_reduce(buf.data(), 16, ElementType::float32, {}); }),
              HasSubstr("all_reduce on rank 0 of 1: the current device is 0, but the communicator's is 1"));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(1));
  t.all_reduce(buf.data(), 16, ElementType::float32, {});
  stream1.synchronize();
  (void)ncclCommDestroy(comm);
}

}  // namespace
