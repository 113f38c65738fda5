// Crash-safe file replacement: write beside the target, fsync, rename over it, fsync the directory.
// A crash at any point leaves either the old file or the new one, never a mix.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

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
// Renames temp over path and syncs the containing directory; `renamed` (where given) runs between the two, so that
// what it removes beside the path (a writer's lock file) goes with the same sync.
Status commit_rename(const std::string& temp, const std::string& path, FaultPoints points = FaultPoints::kCounted,
                     const std::function<void()>& renamed = nullptr);

// Files that belong together (a dataset's .bin and .idx) replaced as one unit. Each target that exists is first set
// aside under set_aside_name(path), then every temporary renamed in, the directories synced and the old files
// removed. A failure puts the old files back and removes the temporaries; a crash leaves the new set whole, or the
// targets partly missing with the old files beside them: never old and new files mixed under the targets' names.
struct StagedFile {
  std::string temp;
  std::string path;
};
Status commit_renames(const std::vector<StagedFile>& files);
std::string set_aside_name(const std::string& path);       // "<path>.trestle-old"
void remove_staged(const std::vector<StagedFile>& files);  // unlinks the temporaries

}  // namespace trestle
