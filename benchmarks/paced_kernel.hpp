#pragma once
// PacedKernel: an attention kernel that runs at one speed whatever the other
// ranks do, as each rank's own GPU does. The benchmarks run W ranks as threads
// on a few cores, so a rank whose kernel runs while the others wait on the
// link gets a whole core and finishes several times sooner than when every
// rank computes at once; a plan whose ranks compute at different times would
// be measured on a faster machine than Ulysses, whose ranks compute together.
// A paced call measures the CPU time its thread spent (one thread a call) and
// returns no sooner than `pace` times that after it began: with pace = W /
// cores, the time a call takes when every rank computes at once.

#include <algorithm>
#include <chrono>
#include <thread>
#include <time.h>
#include <utility>

namespace cpdispatch_bench {

/// W / cores, at least 1: how much slower a call runs when all W ranks compute at once.
inline double pace_for(int world) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1.0, static_cast<double>(world) / static_cast<double>(cores));
}

/// This thread's CPU time, seconds.
inline double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

template <class Kernel>
class PacedKernel {
 public:
  PacedKernel(Kernel inner, double pace) : inner_(std::move(inner)), pace_(pace) {}

  template <class... Args>
  void forward(Args&&... args) {
    paced([&] { inner_.forward(std::forward<Args>(args)...); });
  }
  template <class... Args>
  void backward(Args&&... args) {
    paced([&] { inner_.backward(std::forward<Args>(args)...); });
  }

 private:
  template <class F>
  void paced(F call) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu = thread_cpu_seconds();
    call();
    const double spent = thread_cpu_seconds() - cpu;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(pace_ * spent)));
  }

  Kernel inner_;
  double pace_ = 1;
};

}  // namespace cpdispatch_bench
