// A conversion's output directory, built under a staging sibling "<parent>/.<name>.partial.<pid>" and renamed into
// place only when complete: the destination is either absent (or the empty directory it was) or a whole conversion,
// whenever the process dies. An empty directory given as the destination keeps its permissions and group (a mount
// point, which no rename can replace, is refused up front). Staging left by a writer that died is removed by the next
// conversion into the same destination; one still being written by a live process makes the new conversion fail
// instead.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/owned_dir.h"
#include "ckpt/status.h"

namespace trestle {

// That `dst` is neither `src` nor inside it, nor inside the checkpoint root an iteration directory `src` belongs to
// (symbolic links resolved): a conversion or reshard never writes into what it reads; the error names both.
Status check_output_outside_source(const std::string& dst, const std::string& src);

class StagedOutput {
 public:
  // What begin refuses before it creates anything (the destination is the source or inside it, a symbolic link, exists
  // and is not an empty directory, or is a mount point): a --dry-run checks the destination as the run would.
  static Status check_destination(const std::string& dst, const std::string& source = {});
  // Fails naming `dst` when it exists and is not an empty directory, is a symbolic link or a mount point, is being
  // written by another live process, or is `source` (the path the conversion reads; empty: none) or inside it.
  static Result<StagedOutput> begin(const std::string& dst, const std::string& source = {});
  // Where to write everything that belongs in the destination.
  const std::string& path() const { return staging_->path(); }
  // Fails naming the destination when its file system has fewer than `bytes` free, so that a conversion that cannot
  // finish (a sparse source of terabytes) is refused before it fills the disk.
  Status check_room(std::uint64_t bytes) const;
  // Syncs the staging directory and renames it to the destination; fails, leaving none, once the operation is
  // cancelled (ckpt/progress.h).
  Status commit();

 private:
  StagedOutput(std::string dst, OwnedDir staging) : dst_(std::move(dst)), staging_(std::move(staging)) {}
  std::string dst_;
  std::optional<OwnedDir> staging_;  // discarded (removed) when the conversion fails before commit
  bool committed_ = false;
  // The empty destination directory's permission bits and group, which the output takes over (-1: none was there).
  int kept_mode_ = -1;
  int kept_group_ = -1;

 public:
  StagedOutput(StagedOutput&&) = default;
  ~StagedOutput();
};

}  // namespace trestle
