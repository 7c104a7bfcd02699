// bench_plan_agreement: what the plan agreement adds to a replan, in the same
// run: QkvDispatch::replan of one rank's share with check_plan_agreement on
// and off, on the sim transport (W ranks as threads).
//
//   bin/bench_plan_agreement [W=8] [rounds=40]
//
// The plan: create_qkv_dispatch(W, 4096 tokens a rank, 16 documents a rank,
// CP degree min(W, 4), seed 2026), each rank's share planned once
// (plan_qkv_for_rank). A sample is one replan on every rank, from a barrier
// to a barrier (the slowest rank decides); the two kinds alternate which goes
// first. Reported: the median of each and their difference (the agreement's
// cost per replan: building the record, one all_to_all_v of it, the verdict).

#include <cpdispatch/execute/qkv_dispatch.hpp>
#include <cpdispatch/workload/generate.hpp>
#include <cpdispatch/plan/rank.hpp>
#include <cpdispatch/transports/sim.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>
#include "stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using bench::median;

}  // namespace

int main(int argc, char** argv) {
  const int W = argc > 1 ? std::atoi(argv[1]) : 8;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 40;
  if (W < 2 || rounds < 1) {
    std::fprintf(stderr, "usage: %s [world_size>=2] [rounds>=1]\n", argv[0]);
    return 2;
  }
  try {
    const std::int64_t tokens = 4096, cp = std::min(W, 4);
    const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(W, tokens, 16, cp, 2026);
    cpdispatch::SimWorld world(W);
    std::vector<double> on_ms, off_ms;
    world.run([&](cpdispatch::SimTransport& t) {
      const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
      using Dispatch = cpdispatch::QkvDispatch<cpdispatch::SimTransport, float>;
      Dispatch checked(t, share, 64, 64, {.dedup = false, .check_plan_agreement = true});
      Dispatch unchecked(t, share, 64, 64, {.dedup = false, .check_plan_agreement = false});
      const auto sample = [&](Dispatch& d) {
        t.barrier();
        const auto start = clock_type::now();
        d.replan(share);
        t.barrier();
        return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
      };
      for (int r = -2; r < rounds; ++r) {  // two warm-up rounds
        const bool on_first = r % 2 == 0;
        const double a = sample(on_first ? checked : unchecked), b = sample(on_first ? unchecked : checked);
        if (t.rank() == 0 && r >= 0) {
          on_ms.push_back(on_first ? a : b);
          off_ms.push_back(on_first ? b : a);
        }
      }
    });
    const double on = median(on_ms), off = median(off_ms);
    std::printf("bench_plan_agreement: W = %d ranks as threads, %lld tokens a rank, median of %d alternated replans (barrier to barrier)\n\n", W,
                static_cast<long long>(tokens), rounds);
    std::printf("| W | replan, agreement on (ms) | replan, off (ms) | the agreement's cost (ms) | on / off |\n|---:|---:|---:|---:|---:|\n");
    std::printf("| %d | %.3f | %.3f | %.3f | %.2f |\n", W, on, off, on - off, on / off);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_plan_agreement: %s\n", e.what());
    return 1;
  }
  return 0;
}
