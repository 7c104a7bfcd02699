// Documents that span ranks over MpiTransport, for every world size mpiexec
// gives: a KV group at one rank mixes shards from several home ranks, and the
// forward, reverse and combine results are checked against the plan itself.
#include <cpdispatch/transports/mpi.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cpdispatch/workload/generate.hpp"
#include "documents_exchange.hpp"

namespace {

TEST(MpiDocuments, CrossRankDocumentsMoveExactly) {
  cpdispatch::MpiTransport t = cpdispatch::MpiTransport::duplicate(MPI_COMM_WORLD);
  const int W = t.world_size();
  std::size_t mixed_groups = 0;  // shards whose document began on another home rank
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", W = " + std::to_string(W));
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = W;
    o.num_documents = 3 + static_cast<std::int64_t>(seed);
    o.max_shards = 2 * W + 1;
    o.max_len = 7;
    const auto plan = cpdispatch::random_documents_plan(o, seed);  // the same on every rank
    const auto m = cpdispatch::plan_qkv(plan);
    cptest::check_documents_exchange(t, plan, m);
    for (const auto& doc : plan.documents) {
      for (std::size_t i = 1; i < doc.shards.size(); ++i) mixed_groups += doc.shards[i].rank != doc.shards[0].rank ? 1 : 0;
    }
  }
  if (W > 1) {
    EXPECT_GT(mixed_groups, 0u);
  }
}

// Each rank plans only its own share (plan_qkv_for_rank) and builds its
// dispatchers from it.
TEST(MpiDocuments, DispatchersFromPerRankPlanning) {
  cpdispatch::MpiTransport t = cpdispatch::MpiTransport::duplicate(MPI_COMM_WORLD);
  for (std::uint64_t seed = 21; seed <= 24; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", W = " + std::to_string(t.world_size()));
    cpdispatch::RandomDocumentsOptions o;
    o.world_size = t.world_size();
    o.num_documents = 6;
    o.max_shards = 2 * t.world_size() + 1;
    o.max_len = 7;
    cptest::check_documents_exchange_per_rank(t, cpdispatch::random_documents_plan(o, seed));
  }
}

}  // namespace
