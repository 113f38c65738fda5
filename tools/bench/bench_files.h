// Files for benchmarks: a scratch directory that is cleaned up, page-cache eviction for cold reads, free space.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "tools/bench/bench_report.h"

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
// Reads every byte of a file (every regular file's, for a directory) through the page cache, so it is resident.
Status load_into_page_cache(const std::string& path);
// Commits the file system holding `path` (syncfs). On ext4 mounted with `discard`, the blocks of deleted files are
// discarded at the next journal commit; forcing it here keeps that work out of the next timed write.
Status sync_file_system(const std::string& path);
// Bytes available to this user on the file system holding `path`.
Result<std::uint64_t> free_bytes(const std::string& path);
// Removes `path` and everything under it (nothing to do when it is absent); fails with the OS reason.
Status remove_tree(const std::string& path);
// Total size of the regular files under `path` (or of `path` itself).
std::uint64_t bytes_on_disk(const std::string& path);

// Runs a benchmark made of rounds: Bench(options, scratch) in a fresh ScratchDir under options.dir, then prepare(),
// run_round(r) for each of options.repeat rounds, print_table(), and report() saved to options.json_out when set.
template <class Bench, class Options>
Status run_bench_rounds(const Options& options) {
  TRESTLE_ASSIGN_OR_RETURN(ScratchDir scratch, ScratchDir::create(options.dir));
  Bench bench(options, std::move(scratch));
  TRESTLE_RETURN_IF_ERROR(bench.prepare());
  for (unsigned round = 0; round < options.repeat; ++round) TRESTLE_RETURN_IF_ERROR(bench.run_round(round));
  bench.print_table();
  if (!options.json_out.empty()) TRESTLE_RETURN_IF_ERROR(write_json_file(options.json_out, bench.report()));
  return OkStatus();
}

}  // namespace trestle::cli
