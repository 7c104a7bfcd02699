#pragma once
// NcclTransport on W GPUs of one process for the CUDA tests: one thread per
// GPU, each with its own communicator and stream.

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transports/nccl.hpp"

namespace cptest {

/// Runs f(transport) on one thread per GPU 0..W-1, each with its own
/// communicator (ncclCommInitAll) and stream, and waits for the streams.
/// A failing rank aborts its communicator; the first error is rethrown.
template <class F>
inline void run_nccl(int W, F f) {
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(W));
  std::vector<int> devices(static_cast<std::size_t>(W));
  for (int d = 0; d < W; ++d) devices[static_cast<std::size_t>(d)] = d;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(comms.data(), W, devices.data()));
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      const auto me = static_cast<std::size_t>(r);
      try {
        CPDISPATCH_CUDA_CHECK(cudaSetDevice(r));
        const cpdispatch::cuda::Stream stream;
        cpdispatch::NcclTransport t(comms[me], stream.get());
        f(t);
        CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        (void)ncclCommDestroy(comms[me]);
      } catch (...) {
        (void)ncclCommAbort(comms[me]);
        std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

/// Runs step(transport, stalled) on W ranks, a thread and a GPU each, every
/// transport with a watchdog of `deadline` (NcclTransportOptions::deadline).
/// Rank W-1 is the stalled one (stalled = true): its step must not post; the
/// helper keeps its transport alive until every other rank's step has
/// returned. The others' communicators, aborted by their watchdogs, are left
/// alone; the stalled rank's is destroyed.
template <class Step>
inline void run_nccl_with_a_stalled_rank(int W, std::chrono::milliseconds deadline, Step step) {
  const auto U = static_cast<std::size_t>(W);
  std::vector<ncclComm_t> comms(U);
  std::vector<int> devices(U);
  for (int d = 0; d < W; ++d) devices[static_cast<std::size_t>(d)] = d;
  CPDISPATCH_NCCL_CHECK(ncclCommInitAll(comms.data(), W, devices.data()));
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      const auto me = static_cast<std::size_t>(r);
      const bool stalled = r == W - 1;
      CPDISPATCH_CUDA_CHECK(cudaSetDevice(r));
      {
        const cpdispatch::cuda::Stream stream;
        cpdispatch::NcclTransport t(comms[me], stream.get(), cpdispatch::NcclTransportOptions{.timeout = {}, .comm_stream = nullptr, .deadline = deadline});
        step(t, stalled);
        if (stalled) {
          while (done < W - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        } else {
          ++done;
        }
      }
      if (stalled) (void)ncclCommDestroy(comms[me]);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace cptest
