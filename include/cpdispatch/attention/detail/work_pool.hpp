#pragma once
// A small pool of threads for the host attention kernel: run(items, body)
// calls body(item, worker) once for every item in [0, items), spread over the
// pool's workers and the calling thread (worker 0), and returns when all are
// done. Items are handed out one at a time from a shared counter, so uneven
// items balance themselves. The first exception a body throws is rethrown
// to the caller once every worker has stopped.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace cpdispatch::detail::attention {

class WorkPool {
 public:
  /// `threads` counts the caller: threads - 1 workers are started.
  explicit WorkPool(int threads) : threads_(std::max(threads, 1)) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { serve(w); });
  }
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;
  ~WorkPool() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int threads() const noexcept { return threads_; }

  template <class Body>
  void run(std::int64_t items, Body& body) {
    if (items <= 0) return;
    const int helpers = static_cast<int>(std::min<std::int64_t>(threads_, items)) - 1;
    if (helpers == 0) {
      for (std::int64_t i = 0; i < items; ++i) body(i, 0);
      return;
    }
    Job job;
    job.body = &body;
    job.call = [](void* b, std::int64_t i, int w) { (*static_cast<Body*>(b))(i, w); };
    job.items = items;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      joining_ = helpers;
      active_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    work(job, 0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return active_ == 0; });
    job_ = nullptr;
    if (job.failure) std::rethrow_exception(job.failure);
  }

 private:
  struct Job {
    void* body = nullptr;
    void (*call)(void*, std::int64_t, int) = nullptr;
    std::int64_t items = 0;
    std::atomic<std::int64_t> next{0};
    std::mutex failure_mutex;
    std::exception_ptr failure;
  };

  static void work(Job& job, int worker) {
    for (std::int64_t i = job.next.fetch_add(1); i < job.items; i = job.next.fetch_add(1)) {
      try {
        job.call(job.body, i, worker);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(job.failure_mutex);
        if (!job.failure) job.failure = std::current_exception();
        job.next.store(job.items);  // stop handing out items
      }
    }
  }

  void serve(int worker) {
    std::uint64_t seen = 0;
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Only the first `joining_` workers join a job; the rest wait for the next one.
        wake_.wait(lock, [&] { return stop_ || (generation_ != seen && worker <= joining_ && job_ != nullptr); });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      work(*job, worker);
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        --active_;
      }
      done_.notify_one();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  Job* job_ = nullptr;
  int joining_ = 0;  // workers 1 .. joining_ take part in the current job
  int active_ = 0;   // of those, the ones still working
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace cpdispatch::detail::attention
