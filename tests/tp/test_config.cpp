// init_tensor_parallel / get_tensor_parallel_config, the collectives' checks
// and TP_DEBUG logging, without a real multi-rank transport.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/tp/tensor_parallel.hpp"
#include "cpdispatch/transports/single_rank.hpp"
#include "loopback_transport.hpp"
#include "tp_test_util.hpp"

namespace tp = cpdispatch::tp;
using testing::HasSubstr;
using tp_test::error_of;
using tp_test::LoopbackTransport;

TEST(TpConfig, InitRecordsThisThreadsConfig) {
  tp::reset_tensor_parallel_config();
  EXPECT_EQ(error_of([] { tp::get_tensor_parallel_config(); }),
            "get_tensor_parallel_config: init_tensor_parallel has not been called on this thread");
  LoopbackTransport t(2, 4);
  const auto config = tp::init_tensor_parallel("mpi", t);
  EXPECT_EQ(config, (tp::TensorParallelConfig{4, 2, tp::Backend::mpi}));
  EXPECT_EQ(tp::get_tensor_parallel_config(), config);
  // Another thread (another simulated rank) has its own.
  std::thread([] {
    EXPECT_THROW(tp::get_tensor_parallel_config(), cpdispatch::error);
    cpdispatch::SingleRankTransport one;
    EXPECT_EQ(tp::init_tensor_parallel(tp::Backend::sim, one), (tp::TensorParallelConfig{1, 0, tp::Backend::sim}));
  }).join();
  EXPECT_EQ(tp::get_tensor_parallel_config().rank, 2);
  tp::reset_tensor_parallel_config();
}

TEST(TpConfig, NcclTakesADeviceTransportAndTheHostBackendsAHostOne) {
  cpdispatch::SingleRankTransport one;
  EXPECT_THAT(error_of([&] { tp::init_tensor_parallel("nccl", one); }),
              HasSubstr("init_tensor_parallel(\"nccl\"): this backend runs on device memory but the transport works on host memory"));
  EXPECT_THAT(error_of([] { tp::init_tensor_parallel("nccl"); }),
              HasSubstr("init_tensor_parallel(\"nccl\"): pass this rank's transport too"));
  const cpdispatch::testing::BasicMockCollectiveTransport<cpdispatch::MemorySpace::device> device(1, 2);
  EXPECT_EQ(tp::init_tensor_parallel("nccl", device), (tp::TensorParallelConfig{2, 1, tp::Backend::nccl}));
  EXPECT_THAT(error_of([&] { tp::init_tensor_parallel("mpi", device); }),
              HasSubstr("this backend runs on host memory but the transport works on device memory"));
  tp::reset_tensor_parallel_config();
}

TEST(TpConfig, BackendNames) {
  EXPECT_EQ(error_of([] { tp::init_tensor_parallel("gloo"); }),
            "init_tensor_parallel: unknown backend \"gloo\"; expected \"sim\", \"mpi\" or \"nccl\"");
  EXPECT_EQ(error_of([] { tp::init_tensor_parallel("mpi"); }),
            "init_tensor_parallel(\"mpi\"): pass this rank's transport too: init_tensor_parallel(\"mpi\", transport)");
  EXPECT_STREQ(tp::backend_name(tp::parse_backend("sim")), "sim");
}

TEST(TpCollectives, OneRankMakesNoTransportCall) {
  LoopbackTransport t(0, 1);
  std::vector<float> v{1, 2, 3};
  tp::all_reduce_sum(t, std::span<float>(v));
  tp::broadcast_tensor(t, std::span<float>(v), 0);
  tp::synchronize_across_ranks(t);
  EXPECT_TRUE(t.calls.empty());
  EXPECT_EQ(v, (std::vector<float>{1, 2, 3}));
}

TEST(TpCollectives, CallsAndChecks) {
  LoopbackTransport t(1, 2);
  std::vector<double> v{1, 2, 3};
  tp::all_reduce_sum(t, std::span<double>(v));
  EXPECT_EQ(v, (std::vector<double>{2, 4, 6}));  // loopback: both ranks hold v
  tp::broadcast_tensor(t, std::span<double>(v), 1);
  tp::synchronize_across_ranks(t);
  ASSERT_EQ(t.calls.size(), 3u);
  EXPECT_EQ(t.calls[0].op, "all_reduce");
  EXPECT_EQ(t.calls[1].op, "broadcast");
  EXPECT_EQ(t.calls[1].count, 3 * sizeof(double));  // bytes
  EXPECT_EQ(t.calls[2].op, "barrier");
  EXPECT_EQ(error_of([&] { tp::broadcast_tensor(t, std::span<double>(v), 2); }),
            "broadcast_tensor: src = 2 is outside [0, 2)");
}

namespace {
/// A transport whose all_reduce fails, to see the failure logged.
struct FailingTransport : LoopbackTransport {
  FailingTransport() : LoopbackTransport(0, 2) {}
  void all_reduce(void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {
    throw cpdispatch::error("All-reduce timeout (test)");
  }
};
}  // namespace

TEST(TpCollectives, DebugLoggingNamesRankOperationBytesAndDuration) {
  LoopbackTransport t(1, 2);
  std::vector<float> v(6, 1.0f);
  tp::set_debug_logging(false);
  testing::internal::CaptureStderr();
  tp::all_reduce_sum(t, std::span<float>(v));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");

  ASSERT_EQ(setenv("TP_DEBUG", "1", 1), 0);
  tp::reset_debug_logging();  // read TP_DEBUG again
  EXPECT_TRUE(tp::debug_logging());
  testing::internal::CaptureStderr();
  tp::all_reduce_sum(t, std::span<float>(v));
  tp::synchronize_across_ranks(t);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, testing::ContainsRegex(
                       R"(\[TP_DEBUG\] rank 1/2 all_reduce_sum float32 x 6 \(24 bytes\) [0-9]+\.[0-9]{3} ms)"));
  EXPECT_THAT(log, HasSubstr("[TP_DEBUG] rank 1/2 synchronize_across_ranks"));

  FailingTransport f;
  testing::internal::CaptureStderr();
  EXPECT_THROW(tp::all_reduce_sum(f, std::span<float>(v)), cpdispatch::error);
  EXPECT_THAT(testing::internal::GetCapturedStderr(), HasSubstr("all_reduce_sum float32 x 6 (24 bytes) FAILED after"));

  ASSERT_EQ(setenv("TP_DEBUG", "0", 1), 0);
  tp::reset_debug_logging();
  EXPECT_FALSE(tp::debug_logging());
  ASSERT_EQ(unsetenv("TP_DEBUG"), 0);
}
