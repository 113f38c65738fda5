// run_isolated: the child's outcome comes back as it ended; a child ended by a fault is reported, one killed from
// outside kills its parent alike (after its cleanup); SIGTERM sent to the parent reaches the child.
#include "tools/isolated_run.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace trestle::cli {
namespace {

Outcome not_crashed(int) { return {99, "unexpected signal"}; }

TEST(IsolatedRunTest, TheChildsExitCodeAndMessageComeBack) {
  const Outcome ok = run_isolated([] { return finished(); }, not_crashed);
  EXPECT_EQ(ok.code, kExitOk);
  EXPECT_EQ(ok.message, "");
  const Outcome failed =
      run_isolated([] { return failure(Status::Error("bad.h5: no 'dtype' attribute")); }, not_crashed);
  EXPECT_EQ(failed.code, kExitFailure);
  EXPECT_EQ(failed.message, "bad.h5: no 'dtype' attribute");
  const std::string long_message(100000, 'x');  // past a pipe's buffer
  EXPECT_EQ(run_isolated([&] { return usage_error(long_message); }, not_crashed).message, long_message);
  EXPECT_EQ(run_isolated([&] { return usage_error(long_message); }, not_crashed).code, kExitUsage);
}

TEST(IsolatedRunTest, AnExceptionInTheChildIsAFailure) {
  const Outcome thrown = run_isolated([]() -> Outcome { throw std::runtime_error("parser gave up"); }, not_crashed);
  EXPECT_EQ(thrown.code, kExitFailure);
  EXPECT_EQ(thrown.message, "parser gave up");
}

TEST(IsolatedRunTest, AChildEndedByAFaultIsReported) {
  // (SIGABRT: a library's failed assertion; AddressSanitizer, which the sanitizer job builds with, turns a SIGSEGV into
  // an exit of its own)
  int seen = 0;
  const Outcome crashed = run_isolated([]() -> Outcome { std::abort(); },
                                       [&](int signal) {
                                         seen = signal;
                                         return failure(Status::Error("the library crashed"));
                                       });
  EXPECT_EQ(seen, SIGABRT);
  EXPECT_EQ(crashed.code, kExitFailure);
  EXPECT_EQ(crashed.message, "the library crashed");
}

TEST(IsolatedRunTest, AChildKilledFromOutsideKillsItsParentTheSameWay) {
  // (run_isolated in a process of its own, which the child's SIGKILL then ends too)
  const pid_t runner = ::fork();
  ASSERT_GE(runner, 0);
  if (runner == 0) {
    run_isolated(
        []() -> Outcome {
          std::raise(SIGKILL);
          return finished();
        },
        not_crashed);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(runner, &status, 0), runner);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(IsolatedRunTest, SigtermSentToTheParentReachesTheChildAndTheCleanupRuns) {
  // (a job scheduler's `kill PID` names trestle, not the child doing its work: the child's own handlers must run)
  const std::string dir = std::filesystem::temp_directory_path() / ("isolated_run_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string started = dir + "/started", cleaned = dir + "/cleaned";
  const pid_t runner = ::fork();
  ASSERT_GE(runner, 0);
  if (runner == 0) {
    run_isolated(
        [&]() -> Outcome {
          std::ofstream(started) << ::getpid();
          for (;;) ::pause();
        },
        not_crashed, [&](int signal) { std::ofstream(cleaned) << signal; });
    ::_exit(0);
  }
  // Once the child runs and the parent catches SIGTERM (its handler passing it on), the signal is sent.
  auto catches_sigterm = [&] {
    std::ifstream status("/proc/" + std::to_string(runner) + "/status");
    for (std::string line; std::getline(status, line);)
      if (line.starts_with("SigCgt:")) return ((std::stoull(line.substr(7), nullptr, 16) >> (SIGTERM - 1)) & 1) != 0;
    return false;
  };
  for (int i = 0; i < 1000 && !(std::filesystem::exists(started) && catches_sigterm()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(std::filesystem::exists(started));
  ASSERT_TRUE(catches_sigterm());
  ASSERT_EQ(::kill(runner, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(runner, &status, 0), runner);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_EQ(read_file(cleaned), std::to_string(SIGTERM));  // the child died by the SIGTERM passed on; then the cleanup
  const pid_t child = std::stoi(read_file(started));
  EXPECT_NE(::kill(child, 0), 0);  // (reaped by the runner before it died)
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace trestle::cli
