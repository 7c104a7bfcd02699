// Posted exchanges on the device sim (cuda-cpu harness): each rank's
// exchange runs on its communication stream while its stream computes,
// wait() orders the stream after it, collectives called before the wait
// leave it intact, a read before the wait is caught under some scheduler
// seed, a captured step replays it, and post + wait make no synchronising
// call and, once warm, no new event.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/transports/device_sim.hpp"
#include "all_to_all_case.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::ElementType;
using cpdispatch::Request;
using cptest::Bytes;
using Buffer = cpdispatch::cuda::DeviceBuffer<std::byte>;

using cptest::AllToAllCase;

Bytes host(const Buffer& b) { return cptest::to_host(b.data(), b.size()); }

constexpr int W = 3;

TEST(DeviceSimPosted, TheStreamComputesWhileTheExchangeTravelsAndWaitOrdersItsReads) {
  const cuda_harness::SeedGuard guard;
  DeviceSimWorld world(W);
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    cuda_harness::set_seed(seed);
    const AllToAllCase first(W, 200, seed), second(W, 24, seed + 50);
    auto send1 = first.sends(), recv1 = first.receives(), send2 = second.sends(), recv2 = second.receives();
    std::vector<Buffer> out1, out2, work;
    for (int r = 0; r < W; ++r) {
      out1.emplace_back(first.bytes());
      out2.emplace_back(second.bytes());
      work.emplace_back(1024);
    }
    world.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      EXPECT_NE(t.comm_stream(), t.stream());
      EXPECT_EQ(t.comm_stream(), world.comm_stream(t.rank()));
      const Request a = first.post(t, send1[r], recv1[r]);
      const Request b = second.post(t, send2[r], recv2[r]);
      CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(work[r].data(), 0x5A, work[r].size(), t.stream()));  // needs neither exchange
      t.wait(b);
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out2[r].data(), recv2[r].data(), second.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
      t.wait(a);
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out1[r].data(), recv1[r].data(), first.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
    });
    world.synchronize();
    for (int r = 0; r < W; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(host(out1[u]), first.expected(r)) << "rank " << r;
      EXPECT_EQ(host(out2[u]), second.expected(r)) << "rank " << r;
      EXPECT_EQ(host(work[u]), Bytes(1024, std::byte{0x5A})) << "rank " << r;
    }
  }
}

TEST(DeviceSimPosted, EachRequestIsWaitedForOnce) {
  DeviceSimWorld world(W);
  const AllToAllCase c(W, 16, 5);
  auto send = c.sends(), recv = c.receives();
  const std::string what = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      const Request request = c.post(t, send[r], recv[r]);
      t.wait(request);
      if (t.rank() == 1) t.wait(request);
    });
  });
  EXPECT_THAT(what, ::testing::HasSubstr("is not a pending posted exchange on this rank"));
  world.synchronize();
}

TEST(DeviceSimPosted, ReadingTheReceiveBufferBeforeTheWaitIsCaughtUnderSomeSeed) {
  const cuda_harness::SeedGuard guard;
  DeviceSimWorld world(W);
  int stale = 0;
  for (std::uint64_t seed = 1; seed <= 24; ++seed) {
    cuda_harness::set_seed(seed);
    const AllToAllCase c(W, 32, seed);
    auto send = c.sends(), recv = c.receives();
    std::vector<Buffer> out;
    for (int r = 0; r < W; ++r) out.emplace_back(c.bytes());
    world.run([&](DeviceSimTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      const Request request = c.post(t, send[r], recv[r]);
      // Deliberately broken: the stream reads the receive buffer before it waits.
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out[r].data(), recv[r].data(), c.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
      t.wait(request);
    });
    world.synchronize();
    for (int r = 0; r < W; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(host(recv[u]), c.expected(r)) << "seed " << seed << " rank " << r;
      stale += host(out[u]) != c.expected(r);
    }
  }
  EXPECT_GT(stale, 0) << "the exchange never ran after the early read, so it is not on a stream of its own";
}

/// The bytes of `n` floats equal to `value`.
Bytes floats_of(std::size_t n, float value) {
  Bytes out(n * sizeof(float));
  for (std::size_t i = 0; i < n; ++i) std::memcpy(out.data() + i * sizeof(float), &value, sizeof(float));
  return out;
}

TEST(DeviceSimPosted, CollectivesCalledBeforeTheWaitLeaveTheExchangeIntact) {
  const cuda_harness::SeedGuard guard;
  DeviceSimWorld world(W);
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    cuda_harness::set_seed(seed);
    const AllToAllCase first(W, 64, seed), blocking(W, 40, seed + 1), last(W, 8, seed + 2);
    auto send1 = first.sends(), recv1 = first.receives(), send2 = blocking.sends(), recv2 = blocking.receives();
    auto send3 = last.sends(), recv3 = last.receives();
    std::vector<Buffer> sums, ring_send, ring_recv;
    for (int r = 0; r < W; ++r) {
      sums.push_back(cptest::to_device(floats_of(8, static_cast<float>(r + 1))));
      ring_send.push_back(cptest::to_device(cptest::pattern(50, 900 + static_cast<std::uint64_t>(r))));
      ring_recv.push_back(cptest::to_device(Bytes(50, std::byte{0})));
    }
    world.run([&](DeviceSimTransport& t) {
      const int me = t.rank();
      const auto r = static_cast<std::size_t>(me);
      const Request a = first.post(t, send1[r], recv1[r]);
      t.all_reduce(sums[r].data(), 8, ElementType::float32, cpdispatch::ReduceOp::sum);
      t.barrier();
      const Request to = t.irecv(ring_recv[r].data(), 50, (me + W - 1) % W, 1);
      const Request from = t.isend(ring_send[r].data(), 50, (me + 1) % W, 1);
      t.wait(from);
      t.wait(to);
      t.all_to_all_v(send2[r].data(), blocking.counts, blocking.displs, recv2[r].data(), blocking.counts, blocking.displs);
      const Request c = last.post(t, send3[r], recv3[r]);
      t.wait(c);
      t.wait(a);
    });
    world.synchronize();
    for (int r = 0; r < W; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(host(recv1[u]), first.expected(r)) << "rank " << r;
      EXPECT_EQ(host(recv2[u]), blocking.expected(r)) << "rank " << r;
      EXPECT_EQ(host(recv3[u]), last.expected(r)) << "rank " << r;
      EXPECT_EQ(host(sums[u]), floats_of(8, static_cast<float>(W * (W + 1) / 2))) << "rank " << r;
      EXPECT_EQ(host(ring_recv[u]), cptest::pattern(50, 900 + static_cast<std::uint64_t>((r + W - 1) % W))) << "rank " << r;
    }
  }
}

TEST(DeviceSimPosted, PostWaitAndADeviceCopyMakeNoSynchronisingCallNorNewEvents) {
  DeviceSimWorld world(W);
  const AllToAllCase c(W, 48, 3);
  auto send = c.sends(), recv = c.receives();
  std::vector<Buffer> out;
  for (int r = 0; r < W; ++r) out.emplace_back(c.bytes());
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    t.wait(c.post(t, send[r], recv[r]));  // the first post makes the pool's event
  });
  std::vector<std::uint64_t> synchronising(static_cast<std::size_t>(W), 99);
  const std::size_t events_before = cuda_harness::events_created();
  world.run([&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const std::uint64_t before = cuda_harness::synchronizing_calls_on_this_thread();
    for (int i = 0; i < 6; ++i) {
      const Request request = c.post(t, send[r], recv[r]);
      t.wait(request);
      CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out[r].data(), recv[r].data(), c.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
    }
    synchronising[r] = cuda_harness::synchronizing_calls_on_this_thread() - before;
  });
  EXPECT_EQ(cuda_harness::events_created(), events_before) << "steady-state posts reuse the pool's events";
  world.synchronize();
  for (int r = 0; r < W; ++r) {
    const auto u = static_cast<std::size_t>(r);
    EXPECT_EQ(synchronising[u], 0u) << "rank " << r;
    EXPECT_EQ(host(out[u]), c.expected(r)) << "rank " << r;
  }
}

TEST(DeviceSimPosted, ACapturedStepWithAPostedExchangeReplaysTheSameBytes) {
  DeviceSimWorld world(W);
  const AllToAllCase c(W, 100, 11);
  auto send = c.sends(), recv = c.receives();
  std::vector<Buffer> out, work;
  for (int r = 0; r < W; ++r) {
    out.emplace_back(c.bytes());
    work.emplace_back(256);
  }
  auto step = [&](DeviceSimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const Request request = c.post(t, send[r], recv[r]);
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(work[r].data(), 0x11, work[r].size(), t.stream()));
    t.wait(request);
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out[r].data(), recv[r].data(), c.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
  };
  world.run(step);  // warm: the pool's event exists before the capture
  world.synchronize();
  for (auto& b : out) CPDISPATCH_CUDA_CHECK(cudaMemset(b.data(), 0, b.size()));
  for (auto& b : recv) CPDISPATCH_CUDA_CHECK(cudaMemset(b.data(), 0, b.size()));
  cptest::device_sync();
  const cpdispatch::DeviceSimGraph graph = world.capture(step);
  EXPECT_EQ(host(out[0]), Bytes(c.bytes(), std::byte{0}));  // captured, not run
  const cpdispatch::cuda::Stream replay;
  graph.launch(replay.get());
  graph.launch(replay.get());
  replay.synchronize();
  for (int r = 0; r < W; ++r) {
    const auto u = static_cast<std::size_t>(r);
    EXPECT_EQ(host(out[u]), c.expected(r)) << "rank " << r;
    EXPECT_EQ(host(work[u]), Bytes(256, std::byte{0x11})) << "rank " << r;
  }
}

}  // namespace
