// KvWireDispatcher over MpiTransport, one process per rank (CTest runs it
// under mpiexec with 1 to 4 ranks): the same checks as on the sim, each rank
// judging its own buffers against the section 2 Dispatcher over the same
// transport.
#include <cpdispatch/transports/mpi.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "dedup_exec.hpp"

namespace {

using namespace dedup_test;
using cpdispatch::MpiTransport;

class MpiDedup : public ::testing::Test {
 protected:
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  int W = t.world_size();
  std::size_t me = static_cast<std::size_t>(t.rank());
};

TEST_F(MpiDedup, ForwardBytesAndBackwardGradientsMatchTheSectionTwoExchange) {
  for (const Case& c : cases_for(W)) {
    SCOPED_TRACE(c.name + ", W = " + std::to_string(W));
    check_rank<std::int32_t>(me, run_rank<std::int32_t>(t, c, false));
    EXPECT_EQ(check_rank<cpdispatch::bfloat16>(me, run_rank<cpdispatch::bfloat16>(t, c, true)), 0.0);
    const double C = static_cast<double>(c.meta.kv_fwd.num_copies());
    EXPECT_LE(check_rank<float>(me, run_rank<float>(t, c, false)), 2 * C * std::ldexp(1.0, -23));
    EXPECT_LE(check_rank<cpdispatch::float16>(me, run_rank<cpdispatch::float16>(t, c, false)), 2 * C * std::ldexp(1.0, -10));
  }
}

}  // namespace
