#pragma once
// Runs the cpdispatch-plan tool (CPDISPATCH_PLAN_EXE) on an input file, for
// the suites that check its output and exit status.

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace plan_cli {

#ifdef CPDISPATCH_PLAN_EXE
struct CliRun {
  int status = -1;
  std::string out, err;
};

/// Runs `cpdispatch-plan [subcommand] FILE args` on a file holding `input`.
/// ctest runs tests as parallel processes, so the files are named after the
/// test, after `prefix` (one per suite).
inline CliRun run_cli(const std::string& prefix, const std::string& input, const std::string& args, const std::string& subcommand = "") {
  const std::string dir = ::testing::TempDir() + prefix + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string in = dir + "-in.json", out = dir + "-out.txt", err = dir + "-err.txt";
  std::ofstream(in) << input;
  const std::string sub = subcommand.empty() ? std::string() : subcommand + " ";
  const std::string cmd = std::string("'") + CPDISPATCH_PLAN_EXE + "' " + sub + "'" + in + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int raw = std::system(cmd.c_str());
  auto slurp = [](const std::string& path) {
    std::stringstream s;
    s << std::ifstream(path).rdbuf();
    return s.str();
  };
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, slurp(out), slurp(err)};
}
#endif

}  // namespace plan_cli
