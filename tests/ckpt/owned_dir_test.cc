// OwnedDir and remove_abandoned_dirs: a directory written by a live process is never removed by another writer's
// cleanup; one whose writer is gone (its lock free) is, with its lock file; a stale tracker temporary goes too. A
// checkpoint root's save lock admits one job at a time.
#include "ckpt/owned_dir.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {
namespace fs = std::filesystem;

TEST(OwnedDir, ALiveWritersDirectoryIsKeptAndASecondOwnerRefused) {
  testing::TempDir root;
  const std::string dir = (root.path() / ".partial.1").string();
  auto owned = OwnedDir::create(dir);
  ASSERT_TRUE(owned.ok()) << owned.status().message();
  EXPECT_TRUE(fs::is_directory(dir));
  auto second = OwnedDir::create(dir);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("another process is writing it"), std::string::npos);
  auto live = remove_abandoned_dirs(root.path().string(), ".partial.");
  ASSERT_TRUE(live.ok()) << live.status().message();
  EXPECT_EQ(*live, std::vector<std::string>{dir});
  EXPECT_TRUE(fs::is_directory(dir));
}

TEST(OwnedDir, AnAbandonedDirectoryIsRemovedWithItsLock) {
  testing::TempDir root;
  const std::string dir = (root.path() / ".partial.2").string();
  const pid_t child = ::fork();
  if (child == 0) {  // a writer that dies holding its directory
    auto owned = OwnedDir::create(dir);
    std::ofstream(dir + "/data") << "half";
    ::_exit(owned.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_EQ(WEXITSTATUS(status), 0);
  ASSERT_TRUE(fs::exists(dir + "/data") && fs::exists(dir + ".lock"));
  fs::create_directory(root.path() / "unrelated");
  auto live = remove_abandoned_dirs(root.path().string(), ".partial.");
  ASSERT_TRUE(live.ok()) << live.status().message();
  EXPECT_TRUE(live->empty());
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(fs::exists(dir + ".lock"));
  EXPECT_TRUE(fs::exists(root.path() / "unrelated"));
}

TEST(OwnedDir, DiscardRemovesTheDirectoryAndReleasesTheLock) {
  testing::TempDir root;
  const std::string dir = (root.path() / ".partial.3").string();
  auto owned = OwnedDir::create(dir);
  ASSERT_TRUE(owned.ok());
  owned->discard();
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(fs::exists(dir + ".lock"));
  EXPECT_TRUE(OwnedDir::create(dir).ok());
}

TEST(SaveRootLock, ASecondJobIsRefusedNamingTheHolderUntilTheFirstLetsGo) {
  testing::TempDir dir;
  const std::string root = (dir.path() / "not" / "yet").string();
  auto first = lock_save_root(root);
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_TRUE(fs::is_directory(root)) << "the root is created";
  const std::string lock_file = root + "/" + kSaveLockFile;
  auto second = lock_save_root(root);
  ASSERT_FALSE(second.ok());
  const std::string message = second.status().message();
  EXPECT_NE(message.find("another job is saving checkpoints here (host "), std::string::npos) << message;
  EXPECT_NE(message.find(", pid " + std::to_string(::getpid()) + ", holding " + lock_file), std::string::npos)
      << message;
  first->release();
  EXPECT_FALSE(fs::exists(lock_file)) << "the lock file goes with the lock";
  auto third = lock_save_root(root);
  EXPECT_TRUE(third.ok()) << third.status().message();
}

TEST(SaveRootLock, ALockLeftByAKilledJobIsTakenOver) {
  testing::TempDir dir;
  const std::string root = dir.path().string();
  const pid_t child = ::fork();
  if (child == 0) {
    auto lock = lock_save_root(root);
    ::_exit(lock.ok() ? 0 : 1);  // dies holding it: the file stays, its flock goes with the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(fs::exists(root + "/" + kSaveLockFile));
  auto lock = lock_save_root(root);
  EXPECT_TRUE(lock.ok()) << lock.status().message();
}

TEST(AtomicFile, TemporariesOfDeadProcessesAreRemovedLiveOnesKept) {
  testing::TempDir root;
  const std::string target = (root.path() / "tracker.txt").string();
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that no longer runs
  const std::string dead = (root.path() / (".tracker.txt.tmp." + std::to_string(child))).string();
  const std::string live = temporary_sibling(target);  // this process's
  std::ofstream(dead) << "1";
  std::ofstream(live) << "2";
  remove_dead_temporaries(target);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
}

}  // namespace
}  // namespace trestle
