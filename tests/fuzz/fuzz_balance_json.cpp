// Fuzz target: the input document of `cpdispatch-plan balance` (a packed
// batch of document pieces, or the document lengths per rank; C,
// capacities, bytes per token, dedup). Reading, the lower bound, the balanced,
// unbalanced and greedy plans and their costs must succeed or throw
// invalid_input (capacity_error included); a plan the balancer returns must
// itself plan, into a layout that covers every allowed pair once.

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "fuzz_coverage.hpp"
#include "fuzz_target.hpp"

namespace {

// The planner is polynomial in documents and ranks; bound them so one input
// stays in the milliseconds (lengths are left free: their arithmetic is what
// is fuzzed).
bool small_enough(const cpdispatch::BalanceProblem& p) {
  std::size_t docs = 0;
  for (const auto& rank : p.docs) docs += rank.size();
  for (const auto& document : p.documents) docs += document.pieces.size() + document.slices.size();  // pieces (and slices) of a packed batch
  return p.world_size <= 16 && docs <= 64;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
    const nlohmann::json input = cpdispatch::parse_json(cpdispatch_fuzz::as_text(data, size), cpdispatch_fuzz::limits);
    const cpdispatch::BalanceProblem problem = cpdispatch::balance_problem_from_json(input);
    const cpdispatch::BalanceOptions options = cpdispatch::balance_options_from_json(input);
    if (!small_enough(problem)) return;
    (void)cpdispatch::balance_lower_bound(problem, cpdispatch_fuzz::limits);
    (void)cpdispatch::plan_cost(cpdispatch::plan_unbalanced(problem, cpdispatch_fuzz::limits), problem.q_bytes, problem.kv_bytes, cpdispatch_fuzz::limits);
    (void)cpdispatch::plan_cost(cpdispatch::plan_greedy(problem, 0.10, cpdispatch_fuzz::limits), problem.q_bytes, problem.kv_bytes, cpdispatch_fuzz::limits);
    const cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(problem, options, cpdispatch_fuzz::limits);
    (void)cpdispatch::plan_cost(plan, problem.q_bytes, problem.kv_bytes, cpdispatch_fuzz::limits);
    try {
      cpdispatch_fuzz::expect_coverage(plan, cpdispatch::plan_qkv(plan));  // the balancer's own output must be a valid plan
    } catch (...) {
      std::abort();
    }
  });
  return 0;
}
