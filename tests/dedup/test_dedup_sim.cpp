// KvWireDispatcher on the sim transport, every rank a thread: the forward
// attention layout is byte-identical to the section 2 Dispatcher's, the
// backward gradient equals its reverse_combine (exactly for integers and
// exactly representable sums, within the element type's rounding otherwise)
// and is bit-identical run to run.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "../common/sim_world_fixture.hpp"
#include "dedup_exec.hpp"

namespace {

using cpdispatch::SimTransport;
using namespace dedup_test;

/// Both exchanges on every rank of a SimWorld; `packing`: through
/// SimPackingTransport (pack, all_to_all_v, unpack, as over MPI).
template <class E>
double check_case(int W, const Case& c, bool exact, bool packing = false) {
  std::vector<RankResult> res(static_cast<std::size_t>(W));
  cpdispatch::SimWorld world(W, cpdispatch::SimOptions{sim_test::hang_timeout});
  world.run([&](SimTransport& t) {
    RankResult& mine = res[static_cast<std::size_t>(t.rank())];
    if (packing) {
      cpdispatch::SimPackingTransport p(t);
      mine = run_rank<E>(p, c, exact);
    } else {
      mine = run_rank<E>(t, c, exact);
    }
  });
  double worst = 0;
  for (std::size_t r = 0; r < res.size(); ++r) worst = std::max(worst, check_rank<E>(r, res[r]));
  return worst;
}

class DedupSim : public sim_test::WorldSizeTest {};
INSTANTIATE_TEST_SUITE_P(Worlds, DedupSim, ::testing::Values(1, 2, 3, 4, 5), sim_test::WorldSizeName{"W"});

TEST_P(DedupSim, IntegerGradientsEqualTheSectionTwoCombineExactly) {
  for (const Case& c : cases_for(GetParam())) {
    SCOPED_TRACE(c.name);
    check_case<std::int32_t>(GetParam(), c, false);
    check_case<std::int8_t>(GetParam(), c, false);
    check_case<std::int64_t>(GetParam(), c, false);
  }
}

// Small integer values: every partial sum is exact in every type, so the two
// summation orders must agree bit for bit.
TEST_P(DedupSim, ExactlyRepresentableSumsAgreeBitForBit) {
  for (const Case& c : cases_for(GetParam())) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(check_case<cpdispatch::bfloat16>(GetParam(), c, true), 0.0);
    EXPECT_EQ(check_case<cpdispatch::float16>(GetParam(), c, true), 0.0);
    EXPECT_EQ(check_case<float>(GetParam(), c, true), 0.0);
  }
}

// Random values in [-1, 1]: the fan-in rounds each destination's partial sum
// to the element type once, so the difference is at most a few roundings of
// sums of at most C values: C * 2^-mantissa bits.
TEST_P(DedupSim, FloatingGradientsAgreeWithinRounding) {
  for (const Case& c : cases_for(GetParam())) {
    SCOPED_TRACE(c.name);
    const double C = static_cast<double>(c.meta.kv_fwd.num_copies());
    EXPECT_LE(check_case<float>(GetParam(), c, false), 2 * C * std::ldexp(1.0, -23));
    EXPECT_LE(check_case<double>(GetParam(), c, false), 2 * C * std::ldexp(1.0, -52));
    EXPECT_LE(check_case<cpdispatch::bfloat16>(GetParam(), c, false), 2 * C * std::ldexp(1.0, -7));
    EXPECT_LE(check_case<cpdispatch::float16>(GetParam(), c, false), 2 * C * std::ldexp(1.0, -10));
  }
}

// The same through the staging path (the in-place fan-in writes straight
// into the send staging there).
TEST_P(DedupSim, PackingTransportAgreesToo) {
  for (const Case& c : cases_for(GetParam())) {
    SCOPED_TRACE(c.name);
    check_case<std::int32_t>(GetParam(), c, false, true);
    EXPECT_EQ(check_case<cpdispatch::bfloat16>(GetParam(), c, true, true), 0.0);
    const double C = static_cast<double>(c.meta.kv_fwd.num_copies());
    EXPECT_LE(check_case<cpdispatch::bfloat16>(GetParam(), c, false, true), 2 * C * std::ldexp(1.0, -7));
  }
}

}  // namespace
