// Documents that span ranks on the threaded sim transport, every rank: the
// forward exchanges put each query shard next to exactly its causal KV
// context (gathered from several home ranks), reverse Q is the identity and
// the KV combine sums every copy back at the shard's home; with dispatchers
// built from the global metadata and from each rank's own plan.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "documents_exchange.hpp"

namespace {

TEST(DocumentsSim, Section2bExampleOnTwoRanks) {
  cpdispatch::QkvDocumentsPlan p;
  p.world_size = 2;
  p.max_cp_degree = 3;
  p.documents = {{{{0, 3, 1}, {1, 2, 0}, {1, 4, 1}}}, {{{0, 5, 0}}}, {{{1, 1, 1}}}};
  const auto m = cpdispatch::plan_qkv(p);
  cpdispatch::SimWorld world(2, cpdispatch::SimOptions{std::chrono::milliseconds(60000)});
  world.run([&](cpdispatch::SimTransport& t) { cptest::check_documents_exchange(t, p, m); });
}

TEST(DocumentsSim, RandomCrossRankPlansEveryRank) {
  for (int W : {1, 2, 3, 4, 7, 8}) {
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      SCOPED_TRACE("W " + std::to_string(W) + " seed " + std::to_string(seed));
      cpdispatch::RandomDocumentsOptions o;
      o.world_size = W;
      o.num_documents = 2 + static_cast<std::int64_t>(seed) * 2;
      o.max_shards = 2 * W;
      o.max_len = 9;
      const auto plan = cpdispatch::random_documents_plan(o, seed);
      const auto m = cpdispatch::plan_qkv(plan);
      cpdispatch::SimWorld world(W, cpdispatch::SimOptions{std::chrono::milliseconds(60000)});
      world.run([&](cpdispatch::SimTransport& t) { cptest::check_documents_exchange(t, plan, m); });
    }
  }
}

// Each rank plans only its own share and builds its dispatchers from it.
TEST(DocumentsSim, DispatchersFromPerRankPlanning) {
  for (int W : {1, 2, 3, 5, 8}) {
    for (std::uint64_t seed = 11; seed <= 12; ++seed) {
      SCOPED_TRACE("W " + std::to_string(W) + " seed " + std::to_string(seed));
      cpdispatch::RandomDocumentsOptions o;
      o.world_size = W;
      o.num_documents = 3 * W;
      o.max_shards = 2 * W;
      o.max_len = 9;
      const auto plan = cpdispatch::random_documents_plan(o, seed);
      cpdispatch::SimWorld world(W, cpdispatch::SimOptions{std::chrono::milliseconds(60000)});
      world.run([&](cpdispatch::SimTransport& t) { cptest::check_documents_exchange_per_rank(t, plan); });
    }
  }
}

}  // namespace
