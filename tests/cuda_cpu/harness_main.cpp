// main() of the cuda-cpu test programs: GoogleTest, then the harness's own
// verdict. Violations the CUDA runtime and NCCL doubles found while a test
// ran (freed or out-of-bounds memory, overwritten guard bytes, mismatched
// NCCL calls, use of an aborted communicator, work that can never run) fail
// the program even when the test's own checks passed.

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_runtime.h"

namespace {

/// Names the test during which violations appeared.
class Verdict : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    {
      auto lock = cuda_harness::lock();
      cuda_harness::Runtime::get().check_all_guards("after the test");
    }
    auto& rt = cuda_harness::Runtime::get();
    auto lock = cuda_harness::lock();
    if (rt.violations.size() > reported_) {
      std::fprintf(stderr, "cuda-cpu harness: %zu violation(s) during %s.%s (seed %llu)\n", rt.violations.size() - reported_,
                   info.test_suite_name(), info.name(), static_cast<unsigned long long>(rt.seed));
      reported_ = rt.violations.size();
    }
  }

 private:
  std::size_t reported_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::UnitTest::GetInstance()->listeners().Append(new Verdict);
  const int rc = RUN_ALL_TESTS();
  (void)cudaDeviceSynchronize();
  {
    auto lock = cuda_harness::lock();
    cuda_harness::Runtime::get().check_all_guards("at exit");
  }
  const std::vector<std::string> violations = cuda_harness::take_violations();
  if (!violations.empty()) {
    std::fprintf(stderr, "cuda-cpu harness: FAILED with %zu violation(s); the first: %s\n", violations.size(), violations.front().c_str());
    return 1;
  }
  return rc;
}
