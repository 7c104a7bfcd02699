// The SVG picture of a plan: a well-formed XML document with one heat-map
// cell per pair of ranks that exchange bytes and one bar per rank.

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "balance_helpers.hpp"
#include "cpdispatch/io/svg.hpp"

namespace {

using baltest::I;
using baltest::well_formed_xml;

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(WellFormedXml, CatchesBrokenDocuments) {
  EXPECT_TRUE(well_formed_xml("<?xml version=\"1.0\"?>\n<svg a=\"1\"><g><rect/></g><text>a &amp; b</text></svg>\n"));
  EXPECT_FALSE(well_formed_xml("<svg><g></svg></g>"));
  EXPECT_FALSE(well_formed_xml("<svg><g>"));
  EXPECT_FALSE(well_formed_xml("<svg a=1></svg>"));
  EXPECT_FALSE(well_formed_xml("<svg><text>a & b</text></svg>"));
  EXPECT_FALSE(well_formed_xml("<svg></svg><svg></svg>"));
}

TEST(PlanSvg, IsWellFormedAndDrawsEveryFlowAndRank) {
  cpdispatch::BalanceProblem p;
  p.world_size = 6;
  p.max_cp_degree = 4;
  p.docs = {{900, 20, 30}, {40}, {10, 10}, {600}, {5}, {}};
  const auto before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(p));
  const auto after = cpdispatch::plan_cost(cpdispatch::plan_balanced(p));
  const std::string svg = cpdispatch::plan_svg(after, &before, "6 ranks <test> & \"quotes\"");
  ASSERT_TRUE(well_formed_xml(svg)) << svg;
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("6 ranks &lt;test&gt; &amp; &quot;quotes&quot;"), std::string::npos);
  std::size_t flows = 0;
  for (I b : after.bytes) flows += b > 0;
  ASSERT_GT(flows, 0u);
  EXPECT_EQ(count(svg, " bytes</title>"), flows);    // one heat-map cell per exchanging pair
  EXPECT_EQ(count(svg, " before: "), 6u);             // one bar per rank, before ...
  EXPECT_EQ(count(svg, "</title></rect>"), flows + 12);  // ... and after
  const std::string alone = cpdispatch::plan_svg(after);
  EXPECT_TRUE(well_formed_xml(alone));
  EXPECT_EQ(count(alone, " before: "), 0u);
}

TEST(PlanSvg, RejectsMismatchedCosts) {
  cpdispatch::PlanCost empty;
  EXPECT_THROW(cpdispatch::plan_svg(empty), cpdispatch::invalid_input);
  cpdispatch::BalanceProblem p;
  p.world_size = 2;
  p.docs = {{3}, {4}};
  const auto two = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(p));
  p.world_size = 3;
  p.docs = {{3}, {4}, {5}};
  const auto three = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(p));
  EXPECT_THROW(cpdispatch::plan_svg(three, &two), cpdispatch::invalid_input);
}

}  // namespace
