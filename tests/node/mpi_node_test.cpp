// NodeWireDispatcher over MpiTransport, one process per rank (CTest runs it
// under mpiexec with 2 and 4 ranks): each rank checks its own buffers against
// KvWireDispatcher over the same transport, on every node map of its world.
#include <cpdispatch/transports/mpi.hpp>
#include <cpdispatch/transports/mpi_topology.hpp>

#include <gtest/gtest.h>

#include <string>

#include "node_exec.hpp"

namespace {

using cpdispatch::MpiTransport;

TEST(MpiNodeWire, EqualsTheDeduplicatedExchangeOnEveryNodeMap) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  const auto me = static_cast<std::size_t>(t.rank());
  for (const node_test::Case& c : node_test::cases(t.world_size(), t.world_size())) {
    SCOPED_TRACE(c.name);
    const node_test::Planned p(c);
    node_test::check_rank(me, node_test::run_rank<std::int32_t>(t, p));
    node_test::check_rank(me, node_test::run_rank<cpdispatch::bfloat16>(t, p));
  }
}

// One machine: every rank shares memory with every other, one node.
TEST(MpiNodeWire, DiscoversOneNodeOnOneMachine) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  const cpdispatch::Topology topology = cpdispatch::mpi_topology(t.comm());
  EXPECT_EQ(topology.world_size(), t.world_size());
  EXPECT_EQ(topology.num_nodes(), 1);
}

}  // namespace
