// The NCCL transport through the dispatcher: at W = 1 on one GPU (NCCL does
// not put two ranks on one GPU; the device sim covers W > 1 there), and at
// W = number of GPUs (up to 8) when a machine has two or more. Results are
// byte-identical to the host simulation; a whole step captured in a CUDA
// graph replays the same bytes (bad arguments and NCCL's own failures:
// test_nccl_errors.cpp). Posted exchanges run on the communication stream
// while the stream computes, wait() orders the stream after them, and
// collectives called before the wait run after the exchange on every rank
// (under the harness: many scheduler seeds, a read before the wait caught,
// no synchronising call). The watchdog reports a post or a collective a peer
// never joins and leaves completed or captured calls alone. Without a CUDA
// device every test skips ("no CUDA device").

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "all_to_all_case.hpp"
#include "cuda_test_util.hpp"
#include "dispatch_helpers.hpp"
#include "nccl_world.hpp"

namespace {

using cpdispatch::ElementType;
using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::NcclTransport;
using cpdispatch::cuda::DeviceBuffer;
using cptest::Bytes;
using cptest::cbytes;
using cptest::mbytes;
using cptest::to_device;
using cptest::to_host;

using DeviceBytesBuffer = DeviceBuffer<std::byte>;

/// One communicator per GPU 0..n-1 of this process (ncclCommInitAll).
class NcclComms {
 public:
  explicit NcclComms(int n) : comms_(static_cast<std::size_t>(n)), devices_(static_cast<std::size_t>(n)), aborted_(static_cast<std::size_t>(n)) {
    for (int d = 0; d < n; ++d) devices_[static_cast<std::size_t>(d)] = d;
    CPDISPATCH_NCCL_CHECK(ncclCommInitAll(comms_.data(), n, devices_.data()));
  }
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;
  ~NcclComms() {
    for (std::size_t r = 0; r < comms_.size(); ++r) {
      if (!aborted_[r]) (void)ncclCommDestroy(comms_[r]);  // ncclCommAbort freed the others
    }
  }
  int size() const { return static_cast<int>(comms_.size()); }

  /// Runs f(transport) for every rank on its own thread and GPU, then waits
  /// for the streams. A failing rank aborts its own communicator, and the
  /// others abort theirs when they see it, each thread touching only its own
  /// (ncclCommAbort on a communicator another thread still uses is a race).
  /// The first exception is rethrown; the communicators are then unusable.
  template <class F>
  void run(F f) {
    std::mutex mutex;
    std::exception_ptr first;
    std::atomic<bool> failed{false};
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) {
      threads.emplace_back([&, r] {
        const auto me = static_cast<std::size_t>(r);
        auto give_up = [&] {  // abort our own communicator before anything of ours is released
          failed = true;
          if (!aborted_[me]) (void)ncclCommAbort(comms_[me]);
          aborted_[me] = true;
          std::lock_guard lock(mutex);
          if (!first) first = std::current_exception();
        };
        try {
          CPDISPATCH_CUDA_CHECK(cudaSetDevice(devices_[me]));
          const cpdispatch::cuda::Stream stream;
          NcclTransport t(comms_[me], stream.get());
          try {
            f(t);
            // Poll rather than block: a peer's failure must be able to end the wait.
            cudaError_t rc;
            while ((rc = cudaStreamQuery(stream.get())) == cudaErrorNotReady) {
              if (failed) throw std::runtime_error("rank " + std::to_string(r) + " stopped: another rank failed");
              std::this_thread::yield();
            }
            CPDISPATCH_CUDA_CHECK(rc);
          } catch (...) {
            give_up();
          }
        } catch (...) {
          give_up();
        }
      });
    }
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

 private:
  std::vector<ncclComm_t> comms_;
  std::vector<int> devices_;
  std::vector<char> aborted_;  // per rank, written by that rank's thread only
};

/// Forward and reverse of every pair case, and the combine of the KV ones,
/// on `comms` (one rank per GPU), against the host simulation.
void expect_dispatch_matches_simulation(NcclComms& comms, std::uint64_t seed) {
  const int W = comms.size();
  const auto U = static_cast<std::size_t>(W);
  for (const auto& c : cptest::pair_cases(W, seed)) {
    for (std::size_t tb : cptest::sizes<std::size_t>({2, 12, 1000, 8192}, {12, 1000})) {
      SCOPED_TRACE(c.name + " token_bytes " + std::to_string(tb));
      const auto mlp = cptest::inputs_for(W, tb, seed, [&](int r) { return c.fwd.send_tokens(r); });
      const auto attention_in = cptest::inputs_for(W, tb, seed + 7, [&](int r) { return c.rev.send_tokens(r); });
      const auto expect_attention = cptest::simulate_bytes(c.fwd, mlp, tb);
      const auto expect_replica = cptest::simulate_bytes(c.rev, attention_in, tb);
      std::vector<Bytes> attention(U), replica(U);
      comms.run([&](NcclTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        const auto d_mlp = to_device(mlp[r]), d_in = to_device(attention_in[r]);
        const auto d_attn = to_device(Bytes(expect_attention[r].size(), std::byte{0xA5}));
        const auto d_replica = to_device(Bytes(expect_replica[r].size(), std::byte{0xA5}));
        Dispatcher d(t, c.fwd, c.rev, tb);
        d.forward(cbytes(d_mlp), mbytes(d_attn));
        d.reverse(cbytes(d_in), mbytes(d_replica));
        attention[r] = to_host(d_attn.data(), expect_attention[r].size());
        replica[r] = to_host(d_replica.data(), expect_replica[r].size());
      });
      for (std::size_t r = 0; r < U; ++r) {
        EXPECT_EQ(attention[r], expect_attention[r]) << "forward, rank " << r;
        EXPECT_EQ(replica[r], expect_replica[r]) << "reverse, rank " << r;
      }
    }
    if (!c.kv) continue;
    for (auto type : {ElementType::float32, ElementType::bfloat16, ElementType::float16}) {
      SCOPED_TRACE(c.name + " combine " + cpdispatch::element_name(type));
      const std::size_t tb = 8 * cpdispatch::element_size(type);
      std::vector<Bytes> grads;
      for (int r = 0; r < W; ++r) {
        grads.push_back(cptest::float_pattern(static_cast<std::size_t>(c.rev.send_tokens(r)) * tb, seed + static_cast<std::uint64_t>(r), type));
      }
      const auto expect_replica = cptest::simulate_bytes(c.rev, grads, tb, std::byte{0});
      std::vector<Bytes> grad(U);
      comms.run([&](NcclTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        Dispatcher d(t, c.fwd, c.rev, tb);
        const auto d_grads = to_device(grads[r]);
        const auto d_replica = to_device(Bytes(d.required_bytes().replica_bytes, std::byte{0}));
        DeviceBytesBuffer d_grad(d.required_bytes().mlp_bytes);
        d.reverse_combine(cbytes(d_grads), mbytes(d_replica), mbytes(d_grad), type);
        grad[r] = to_host(d_grad.data(), d_grad.size());
      });
      for (std::size_t r = 0; r < U; ++r) {
        Bytes expect(grad[r].size(), std::byte{0});
        cpdispatch::combine_copies(c.rev.get_slice(static_cast<std::int64_t>(r)), expect_replica[r], expect, tb, type);
        EXPECT_EQ(grad[r], expect) << "rank " << r;
      }
    }
  }
}

TEST(NcclTransportOneRank, DispatcherMatchesTheHostSimulation) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  NcclComms comms(1);
  for (std::uint64_t seed : cptest::sizes<std::uint64_t>({1, 2}, {1})) expect_dispatch_matches_simulation(comms, seed);
}

TEST(NcclTransportOneRank, CollectivesAndPointToPoint) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  NcclComms comms(1);
  comms.run([&](NcclTransport& t) {
    EXPECT_EQ(t.rank(), 0);
    EXPECT_EQ(t.world_size(), 1);
    const Bytes a = cptest::float_pattern(4096, 3, ElementType::bfloat16), b = cptest::pattern(4096, 4);
    const auto d_a = to_device(a), d_b = to_device(b);
    DeviceBytesBuffer d_c(4096);
    t.all_reduce(d_a.data(), 2048, ElementType::bfloat16, cpdispatch::ReduceOp::sum);  // one rank: unchanged
    t.all_gather(d_b.data(), d_c.data(), 4096, ElementType::uint8);
    EXPECT_EQ(to_host(d_a.data(), 4096), a);
    EXPECT_EQ(to_host(d_c.data(), 4096), b);
    t.reduce_scatter(d_a.data(), d_c.data(), 1024, ElementType::float32, cpdispatch::ReduceOp::sum);
    EXPECT_EQ(to_host(d_c.data(), 4096), a);
    t.broadcast(d_b.data(), 4096, 0);
    t.barrier();
    EXPECT_EQ(to_host(d_b.data(), 4096), b);
    // Point to point with itself: recorded, then issued as one group at the first wait.
    CPDISPATCH_CUDA_CHECK(cudaMemset(d_c.data(), 0, 4096));
    cptest::device_sync();
    const auto recv = t.irecv(d_c.data(), 1000, 0, 5);
    const auto send = t.isend(d_b.data() + 7, 1000, 0, 5);
    EXPECT_EQ(t.posted(), 2u);
    t.wait(send);
    EXPECT_EQ(t.posted(), 0u);
    t.wait(recv);
    EXPECT_EQ(to_host(d_c.data(), 1000), Bytes(b.begin() + 7, b.begin() + 1007));
    // all_to_all_v with itself is a copy.
    const std::vector<std::size_t> counts{300}, send_displs{11}, recv_displs{2000};
    t.all_to_all_v(d_b.data(), counts, send_displs, d_c.data(), counts, recv_displs);
    EXPECT_EQ(to_host(d_c.data() + 2000, 300), Bytes(b.begin() + 11, b.begin() + 311));
  });
}

TEST(NcclTransportOneRank, GraphCaptureOfAWholeStepReplaysTheSameBytes) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  NcclComms comms(1);
  const auto qkv = cptest::random_qkv(1, 13, 200, 5);
  const std::size_t q_tb = 1024, kv_tb = 40;  // kv: 20 fp16 per token
  comms.run([&](NcclTransport& t) {
    Dispatcher q(t, qkv.q_fwd, qkv.q_rev, q_tb);
    Dispatcher kv(t, qkv.kv_fwd, qkv.kv_rev, kv_tb);
    const Bytes q_in = cptest::pattern(q.required_bytes().mlp_bytes, 1);
    const Bytes kv_in = cptest::float_pattern(kv.required_bytes().mlp_bytes, 2, ElementType::float16);
    const auto q_mlp = to_device(q_in), kv_mlp = to_device(kv_in);
    DeviceBytesBuffer q_attn(q.required_bytes().attention_bytes), q_back(q.required_bytes().replica_bytes),
        kv_attn(kv.required_bytes().attention_bytes), kv_replica(kv.required_bytes().replica_bytes), kv_grad(kv.required_bytes().mlp_bytes);
    DeviceBytesBuffer word(64);
    auto step = [&] {
      q.forward(cbytes(q_mlp), mbytes(q_attn));
      kv.forward(cbytes(kv_mlp), mbytes(kv_attn));
      q.reverse(cbytes(q_attn), mbytes(q_back));
      kv.reverse_combine(cbytes(kv_attn), mbytes(kv_replica), mbytes(kv_grad), ElementType::float16);
      t.all_reduce(word.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);  // an NCCL call in the graph too
    };
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(kv_replica.data(), 0, kv_replica.size(), t.stream()));
    step();
    const Bytes q_expect = to_host(q_back.data(), q_back.size()), kv_expect = to_host(kv_grad.data(), kv_grad.size());
    EXPECT_EQ(q_expect, q_in);  // one copy per shard: Q comes back as it left
    CPDISPATCH_CUDA_CHECK(cudaMemset(q_back.data(), 0xEE, q_back.size()));
    CPDISPATCH_CUDA_CHECK(cudaMemset(kv_grad.data(), 0xEE, kv_grad.size()));
    cptest::device_sync();
    cudaGraph_t graph = nullptr;
    CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(t.stream(), cudaStreamCaptureModeGlobal));
    step();
    CPDISPATCH_CUDA_CHECK(cudaStreamEndCapture(t.stream(), &graph));
    cudaGraphExec_t exec = nullptr;
    CPDISPATCH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    EXPECT_EQ(to_host(q_back.data(), 1)[0], std::byte{0xEE});  // captured, not run
    CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec, t.stream()));
    CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec, t.stream()));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
    EXPECT_EQ(to_host(q_back.data(), q_back.size()), q_expect);
    EXPECT_EQ(to_host(kv_grad.data(), kv_grad.size()), kv_expect);
    CPDISPATCH_CUDA_CHECK(cudaGraphExecDestroy(exec));
    CPDISPATCH_CUDA_CHECK(cudaGraphDestroy(graph));
  });
}

/// W ranks, one per GPU: the dispatcher byte for byte against the host simulation.
class NcclTransportWorlds : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Gpus, NcclTransportWorlds, ::testing::Values(2, 3, 4, 5, 6, 7, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return std::string("W").append(std::to_string(info.param)); });

TEST_P(NcclTransportWorlds, DispatcherMatchesTheHostSimulation) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < W) GTEST_SKIP() << "needs " << W << " CUDA devices (this machine has " << count << ")";
  NcclComms comms(W);
  expect_dispatch_matches_simulation(comms, 3 + static_cast<std::uint64_t>(W));
}

TEST(NcclTransportFailure, AFailingRankEndsTheRunWithoutTouchingOtherRanksCommunicators) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs 2 CUDA devices (this machine has " << count << ")";
  NcclComms comms(2);
  std::atomic<bool> thrown{false};
  DeviceBytesBuffer word(64);  // freed after the run: cudaFree waits for the device
  const std::string what = cptest::message_of<std::runtime_error>([&] {
    comms.run([&](NcclTransport& t) {
      if (t.rank() == 1) {
        thrown = true;
        throw std::runtime_error("rank 1 fails before its all_reduce");
      }
      while (!thrown) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 1's failure handling has run
      t.all_reduce(word.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);  // its communicator must still be valid
    });
  });
  EXPECT_THAT(what, ::testing::HasSubstr("rank 1 fails before its all_reduce"));
}

// ---- the watchdog of posted exchanges (NcclTransportOptions::deadline) ----------

/// What the ranks but the stalled one (W-1) saw: each calls `communicate(t)`
/// (which rank W-1 never joins; it returns the device buffers the call uses,
/// kept until the end), waits for its stream (which ends once its watchdog,
/// deadline 200 ms, aborted the communicator), then calls barrier() and keeps
/// the timeout_error's text and the seconds since its call.
struct StuckReports {
  int W = 0;
  std::vector<std::string> errors;
  std::vector<double> seconds;
};

template <class Communicate>
StuckReports stuck_reports(int W, Communicate&& communicate) {
  const auto U = static_cast<std::size_t>(W);
  StuckReports out{W, std::vector<std::string>(U), std::vector<double>(U, -1)};
  cptest::run_nccl_with_a_stalled_rank(W, std::chrono::milliseconds(200), [&](NcclTransport& t, bool stalled) {
    if (stalled) return;  // never joins
    const auto me = static_cast<std::size_t>(t.rank());
    const auto start = std::chrono::steady_clock::now();
    const auto buffers = communicate(t);
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));  // ends once the watchdog aborted the communicator
    try {
      t.barrier();
    } catch (const cpdispatch::timeout_error& e) {
      out.errors[me] = e.what();
    }
    (void)buffers;
    out.seconds[me] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(t.broken());
  });
  return out;
}

/// Rank r's report: `what` first, then the deadline, the abort, and its time: within the deadline plus a second.
void expect_reported(const StuckReports& reports, int r, const std::string& what) {
  const auto me = static_cast<std::size_t>(r);
  EXPECT_THAT(reports.errors[me], ::testing::HasSubstr(what));
  EXPECT_THAT(reports.errors[me], ::testing::HasSubstr("(NcclTransportOptions::deadline = 200 ms)"));
  EXPECT_THAT(reports.errors[me], ::testing::HasSubstr("the communicator was aborted (seen at barrier)"));
  EXPECT_GE(reports.seconds[me], 0.2) << "rank " << r;
  EXPECT_LT(reports.seconds[me], 0.2 + 1.0) << "rank " << r << ": the deadline plus a second";
}

/// Ranks for the stalled-rank tests: 2 or 3, or 0 (skip) without two GPUs.
int stalled_world() {
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  return count < 2 ? 0 : std::min(count, 3);
}

// Rank W-1 never posts its side: every other rank's watchdog aborts its
// communicator within the deadline (plus a poll), its stream then ends, and
// its next call throws timeout_error naming the post and its peers.
TEST(NcclTransportWatchdog, APostAPeerNeverJoinsIsReportedWithinTheDeadline) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = stalled_world();
  if (W == 0) GTEST_SKIP() << "needs 2 CUDA devices";
  const auto U = static_cast<std::size_t>(W);
  const StuckReports reports = stuck_reports(W, [&](NcclTransport& t) {
    const std::size_t n = 64;
    std::vector<DeviceBytesBuffer> buffers;  // send, receive
    buffers.emplace_back(n * U);
    buffers.emplace_back(n * U);
    std::vector<std::size_t> counts(U, n), displs(U);
    for (std::size_t p = 0; p < U; ++p) displs[p] = p * n;
    t.wait(t.post_all_to_all_v(buffers[0].data(), counts, displs, buffers[1].data(), counts, displs));
    return buffers;
  });
  for (int r = 0; r + 1 < W; ++r) {
    std::string peers;
    for (int p = 0; p < W; ++p) peers += p == r ? "" : (peers.empty() ? " " : ", ") + std::to_string(p);
    expect_reported(reports, r, "NcclTransport: posted exchange #1 on rank " + std::to_string(r) + " of " + std::to_string(W) +
                                    " (receives from rank(s)" + peers + "; sends to rank(s)" + peers + ") was not done");
  }
}

// Rank W-1 never joins a collective: every other rank's watchdog aborts its
// communicator within the deadline (plus a poll), and its next call throws
// timeout_error naming the collective.
TEST(NcclTransportWatchdog, ACollectiveAPeerNeverJoinsIsReportedWithinTheDeadline) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = stalled_world();
  if (W == 0) GTEST_SKIP() << "needs 2 CUDA devices";
  const StuckReports reports = stuck_reports(W, [](NcclTransport& t) {
    DeviceBytesBuffer word(64);
    t.all_reduce(word.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);
    return word;
  });
  for (int r = 0; r + 1 < W; ++r) {
    expect_reported(reports, r, "NcclTransport: all_reduce (call #1 on the stream) on rank " + std::to_string(r) + " of " + std::to_string(W) +
                                    " was not done");
    EXPECT_THAT(reports.errors[static_cast<std::size_t>(r)],
                ::testing::HasSubstr("after it was called (NcclTransportOptions::deadline = 200 ms): a peer that never made the same call"));
  }
}

// Calls on the stream that are done stay done: ten deadlines later the
// watchdog has aborted nothing.
TEST(NcclTransportWatchdog, CallsThatCompletedAreNotReportedLater) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  ncclComm_t comm = nullptr;
  const int device = 0;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm, 1, &device));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  {
    const cpdispatch::cuda::Stream stream;
    NcclTransport t(comm, stream.get(), cpdispatch::NcclTransportOptions{.timeout = {}, .comm_stream = nullptr, .deadline = std::chrono::milliseconds(20)});
    DeviceBytesBuffer word(64);
    t.all_reduce(word.data(), 16, ElementType::float32, cpdispatch::ReduceOp::sum);
    t.barrier();
    t.broadcast(word.data(), 64, 0);
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(t.broken());
    EXPECT_NO_THROW(t.barrier());
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  }
  CPDISPATCH_NCCL_CHECK(ncclCommDestroy(comm));
}

// A post captured into a graph runs at the graph's launch: the watchdog does
// not count it as late while the graph waits to be launched.
TEST(NcclTransportWatchdog, APostCapturedInAGraphIsNotWatched) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  ncclComm_t comm = nullptr;
  const int device = 0;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm, 1, &device));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  {
    const cpdispatch::cuda::Stream stream;
    NcclTransport t(comm, stream.get(), cpdispatch::NcclTransportOptions{.timeout = {}, .comm_stream = nullptr, .deadline = std::chrono::milliseconds(20)});
    const cptest::AllToAllCase c(1, 200, 9);
    const auto send = to_device(c.send(0));
    DeviceBytesBuffer recv(c.bytes());
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(recv.data(), 0, recv.size(), t.stream()));
    cudaGraph_t graph = nullptr;
    CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(t.stream(), cudaStreamCaptureModeGlobal));
    t.wait(c.post(t, send, recv));
    CPDISPATCH_CUDA_CHECK(cudaStreamEndCapture(t.stream(), &graph));
    cudaGraphExec_t exec = nullptr;
    CPDISPATCH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // ten deadlines before the launch
    EXPECT_FALSE(t.broken());
    EXPECT_NO_THROW(t.check_async());
    CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec, t.stream()));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
    EXPECT_EQ(to_host(recv.data(), recv.size()), c.expected(0));
    CPDISPATCH_CUDA_CHECK(cudaGraphExecDestroy(exec));
    CPDISPATCH_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  CPDISPATCH_NCCL_CHECK(ncclCommDestroy(comm));
}

// ---- posted exchanges ----------------------------------------------------------

using cptest::AllToAllCase;

/// The bytes of `n` floats equal to `value`.
Bytes floats_of(std::size_t n, float value) {
  Bytes out(n * sizeof(float));
  for (std::size_t i = 0; i < n; ++i) std::memcpy(out.data() + i * sizeof(float), &value, sizeof(float));
  return out;
}

/// World sizes for the posted-exchange tests: 1, 2 and 3 under the harness; 1, and 2 on a machine with two GPUs.
std::vector<int> posted_worlds() {
  if (cptest::cpu_harness) return {1, 2, 3};
  int count = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&count));
  return count >= 2 ? std::vector<int>{1, 2} : std::vector<int>{1};
}

/// Scheduler seeds tried per case: many under the harness (each a different interleaving of the streams), one pass on a GPU.
std::vector<std::uint64_t> posted_seeds(std::uint64_t harness_count) {
  std::vector<std::uint64_t> seeds;
  for (std::uint64_t s = 1; s <= (cptest::cpu_harness ? harness_count : 2); ++s) seeds.push_back(s);
  return seeds;
}

/// Reseeds the harness's scheduler (nothing on a GPU); the test's own seed comes back at the end.
class Reseed {
 public:
#ifdef CPDISPATCH_CUDA_HOST_HARNESS
  Reseed() : saved_(cuda_harness::seed()) {}
  ~Reseed() { cuda_harness::set_seed(saved_); }
  void operator()(std::uint64_t seed) const { cuda_harness::set_seed(seed); }

 private:
  std::uint64_t saved_;
#else
  void operator()(std::uint64_t) const {}
#endif
};

TEST(NcclTransportPosted, TheStreamComputesWhileTheExchangeTravelsAndWaitOrdersItsReads) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Reseed reseed;
  for (int W : posted_worlds()) {
    NcclComms comms(W);
    const auto U = static_cast<std::size_t>(W);
    for (std::uint64_t seed : posted_seeds(12)) {
      SCOPED_TRACE("W " + std::to_string(W) + " seed " + std::to_string(seed));
      reseed(seed);
      const AllToAllCase first(W, 300, seed), second(W, 40, seed + 100);
      std::vector<Bytes> got_first(U), got_second(U), computed(U);
      comms.run([&](NcclTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        EXPECT_NE(t.comm_stream(), t.stream());
        const auto send1 = to_device(first.send(t.rank())), recv1 = to_device(Bytes(first.bytes(), std::byte{0xA5}));
        const auto send2 = to_device(second.send(t.rank())), recv2 = to_device(Bytes(second.bytes(), std::byte{0xA5}));
        DeviceBytesBuffer out1(first.bytes()), out2(second.bytes()), work(4096);
        const cpdispatch::Request a = first.post(t, send1, recv1);
        const cpdispatch::Request b = second.post(t, send2, recv2);
        EXPECT_EQ(t.outstanding(), 2u);
        // Compute that needs neither exchange: free to run while they travel.
        CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(work.data(), 0x5A, work.size(), t.stream()));
        t.wait(b);  // in either order
        CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out2.data(), recv2.data(), second.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
        t.wait(a);
        EXPECT_EQ(t.outstanding(), 0u);
        CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out1.data(), recv1.data(), first.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
        got_first[r] = to_host(out1.data(), out1.size());
        got_second[r] = to_host(out2.data(), out2.size());
        computed[r] = to_host(work.data(), work.size());
      });
      for (int r = 0; r < W; ++r) {
        const auto u = static_cast<std::size_t>(r);
        EXPECT_EQ(got_first[u], first.expected(r)) << "rank " << r;
        EXPECT_EQ(got_second[u], second.expected(r)) << "rank " << r;
        EXPECT_EQ(computed[u], Bytes(4096, std::byte{0x5A})) << "rank " << r;
      }
    }
  }
}

TEST(NcclTransportPosted, ReadingTheReceiveBufferBeforeTheWaitIsCaughtUnderSomeSeed) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
#ifndef CPDISPATCH_CUDA_HOST_HARNESS
  GTEST_SKIP() << "a race: the harness's scheduler shows it for certain, a GPU only sometimes";
#else
  const Reseed reseed;
  for (int W : {1, 2}) {
    NcclComms comms(W);
    const auto U = static_cast<std::size_t>(W);
    int stale = 0;
    for (std::uint64_t seed : posted_seeds(24)) {
      reseed(seed);
      const AllToAllCase c(W, 64, seed);
      std::vector<Bytes> early(U), late(U);
      comms.run([&](NcclTransport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        const auto send = to_device(c.send(t.rank())), recv = to_device(Bytes(c.bytes(), std::byte{0xA5}));
        DeviceBytesBuffer out(c.bytes());
        const cpdispatch::Request request = c.post(t, send, recv);
        // Deliberately broken: the stream reads the receive buffer before it waits.
        CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out.data(), recv.data(), c.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
        t.wait(request);
        early[r] = to_host(out.data(), out.size());
        late[r] = to_host(recv.data(), recv.size());
      });
      for (int r = 0; r < W; ++r) {
        const auto u = static_cast<std::size_t>(r);
        EXPECT_EQ(late[u], c.expected(r)) << "W " << W << " seed " << seed << " rank " << r;  // complete after the wait
        stale += early[u] != c.expected(r);
      }
    }
    EXPECT_GT(stale, 0) << "W " << W << ": the exchange never ran after the early read, so it is not on a stream of its own";
  }
#endif
}

TEST(NcclTransportPosted, CollectivesCalledBeforeTheWaitRunAfterTheExchangeOnEveryRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Reseed reseed;
#ifdef CPDISPATCH_CUDA_HOST_HARNESS
  cuda_harness::set_stall_limit(std::chrono::milliseconds(5000));  // a rank reaching NCCL calls out of order stalls: fail soon
#endif
  for (int W : posted_worlds()) {
    NcclComms comms(W);
    const auto U = static_cast<std::size_t>(W);
    for (std::uint64_t seed : posted_seeds(8)) {
      SCOPED_TRACE("W " + std::to_string(W) + " seed " + std::to_string(seed));
      reseed(seed);
      const AllToAllCase first(W, 128, seed), second(W, 24, seed + 1), blocking(W, 80, seed + 2), last(W, 16, seed + 3);
      std::vector<Bytes> got(U * 4), ring(U), sums(U);
      comms.run([&](NcclTransport& t) {
        const int me = t.rank();
        const auto r = static_cast<std::size_t>(me);
        const AllToAllCase* cases[4] = {&first, &second, &blocking, &last};
        std::vector<DeviceBytesBuffer> send, recv;
        for (const AllToAllCase* c : cases) {
          send.push_back(to_device(c->send(me)));
          recv.push_back(to_device(Bytes(c->bytes(), std::byte{0xA5})));
        }
        const auto sum = to_device(floats_of(8, static_cast<float>(me + 1)));
        const auto ring_send = to_device(cptest::pattern(100, 500 + r)), ring_recv = to_device(Bytes(100, std::byte{0}));
        const cpdispatch::Request a = first.post(t, send[0], recv[0]);
        const cpdispatch::Request b = second.post(t, send[1], recv[1]);
        // Blocking calls with both posts outstanding: each rank's GPU must run them after the posts, in program order.
        t.all_reduce(sum.data(), 8, ElementType::float32, cpdispatch::ReduceOp::sum);
        t.barrier();
        const auto to = t.irecv(ring_recv.data(), 100, (me + W - 1) % W, 3);
        const auto from = t.isend(ring_send.data(), 100, (me + 1) % W, 3);
        t.wait(from);
        t.wait(to);
        t.all_to_all_v(send[2].data(), blocking.counts, blocking.displs, recv[2].data(), blocking.counts, blocking.displs);
        const cpdispatch::Request c = last.post(t, send[3], recv[3]);
        t.wait(b);
        t.wait(c);
        t.wait(a);
        for (std::size_t k = 0; k < 4; ++k) got[r * 4 + k] = to_host(recv[k].data(), recv[k].size());
        ring[r] = to_host(ring_recv.data(), 100);
        sums[r] = to_host(sum.data(), sum.size());
      });
      const Bytes expect_sum = floats_of(8, static_cast<float>(W * (W + 1) / 2));
      for (int r = 0; r < W; ++r) {
        const auto u = static_cast<std::size_t>(r);
        EXPECT_EQ(got[u * 4 + 0], first.expected(r)) << "rank " << r;
        EXPECT_EQ(got[u * 4 + 1], second.expected(r)) << "rank " << r;
        EXPECT_EQ(got[u * 4 + 2], blocking.expected(r)) << "rank " << r;
        EXPECT_EQ(got[u * 4 + 3], last.expected(r)) << "rank " << r;
        EXPECT_EQ(ring[u], cptest::pattern(100, 500 + static_cast<std::uint64_t>((r + W - 1) % W))) << "rank " << r;
        EXPECT_EQ(sums[u], expect_sum) << "rank " << r;
      }
      if (HasFailure()) break;  // a stall costs seconds: one failing seed says enough
    }
    if (HasFailure()) break;
  }
#ifdef CPDISPATCH_CUDA_HOST_HARNESS
  cuda_harness::set_stall_limit(std::chrono::milliseconds(20000));
#endif
}

TEST(NcclTransportPosted, PostWaitAndADeviceCopyMakeNoSynchronisingCallNorNewEvents) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
#ifndef CPDISPATCH_CUDA_HOST_HARNESS
  GTEST_SKIP() << "counts the runtime's calls: the cuda-cpu harness only";
#else
  for (int W : {1, 2}) {
    NcclComms comms(W);
    const auto U = static_cast<std::size_t>(W);
    const AllToAllCase c(W, 96, 7);
    std::vector<std::uint64_t> synchronising(U, 99);
    std::vector<Bytes> got(U);
    std::size_t events = 99;
    comms.run([&](NcclTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      const auto send = to_device(c.send(t.rank())), recv = to_device(Bytes(c.bytes(), std::byte{0xA5}));
      DeviceBytesBuffer out(c.bytes());
      t.wait(c.post(t, send, recv));  // the first post makes the pool's event
      const std::uint64_t before = cuda_harness::synchronizing_calls_on_this_thread();
      const std::size_t events_before = cuda_harness::events_created();
      for (int i = 0; i < 8; ++i) {
        const cpdispatch::Request request = c.post(t, send, recv);
        t.wait(request);
        CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(out.data(), recv.data(), c.bytes(), cudaMemcpyDeviceToDevice, t.stream()));
      }
      synchronising[r] = cuda_harness::synchronizing_calls_on_this_thread() - before;
      if (W == 1) events = cuda_harness::events_created() - events_before;  // other ranks' threads would make theirs meanwhile
      got[r] = to_host(out.data(), out.size());
    });
    for (int r = 0; r < W; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(synchronising[u], 0u) << "W " << W << " rank " << r;
      EXPECT_EQ(got[u], c.expected(r)) << "W " << W << " rank " << r;
    }
    if (W == 1) {
      EXPECT_EQ(events, 0u) << "steady-state posts reuse the pool's events";
    }
  }
#endif
}

TEST(NcclTransportPosted, TheCommunicationStreamIsOwnedOrBorrowedAndMovesWithTheTransport) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  ncclComm_t comm = nullptr;
  const int device = 0;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm, 1, &device));
  CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
  const cpdispatch::cuda::Stream stream, side;
  const AllToAllCase c(1, 200, 9);
  const auto send = to_device(c.send(0));
  DeviceBytesBuffer recv(c.bytes());
  auto round_trip = [&](NcclTransport& t) {
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(recv.data(), 0, recv.size(), t.stream()));
    const cpdispatch::Request request = c.post(t, send, recv);
    t.wait(request);
    EXPECT_THROW(t.wait(request), cpdispatch::invalid_input);  // waited for once: gone
    EXPECT_EQ(to_host(recv.data(), recv.size()), c.expected(0));
  };
  {
    NcclTransport borrowing(comm, stream.get(), cpdispatch::NcclTransportOptions{.timeout = {}, .comm_stream = side.get()});
    EXPECT_EQ(borrowing.comm_stream(), side.get());
    round_trip(borrowing);
    NcclTransport moved(std::move(borrowing));
    EXPECT_EQ(moved.comm_stream(), side.get());
    round_trip(moved);
  }
  CPDISPATCH_CUDA_CHECK(cudaStreamQuery(side.get()));  // still ours, still usable
  {
    NcclTransport same(comm, stream.get(), cpdispatch::NcclTransportOptions{.timeout = {}, .comm_stream = stream.get()});  // no overlap, still correct
    round_trip(same);
  }
  {
    NcclTransport owning(comm, stream.get());
    const cudaStream_t owned = owning.comm_stream();
    EXPECT_NE(owned, nullptr);
    EXPECT_NE(owned, stream.get());
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(recv.data(), 0, recv.size(), stream.get()));
    const cpdispatch::Request pending = c.post(owning, send, recv);
    NcclTransport moved(std::move(owning));  // with a post outstanding
    EXPECT_EQ(moved.comm_stream(), owned);
    EXPECT_EQ(moved.outstanding(), 1u);
    moved.wait(pending);
    EXPECT_EQ(to_host(recv.data(), recv.size()), c.expected(0));
    EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { moved.wait(cpdispatch::Request{12345}); }),
                ::testing::HasSubstr("request 12345 is not pending"));
    NcclTransport assigned(comm, stream.get());
    assigned = std::move(moved);
    EXPECT_EQ(assigned.comm_stream(), owned);
    round_trip(assigned);
  }
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  CPDISPATCH_NCCL_CHECK(ncclCommDestroy(comm));
}

}  // namespace
