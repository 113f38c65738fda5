#include "ckpt/owned_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ckpt/fault_point.h"
#include "ckpt/file_lock.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLockSuffix = kOwnedDirLockSuffix;

}  // namespace

Result<OwnedDir> OwnedDir::create(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(auto lock, FileLock::try_acquire(dir + kLockSuffix));
  if (!lock) return Status::Error(dir + ": another process is writing it");
  OwnedDir owned(dir, std::move(*lock));
  if (::mkdir(dir.c_str(), 0755) != 0) return Status::Error(dir + ": cannot create: " + std::strerror(errno));
  if (Status s = fault_point("create directory", dir); !s.ok()) {
    owned.discard();
    return s;
  }
  return owned;
}

void OwnedDir::discard() {
  if (lock_.fd() < 0) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
  removed_on_signal_.release();
  lock_removed_on_signal_.release();
  lock_.release();
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
    TRESTLE_ASSIGN_OR_RETURN(auto lock, FileLock::try_acquire(dir + kLockSuffix));
    if (!lock) {
      live.push_back(dir);
      continue;
    }
    fs::remove_all(dir, ec);
    const std::string error = ec ? ec.message() : "";
    lock->release();
    if (!error.empty()) return Status::Error(dir + ": cannot remove an abandoned attempt: " + error);
  }
  return live;
}

}  // namespace trestle
