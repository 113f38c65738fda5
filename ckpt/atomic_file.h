// Crash-safe file replacement: write beside the target, fsync, rename over it, fsync the directory.
// A crash at any point leaves either the old file or the new one, never a mix.
#pragma once

#include <string>
#include <string_view>

#include "ckpt/status.h"

namespace trestle {

// "<dir>/.<name>.tmp.<pid>": a temporary sibling that a later rename moves into place.
std::string temporary_sibling(const std::string& path);
// Removes the temporary siblings of `path` whose process is gone (left by a crash between write and rename).
void remove_dead_temporaries(const std::string& path);
// Whether the steps are fault points (ckpt/fault_point.h): those of checkpoints are, and the fault-injection tests
// number them; files outside the commit protocol (dataset index caches, preprocess outputs) are written uncounted.
enum class FaultPoints { kCounted, kSkipped };
Status write_file_atomically(const std::string& path, std::string_view content,
                             FaultPoints points = FaultPoints::kCounted);
Status fsync_directory(const std::string& dir);
// Renames temp over path and syncs the containing directory.
Status commit_rename(const std::string& temp, const std::string& path, FaultPoints points = FaultPoints::kCounted);

}  // namespace trestle
