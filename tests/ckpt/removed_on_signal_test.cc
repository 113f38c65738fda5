// RemovedOnSignal: a process ended by SIGINT, SIGTERM or SIGHUP removes the paths it registered (a directory tree
// whole, a symbolic link inside it removed, not followed) and still dies by that signal; a released path, a signal
// the process handles itself, and a forked child's signal leave the paths alone. Each case runs in a forked child,
// so the test process keeps its own signal actions.
#include "ckpt/removed_on_signal.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "tests/support/temp_dir.h"

namespace trestle {
namespace {
namespace fs = std::filesystem;

// Runs `body` in a forked child and returns its wait status.
int run_in_child(const std::function<void()>& body) {
  const pid_t child = ::fork();
  if (child == 0) {
    body();
    ::_exit(0);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(child, &status, 0), child);
  return status;
}

bool died_by(int status, int sig) { return WIFSIGNALED(status) && WTERMSIG(status) == sig; }

// A staging directory as a conversion leaves it midway: nested directories, files, a link out of it.
void fill_tree(const fs::path& dir, const fs::path& outside) {
  fs::create_directories(dir / "a" / "b" / "c");
  for (int i = 0; i < 200; ++i) std::ofstream(dir / ("shard-" + std::to_string(i))) << "x";  // more than one read
  std::ofstream(dir / "a" / "b" / "c" / "deep") << "y";
  fs::create_symlink(outside, dir / "a" / "link-out");
}

TEST(RemovedOnSignal, ATerminatedProcessRemovesItsTreeAndDiesByTheSignal) {
  for (const int sig : {SIGTERM, SIGINT, SIGHUP}) {
    testing::TempDir root;
    const fs::path dir = root.path() / ".out.partial.1";
    const fs::path outside = root.path() / "kept";
    fs::create_directory(outside);
    std::ofstream(outside / "precious") << "z";
    const int status = run_in_child([&] {
      // As a job run in the foreground has it: a background job inherits SIGINT ignored (and nohup SIGHUP), which the
      // handler leaves so by design.
      ::signal(sig, SIG_DFL);
      fill_tree(dir, outside);
      const RemovedOnSignal registered(dir.string());
      if (!registered.registered()) ::_exit(3);
      ::raise(sig);
      ::_exit(4);  // not reached: the signal ends the process
    });
    EXPECT_TRUE(died_by(status, sig)) << "signal " << sig << ", wait status " << status;
    EXPECT_FALSE(fs::exists(fs::symlink_status(dir))) << "signal " << sig;
    EXPECT_TRUE(fs::exists(outside / "precious")) << "the link was followed";
  }
}

TEST(RemovedOnSignal, AReleasedPathIsKeptAndAFileIsRemoved) {
  testing::TempDir root;
  const fs::path released = root.path() / "committed";
  const fs::path file = root.path() / "export.h5.tmp";
  const int status = run_in_child([&] {
    fs::create_directory(released);
    std::ofstream(file) << "half";
    RemovedOnSignal committed(released.string());
    const RemovedOnSignal temporary(file.string());
    committed.release();
    ::raise(SIGTERM);
  });
  EXPECT_TRUE(died_by(status, SIGTERM)) << status;
  EXPECT_TRUE(fs::is_directory(released));
  EXPECT_FALSE(fs::exists(file));
}

TEST(RemovedOnSignal, AMovedRegistrationIsHeldByItsNewOwner) {
  testing::TempDir root;
  const fs::path dir = root.path() / "staging";
  const int status = run_in_child([&] {
    fs::create_directory(dir);
    RemovedOnSignal first(dir.string());
    RemovedOnSignal second = std::move(first);
    first.release();  // the moved-from object holds nothing
    if (first.registered() || !second.registered()) ::_exit(3);
    ::raise(SIGTERM);
  });
  EXPECT_TRUE(died_by(status, SIGTERM)) << status;
  EXPECT_FALSE(fs::exists(dir));
}

TEST(RemovedOnSignal, ARelativePathIsTheOneMeantWhenItWasRegistered) {
  testing::TempDir root;
  const int status = run_in_child([&] {
    if (::chdir(root.path().c_str()) != 0) ::_exit(3);
    fs::create_directory("relative");
    const RemovedOnSignal registered("relative");
    if (::chdir("/") != 0) ::_exit(3);
    ::raise(SIGTERM);
  });
  EXPECT_TRUE(died_by(status, SIGTERM)) << status;
  EXPECT_FALSE(fs::exists(root.path() / "relative"));
}

void exit_seven(int) { ::_exit(7); }

TEST(RemovedOnSignal, ASignalTheProcessHandlesItselfIsLeftAlone) {
  testing::TempDir root;
  const fs::path dir = root.path() / "staging";
  const int status = run_in_child([&] {
    std::signal(SIGTERM, exit_seven);  // as the trainer's --exit-signal-handler does
    fs::create_directory(dir);
    const RemovedOnSignal registered(dir.string());
    ::raise(SIGTERM);
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 7);
  EXPECT_TRUE(fs::is_directory(dir));
}

TEST(RemovedOnSignal, AForkedChildsSignalLeavesItsParentsPathsAlone) {
  testing::TempDir root;
  const fs::path dir = root.path() / "staging";
  const int status = run_in_child([&] {
    fs::create_directory(dir);
    const RemovedOnSignal registered(dir.string());
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::raise(SIGTERM);
      ::_exit(4);
    }
    int grandchild_status = 0;
    if (::waitpid(grandchild, &grandchild_status, 0) != grandchild || !died_by(grandchild_status, SIGTERM)) ::_exit(5);
    ::_exit(fs::is_directory(dir) ? 0 : 6);
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "5: the forked child did not die by SIGTERM; 6: it removed its parent's path";
}

TEST(RemovedOnSignal, SlotsAreReusedOnceReleased) {
  testing::TempDir root;
  const int status = run_in_child([&] {
    for (int round = 0; round < 3; ++round) {
      std::vector<RemovedOnSignal> held;
      for (int i = 0; i < kMaxRemovedOnSignal; ++i) held.emplace_back((root.path() / std::to_string(i)).string());
      for (const auto& r : held)
        if (!r.registered()) ::_exit(3);
      if (RemovedOnSignal((root.path() / "one more").string()).registered()) ::_exit(4);
    }
    ::_exit(0);
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: a slot was not free again; 4: more paths than slots were registered";
}

}  // namespace
}  // namespace trestle
