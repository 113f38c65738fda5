// A directory being written by one live process: "<dir>.lock" beside it is flock()ed for as long as the writer holds
// the OwnedDir, so a later writer can tell an abandoned directory (its writer died: the lock is free) from one still
// in progress, and clean up only the former.
#pragma once

#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

class OwnedDir {
 public:
  // Creates `dir` (which must not exist) and takes its lock.
  static Result<OwnedDir> create(const std::string& dir);
  OwnedDir(OwnedDir&& other) noexcept;
  OwnedDir& operator=(OwnedDir&& other) noexcept;
  OwnedDir(const OwnedDir&) = delete;
  OwnedDir& operator=(const OwnedDir&) = delete;
  ~OwnedDir();  // releases the lock and removes the lock file; the directory itself is left as it is

  const std::string& path() const { return path_; }
  // Removes the directory with everything in it (an abandoned attempt) and releases the lock.
  void discard();

 private:
  OwnedDir(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  void release();
  std::string path_;
  int lock_fd_ = -1;
};

// In `parent`, every directory whose name starts with `prefix` and whose lock is free (its writer died) is removed with
// its lock file; so are lock files left without a directory. Returns the directories still held by live writers.
Result<std::vector<std::string>> remove_abandoned_dirs(const std::string& parent, const std::string& prefix);

}  // namespace trestle
