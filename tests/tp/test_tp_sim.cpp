// The tensor-parallel layers, wrapper and utilities on the in-process
// transport (SimWorld: ranks as threads), world sizes 1 to 4.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "cpdispatch/transports/sim.hpp"
#include "sim_world_fixture.hpp"
#include "tp_cases.hpp"

namespace tp = cpdispatch::tp;
using cpdispatch::SimOptions;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using testing::HasSubstr;
using testing::MatchesRegex;
using namespace std::chrono_literals;

namespace {

class TpSim : public sim_test::WorldSizeTest {};

INSTANTIATE_TEST_SUITE_P(WorldSizes, TpSim, testing::Values(1, 2, 3, 4), sim_test::WorldSizeName{"W"});

}  // namespace

TEST_P(TpSim, RowParallelLinearMatchesUnsharded) {
  run([](SimTransport& t) {
    tp_cases::row_layer_matches_unsharded<float>(t);
    tp_cases::row_layer_matches_unsharded<double>(t);
  });
}

TEST_P(TpSim, ColumnParallelLinearMatchesUnsharded) {
  run([](SimTransport& t) {
    tp_cases::column_layer_matches_unsharded<float>(t);
    tp_cases::column_layer_matches_unsharded<double>(t);
  });
}

TEST_P(TpSim, WrapperMatchesUnsharded) {
  run([](SimTransport& t) {
    for (const char* name : {"mlp2", "mlp4", "odd3", "back_to_back"}) {
      tp_cases::wrapper_matches_unsharded<float>(t, name);
      tp_cases::wrapper_matches_unsharded<double>(t, name);
    }
  });
}

TEST_P(TpSim, TrainingMatchesUnsharded) {
  run([](SimTransport& t) { tp_cases::training_matches_unsharded<float>(t); });
}

TEST_P(TpSim, Divisibility) {
  run([](SimTransport& t) { tp_cases::divisibility(t); });
}

TEST_P(TpSim, WorldSizeMustMatchAcrossAllRanks) {
  if (GetParam() == 1) GTEST_SKIP() << "needs two ranks to disagree";
  run([](SimTransport& t) { tp_cases::world_size_mismatch(t); });
}

TEST_P(TpSim, Utilities) {
  run([](SimTransport& t) { tp_cases::utilities(t, tp::Backend::sim); });
}

// ---- a rank that never joins: "All-reduce timeout", not a hang ----------------

TEST(TpSimTimeout, ColumnForwardRaisesAllReduceTimeoutWhenARankNeverJoins) {
  SimWorld world(4, SimOptions{500ms});  // generous: the construction's all_gather waits too
  tp_cases::HostGemm gemm;
  try {
    world.run([&](SimTransport& t) {
      tp::ColumnParallelLinear layer(t, gemm, 8, 4);  // every rank builds it
      if (t.rank() == 3) {
        std::this_thread::sleep_for(2500ms);  // ... but rank 3 never runs forward
        return;
      }
      std::vector<float> x(2 * 2, 1.0f), y(2 * 4);
      layer.forward(x.data(), 2, y.data());
    });
    FAIL() << "no timeout";
  } catch (const cpdispatch::timeout_error& e) {
    EXPECT_THAT(e.what(), MatchesRegex("SimWorld rank [0-2] of 4: All-reduce timeout on rank [0-2] of 4 in all_reduce: "
                                       "not complete after 500 ms \\(SimOptions::timeout\\)"));
  }
}

TEST(TpSimTimeout, WrapperForwardRaisesAllReduceTimeoutToo) {
  SimWorld world(2, SimOptions{500ms});
  tp_cases::HostGemm gemm;
  const auto model = tp_cases::stack<float>("mlp2");
  try {
    world.run([&](SimTransport& t) {
      tp::DistributedModelWrapper wrapper(model, t, gemm);
      if (t.rank() == 0) {
        std::this_thread::sleep_for(2500ms);
        return;
      }
      wrapper.forward(tp_test::random_tensor<float>({2, 10}, 1));
    });
    FAIL() << "no timeout";
  } catch (const cpdispatch::timeout_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("All-reduce timeout on rank 1 of 2 in all_reduce: not complete after 500 ms"));
  }
}

// ---- construction errors agree across ranks ------------------------------------

TEST(TpSimErrors, ShapesMustMatchAcrossAllRanks) {
  SimWorld world(3, SimOptions{sim_test::hang_timeout});
  tp_cases::HostGemm gemm;
  std::vector<std::string> errors(3);
  world.run([&](SimTransport& t) {
    const std::size_t out = t.rank() == 1 ? 6 : 12;
    errors[static_cast<std::size_t>(t.rank())] = tp_cases::error_of([&] { tp::RowParallelLinear(t, gemm, 4, out); });
  });
  for (const auto& e : errors) {
    EXPECT_EQ(e, "RowParallelLinear: the layer must be the same on all ranks: rank 0 builds RowParallelLinear("
                 "in_features 4, out_features 12, bias on, float32), rank 1 builds RowParallelLinear(in_features 4, "
                 "out_features 6, bias on, float32)");
  }
}

TEST(TpSimErrors, ABadShardOnOneRankFailsEveryRank) {
  SimWorld world(2, SimOptions{sim_test::hang_timeout});
  tp_cases::HostGemm gemm;
  std::vector<std::string> errors(2);
  world.run([&](SimTransport& t) {
    const std::vector<float> w(t.rank() == 0 ? 16 : 15), b(4);
    errors[static_cast<std::size_t>(t.rank())] = tp_cases::error_of([&] {
      tp::RowParallelLinear<SimTransport, tp_cases::HostGemm>::from_full(t, gemm, 4, 4, w, b);
    });
  });
  EXPECT_EQ(errors[0], "RowParallelLinear: rank 1 could not build its shard (its own error names the cause)");
  EXPECT_EQ(errors[1], "RowParallelLinear::from_full: the weight has 15 elements, expected out_features x "
                       "in_features = 4 x 4 = 16");
}

// ---- TP_DEBUG -------------------------------------------------------------------

TEST(TpSimDebug, LogsEachCollectiveOfEachRank) {
  SimWorld world(2, SimOptions{sim_test::hang_timeout});
  tp_cases::HostGemm gemm;
  tp::set_debug_logging(true);
  testing::internal::CaptureStderr();
  world.run([&](SimTransport& t) {
    tp::ColumnParallelLinear layer(t, gemm, 8, 3, {.check_across_ranks = false});
    std::vector<float> x(5 * 4, 1.0f), y(5 * 3);
    layer.forward(x.data(), 5, y.data());
  });
  const std::string log = testing::internal::GetCapturedStderr();
  tp::reset_debug_logging();
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(log, testing::ContainsRegex("\\[TP_DEBUG\\] rank " + std::to_string(r) +
                                            "/2 all_reduce_sum float32 x 15 \\(60 bytes\\) [0-9.]+ ms"));
  }
}
