// The local launcher over real processes: it serves the job's c10d store before any worker starts (the workers find
// it listening and TORCHELASTIC_USE_AGENT_STORE set), refuses a store port another process holds, and filters its own
// options out of the workers' command line.
#include "parallel/launcher.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace {

using trestle::fails_with;
using trestle::parallel::launch_local_workers;
using trestle::parallel::LaunchOptions;
using trestle::testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Each worker connects to the store's port (bash's /dev/tcp fails unless something listens) and writes its
// variables to <dir>/<RANK>.
std::vector<std::string> reporting_worker(const TempDir& dir) {
  return {"/bin/bash", "-c",
          "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && echo \"$MASTER_PORT $TORCHELASTIC_USE_AGENT_STORE "
          "$WORLD_SIZE\" > " +
              dir.str() + "/$RANK"};
}

TEST(Launcher, ServesTheStoreBeforeTheWorkersStart) {
  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  auto outcome = launch_local_workers(reporting_worker(dir), options);
  ASSERT_TRUE(outcome.ok()) << outcome.status().message();
  EXPECT_EQ(outcome->exit_code, 0) << outcome->failure;
  const std::string rank0 = read_file(dir / "0");
  EXPECT_EQ(read_file(dir / "1"), rank0);
  std::istringstream fields(rank0);
  int port = 0;
  std::string agent_store, world;
  fields >> port >> agent_store >> world;
  EXPECT_GT(port, 0);
  EXPECT_EQ(agent_store, "True");
  EXPECT_EQ(world, "2");
}

TEST(Launcher, RefusesAStorePortAnotherProcessHoldsAndStartsNoWorker) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int held = ntohs(address.sin_port);

  TempDir dir;
  LaunchOptions options;
  options.nproc = 2;
  options.master_port = held;
  const auto outcome = launch_local_workers(reporting_worker(dir), options);
  ::close(fd);
  EXPECT_TRUE(
      fails_with(outcome, "the launcher cannot serve the job's c10d TCPStore at 127.0.0.1:" + std::to_string(held)));
  EXPECT_TRUE(dir.entries().empty());
}

TEST(Launcher, RemovesLauncherOptionsAndTheirValues) {
  const std::vector<std::string> in = {
      "train", "--nproc-per-node", "4",       "--master-port=29500", "--tensor-model-parallel-size",
      "2",     "--master-addr",    "10.0.0.1"};
  EXPECT_EQ(trestle::parallel::remove_options(in, {"--nproc-per-node", "--master-addr", "--master-port"}),
            (std::vector<std::string>{"train", "--tensor-model-parallel-size", "2"}));
}

}  // namespace
