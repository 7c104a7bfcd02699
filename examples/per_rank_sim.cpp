// The per-rank program (per_rank_dispatch.hpp) on the sim transport: N ranks
// as threads of this process.  per_rank_sim [--world-size 4] [--tokens 2048] ...
// Exit status: 0 when every rank's checks pass, 1 when one fails, 2 on an error.

#include <atomic>
#include <cstdio>
#include <exception>

#include "cpdispatch/transports/sim.hpp"
#include "per_rank_dispatch.hpp"

int main(int argc, char** argv) {
  cpdispatch_example::Options opt;
  if (!cpdispatch_example::parse_options(argc, argv, opt)) return 2;
  try {
    std::atomic<long long> mismatches{0};
    cpdispatch::SimWorld world(opt.world_size);
    world.run([&](cpdispatch::SimTransport& t) {
      const auto all = cpdispatch_example::run_rank(t, opt);
      if (t.rank() == 0) mismatches = all;
    });
    std::printf("%s: %lld mismatches over %d ranks\n", mismatches == 0 ? "PASS" : "FAIL", mismatches.load(), opt.world_size);
    return mismatches == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "per_rank_sim: %s\n", e.what());
    return 2;
  }
}
