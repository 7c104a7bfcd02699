// _time_planning: the C++ calls behind cpdispatch.plan, plan_for_rank and
// balance, timed in C++ on plans read from JSON text, for bench_binding.py
// (which builds this file itself: the shipped module has no timing hooks).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <variant>

#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/io/json.hpp"

namespace py = pybind11;

namespace {

/// Seconds per call of `work`, the best of `repeats` calls, without the GIL.
template <class F>
double best_seconds(int repeats, F&& work) {
  py::gil_scoped_release unlocked;
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    work();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

/// plan_metadata (and plan_kv_wire with dedup) of the whole plan, or
/// plan_metadata_for_rank where rank >= 0.
double time_plan(const std::string& text, std::int64_t rank, bool dedup, int repeats) {
  const cpdispatch::Plan plan = cpdispatch::parse_plan(text);
  return best_seconds(repeats, [&] {
    if (rank >= 0) {
      const cpdispatch::RankPlanMetadata share = cpdispatch::plan_metadata_for_rank(plan, rank);
      return;
    }
    const cpdispatch::PlanMetadata planned = cpdispatch::plan_metadata(plan);
    if (dedup) const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(std::get<cpdispatch::QkvMetadata>(planned));
  });
}

double time_balance(const std::string& text, int repeats) {
  const nlohmann::json j = cpdispatch::parse_json(text);
  const cpdispatch::BalanceProblem problem = cpdispatch::balance_problem_from_json(j);
  const cpdispatch::BalanceOptions options = cpdispatch::balance_options_from_json(j);
  return best_seconds(repeats, [&] { const cpdispatch::QkvDocumentsPlan balanced = cpdispatch::plan_balanced(problem, options); });
}

}  // namespace

PYBIND11_MODULE(_time_planning, m) {
  m.def("time_plan", &time_plan, py::arg("plan_json"), py::arg("rank"), py::arg("dedup"), py::arg("repeats"));
  m.def("time_balance", &time_balance, py::arg("batch_json"), py::arg("repeats"));
}
