// The cuda-cpu harness's doubles find what a GPU run would show: a missing
// event wait gives wrong bytes under some scheduling order, a one-byte
// overrun is caught by the guard bytes, freed memory used by a later kernel
// is reported, capture errors fail as CUDA fails them, launch configurations
// are checked, graphs replay in dependency order, and the NCCL double
// reports mismatched and unmatched operations, runs grouped sends and
// receives on any stream in that stream's event order, and deadlocks (a
// reported stall) when two ranks reach a communicator's operations in
// different orders. Synchronising calls are counted.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/cuda/kernels.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"
#include "nccl.h"

namespace {

using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::Event;
using cpdispatch::cuda::Stream;
using ::testing::HasSubstr;

__global__ void write_byte(unsigned char* p, std::uint64_t at, unsigned char value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) p[at] = value;
}

/// p[slot] = ++p[0]: the order in which stamps ran.
__global__ void stamp(unsigned char* p, std::uint64_t slot) {
  if (threadIdx.x == 0 && blockIdx.x == 0) p[slot] = ++p[0];
}

__global__ void fill(unsigned char* p, std::uint64_t n, unsigned char value) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) p[i] = value;
}

__global__ void add_one(unsigned char* p, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x) ++p[i];
}

unsigned char read_byte(const unsigned char* device) {
  unsigned char v = 0;
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(&v, device, 1, cudaMemcpyDeviceToHost));
  return v;
}

/// Stream b copies what stream a wrote, with or without the event between them.
int stale_reads(bool wait, int trials) {
  const Stream a, b;
  const Event written;
  DeviceBuffer<unsigned char> src(1), dst(1);
  int stale = 0;
  for (int i = 0; i < trials; ++i) {
    CPDISPATCH_CUDA_CHECK(cudaMemset(src.data(), 0, 1));
    cpdispatch::cuda::launch_kernel("write_byte", &write_byte, 1, 32, a.get(), src.data(), std::uint64_t{0}, static_cast<unsigned char>(1));
    written.record(a.get());
    if (wait) written.wait_on(b.get());
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), 1, cudaMemcpyDeviceToDevice, b.get()));
    CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
    stale += read_byte(dst.data()) != 1;
  }
  return stale;
}

TEST(HarnessStreams, AMissingEventWaitShowsUnderSomeOrderAndAPresentOneNever) {
  EXPECT_GT(stale_reads(false, 64), 0) << "seed " << cuda_harness::seed();
  EXPECT_EQ(stale_reads(true, 64), 0);
}

/// Three stamps on stream a and three on stream b (b after a's second one
/// when `wait`); the order they ran in, slots 1..6.
std::vector<unsigned char> stamps(std::uint64_t seed, bool wait) {
  cuda_harness::set_seed(seed);
  const Stream a, b;
  const Event second;
  DeviceBuffer<unsigned char> p(8);
  CPDISPATCH_CUDA_CHECK(cudaMemset(p.data(), 0, 8));
  for (std::uint64_t i = 1; i <= 3; ++i) {
    cpdispatch::cuda::launch_kernel("stamp", &stamp, 1, 32, a.get(), p.data(), i);
    if (i == 2) second.record(a.get());
  }
  if (wait) second.wait_on(b.get());
  for (std::uint64_t i = 4; i <= 6; ++i) cpdispatch::cuda::launch_kernel("stamp", &stamp, 1, 32, b.get(), p.data(), i);
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> out(8);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(out.data(), p.data(), 8, cudaMemcpyDeviceToHost));
  return {out.begin() + 1, out.begin() + 7};
}

TEST(HarnessStreams, TwoStreamsInterleaveAsTheSeedChoosesAndEventsAreHonoured) {
  const cuda_harness::SeedGuard guard;
  int a_first = 0, b_first = 0;
  for (std::uint64_t seed = 1; seed <= 32; ++seed) {
    const auto free = stamps(seed, false);
    SCOPED_TRACE("seed " + std::to_string(seed));
    EXPECT_TRUE(free[0] < free[1] && free[1] < free[2] && free[3] < free[4] && free[4] < free[5]);  // each stream in order
    (free[0] < free[3] ? a_first : b_first) += 1;
    EXPECT_EQ(stamps(seed, false), free);  // the seed alone decides the interleaving
    const auto ordered = stamps(seed, true);
    EXPECT_GT(ordered[3], ordered[1]);  // b's first stamp after a's second
  }
  EXPECT_GT(a_first, 0);
  EXPECT_GT(b_first, 0);
}

TEST(HarnessStreams, NothingRunsBeforeASynchronisationPoint) {
  const Stream s;
  DeviceBuffer<unsigned char> p(1);
  CPDISPATCH_CUDA_CHECK(cudaMemset(p.data(), 0, 1));
  cpdispatch::cuda::launch_kernel("write_byte", &write_byte, 1, 32, s.get(), p.data(), std::uint64_t{0}, static_cast<unsigned char>(7));
  EXPECT_EQ(cudaStreamQuery(s.get()), cudaSuccess);  // a query runs what can run
  EXPECT_EQ(read_byte(p.data()), 7);
}

TEST(HarnessSync, EverySynchronisingCallIsCountedAndNoOtherCall) {
  const Stream s;
  const Event e;
  std::vector<unsigned char> host(16);
  const std::uint64_t total = cuda_harness::synchronizing_calls();
  const std::uint64_t here = cuda_harness::synchronizing_calls_on_this_thread();
  auto made = [&] { return cuda_harness::synchronizing_calls_on_this_thread() - here; };
  void* p = nullptr;
  CPDISPATCH_CUDA_CHECK(cudaMalloc(&p, 16));
  EXPECT_EQ(made(), 1u);
  CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(p, 1, 16, s.get()));
  CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(host.data(), p, 16, cudaMemcpyDeviceToHost, s.get()));
  e.record(s.get());
  e.wait_on(s.get());
  (void)cudaStreamQuery(s.get());
  (void)cudaEventQuery(e.get());
  cpdispatch::cuda::launch_kernel("add_one", &add_one, 1, 32, s.get(), static_cast<unsigned char*>(p), std::uint64_t{16});
  EXPECT_EQ(made(), 1u);  // asynchronous work and queries block nothing
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  CPDISPATCH_CUDA_CHECK(cudaEventSynchronize(e.get()));
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(made(), 4u);
  CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), p, 16, cudaMemcpyDeviceToHost));  // once, not twice
  CPDISPATCH_CUDA_CHECK(cudaMemset(p, 0, 16));
  EXPECT_EQ(made(), 6u);
  CPDISPATCH_CUDA_CHECK(cudaFree(nullptr));  // does nothing
  CPDISPATCH_CUDA_CHECK(cudaFree(p));
  EXPECT_EQ(made(), 7u);
  EXPECT_GE(cuda_harness::synchronizing_calls() - total, 7u);  // the total counts every thread
}

TEST(HarnessMemory, AOneByteOverrunIsCaughtByTheGuardBytes) {
  {
    DeviceBuffer<unsigned char> p(100);
    cpdispatch::cuda::launch_kernel("write_byte", &write_byte, 1, 32, nullptr, p.data(), std::uint64_t{100}, static_cast<unsigned char>(1));
    CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  }  // cudaFree checks the guards
  const auto violations = cuda_harness::take_violations();
  ASSERT_EQ(violations.size(), 1u);
  EXPECT_THAT(violations[0], HasSubstr("guard byte 0 after an allocation of 100 bytes"));
}

TEST(HarnessMemory, FreshMemoryIsPoisoned) {
  DeviceBuffer<unsigned char> p(16);
  EXPECT_EQ(read_byte(p.data()), 0xCB);
}

TEST(HarnessMemory, AKernelArgumentIntoFreedMemoryIsReported) {
  void* p = nullptr;
  CPDISPATCH_CUDA_CHECK(cudaMalloc(&p, 64));
  CPDISPATCH_CUDA_CHECK(cudaFree(p));
  cpdispatch::cuda::launch_kernel("add_one", &add_one, 1, 64, nullptr, static_cast<unsigned char*>(p), std::uint64_t{64});
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  const auto violations = cuda_harness::take_violations();
  ASSERT_FALSE(violations.empty());
  EXPECT_THAT(violations[0], HasSubstr("add_one: argument 0 points into freed device memory"));
}

TEST(HarnessMemory, CopiesOutsideAnAllocationAreInvalidValues) {
  DeviceBuffer<unsigned char> p(16);
  std::vector<unsigned char> host(32);
  EXPECT_EQ(cudaMemcpy(p.data(), host.data(), 17, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), p.data() + 8, 8, cudaMemcpyDeviceToHost), cudaSuccess);
}

TEST(HarnessLaunch, ConfigurationsBeyondTheLimitsFailTheLaunch) {
  DeviceBuffer<unsigned char> p(16);
  const std::string what = cptest::message_of<cpdispatch::cuda_error>(
      [&] { cpdispatch::cuda::launch_kernel("add_one", &add_one, 1, 2048, nullptr, p.data(), std::uint64_t{16}); });
  EXPECT_THAT(what, HasSubstr("add_one failed at"));
  EXPECT_THAT(what, HasSubstr("cudaErrorInvalidConfiguration"));
  EXPECT_THROW(cpdispatch::cuda::launch_kernel("add_one", &add_one, dim3(1, 70000), 32, nullptr, p.data(), std::uint64_t{16}),
               cpdispatch::cuda_error);
}

TEST(HarnessLaunch, AStreamOfAnotherDeviceIsRefused) {
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(1));
  const Stream other;
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  DeviceBuffer<unsigned char> p(16);
  EXPECT_THROW(cpdispatch::cuda::launch_kernel("add_one", &add_one, 1, 32, other.get(), p.data(), std::uint64_t{16}), cpdispatch::cuda_error);
}

// ---- capture ----

TEST(HarnessCapture, AJoinedStreamNotJoinedBackFailsTheCapture) {
  const Stream origin, side;
  const Event fork;
  DeviceBuffer<unsigned char> p(16);
  CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(origin.get(), cudaStreamCaptureModeRelaxed));
  fork.record(origin.get());
  fork.wait_on(side.get());
  CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(p.data(), 1, 16, side.get()));
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(origin.get(), &graph), cudaErrorStreamCaptureUnjoined);
  EXPECT_EQ(graph, nullptr);
  (void)cudaGetLastError();
}

TEST(HarnessCapture, SynchronisingDuringACaptureInvalidatesIt) {
  const Stream s;
  DeviceBuffer<unsigned char> p(16);
  CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(p.data(), 1, 16, s.get()));
  EXPECT_EQ(cudaStreamSynchronize(s.get()), cudaErrorStreamCaptureUnsupported);
  void* q = nullptr;
  EXPECT_EQ(cudaMalloc(&q, 16), cudaErrorStreamCaptureUnsupported);  // global mode: no allocation either
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s.get(), &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  EXPECT_EQ(read_byte(p.data()), 0xCB);  // nothing of the capture ran
}

TEST(HarnessCapture, AGraphReplaysItsBranchesInADependencyRespectingOrder) {
  const Stream origin, side;
  const Event fork, join;
  DeviceBuffer<unsigned char> a(256), b(256);
  CPDISPATCH_CUDA_CHECK(cudaMemset(a.data(), 0, 256));
  CPDISPATCH_CUDA_CHECK(cudaMemset(b.data(), 0, 256));
  CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(origin.get(), cudaStreamCaptureModeRelaxed));
  fork.record(origin.get());
  fork.wait_on(side.get());
  cpdispatch::cuda::launch_kernel("add_one", &add_one, 2, 64, origin.get(), a.data(), std::uint64_t{256});  // a = 1
  CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), 256, cudaMemcpyDeviceToDevice, origin.get()));  // b = a
  cpdispatch::cuda::launch_kernel("add_one", &add_one, 2, 64, side.get(), a.data() + 128, std::uint64_t{0});  // an independent branch
  join.record(side.get());
  join.wait_on(origin.get());
  cpdispatch::cuda::launch_kernel("add_one", &add_one, 2, 64, origin.get(), b.data(), std::uint64_t{256});  // b = a + 1
  cudaGraph_t graph = nullptr;
  CPDISPATCH_CUDA_CHECK(cudaStreamEndCapture(origin.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  CPDISPATCH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  EXPECT_EQ(read_byte(a.data()), 0);  // captured, not run
  for (int i = 1; i <= 20; ++i) {
    CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec, origin.get()));
    origin.synchronize();
    ASSERT_EQ(read_byte(a.data() + 200), i);
    ASSERT_EQ(read_byte(b.data() + 3), i + 1);
  }
  CPDISPATCH_CUDA_CHECK(cudaGraphExecDestroy(exec));
  CPDISPATCH_CUDA_CHECK(cudaGraphDestroy(graph));
}

// ---- the NCCL double ----

TEST(HarnessNccl, MismatchedCountsAreReportedAndNothingHangs) {
  ncclComm_t comms[2];
  const int devices[2] = {0, 0};
  ASSERT_EQ(ncclCommInitAll(comms, 2, devices), ncclSuccess);
  const Stream s0, s1;
  DeviceBuffer<unsigned char> a(64), b(64);
  ASSERT_EQ(ncclSend(a.data(), 64, ncclUint8, 1, comms[0], s0.get()), ncclSuccess);
  ASSERT_EQ(ncclRecv(b.data(), 32, ncclUint8, 0, comms[1], s1.get()), ncclSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  const auto violations = cuda_harness::take_violations();
  ASSERT_EQ(violations.size(), 1u);
  EXPECT_THAT(violations[0], HasSubstr("send 0 from rank 0 to rank 1 has 64 elements of type 1, the receive 32"));
  ncclResult_t async = ncclSuccess;
  ASSERT_EQ(ncclCommGetAsyncError(comms[1], &async), ncclSuccess);
  EXPECT_EQ(async, ncclInvalidUsage);
}

TEST(HarnessNccl, SendsMatchReceivesInPerPeerOrder) {
  ncclComm_t comms[2];
  const int devices[2] = {0, 0};
  ASSERT_EQ(ncclCommInitAll(comms, 2, devices), ncclSuccess);
  const Stream s0, s1;
  DeviceBuffer<unsigned char> x(8), y(8), u(8), v(8);
  CPDISPATCH_CUDA_CHECK(cudaMemset(x.data(), 1, 8));
  CPDISPATCH_CUDA_CHECK(cudaMemset(y.data(), 2, 8));
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(x.data(), 8, ncclUint8, 1, comms[0], s0.get()), ncclSuccess);
  ASSERT_EQ(ncclSend(y.data(), 8, ncclUint8, 1, comms[0], s0.get()), ncclSuccess);
  ASSERT_EQ(ncclRecv(u.data(), 8, ncclUint8, 0, comms[1], s1.get()), ncclSuccess);
  ASSERT_EQ(ncclRecv(v.data(), 8, ncclUint8, 0, comms[1], s1.get()), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(read_byte(u.data() + 7), 1);
  EXPECT_EQ(read_byte(v.data()), 2);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);  // not opened
  for (ncclComm_t c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
}

TEST(HarnessNccl, AnUnmatchedReceiveIsReportedAsNoProgress) {
  ncclComm_t comms[2];
  const int devices[2] = {0, 0};
  ASSERT_EQ(ncclCommInitAll(comms, 2, devices), ncclSuccess);
  const Stream s;
  DeviceBuffer<unsigned char> b(8);
  ASSERT_EQ(ncclRecv(b.data(), 8, ncclUint8, 1, comms[0], s.get()), ncclSuccess);
  cuda_harness::set_stall_limit(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamSynchronize(s.get()), cudaErrorLaunchTimeout);
  cuda_harness::set_stall_limit(std::chrono::milliseconds(20000));
  const auto violations = cuda_harness::take_violations();
  ASSERT_EQ(violations.size(), 1u);
  EXPECT_THAT(violations[0], HasSubstr("waits in ncclRecv on rank 0"));
  ASSERT_EQ(ncclCommAbort(comms[0]), ncclSuccess);  // its pending work is dropped
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  int rank = -1;
  EXPECT_EQ(ncclCommUserRank(comms[0], &rank), ncclInvalidArgument);  // used after the abort
  EXPECT_THAT(cuda_harness::take_violations(), ::testing::ElementsAre(HasSubstr("use of a communicator after ncclCommAbort")));
}

/// Two communicators of one clique on device 0.
std::vector<ncclComm_t> pair_of_comms() {
  std::vector<ncclComm_t> comms(2);
  const int devices[2] = {0, 0};
  EXPECT_EQ(ncclCommInitAll(comms.data(), 2, devices), ncclSuccess);
  return comms;
}

/// Rank r's compute stream fills its send buffer with r + 1; its
/// communication stream exchanges it with the other rank in one group; the
/// compute stream copies what arrived to `out`. With `events`, the
/// communication stream waits for the fill and the compute stream for the
/// exchange. Returns how many ranks' `out` is wrong.
int exchange_on_side_streams(bool events) {
  const auto comms = pair_of_comms();
  const Stream compute[2], comm[2];
  const Event ready[2], done[2];
  DeviceBuffer<unsigned char> send[2] = {DeviceBuffer<unsigned char>(64), DeviceBuffer<unsigned char>(64)};
  DeviceBuffer<unsigned char> recv[2] = {DeviceBuffer<unsigned char>(64), DeviceBuffer<unsigned char>(64)};
  DeviceBuffer<unsigned char> out[2] = {DeviceBuffer<unsigned char>(64), DeviceBuffer<unsigned char>(64)};
  for (int r = 0; r < 2; ++r) {
    CPDISPATCH_CUDA_CHECK(cudaMemset(send[r].data(), 0, 64));
    CPDISPATCH_CUDA_CHECK(cudaMemset(recv[r].data(), 0, 64));
  }
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < 2; ++r) {
    cpdispatch::cuda::launch_kernel("fill", &fill, 1, 64, compute[r].get(), send[r].data(), std::uint64_t{64}, static_cast<unsigned char>(r + 1));
    ready[r].record(compute[r].get());
    if (events) ready[r].wait_on(comm[r].get());
  }
  EXPECT_EQ(ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ncclSend(send[r].data(), 64, ncclUint8, 1 - r, comms[static_cast<std::size_t>(r)], comm[r].get()), ncclSuccess);
    EXPECT_EQ(ncclRecv(recv[r].data(), 64, ncclUint8, 1 - r, comms[static_cast<std::size_t>(r)], comm[r].get()), ncclSuccess);
  }
  EXPECT_EQ(ncclGroupEnd(), ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    done[r].record(comm[r].get());
    if (events) done[r].wait_on(compute[r].get());
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out[r].data(), recv[r].data(), 64, cudaMemcpyDeviceToDevice, compute[r].get()));
  }
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  int wrong = 0;
  for (int r = 0; r < 2; ++r) {
    std::vector<unsigned char> host(64);
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), out[r].data(), 64, cudaMemcpyDeviceToHost));
    wrong += host != std::vector<unsigned char>(64, static_cast<unsigned char>(2 - r));
  }
  for (ncclComm_t c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
  return wrong;
}

TEST(HarnessNccl, GroupedSendsAndReceivesOnSideStreamsFollowTheirEvents) {
  const cuda_harness::SeedGuard guard;
  int wrong_without = 0;
  for (std::uint64_t seed = 1; seed <= 24; ++seed) {
    cuda_harness::set_seed(seed);
    EXPECT_EQ(exchange_on_side_streams(true), 0) << "seed " << seed;
    wrong_without += exchange_on_side_streams(false);
  }
  EXPECT_GT(wrong_without, 0);  // the scheduler does run the streams in every order
}

/// Each rank enqueues a send or receive on stream a and an all-reduce on
/// stream b (b after a when `ordered`). Returns whether the streams stalled.
bool two_streams_on_one_communicator(bool ordered) {
  const auto comms = pair_of_comms();
  const Stream a[2], b[2];
  const Event sent[2];
  DeviceBuffer<unsigned char> buf[2] = {DeviceBuffer<unsigned char>(16), DeviceBuffer<unsigned char>(16)};
  DeviceBuffer<float> sum[2] = {DeviceBuffer<float>(4), DeviceBuffer<float>(4)};
  for (int r = 0; r < 2; ++r) CPDISPATCH_CUDA_CHECK(cudaMemset(buf[r].data(), 0, 16));
  EXPECT_EQ(ncclSend(buf[0].data(), 16, ncclUint8, 1, comms[0], a[0].get()), ncclSuccess);
  EXPECT_EQ(ncclRecv(buf[1].data(), 16, ncclUint8, 0, comms[1], a[1].get()), ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    sent[r].record(a[r].get());
    if (ordered) sent[r].wait_on(b[r].get());
    EXPECT_EQ(ncclAllReduce(sum[r].data(), sum[r].data(), 4, ncclFloat32, ncclSum, comms[static_cast<std::size_t>(r)], b[r].get()), ncclSuccess);
  }
  const bool stalled = cudaDeviceSynchronize() == cudaErrorLaunchTimeout;
  (void)cudaGetLastError();
  if (!stalled) {
    for (ncclComm_t c : comms) EXPECT_EQ(ncclCommDestroy(c), ncclSuccess);
    return false;
  }
  EXPECT_THAT(cuda_harness::take_violations(), ::testing::ElementsAre(HasSubstr("no operation could run")));
  for (ncclComm_t c : comms) EXPECT_EQ(ncclCommAbort(c), ncclSuccess);  // drops the stuck work
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  return true;
}

TEST(HarnessNccl, RanksReachingACommunicatorsOperationsInDifferentOrdersDeadlock) {
  const cuda_harness::SeedGuard guard;
  cuda_harness::set_stall_limit(std::chrono::milliseconds(100));
  int stalls = 0;
  for (std::uint64_t seed = 1; seed <= 16; ++seed) {
    cuda_harness::set_seed(seed);
    EXPECT_FALSE(two_streams_on_one_communicator(true)) << "seed " << seed;
    stalls += two_streams_on_one_communicator(false);
  }
  cuda_harness::set_stall_limit(std::chrono::milliseconds(20000));
  EXPECT_GT(stalls, 0);
}

}  // namespace
