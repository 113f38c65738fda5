#include "convert/output_dir.h"

#include <unistd.h>

#include <filesystem>

#include "ckpt/atomic_file.h"
#include "ckpt/fault_point.h"

namespace trestle {
namespace fs = std::filesystem;

Result<StagedOutput> StagedOutput::begin(const std::string& dst) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(dst, ec);
  if (fs::is_symlink(status))
    return Status::Error(dst + ": destination is a symbolic link; give the directory it points to, or a new path");
  if (fs::exists(status) && (!fs::is_directory(status) || !fs::is_empty(dst, ec)))
    return Status::Error(dst + ": destination exists and is not an empty directory; choose a new path");
  fs::path target = fs::path(dst).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::create_directories(parent, ec);
  if (ec) return Status::Error(parent.string() + ": cannot create: " + ec.message());
  const std::string prefix = "." + target.filename().string() + ".partial.";
  TRESTLE_ASSIGN_OR_RETURN(const auto live, remove_abandoned_dirs(parent.string(), prefix));
  if (!live.empty())
    return Status::Error(dst + ": another process is writing this destination (its partial output: " + live.front() +
                         ")");
  TRESTLE_ASSIGN_OR_RETURN(OwnedDir staging,
                           OwnedDir::create((parent / (prefix + std::to_string(::getpid()))).string()));
  return StagedOutput(target.string(), std::move(staging));
}

Status StagedOutput::commit() {
  if (committed_ || !staging_) return Status::Error(dst_ + ": output committed twice");
  TRESTLE_RETURN_IF_ERROR(fsync_directory(staging_->path()));
  // rename() replaces an empty directory in one step and fails on one that gained content meanwhile.
  TRESTLE_RETURN_IF_ERROR(commit_rename(staging_->path(), dst_));
  committed_ = true;
  staging_.reset();  // releases the lock; the directory now lives at dst_
  TRESTLE_RETURN_IF_ERROR(fault_point("output committed", dst_));
  return OkStatus();
}

StagedOutput::~StagedOutput() {
  if (staging_ && !committed_) staging_->discard();
}

}  // namespace trestle
