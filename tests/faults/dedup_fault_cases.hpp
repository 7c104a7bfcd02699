#pragma once
// What the fault tests of the deduplicated KV exchange (KvWireDispatcher)
// share between the sim and MPI runs: a plan where every rank's shards are
// attended twice on one rank (so the fan-out and the fan-in have work), one
// step of the dispatcher on fresh buffers, and what it must produce.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "fault_cases.hpp"

namespace dedup_fault_cases {

using fault_cases::Outcome;
using fault_cases::StepData;

struct Plan {
  cpdispatch::QkvMetadata meta;
  cpdispatch::KvWireMetadata wire;
};

/// Each rank r: a document [2, 3, 1] whose first two query shards are
/// attended on r+1 (its first KV shard crosses once for two copies) and the
/// last on r, and a document [4] attended on r+2.
inline Plan shared_plan(int world_size) {
  cpdispatch::QkvPlan plan;
  plan.world_size = world_size;
  for (int r = 0; r < world_size; ++r) {
    const int next = (r + 1) % world_size;
    plan.ranks.push_back(cpdispatch::RankDocuments{{cpdispatch::Document{{2, 3, 1}, {next, next, r}},
                                                    cpdispatch::Document{{4}, {(r + 2) % world_size}}}});
  }
  Plan p{cpdispatch::plan_qkv(plan), {}};
  p.wire = cpdispatch::plan_kv_wire(p.meta);
  return p;
}

/// The most copies one received shard has on any rank: a byte corrupted on
/// the wire of the forward reaches at most that many places.
inline std::size_t most_copies(const Plan& p) {
  std::size_t most = 0;
  for (const cpdispatch::KvFanList& f : p.wire.fan) {
    for (std::size_t e = 0; e < f.num_entries(); ++e) most = std::max(most, f.copy_splits[e + 1] - f.copy_splits[e]);
  }
  return most;
}

enum class Step { forward, reverse_combine, reverse_combine_in_place };
inline const char* step_name(Step s) {
  return s == Step::forward ? "forward" : s == Step::reverse_combine ? "reverse_combine" : "reverse_combine_in_place";
}

/// Every rank's input and expected output: section 2's, since the forward
/// writes the same attention layout and the backward's sums are exact here
/// (the values and their sums are multiples of 0.5 far below 2^23: exact in
/// any order).
inline StepData step_data(const Plan& p, Step s) {
  return fault_cases::step_data(p.meta, s == Step::forward ? fault_cases::Step::forward : fault_cases::Step::reverse_combine);
}

/// An outcome, and whether the call's outputs (forward: the attention
/// layout; backward: the replica buffer and the gradient) still hold what
/// the caller put there.
struct DedupOutcome : Outcome {
  bool outputs_untouched = true;
};

constexpr float unwritten = -12345.0f;

inline bool all_unwritten(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return x == unwritten; });
}

/// One step of `d` on rank r, buffers fresh and filled with `unwritten`.
/// The in-place backward consumes a copy of the input (the input itself
/// stays the caller's).
template <class D>
void run_step(D& d, Step step, const StepData& data, std::size_t r, DedupOutcome& o) {
  const std::vector<float> input = data.input[r];
  const auto& need = d.required_bytes();
  std::vector<float> out(data.expected[r].size(), unwritten), replica(need.replica_bytes / sizeof(float), unwritten),
      wire(need.wire_bytes / sizeof(float), unwritten), consumed = input;
  const auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
  const auto type = cpdispatch::ElementType::float32;
  const auto start = std::chrono::steady_clock::now();
  try {
    if (step == Step::forward) d.forward(std::as_bytes(std::span(input)), bytes(out));
    if (step == Step::reverse_combine) d.reverse_combine(std::as_bytes(std::span(input)), bytes(wire), bytes(replica), bytes(out), type);
    if (step == Step::reverse_combine_in_place) d.reverse_combine_in_place(bytes(consumed), bytes(replica), bytes(out), type);
    o.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    o.wrong_floats = fault_cases::count_wrong(out, data.expected[r]);
  } catch (...) {
    fault_cases::record_exception(o, start);
  }
  o.input_unchanged = input == data.input[r];
  o.outputs_untouched = all_unwritten(out) && all_unwritten(replica);
}

}  // namespace dedup_fault_cases
