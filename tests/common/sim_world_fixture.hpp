#pragma once
// Scaffolding of the suites that run a case on every rank of a SimWorld (ranks
// as threads), one instantiation per world size (tests/tp, tests/overlap),
// and the two ways the sim transport moves an exchange.

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "cpdispatch/transports/sim.hpp"

namespace sim_test {

/// Bound on every wait of a test's SimWorld: a hang fails the test instead of
/// blocking it.
inline constexpr std::chrono::seconds hang_timeout{60};

/// A suite parameterised by the world size; derive one fixture per suite.
class WorldSizeTest : public testing::TestWithParam<int> {
 protected:
  /// Runs per_rank(SimTransport&) on every rank of a world of GetParam() ranks.
  template <class F>
  void run(F&& per_rank) {
    cpdispatch::SimWorld world(GetParam(), cpdispatch::SimOptions{hang_timeout});
    world.run(per_rank);
  }
};

/// Names each instantiation prefix + world size ("W2", "tp3").
struct WorldSizeName {
  const char* prefix;
  std::string operator()(const testing::TestParamInfo<int>& info) const {
    return prefix + std::to_string(info.param);
  }
};

/// The sim transport as is (a PieceTransport: all_to_all_pieces), for suites
/// that run both paths; get() is the transport a rank uses.
struct Pieces {
  explicit Pieces(cpdispatch::SimTransport& s) : sim(s) {}
  cpdispatch::SimTransport& sim;
  cpdispatch::SimTransport& get() { return sim; }
};
/// The sim transport behind SimPackingTransport (pack, all_to_all_v, unpack, as over MPI).
struct Packing {
  explicit Packing(cpdispatch::SimTransport& s) : packing(s) {}
  cpdispatch::SimPackingTransport packing;
  cpdispatch::SimPackingTransport& get() { return packing; }
};

}  // namespace sim_test
