#pragma once
// Runs the cpdispatch-plan tool (CPDISPATCH_PLAN_EXE), for the suites that
// check its output and exit status: one runner for all of them.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace plan_cli {

#ifdef CPDISPATCH_PLAN_EXE
struct CliRun {
  int status = -1;  ///< the exit status, or -1 if the tool did not exit normally
  std::string out, err;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Runs `cpdispatch-plan args...` (no shell) with `input` on its stdin; the
/// files it needs are named `scratch` + "stdin" / "stdout" / "stderr".
/// stdout goes to `stdout_path` when given (e.g. /dev/full), else is captured.
inline CliRun run(const std::vector<std::string>& args, const std::string& input, const std::string& scratch,
                  const std::string& stdout_path = "") {
  const std::string exe = CPDISPATCH_PLAN_EXE, in = scratch + "stdin", err = scratch + "stderr";
  const std::string out = stdout_path.empty() ? scratch + "stdout" : stdout_path;
  std::ofstream(in, std::ios::binary) << input;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::vector<char*> argv = {const_cast<char*>(exe.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  CliRun r;
  if (spawned != 0) {
    ADD_FAILURE() << "cannot run " << exe << ": " << std::strerror(spawned);
    return r;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (stdout_path.empty()) r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

/// The words of `args` (split at spaces; the callers' arguments hold none).
inline std::vector<std::string> words(const std::string& args) {
  std::vector<std::string> out;
  std::istringstream in(args);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

/// Runs `cpdispatch-plan [subcommand] FILE args` on a file holding `input`.
/// ctest runs tests as parallel processes, so the files are named after the
/// test, after `prefix` (one per suite).
inline CliRun run_cli(const std::string& prefix, const std::string& input, const std::string& args, const std::string& subcommand = "") {
  const std::string scratch = ::testing::TempDir() + prefix + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-";
  const std::string in = scratch + "in.json";
  std::ofstream(in) << input;
  std::vector<std::string> argv;
  if (!subcommand.empty()) argv.push_back(subcommand);
  argv.push_back(in);
  for (std::string& w : words(args)) argv.push_back(std::move(w));
  return run(argv, "", scratch);
}
#endif

}  // namespace plan_cli
