#pragma once
// What the dedup JSON and per-rank CLI suites share: section 2b's documents
// plan and a runner of cpdispatch-plan (CPDISPATCH_PLAN_EXE).

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace dedup_cli {

// Section 2b's documents plan: a document spanning ranks, two of its query
// shards attending on rank 1 (the one KV shard rank 1 receives once, not twice).
inline const char* const spec_documents = R"({"kind": "qkv", "world_size": 2, "max_cp_degree": 3, "documents": [
  {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}, {"rank": 1, "len": 4, "dst": 1}]},
  {"shards": [{"rank": 0, "len": 5, "dst": 0}]},
  {"shards": [{"rank": 1, "len": 1, "dst": 1}]}]})";

#ifdef CPDISPATCH_PLAN_EXE
struct CliRun {
  int status = -1;
  std::string out, err;
};

/// Runs cpdispatch-plan with `args` on a plan file holding `plan`. ctest runs
/// tests as parallel processes, so the files are named after the test, after
/// `prefix` (one per suite).
inline CliRun run_cli(const std::string& prefix, const std::string& plan, const std::string& args) {
  const std::string dir = ::testing::TempDir() + prefix + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string in = dir + "-plan.json", out = dir + "-out.txt", err = dir + "-err.txt";
  std::ofstream(in) << plan;
  const std::string cmd = std::string("'") + CPDISPATCH_PLAN_EXE + "' '" + in + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int raw = std::system(cmd.c_str());
  auto slurp = [](const std::string& path) {
    std::stringstream s;
    s << std::ifstream(path).rdbuf();
    return s.str();
  };
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, slurp(out), slurp(err)};
}
#endif

}  // namespace dedup_cli
