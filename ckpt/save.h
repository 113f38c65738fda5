// Saving a checkpoint from every rank: each rank passes the pieces it holds; pieces held by several ranks (data-
// parallel replicas) are written once, the work spread over the replicas by a deterministic greedy plan; every rank
// writes its own file; rank 0 gathers the chunk tables and commits (checkpoint_dir.h). All ranks call the same
// functions in the same order. save_checkpoint does the three steps at once; AsyncSaver splits them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "ckpt/collective.h"
#include "ckpt/io_options.h"
#include "ckpt/manifest.h"
#include "ckpt/owned_dir.h"
#include "ckpt/tensor_view.h"

namespace trestle {

// One piece of a global tensor held by this rank; data holds piece.numel() elements, row-major within the box.
struct SaveItem {
  std::string name;
  DType dtype = DType::kF32;
  Shape global_shape;
  Piece piece;
  const std::byte* data = nullptr;
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(piece.numel()) * dtype_size(dtype); }
};

struct SaveOptions {
  Codec codec = Codec::kRaw;
  int zstd_level = 3;
  unsigned threads = 2;  // checksum / compression threads
  std::uint64_t block_bytes = kDefaultBlockBytes;
  IoOptions io;
  bool overwrite = false;  // replace an existing committed iteration
  // Rank 0, once every rank's files are synced and the manifest is in the temporary directory, before the commit: adds
  // files to the iteration (another format's copy of it, read from the Trestle checkpoint there). Its error fails the
  // save as a write error does, and nothing of the iteration is committed.
  std::function<Status(const std::string& temp_dir, const Manifest& manifest)> before_commit;
};

struct CheckpointInfo {
  std::int64_t iteration = 0;
  nlohmann::json layout = nlohmann::json::object();  // recorded as is (parallel/layout's layout_to_json)
  nlohmann::json model = nlohmann::json::object();
  // Shared state (rank 0's is kept). Its "ranks" list is filled from each rank's rank_state unless the caller
  // already provides it (an import that carries every rank's state).
  nlohmann::json training = nlohmann::json::object();
  nlohmann::json rank_state = nlohmann::json::object();  // this rank's own state (RNG ...), kept per rank
  // Whole files rank 0 copies into the iteration before the commit, recorded in the manifest (recorded_file.h).
  struct File {
    std::string name;    // in the iteration directory, e.g. "hf_files/tokenizer.json"
    std::string source;  // where to copy it from
  };
  std::vector<File> files;
};

struct SavePlan {
  std::string temp_dir;
  std::shared_ptr<OwnedDir> temp_owner;  // rank 0: holds temp_dir's lock until the commit
  std::vector<std::size_t> to_write;     // indices into this rank's items
  std::uint64_t bytes_to_write = 0;
};
struct RankChunks {
  std::vector<std::pair<std::string, StoredChunk>> chunks;
  std::uint64_t bytes_written = 0;
};

// Step 1 (collective): checks that ranks agree on every tensor's dtype and global shape, decides who writes what,
// and has rank 0 open the temporary iteration directory.
Result<SavePlan> plan_save(Collective& group, const std::string& root, std::int64_t iteration,
                           std::span<const SaveItem> items);
// Step 2 (local): writes this rank's share into <temp_dir>/rank_<r>.bin and syncs it.
Result<RankChunks> write_rank_file(const std::string& temp_dir, int rank, std::span<const SaveItem> items,
                                   const std::vector<std::size_t>& to_write, const SaveOptions& options);
// Step 3 (collective): gathers the chunk tables (or a rank's write error); rank 0 writes the manifest and commits
// when every rank succeeded; every rank returns the same result. It is the three parts below, run in a row.
Status commit_save(Collective& group, const std::string& root, const SavePlan& plan, const CheckpointInfo& info,
                   std::span<const SaveItem> items, const Result<RankChunks>& mine, const SaveOptions& options);

// What rank 0 commits once the chunk tables are gathered; empty on the other ranks.
struct PreparedCommit {
  std::string root;
  SavePlan plan;
  Manifest manifest;
  Status status;  // rank 0: an error found while gathering (a rank's write error, a gap), so nothing is committed
};
// 3a (collective): gathers the chunk tables; rank 0 builds the manifest, copies info.files in and, with
// options.before_commit, writes the manifest into the temporary directory. Errors only for a failed collective.
Result<PreparedCommit> gather_commit(Collective& group, const std::string& root, const SavePlan& plan,
                                     const CheckpointInfo& info, std::span<const SaveItem> items,
                                     const Result<RankChunks>& mine, const SaveOptions& options);
// 3b (local, rank 0, any thread): runs options.before_commit and commits the iteration; a failure discards the
// temporary directory. Ok on the other ranks.
Status finish_commit(int rank, PreparedCommit& prepared, const SaveOptions& options);
// 3c (collective): every rank returns rank 0's result of 3b.
Status agree_commit(Collective& group, std::int64_t iteration, const Status& committed);

Status save_checkpoint(Collective& group, const std::string& root, const CheckpointInfo& info,
                       std::span<const SaveItem> items, const SaveOptions& options = {});

}  // namespace trestle
