// The cuda-cpu harness's doubles find what a GPU run would show: a missing
// event wait gives wrong bytes under some scheduling order, a one-byte
// overrun is caught by the guard bytes, freed memory used by a later kernel
// is reported, capture errors fail as CUDA fails them, launch configurations
// are checked, graphs replay in dependency order, and the NCCL double
// reports mismatched and unmatched operations.

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

TEST(HarnessStreams, NothingRunsBeforeASynchronisationPoint) {
  const Stream s;
  DeviceBuffer<unsigned char> p(1);
  CPDISPATCH_CUDA_CHECK(cudaMemset(p.data(), 0, 1));
  cpdispatch::cuda::launch_kernel("write_byte", &write_byte, 1, 32, s.get(), p.data(), std::uint64_t{0}, static_cast<unsigned char>(7));
  EXPECT_EQ(cudaStreamQuery(s.get()), cudaSuccess);  // a query runs what can run
  EXPECT_EQ(read_byte(p.data()), 7);
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

}  // namespace
