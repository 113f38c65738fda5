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

#include "ckpt/manifest.h"
#include "ckpt/owned_dir.h"
#include "ckpt/status.h"

namespace trestle {

inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr const char* kManifestFile = "manifest.json";

std::string iteration_dir_name(std::int64_t iteration);  // "iter_0001200"
std::string rank_file_name(int rank);                    // "rank_00003.bin"

// The iteration the tracker names; nullopt when the root has no tracker yet.
Result<std::optional<std::int64_t>> read_latest_iteration(const std::string& root);
// A tracker's text read as Megatron reads it (int(text.strip())): one decimal integer, 0 or more; whitespace around
// it and a leading '+' are allowed, anything else ("0\n1", "-1", "") is an error naming `path`.
Result<std::int64_t> parse_tracker_iteration(std::string_view text, const std::string& path);
// Committed iterations (directories with a manifest), ascending.
std::vector<std::int64_t> list_iterations(const std::string& root);
// The iteration directory to load: `iteration` if given, else the tracker's; errors say what exists.
Result<std::string> resolve_iteration_dir(const std::string& root, std::optional<std::int64_t> iteration);

// Step 0 (rank 0): removes the temporary directories of earlier saves whose writer died (a live one's are kept) and
// creates a fresh one, owned (locked) until the returned OwnedDir goes.
Result<OwnedDir> begin_iteration(const std::string& root, std::int64_t iteration, const std::string& save_id);
// Steps 2-3 (rank 0, after every rank synced its files): manifest via temp + fsync + rename, directory renamed to
// iter_N, parent synced, tracker replaced atomically. An existing iter_N is refused unless overwrite is set, in
// which case the two are swapped in one rename (RENAME_EXCHANGE) and the old one removed; where the file system
// cannot swap, the old one is moved aside first and begin_iteration puts it back if the commit never finished.
Status commit_iteration(const std::string& root, const std::string& temp_dir, const Manifest& manifest, bool overwrite);

}  // namespace trestle
