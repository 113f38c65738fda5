#include "ckpt/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace trestle {

Result<std::optional<FileLock>> FileLock::try_acquire(const std::string& path) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return Status::Error(path + ": cannot open lock file: " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd);
      if (error == EWOULDBLOCK) return std::optional<FileLock>();
      return Status::Error(path + ": cannot lock: " + std::strerror(error));
    }
    struct stat held {
    }, current{};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &current) == 0 && held.st_ino == current.st_ino &&
        held.st_dev == current.st_dev)
      return std::optional<FileLock>(FileLock(path, fd));
    ::close(fd);  // its holder removed it after we opened it: lock the current file
  }
  return Status::Error(path + ": the lock file keeps being replaced");
}

FileLock::FileLock(FileLock&& other) noexcept : path_(std::move(other.path_)), fd_(other.fd_) { other.fd_ = -1; }

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileLock::~FileLock() { release(); }

void FileLock::release() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // before unlocking: a waiter then re-checks the inode
  ::close(fd_);
  fd_ = -1;
}

Result<FileLock> lock_output(const std::string& output) {
  const std::filesystem::path path(output);
  const std::string lock = (path.parent_path() / ("." + path.filename().string() + ".lock")).string();
  TRESTLE_ASSIGN_OR_RETURN(auto held, FileLock::try_acquire(lock));
  if (!held)
    return Status::Error(output + ": another job is writing it (it holds " + lock +
                         "); wait for it to finish, or write elsewhere");
  return std::move(*held);
}

}  // namespace trestle
