// The on-disk layout of a Trestle checkpoint root and its commit protocol (DESIGN.md "Commit protocol"):
//   <root>/latest_checkpointed_iteration.txt, <root>/iter_0001200/{manifest.json, rank_00003.bin},
//   <root>/.tmp.iter_0001400.<id>/ while a save is in progress.
// A crash at any point leaves the previously committed iteration intact and the tracker pointing at it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/file_lock.h"
#include "ckpt/manifest.h"
#include "ckpt/owned_dir.h"
#include "ckpt/status.h"

namespace trestle {

inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kSaveLockFile = ".trestle_save.lock";

std::string iteration_dir_name(std::int64_t iteration);  // "iter_0001200"
std::string rank_file_name(int rank);                    // "rank_00003.bin"

// What a root's tracker file says: nothing (there is none), Megatron's "release", or an iteration. A tracker that is
// not a regular file (a FIFO is refused, not waited on), is over 4 KiB or holds anything else is an error naming it.
struct Tracker {
  bool present = false;
  bool release = false;
  std::int64_t iteration = 0;
};
Result<Tracker> read_tracker(const std::string& root);
// The directory a present tracker names: <root>/release or <root>/iter_N.
std::string tracked_iteration_dir(const std::string& root, const Tracker& tracker);
// The iteration the tracker names; nullopt when the root has no tracker yet ("release" is an error: Trestle roots
// number their iterations).
Result<std::optional<std::int64_t>> read_latest_iteration(const std::string& root);
// A tracker's text read as Megatron reads it (int(text.strip())): one decimal integer, 0 or more; whitespace around
// it and a leading '+' are allowed, anything else ("0\n1", "-1", "") is an error naming `path`.
Result<std::int64_t> parse_tracker_iteration(std::string_view text, const std::string& path);
// Committed iterations (directories with a manifest), ascending.
std::vector<std::int64_t> list_iterations(const std::string& root);
// Whether `root` is one a Trestle job saves into that has no commit yet: its save lock, or a save's staging
// (.tmp.iter_*), is there.
bool holds_uncommitted_save(const std::string& root);
// The iteration directory to load: `iteration` if given, else the tracker's; errors say what exists.
Result<std::string> resolve_iteration_dir(const std::string& root, std::optional<std::int64_t> iteration);

// Held by the one job that saves into `root` (created when missing) for as long as it saves there: <root>/
// .trestle_save.lock, with the holder's host and pid in it. A second job saving into the same root would interleave
// its checkpoints with the first's and move the tracker back and forth, so it is refused, naming the holder.
Result<FileLock> lock_save_root(const std::string& root);

// An iteration committed into `root` by a writer that died before it moved the tracker there (step 3 cut short): its
// directory is complete, the tracker names an older iteration (or none), and that writer's lock
// (.tmp.iter_N.<id>.lock, whose directory became iter_N) is still beside it, free. Returns that lock, now held by the
// caller, who may finish the commit (replace the iteration and move the tracker); nullopt otherwise.
Result<std::optional<FileLock>> take_untracked_commit(const std::string& root, std::int64_t iteration);

// Step 0 (rank 0): removes the temporary directories of earlier saves whose writer died (a live one's are kept) and
// creates a fresh one, owned (locked) until the returned OwnedDir goes.
Result<OwnedDir> begin_iteration(const std::string& root, std::int64_t iteration, const std::string& save_id);
// Steps 2-3 (rank 0, after every rank synced its files): manifest via temp + fsync + rename, directory renamed to
// iter_N, parent synced, tracker replaced atomically. An existing iter_N is refused unless overwrite is set, in
// which case the two are swapped in one rename (RENAME_EXCHANGE) and the old one removed; where the file system
// cannot swap, the old one is moved aside first and begin_iteration puts it back if the commit never finished.
Status commit_iteration(const std::string& root, const std::string& temp_dir, const Manifest& manifest, bool overwrite);

}  // namespace trestle
