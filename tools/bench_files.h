// Files for benchmarks: a scratch directory that is cleaned up, page-cache eviction for cold reads, free space.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

// Where a benchmark writes. Given a directory, uses it (creating it if needed) and removes only what was made in it;
// given none, makes a fresh "trestle-bench-XXXXXX" under $TMPDIR (or /tmp) and removes it whole.
class ScratchDir {
 public:
  static Result<ScratchDir> create(const std::string& dir);
  ScratchDir(ScratchDir&& other) noexcept;
  ScratchDir& operator=(ScratchDir&&) = delete;
  ScratchDir(const ScratchDir&) = delete;
  ~ScratchDir();

  const std::string& path() const { return path_; }
  // "<path>/<name>", removed (recursively) now if present and again when the ScratchDir goes away.
  std::string fresh(const std::string& name);

 private:
  ScratchDir(std::string path, bool owned) : path_(std::move(path)), owned_(owned) {}
  std::string path_;
  bool owned_;
  std::vector<std::string> made_;
};

// Drops a file's pages (every regular file's, for a directory) from the page cache, syncing first so none is dirty;
// fails naming the file if one cannot be opened or synced. Mapped pages stay: unmap before calling.
Status evict_from_page_cache(const std::string& path);
// Commits the file system holding `path` (syncfs). On ext4 mounted with `discard`, the blocks of deleted files are
// discarded at the next journal commit; forcing it here keeps that work out of the next timed write.
Status sync_file_system(const std::string& path);
// Bytes available to this user on the file system holding `path`.
Result<std::uint64_t> free_bytes(const std::string& path);
// Total size of the regular files under `path` (or of `path` itself).
std::uint64_t bytes_on_disk(const std::string& path);

}  // namespace trestle::cli
