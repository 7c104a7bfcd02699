// cpdispatch-plan on hostile plans: tiny files naming huge worlds end in exit
// status 2 and one line naming the plan's sizes and --max-memory. The
// program runs with its address space capped at 1 GiB (except under
// AddressSanitizer, which reserves far more), so a plan that escaped its
// check would fail with "out of memory" (status 1) rather than pass.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../common/sanitized.hpp"

namespace {

const std::string exe = CPDISPATCH_PLAN_EXE;
const std::string data_dir = CPDISPATCH_CLI_DATA_DIR;

// AddressSanitizer reserves terabytes of address space: no cap under it.
constexpr bool cap_address_space = !cptest::sanitized;

struct Result {
  int status = -1;  // exit status, or -1 if the program did not exit normally
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

class CliLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "cpdispatch-limits-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const char* name : {"input.json", "stderr"}) ::unlink((dir_ + "/" + name).c_str());
    ::rmdir(dir_.c_str());
  }

  /// Runs cpdispatch-plan `args` with `input` written to a file named by the
  /// argument "INPUT"; stdout is discarded.
  Result run(std::vector<std::string> args, const std::string& input = "") {
    const std::string path = dir_ + "/input.json", err = dir_ + "/stderr";
    std::ofstream(path, std::ios::binary) << input;
    for (std::string& a : args) a = a == "INPUT" ? path : a;
    std::vector<char*> argv = {const_cast<char*>(exe.c_str())};
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (cap_address_space) {
        const rlimit cap{rlim_t{1} << 30, rlim_t{1} << 30};
        ::setrlimit(RLIMIT_AS, &cap);
      }
      const int out = ::open("/dev/null", O_WRONLY), errfd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(out, 1);
      ::dup2(errfd, 2);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    Result r;
    int status = 0;
    if (pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status)) r.status = WEXITSTATUS(status);
    r.err = slurp(err);
    return r;
  }

  std::string dir_;
};

const std::string billion_ranks = R"({"kind":"qkv","world_size":1000000000,"documents":[{"shards":[{"rank":0,"len":5,"dst":0}]}]})";

std::string one_document(long long W) {
  return R"({"kind":"qkv","world_size":)" + std::to_string(W) + R"(,"documents":[{"shards":[{"rank":0,"len":5,"dst":0}]}]})";
}

void expect_refused(const Result& r, std::initializer_list<std::string> parts) {
  EXPECT_EQ(r.status, 2) << r.err;
  for (const std::string& part : parts) EXPECT_NE(r.err.find(part), std::string::npos) << "missing '" << part << "' in: " << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
}

TEST_F(CliLimits, BillionRankPlanIsRefusedInEveryMode) {
  for (const std::vector<std::string>& mode : {std::vector<std::string>{"INPUT"}, {"INPUT", "--summary"}, {"INPUT", "--rank", "0"},
                                               {"INPUT", "--dedup"}, {"INPUT", "--rank", "0", "--dedup"}, {"INPUT", "--svg", "/dev/null"}}) {
    SCOPED_TRACE(mode.size() > 1 ? mode[1] : "json");
    expect_refused(run(mode, billion_ranks), {"world_size = 1000000000", "(--max-memory)"});
  }
}

TEST_F(CliLimits, ThirtyThousandRanksGlobalIsRefusedOneRankIsPlanned) {
  expect_refused(run({"INPUT", "--summary"}, one_document(30000)), {"world_size = 30000", "1 shards", "(--max-memory)"});
  expect_refused(run({"INPUT"}, one_document(20000)), {"world_size = 20000"});
  const Result mine = run({"INPUT", "--rank", "29999"}, one_document(30000));
  EXPECT_EQ(mine.status, 0) << mine.err;
}

TEST_F(CliLimits, BalanceOfABillionRanksIsRefused) {
  const std::string problem = R"({"world_size":1000000000,"max_cp_degree":2,"documents":[{"pieces":[{"rank":0,"len":5}]}]})";
  expect_refused(run({"balance", "INPUT"}, problem), {"world_size = 1000000000", "1 pieces", "(--max-memory)"});
  expect_refused(run({"balance", "INPUT", "--summary"}, problem), {"world_size = 1000000000"});
}

TEST_F(CliLimits, DeepNestingIsRefusedBeforeParsing) {
  expect_refused(run({"INPUT"}, std::string(100000, '[') + std::string(100000, ']')), {"nesting deeper than 64 levels"});
  expect_refused(run({"balance", "INPUT"}, std::string(100000, '{') ), {"nesting deeper than 64 levels"});
}

TEST_F(CliLimits, MaxMemoryIsHonouredAndChecked) {
  const std::string spec = slurp(data_dir + "/spec_qkv.json");
  EXPECT_EQ(run({"INPUT", "--max-memory", "64M"}, spec).status, 0);
  EXPECT_EQ(run({"INPUT", "--max-memory=1GiB", "--summary"}, spec).status, 0);
  // Too small for the plan's text: refused while reading.
  expect_refused(run({"INPUT", "--max-memory", "1K"}, spec), {"the most JSON text --max-memory allows"});
  // Enough for the text, not for the JSON output of the metadata.
  expect_refused(run({"INPUT", "--max-memory", "200K"}, one_document(40)), {"world_size = 40", "limit of 200.0 KiB"});
  EXPECT_EQ(run({"INPUT", "--max-memory", "200K", "--summary"}, one_document(40)).status, 0);
  for (const char* bad : {"0", "abc", "-5", "12Q", "99999999999T"}) {
    expect_refused(run({"INPUT", "--max-memory", bad}, spec), {"--max-memory needs a positive size"});
  }
  expect_refused(run({"INPUT", "--max-memory"}, spec), {"--max-memory needs a size"});
}

}  // namespace
