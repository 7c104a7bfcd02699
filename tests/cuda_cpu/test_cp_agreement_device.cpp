// Plan agreement of ContextParallelAttention on device transports (cuda-cpu
// harness): the device sim and NcclTransport over the NCCL double. The
// records go through device memory on the transport's stream; shares of
// different plans throw on every rank with the same verdict, agreeing ones
// build.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/cuda/context_parallel.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cuda_test_util.hpp"
#include "nccl_world.hpp"

namespace cp_agreement_device_test {

using testing::HasSubstr;

const cpdispatch::AttentionShape shape{2, 1, 4, 0.5f};

/// Document d: 4 tokens on rank d, attended on rank d + 1; rank W-1's `extra` more.
cpdispatch::QkvDocumentsPlan ring_plan(int W, std::int64_t extra = 0) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  for (int d = 0; d < W; ++d) plan.documents.push_back({{{d, 4 + (d == W - 1 ? extra : 0), (d + 1) % W}}});
  return plan;
}

/// Builds the op of transport T on every rank from ring_plan(W, extra on rank W-1); what each threw.
template <class T, class Run>
std::vector<std::string> errors_of(int W, std::int64_t extra, cpdispatch::CpAttentionOptions options, Run&& run) {
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  const auto plan = ring_plan(W), longer = ring_plan(W, extra);
  run([&](T& t) {
    try {
      cpdispatch::ContextParallelAttention<T, float> op(t, cpdispatch::plan_qkv_for_rank(t.rank() == W - 1 ? longer : plan, t.rank()), shape, options);
    } catch (const cpdispatch::invalid_input& e) {
      errors[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  return errors;
}

void expect_named_everywhere(const std::vector<std::string>& errors, int W) {
  for (int r = 0; r < W; ++r) {
    EXPECT_THAT(errors[static_cast<std::size_t>(r)], HasSubstr("ContextParallelAttention::replan (rank " + std::to_string(r) + " of " + std::to_string(W) +
                                                              "): the ranks were handed plans that disagree: rank " + std::to_string(W - 1) +
                                                              " sends 6 query tokens to rank 0, which expects 4"));
  }
}

TEST(CpAgreementDevice, DeviceSimRanksWithOtherTokenCountsThrowOnEveryRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (int W : {2, 3, 4}) {
    const auto run = [&](auto&& f) { cpdispatch::DeviceSimWorld(W).run(f); };
    for (const std::string& e : errors_of<cpdispatch::DeviceSimTransport>(W, 0, {false, 2}, run)) EXPECT_EQ(e, "") << "W = " << W;
    expect_named_everywhere(errors_of<cpdispatch::DeviceSimTransport>(W, 2, {false, 2}, run), W);
    for (const std::string& e : errors_of<cpdispatch::DeviceSimTransport>(W, 2, {false, 2, false}, run)) EXPECT_EQ(e, "") << "turned off";
  }
}

TEST(CpAgreementDevice, NcclRanksWithOtherTokenCountsThrowOnEveryRank) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  int devices = 0;
  CPDISPATCH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "NCCL needs a GPU a rank";
  for (int W = 2; W <= std::min(devices, 4); ++W) {
    const auto run = [&](auto&& f) { cptest::run_nccl(W, f); };
    for (const std::string& e : errors_of<cpdispatch::NcclTransport>(W, 0, {}, run)) EXPECT_EQ(e, "") << "W = " << W;
    expect_named_everywhere(errors_of<cpdispatch::NcclTransport>(W, 2, {}, run), W);
  }
}

}  // namespace cp_agreement_device_test
