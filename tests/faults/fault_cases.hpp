#pragma once
// What the fault tests share between the sim and MPI runs: a plan whose every
// rank sends to and receives from others, the per-rank buffers and their
// expected contents (from simulate), and the outcome of one rank.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"

namespace fault_cases {

// The fault-injection vocabulary every fault test uses (with `using namespace fault_cases;`).
using cpdispatch::testing::Fault;
using cpdispatch::testing::FaultInjectingTransport;
using cpdispatch::testing::FaultOptions;
using cpdispatch::testing::FaultRule;
using cpdispatch::testing::TransportCall;

/// Each rank r: a document [3, 2] attended on r+1 and r, and a document [4] attended on r+2.
inline cpdispatch::QkvMetadata ring_plan(int world_size) {
  cpdispatch::QkvPlan plan;
  plan.world_size = world_size;
  for (int r = 0; r < world_size; ++r) {
    plan.ranks.push_back(cpdispatch::RankDocuments{{cpdispatch::Document{{3, 2}, {(r + 1) % world_size, r}},
                                                    cpdispatch::Document{{4}, {(r + 2) % world_size}}}});
  }
  return cpdispatch::plan_qkv(plan);
}

enum class Step { forward, reverse, reverse_combine };
inline const char* step_name(Step s) {
  return s == Step::forward ? "forward" : s == Step::reverse ? "reverse" : "reverse_combine";
}

constexpr std::size_t token_elems = 2;  // floats per token
constexpr std::size_t token_bytes = token_elems * sizeof(float);

/// Every rank's input and expected output of one dispatcher step on the KV tensor.
struct StepData {
  std::vector<std::vector<float>> input, expected;
  std::size_t output_floats(std::size_t r) const { return expected[r].size(); }
};

inline std::vector<float> pattern(std::size_t rank, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(1000 * rank + i) + 0.5f;
  return v;
}

inline StepData step_data(const cpdispatch::QkvMetadata& m, Step step) {
  const auto W = static_cast<std::size_t>(m.kv_fwd.world_size);
  StepData d;
  if (step == Step::forward) {
    for (std::size_t r = 0; r < W; ++r) d.input.push_back(pattern(r, static_cast<std::size_t>(m.kv_fwd.send_tokens(static_cast<std::int64_t>(r))) * token_elems));
    cpdispatch::simulate(m.kv_fwd, d.input, d.expected, token_elems);
    return d;
  }
  for (std::size_t r = 0; r < W; ++r) d.input.push_back(pattern(r + 7, static_cast<std::size_t>(m.kv_rev.send_tokens(static_cast<std::int64_t>(r))) * token_elems));
  cpdispatch::simulate(m.kv_rev, d.input, d.expected, token_elems);
  if (step == Step::reverse_combine) {
    for (std::size_t r = 0; r < W; ++r) {
      const auto slice = m.kv_rev.get_slice(static_cast<std::int64_t>(r));
      std::vector<float> grad(static_cast<std::size_t>(m.kv_fwd.send_tokens(static_cast<std::int64_t>(r))) * token_elems);
      cpdispatch::combine_copies<float>(slice, std::span<const float>(d.expected[r]), std::span<float>(grad), token_elems);
      d.expected[r] = std::move(grad);
    }
  }
  return d;
}

/// What one rank saw.
struct Outcome {
  bool threw = false;
  bool backend = false;   // a backend_error (timeout_error included)
  bool timeout = false;   // a timeout_error
  int code = 0;
  std::string what;
  double ms = 0;          // from the start of the step to the exception (or the return)
  bool input_unchanged = true;
  std::size_t wrong_floats = 0;  // output floats that differ from the expected ones (when it returned)
};

inline void record_exception(Outcome& o, std::chrono::steady_clock::time_point start) {
  o.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  o.threw = true;
  try {
    throw;
  } catch (const cpdispatch::timeout_error& e) {
    o.backend = o.timeout = true;
    o.what = e.what();
  } catch (const cpdispatch::backend_error& e) {
    o.backend = true;
    o.code = e.code();
    o.what = e.what();
  } catch (const std::exception& e) {
    o.what = e.what();
  }
}

inline std::size_t count_wrong(const std::vector<float>& got, const std::vector<float>& want) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < want.size(); ++i) wrong += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
  return wrong;
}

/// Runs one dispatcher step on this rank, filling `o`. Buffers are fresh each call.
template <class Dispatcher>
void run_step(Dispatcher& d, Step step, const StepData& data, std::size_t r, Outcome& o) {
  const std::vector<float> input = data.input[r];
  const auto& need = d.required_bytes();
  std::vector<float> out(data.output_floats(r), 0.0f);  // as simulate's: cells of missing copies stay 0
  std::vector<float> replica(need.replica_bytes / sizeof(float), 0.0f);
  const auto start = std::chrono::steady_clock::now();
  try {
    const auto in = std::as_bytes(std::span(input));
    if (step == Step::forward) d.forward(in, std::as_writable_bytes(std::span(out)));
    if (step == Step::reverse) d.reverse(in, std::as_writable_bytes(std::span(out)));
    if (step == Step::reverse_combine) {
      d.reverse_combine(in, std::as_writable_bytes(std::span(replica)), std::as_writable_bytes(std::span(out)),
                        cpdispatch::ElementType::float32);
    }
    o.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    o.wrong_floats = count_wrong(out, data.expected[r]);
  } catch (...) {
    record_exception(o, start);
  }
  o.input_unchanged = input == data.input[r];
}

}  // namespace fault_cases
