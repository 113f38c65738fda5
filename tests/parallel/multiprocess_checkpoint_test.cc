// Checkpoints saved by 1, 2, 4 and 8 processes (c10d FileStore rendezvous, Gloo process group as the transport,
// save_checkpoint) load into every other process count; with zstd, with the store itself as the transport and with
// AsyncSaver, checkpoints saved by 2 and 6 processes load into 2 and 6 (each way; 6 splits tensor-parallel pieces in 3).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

extern char** environ;

namespace {

namespace fs = std::filesystem;

// Runs `world` worker processes to completion; true when every one exits 0.
struct RunSetup {
  bool zstd;
  bool over_store;
  bool async = false;  // saves through AsyncSaver (loads are the same)
  std::vector<int> counts = {1, 2, 4, 8};  // the process counts that save, each loaded by all of them
};

bool run_ranks(const std::string& mode, const fs::path& root, const fs::path& scratch, int world, RunSetup setup) {
  static int round = 0;
  const std::string store = (scratch / ("store_" + std::to_string(round++))).string();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> args = {TRESTLE_CKPT_WORKER, mode, root.string(), store, std::to_string(world),
                                     std::to_string(rank)};
    if (setup.zstd) args.push_back("zstd");
    if (setup.over_store) args.push_back("store");
    if (setup.async) args.push_back("async");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return false;
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

class MultiProcessCheckpoint : public ::testing::TestWithParam<RunSetup> {};

std::string setup_name(const RunSetup& setup) {
  return std::string(setup.zstd ? "zstd" : "raw") + (setup.over_store ? "_over_store" : "_over_gloo") +
         (setup.async ? "_async" : "");
}

TEST_P(MultiProcessCheckpoint, EveryRankCountLoadsEveryOther) {
  const RunSetup setup = GetParam();
  const fs::path scratch =
      fs::temp_directory_path() / ("trestle_mp_" + std::to_string(::getpid()) + "_" + setup_name(setup));
  fs::create_directories(scratch);
  const std::vector<int>& counts = setup.counts;
  for (int saved : counts) {
    const fs::path root = scratch / ("saved_by_" + std::to_string(saved));
    ASSERT_TRUE(run_ranks("save", root, scratch, saved, setup)) << "save with " << saved << " ranks";
    for (int loading : counts)
      EXPECT_TRUE(run_ranks("load", root, scratch, loading, setup))
          << "saved by " << saved << ", loaded by " << loading;
  }
  fs::remove_all(scratch);
}

std::string param_name(const ::testing::TestParamInfo<RunSetup>& param) { return setup_name(param.param); }

INSTANTIATE_TEST_SUITE_P(Transports, MultiProcessCheckpoint,
                         ::testing::Values(RunSetup{false, false}, RunSetup{true, false, false, {2, 6}},
                                           RunSetup{false, true, false, {2, 6}}, RunSetup{false, false, true, {2, 6}}),
                         param_name);

}  // namespace
