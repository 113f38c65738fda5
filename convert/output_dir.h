// A conversion's output directory, built under a staging sibling "<parent>/.<name>.partial.<pid>" and renamed into
// place only when complete: the destination is either absent (or the empty directory it was) or a whole conversion,
// whenever the process dies. Staging left by a writer that died is removed by the next conversion into the same
// destination; one still being written by a live process makes the new conversion fail instead.
#pragma once

#include <optional>
#include <string>

#include "ckpt/owned_dir.h"
#include "ckpt/status.h"

namespace trestle {

class StagedOutput {
 public:
  // Fails naming `dst` when it exists and is not an empty directory, is a symbolic link, or is being written by
  // another live process.
  static Result<StagedOutput> begin(const std::string& dst);
  // Where to write everything that belongs in the destination.
  const std::string& path() const { return staging_->path(); }
  // Syncs the staging directory and renames it to the destination.
  Status commit();

 private:
  StagedOutput(std::string dst, OwnedDir staging) : dst_(std::move(dst)), staging_(std::move(staging)) {}
  std::string dst_;
  std::optional<OwnedDir> staging_;  // discarded (removed) when the conversion fails before commit
  bool committed_ = false;

 public:
  StagedOutput(StagedOutput&&) = default;
  ~StagedOutput();
};

}  // namespace trestle
