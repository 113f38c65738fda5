// An exclusive flock() on a lock file, held for as long as the FileLock lives. It is taken without blocking (a live
// holder elsewhere means no lock), and the file is removed just before the lock is released, so a process that locked
// the old inode meanwhile notices and retries on the current file.
#pragma once

#include <optional>
#include <string>

#include "ckpt/status.h"

namespace trestle {

class FileLock {
 public:
  // The lock on `path` (created when missing; a symbolic link there is refused), or nullopt when another process
  // holds it.
  static Result<std::optional<FileLock>> try_acquire(const std::string& path);
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  void release();  // removes the file and unlocks; nothing when already released

 private:
  FileLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// The lock a job holds while it writes `output` (a file, or the files sharing a prefix): "<dir>/.<name>.lock". A second
// job writing the same output is refused naming it, where both reported success and the later one's files replaced
// the other's (or, for a set of files, could pair one job's file with the other's).
Result<FileLock> lock_output(const std::string& output);

}  // namespace trestle
