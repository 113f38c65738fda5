#include "convert/output_dir.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/fault_point.h"
#include "ckpt/progress.h"

namespace trestle {
namespace fs = std::filesystem;

namespace {

bool path_starts_with(const fs::path& path, const fs::path& prefix) {
  return std::mismatch(prefix.begin(), prefix.end(), path.begin(), path.end()).first == prefix.end();
}

}  // namespace

Status check_output_outside_source(const std::string& dst, const std::string& src) {
  if (dst.empty() || src.empty()) return OkStatus();
  std::error_code ec;
  const fs::path source = fs::weakly_canonical(fs::absolute(src, ec), ec);
  if (ec) return OkStatus();  // an unreadable source fails where it is opened, with its own message
  const fs::path out = fs::weakly_canonical(fs::absolute(dst, ec), ec);
  if (ec) return OkStatus();
  if (path_starts_with(out, source))
    return Status::Error(dst + ": destination " + (out == source ? "is" : "lies inside") + " the source " + src +
                         "; the source is never written to: choose a path outside it");
  // An iteration directory's checkpoint root (the directory holding latest_checkpointed_iteration.txt) is part of
  // the source too: an output inside it would sit among, and be taken for, the run's own iterations.
  const fs::path root = source.parent_path();
  if (!root.empty() && fs::is_regular_file(root / kTrackerFile, ec) && path_starts_with(out, root))
    return Status::Error(dst + ": destination lies inside the checkpoint directory " + root.string() + " that " + src +
                         " belongs to; the source is never written to: choose a path outside it");
  return OkStatus();
}

namespace {

fs::path normal_target(const std::string& dst) {
  fs::path target = fs::path(dst).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  return target;
}

fs::path parent_of(const fs::path& target) { return target.has_parent_path() ? target.parent_path() : fs::path("."); }

}  // namespace

Status StagedOutput::check_destination(const std::string& dst, const std::string& source) {
  TRESTLE_RETURN_IF_ERROR(check_output_outside_source(dst, source));
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(dst, ec);
  if (fs::is_symlink(status))
    return Status::Error(dst + ": destination is a symbolic link; give the directory it points to, or a new path");
  if (fs::exists(status) && (!fs::is_directory(status) || !fs::is_empty(dst, ec)))
    return Status::Error(dst + ": destination exists and is not an empty directory; choose a new path");
  const fs::path target = normal_target(dst);
  struct stat existing {
  }, above{};
  if (fs::exists(status) && ::stat(target.c_str(), &existing) == 0 && ::stat(parent_of(target).c_str(), &above) == 0 &&
      existing.st_dev != above.st_dev)
    return Status::Error(dst +
                         ": destination is a mount point; the output is written beside it and renamed into "
                         "place, which a mount point cannot take: give a new directory inside it");
  return OkStatus();
}

Result<StagedOutput> StagedOutput::begin(const std::string& dst, const std::string& source) {
  TRESTLE_RETURN_IF_ERROR(check_destination(dst, source));
  std::error_code ec;
  const fs::path target = normal_target(dst);
  const fs::path parent = parent_of(target);
  struct stat existing {};
  const bool exists = fs::exists(fs::symlink_status(dst, ec)) && ::stat(target.c_str(), &existing) == 0;
  fs::create_directories(parent, ec);
  if (ec) return Status::Error(parent.string() + ": cannot create: " + ec.message());
  const std::string prefix = "." + target.filename().string() + ".partial.";
  TRESTLE_ASSIGN_OR_RETURN(const auto live, remove_abandoned_dirs(parent.string(), prefix));
  if (!live.empty())
    return Status::Error(dst + ": another process is writing this destination (its partial output: " + live.front() +
                         ")");
  auto staging = OwnedDir::create((parent / (prefix + std::to_string(::getpid()))).string());
  if (!staging.ok()) return Status::Error(dst + ": cannot stage the output beside it: " + staging.status().message());
  StagedOutput output(target.string(), std::move(*staging));
  if (exists) {
    output.kept_mode_ = static_cast<int>(existing.st_mode & 07777);
    output.kept_group_ = static_cast<int>(existing.st_gid);
  }
  return output;
}

Status StagedOutput::check_room(std::uint64_t bytes) const {
  struct statvfs fs_stat {};
  if (!staging_ || ::statvfs(staging_->path().c_str(), &fs_stat) != 0) return OkStatus();  // unknown: let writes tell
  const std::uint64_t free = static_cast<std::uint64_t>(fs_stat.f_bavail) * fs_stat.f_frsize;
  if (bytes <= free) return OkStatus();
  return Status::Error(dst_ + ": the output needs " + format_bytes(bytes) + " (" + std::to_string(bytes) +
                       " bytes), more than the " + format_bytes(free) + " free on its file system");
}

Status StagedOutput::commit() {
  if (committed_ || !staging_) return Status::Error(dst_ + ": output committed twice");
  // A cancelled conversion (ckpt/progress.h) leaves no destination, however far its writing got.
  TRESTLE_RETURN_IF_ERROR(cancelled().with_context(dst_));
  if (kept_mode_ >= 0) {  // the empty directory it replaces: its group (where this user may give it) and permissions
    if (::chown(staging_->path().c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(kept_group_)) != 0 &&
        errno != EPERM)
      return Status::Error(staging_->path() + ": cannot take over the group of " + dst_ + ": " + std::strerror(errno));
    if (::chmod(staging_->path().c_str(), static_cast<mode_t>(kept_mode_)) != 0)
      return Status::Error(staging_->path() + ": cannot take over the permissions of " + dst_ + ": " +
                           std::strerror(errno));
  }
  TRESTLE_RETURN_IF_ERROR(fsync_directory(staging_->path()));
  // rename() replaces an empty directory in one step and fails on one that gained content meanwhile.
  // Once renamed, the directory lives at dst_: the lock (and its file beside) is released at once, before the sync
  // that makes both lasting, so that a kill during the sync leaves no lock file behind a finished output.
  TRESTLE_RETURN_IF_ERROR(commit_rename(staging_->path(), dst_, FaultPoints::kCounted, [this] {
    committed_ = true;
    staging_.reset();
  }));
  TRESTLE_RETURN_IF_ERROR(fault_point("output committed", dst_));
  return OkStatus();
}

StagedOutput::~StagedOutput() {
  if (staging_ && !committed_) staging_->discard();
}

}  // namespace trestle
