#include "ckpt/owned_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ckpt/fault_point.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLockSuffix = ".lock";

// Opens and locks `lock_path` without blocking: the fd, -1 when another process holds it, or an error. A lock taken on
// a file that was unlinked meanwhile (its owner finished) is retried on the current one.
Result<int> try_lock(const std::string& lock_path) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return Status::Error(lock_path + ": cannot open lock file: " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd);
      if (error == EWOULDBLOCK) return -1;
      return Status::Error(lock_path + ": cannot lock: " + std::strerror(error));
    }
    struct stat held {
    }, current{};
    if (::fstat(fd, &held) == 0 && ::stat(lock_path.c_str(), &current) == 0 && held.st_ino == current.st_ino &&
        held.st_dev == current.st_dev)
      return fd;
    ::close(fd);
  }
  return Status::Error(lock_path + ": the lock file keeps being replaced");
}

}  // namespace

Result<OwnedDir> OwnedDir::create(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(const int fd, try_lock(dir + kLockSuffix));
  if (fd < 0) return Status::Error(dir + ": another process is writing it");
  OwnedDir owned(dir, fd);
  if (::mkdir(dir.c_str(), 0755) != 0) return Status::Error(dir + ": cannot create: " + std::strerror(errno));
  if (Status s = fault_point("create directory", dir); !s.ok()) {
    owned.discard();
    return s;
  }
  return owned;
}

OwnedDir::OwnedDir(OwnedDir&& other) noexcept : path_(std::move(other.path_)), lock_fd_(other.lock_fd_) {
  other.lock_fd_ = -1;
}

OwnedDir& OwnedDir::operator=(OwnedDir&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    lock_fd_ = other.lock_fd_;
    other.lock_fd_ = -1;
  }
  return *this;
}

OwnedDir::~OwnedDir() { release(); }

void OwnedDir::release() {
  if (lock_fd_ < 0) return;
  ::unlink((path_ + kLockSuffix).c_str());  // before unlocking: a waiting cleaner then re-checks the inode
  ::close(lock_fd_);
  lock_fd_ = -1;
}

void OwnedDir::discard() {
  if (lock_fd_ < 0) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
  release();
}

Result<std::vector<std::string>> remove_abandoned_dirs(const std::string& parent, const std::string& prefix) {
  std::vector<std::string> live;
  std::error_code ec;
  std::vector<fs::path> candidates;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with(prefix)) candidates.push_back(it->path());
  }
  if (ec) return Status::Error(parent + ": cannot list: " + ec.message());
  for (const fs::path& path : candidates) {
    std::string dir = path.string();
    const bool is_lock = dir.ends_with(kLockSuffix);
    if (is_lock) dir.resize(dir.size() - std::strlen(kLockSuffix));
    std::error_code type_ec;
    if (is_lock && fs::exists(fs::symlink_status(dir, type_ec))) continue;  // handled with its directory
    if (!is_lock && !fs::is_directory(fs::symlink_status(path, type_ec))) continue;
    TRESTLE_ASSIGN_OR_RETURN(const int fd, try_lock(dir + kLockSuffix));
    if (fd < 0) {
      live.push_back(dir);
      continue;
    }
    fs::remove_all(dir, ec);
    const std::string error = ec ? ec.message() : "";
    ::unlink((dir + kLockSuffix).c_str());
    ::close(fd);
    if (!error.empty()) return Status::Error(dir + ": cannot remove an abandoned attempt: " + error);
  }
  return live;
}

}  // namespace trestle
