// ContextParallelAttention over ChecksummedTransport (sim, W = 4): a payload
// corrupted in one of its posted stage exchanges, or in the one blocking
// exchange of a single-stage op, is a corruption_error naming the source
// rank (posted: on the rank whose wait received it, the others are released
// by the world's abort quoting it; blocking: on every rank by agreement),
// and a healthy step gives the same results as without checksums.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "attention_op/run_op.hpp"
#include "cpdispatch/adapters/checksummed.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"

namespace {

using namespace std::chrono_literals;
using attention_test::CpWorld;
using attention_test::ExactKernel;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::testing::Fault;
using cpdispatch::testing::FaultInjectingTransport;
using cpdispatch::testing::FaultRule;
using cpdispatch::testing::TransportCall;
using testing::HasSubstr;

const AttentionShape shape{2, 1, 4, 0.5f};

cpdispatch::QkvDocumentsPlan plan_of(int W, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = W + 2;
  o.max_shards = 3;
  o.max_len = 4;
  return cpdispatch::random_documents_plan(o, seed);
}

struct Result {
  bool threw = false;
  std::string what;
  attention_test::RankResult values;
};

/// One step of the op on every rank, over ChecksummedTransport<FaultInjectingTransport<sim>>.
std::vector<Result> run(int W, int stages, const std::vector<FaultRule>& rules) {
  const CpWorld world(plan_of(W, 62), shape, AttentionMask::causal(), 62, attention_test::round_to<float>);
  std::vector<Result> out(static_cast<std::size_t>(W));
  cpdispatch::SimWorld sim(W, cpdispatch::SimOptions{1000ms});
  try {
    sim.run([&](cpdispatch::SimTransport& inner) {
      FaultInjectingTransport faulty(inner, rules);
      cpdispatch::ChecksummedTransport t(faulty);
      const auto r = static_cast<std::size_t>(t.rank());
      const auto share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
      cpdispatch::ContextParallelAttention<decltype(t), float, ExactKernel> op(t, share, shape, {false, stages});
      try {
        out[r].values = attention_test::step<float>(op, world.tensors(r));
      } catch (const std::exception& e) {
        out[r].threw = true;
        out[r].what = e.what();
        throw;
      }
    });
  } catch (const cpdispatch::error&) {
  }
  return out;
}

TEST(ChecksummedAttention, HealthyStepEqualsTheStepWithoutChecksums) {
  for (const int stages : {1, 3}) {
    const auto checked = run(4, stages, {});
    const CpWorld world(plan_of(4, 62), shape, AttentionMask::causal(), 62, attention_test::round_to<float>);
    const auto plain = attention_test::run_op<float>(world, shape, {false, stages});
    for (std::size_t r = 0; r < checked.size(); ++r) {
      EXPECT_FALSE(checked[r].threw) << checked[r].what;
      EXPECT_EQ(checked[r].values.out, plain[r].out) << "rank " << r << ", stages " << stages;
    }
  }
}

TEST(ChecksummedAttention, CorruptedStageExchangeIsNamedOnEveryRank) {
  for (const auto& [call, stages] : {std::pair{TransportCall::post_all_to_all_v, 3}, std::pair{TransportCall::post_all_to_all_v, 1}}) {
    SCOPED_TRACE(cpdispatch::testing::call_name(call));
    const auto out = run(4, stages, {FaultRule{call, 1, Fault::corrupt, 3}});
    for (std::size_t r = 0; r < out.size(); ++r) {
      EXPECT_TRUE(out[r].threw) << "rank " << r;
      EXPECT_THAT(out[r].what, HasSubstr("from rank 3"));
      EXPECT_THAT(out[r].what, HasSubstr("corrupted or short"));
    }
    // The receiving rank is named: by its own error (the segment and the two checksums) or by the agreement's.
    EXPECT_TRUE(std::any_of(out.begin(), out.end(), [](const Result& x) {
      return x.what.find("fails its CRC32C check") != std::string::npos || x.what.find("reported by rank") != std::string::npos;
    }));
    std::printf("fault-matrix | ContextParallelAttention stages=%d + ChecksummedTransport | sim | corrupt in %s | W=4 | %zu/4 ranks threw\n",
                stages, cpdispatch::testing::call_name(call), static_cast<std::size_t>(std::count_if(out.begin(), out.end(), [](const Result& x) { return x.threw; })));
  }
}

}  // namespace
