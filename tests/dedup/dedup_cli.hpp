#pragma once
// What the dedup JSON and per-rank CLI suites share: section 2b's documents
// plan and the runner of cpdispatch-plan (tests/common/plan_cli.hpp).

#include <string>

#include "../common/plan_cli.hpp"

namespace dedup_cli {

// Section 2b's documents plan: a document spanning ranks, two of its query
// shards attending on rank 1 (the one KV shard rank 1 receives once, not twice).
inline const char* const spec_documents = R"({"kind": "qkv", "world_size": 2, "max_cp_degree": 3, "documents": [
  {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}, {"rank": 1, "len": 4, "dst": 1}]},
  {"shards": [{"rank": 0, "len": 5, "dst": 0}]},
  {"shards": [{"rank": 1, "len": 1, "dst": 1}]}]})";

#ifdef CPDISPATCH_PLAN_EXE
using plan_cli::CliRun;
using plan_cli::run_cli;
#endif

}  // namespace dedup_cli
