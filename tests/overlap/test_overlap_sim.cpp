// The overlapped GEMM on the in-process transport (SimWorld: ranks as
// threads), tp_size 1 to 4: every supported (type, method) pair, both
// transpose flags, float and double, against the unoverlapped reference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"
#include "overlap_cases.hpp"
#include "sim_world_fixture.hpp"

namespace ov = cpdispatch::overlap;
using cpdispatch::SimOptions;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;

namespace {

class OverlapSim : public sim_test::WorldSizeTest {};

INSTANTIATE_TEST_SUITE_P(TpSizes, OverlapSim, testing::Values(1, 2, 3, 4), sim_test::WorldSizeName{"tp"});

}  // namespace

TEST_P(OverlapSim, EveryMethodMatchesTheUnoverlappedReference) {
  run([](SimTransport& t) { overlap_cases::all_checks(t); });
}

TEST_P(OverlapSim, OverTheSimulatedLinkTheResultsAreTheSame) {
  run([](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, cpdispatch::LinkModel{std::chrono::microseconds(20), 1e10});
    cpdispatch::gemm::ReferenceGemm gemm;
    overlap_cases::every_case_matches_reference<float>(link, gemm);
  });
}

namespace {

/// The reference GEMM, failing from its (fail_after + 1)-th call on.
struct FailingGemm : cpdispatch::gemm::ReferenceGemm {
  int fail_after = 0;
  int calls = 0;
  void gemm(cpdispatch::gemm::Transpose ta, cpdispatch::gemm::Transpose tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
    if (++calls > fail_after) throw cpdispatch::error("injected GEMM failure");
    ReferenceGemm::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

}  // namespace

TEST_P(OverlapSim, AFailingGemmStopsTheCallAndIsRethrown) {
  // Every rank's GEMM fails on its second chunk (PIPELINE) or second partial
  // (RING_EXCHANGE): the communication side stops at its next step instead of
  // waiting for a chunk that never comes, and the call rethrows the failure.
  const int W = GetParam();
  const auto tp = static_cast<std::size_t>(W);
  for (auto method : {ov::CommOverlapMethod::PIPELINE, ov::CommOverlapMethod::RING_EXCHANGE}) {
    const bool fails = !(method == ov::CommOverlapMethod::RING_EXCHANGE && W == 1);  // one partial only
    SimWorld world(W, SimOptions{sim_test::hang_timeout});
    try {
      world.run([&](SimTransport& t) {
        FailingGemm gemm;
        gemm.fail_after = method == ov::CommOverlapMethod::PIPELINE ? W : 1;
        ov::CommOverlapBuffer buffer(ov::CommOverlapType::RS, method, {4 * tp, 2}, cpdispatch::ElementType::float32, W,
                                     ov::CommOverlapOptions{.num_splits = 2});
        std::vector<float> a(4 * tp * 3, 1.0f), b(3 * 2, 1.0f), rs(4 * 2);
        ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), 4 * tp, 3), cpdispatch::gemm::Transpose::no,
                      ov::matrix_view<const float>(b.data(), 3, 2), cpdispatch::gemm::Transpose::no, ov::MatrixView<float>{},
                      ov::matrix_view(rs.data(), 4, 2));
        if (!fails) {
          EXPECT_THAT(rs, testing::Each(3.0f));
        }
      });
      EXPECT_FALSE(fails) << ov::to_string(method) << ": no exception";
    } catch (const cpdispatch::error& e) {
      EXPECT_TRUE(fails) << e.what();
      EXPECT_THAT(e.what(), testing::HasSubstr("injected GEMM failure"));
    }
  }
}
