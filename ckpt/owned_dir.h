// A directory being written by one live process: "<dir>.lock" beside it is flock()ed for as long as the writer holds
// the OwnedDir, so a later writer can tell an abandoned directory (its writer died: the lock is free) from one still
// in progress, and clean up only the former. A process ended by SIGINT, SIGTERM or SIGHUP while it holds the OwnedDir
// removes both first (ckpt/removed_on_signal.h).
#pragma once

#include <string>
#include <vector>

#include "ckpt/file_lock.h"
#include "ckpt/removed_on_signal.h"
#include "ckpt/status.h"

namespace trestle {

inline constexpr const char* kOwnedDirLockSuffix = ".lock";  // "<dir>.lock"

class OwnedDir {
 public:
  // Creates `dir` (which must not exist) and takes its lock.
  static Result<OwnedDir> create(const std::string& dir);
  // Destroying it releases the lock and removes the lock file; the directory itself is left as it is.

  const std::string& path() const { return path_; }
  // Removes the directory with everything in it (an abandoned attempt) and releases the lock.
  void discard();

 private:
  OwnedDir(std::string path, FileLock lock)
      : path_(std::move(path)),
        lock_(std::move(lock)),
        removed_on_signal_(path_),
        lock_removed_on_signal_(lock_.path()) {}
  std::string path_;
  FileLock lock_;
  // Declared after lock_: unregistered before the lock file is removed.
  RemovedOnSignal removed_on_signal_;
  RemovedOnSignal lock_removed_on_signal_;
};

// In `parent`, every directory whose name starts with `prefix` and whose lock is free (its writer died) is removed with
// its lock file; so are lock files left without a directory. Returns the directories still held by live writers.
Result<std::vector<std::string>> remove_abandoned_dirs(const std::string& parent, const std::string& prefix);

}  // namespace trestle
