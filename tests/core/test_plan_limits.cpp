// plan_qkv refuses a copy dimension that would only allocate padding.
#include <gtest/gtest.h>

#include <string>

#include "cpdispatch/cpdispatch.hpp"

TEST(PlanLimits, AbsurdMaxCpDegreeIsAnErrorNamingTheField) {
  cpdispatch::QkvPlan plan;
  plan.world_size = 1;
  plan.ranks = {{{cpdispatch::Document{{4, 2}, {0, 0}}}}};
  plan.max_cp_degree = cpdispatch::max_supported_cp_degree;
  EXPECT_NO_THROW(cpdispatch::plan_qkv(plan));
  plan.max_cp_degree = cpdispatch::max_supported_cp_degree + 1;
  try {
    cpdispatch::plan_qkv(plan);
    FAIL() << "expected invalid_input";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("max_cp_degree = 65537"), std::string::npos) << e.what();
  }
}
