// The local launcher over real processes: it binds the job's c10d store port before any worker starts (the workers find
// it listening, rank 0 holding the socket, named by TRESTLE_STORE_LISTEN_FD), refuses a store port another process
// holds, filters its own
// options out of the workers' command line, and with --exit-signal-handler treats a repeated SIGTERM as the same
// request unless it comes later, when the workers get a grace period before they are killed.
#include "parallel/launcher.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/loopback_listener.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace {

using trestle::fails_with;
using trestle::parallel::ExitSignalRequests;
using trestle::parallel::launch_local_workers;
using trestle::parallel::LaunchOptions;
using trestle::testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Each worker connects to the store's port (bash's /dev/tcp fails unless something listens: no worker accepts here,
// the kernel's backlog answers) and writes to <dir>/<RANK> its variables and what its descriptor 3 is; rank 0, which
// holds the listening socket, stays until rank 1 has written.
std::vector<std::string> reporting_worker(const TempDir& dir) {
  return {"/bin/bash", "-c",
          "fd3=none; if [ -S /dev/fd/3 ]; then fd3=socket; fi; exec 5<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && "
          "echo \"$MASTER_PORT $WORLD_SIZE ${TRESTLE_STORE_LISTEN_FD:-none} ${TORCHELASTIC_USE_AGENT_STORE:-none} "
          "$fd3\" > " +
              dir.str() + "/$RANK && for i in $(seq 200); do [ -e " + dir.str() +
              "/1 ] && exit 0; sleep 0.05; done; exit 1"};
}

TEST(Launcher, BindsTheStorePortBeforeTheWorkersStartAndHandsItToRank0) {
  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  // (A stray variable of an enclosing torchrun job is not passed on: rank 0 serves this job's store.)
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  auto outcome = launch_local_workers(reporting_worker(dir), options);
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  ASSERT_TRUE(outcome.ok()) << outcome.status().message();
  EXPECT_EQ(outcome->exit_code, 0) << outcome->failure;
  auto fields = [&](int rank) {
    std::istringstream in(read_file(dir / std::to_string(rank)));
    std::vector<std::string> out;
    for (std::string field; in >> field;) out.push_back(field);
    return out;
  };
  const auto rank0 = fields(0), rank1 = fields(1);
  ASSERT_EQ(rank0.size(), 5u);
  EXPECT_GT(std::stoi(rank0[0]), 0);
  EXPECT_EQ(rank0, (std::vector<std::string>{rank0[0], "2", "3", "none", "socket"}));
  EXPECT_EQ(rank1, (std::vector<std::string>{rank0[0], "2", "none", "none", "none"}));
}

TEST(Launcher, RefusesAStorePortAnotherProcessHoldsAndStartsNoWorker) {
  const trestle::testing::LoopbackListener holder;
  ASSERT_GT(holder.port(), 0);
  const int held = holder.port();

  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  options.master_port = held;
  const auto outcome = launch_local_workers(reporting_worker(dir), options);
  EXPECT_TRUE(fails_with(outcome, "the launcher cannot bind the job's c10d store port " + std::to_string(held) +
                                      ": bind: Address already in use"));
  EXPECT_TRUE(dir.entries().empty());
}

TEST(Launcher, RemovesLauncherOptionsAndTheirValues) {
  const std::vector<std::string> in = {
      "train", "--nproc-per-node", "4",       "--master-port=29500", "--tensor-model-parallel-size",
      "2",     "--master-addr",    "10.0.0.1"};
  EXPECT_EQ(trestle::parallel::remove_options(in, {"--nproc-per-node", "--master-addr", "--master-port"}),
            (std::vector<std::string>{"train", "--tensor-model-parallel-size", "2"}));
}

TEST(ExitSignalRequests, ARepeatWithinTheWindowIsTheSameRequestALaterOneStartsTheDeadline) {
  using Action = ExitSignalRequests::Action;
  using std::chrono::milliseconds;
  ExitSignalRequests requests(milliseconds(2000));
  const auto start = ExitSignalRequests::Clock::now();
  EXPECT_EQ(requests.receive(start), Action::kForward);
  EXPECT_EQ(requests.receive(start + milliseconds(100)), Action::kSameRequest);
  EXPECT_EQ(requests.receive(start + milliseconds(1999)), Action::kSameRequest);
  EXPECT_EQ(requests.receive(start + milliseconds(2000)), Action::kStartDeadline);
  EXPECT_EQ(requests.receive(start + milliseconds(60000)), Action::kStartDeadline);
}

// Workers that note SIGTERM (`on_term`: a trap body, or '' to ignore it), write <dir>/<RANK> once they listen for it
// and wait.
std::vector<std::string> signalled_worker(const TempDir& dir, const std::string& on_term) {
  return {"/bin/bash", "-c",
          "trap '" + on_term + "' TERM; touch " + dir.str() + "/$RANK; while :; do sleep 0.02; done"};
}

// Sends this process (the launcher) SIGTERM once both workers are ready, then again `later`.
std::thread signal_launcher_twice(const TempDir& dir, std::chrono::milliseconds later) {
  return std::thread([&dir, later] {
    while (dir.entries().size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the launcher's handler is installed by now
    ::kill(::getpid(), SIGTERM);
    std::this_thread::sleep_for(later);
    ::kill(::getpid(), SIGTERM);
  });
}

TEST(Launcher, TwoExitSignalsCloseTogetherAreOneRequestAndWorkersThatExit0EndTheJobWith0) {
  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  options.forward_signals = true;
  // Each worker takes a second to "save" after the signal; the repeat comes 0.1 s after the first.
  std::thread signals = signal_launcher_twice(dir, std::chrono::milliseconds(100));
  const auto outcome = launch_local_workers(signalled_worker(dir, "sleep 1; exit 0"), options);
  signals.join();
  ASSERT_TRUE(outcome.ok()) << outcome.status().message();
  EXPECT_EQ(outcome->exit_code, 0) << outcome->failure;
}

TEST(Launcher, WorkersStillRunningAGraceAfterALaterRepeatAreKilledAndTheJobSaysSo) {
  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  options.forward_signals = true;
  options.exit_signal_grace = std::chrono::milliseconds(300);
  std::thread signals = signal_launcher_twice(dir, std::chrono::milliseconds(2200));
  const auto start = std::chrono::steady_clock::now();
  const auto outcome = launch_local_workers(signalled_worker(dir, ""), options);  // they ignore SIGTERM
  signals.join();
  ASSERT_TRUE(outcome.ok()) << outcome.status().message();
  EXPECT_EQ(outcome->exit_code, 128 + SIGTERM);
  EXPECT_EQ(outcome->failure, "workers did not finish within 0.3 s after the second signal: killing them");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

}  // namespace
