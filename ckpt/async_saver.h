// Asynchronous save (DESIGN.md "Async save"): save_async() plans the save with every rank, copies the pieces this rank
// will write into a reusable staging pool and returns; a background thread writes the rank's file from the pool;
// finalize() waits for it and commits (or start_commit() commits behind the caller too). The caller may change or free
// its tensors as soon as save_async() returns.
//
// Collectives stay on the calling thread: save_async() runs plan_save and finalize() runs commit_save (save.h), so each
// rank calls them in its program order and the background thread never talks to other ranks. Every rank must call
// save_async() and finalize() at the same points of its program. At most one save is in flight: save_async() first
// finalizes the previous save, as does the destructor.
//
// Errors: plan and staging errors come from save_async() (then nothing is in flight; a staging error still joins the
// commit collective, which fails on every rank); write and commit errors come from finalize(), on every rank alike.
// A failed save never touches the previously committed checkpoint.
//
// The pool holds only this rank's share (pieces a replica writes are not copied), is allocated and touched once,
// and grows only when a save needs more bytes than it holds. Not thread-safe: one thread drives an AsyncSaver.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "ckpt/save.h"
#include "ckpt/staging_pool.h"

namespace trestle {

// One piece to stage: items[item]'s bytes go to `destination` (exactly items[item].nbytes() bytes of the pool).
struct StagingCopy {
  std::size_t item = 0;
  std::span<std::byte> destination;
};
// Fills every destination and returns once all bytes are there. The default copies item.data with parallel_copy;
// the LibTorch adapter (torch_async_save.h) copies device tensors on a side stream.
using Stager = std::function<Status(std::span<const SaveItem> items, std::span<const StagingCopy> copies)>;

class AsyncSaver {
 public:
  // copy_threads: staging memcpy threads (0: one per CPU). allocate: where the pool's memory comes from.
  explicit AsyncSaver(unsigned copy_threads = 0, PoolAllocator allocate = allocate_locked_if_allowed);
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;
  // Finalizes a save still in flight (a collective: every rank destroys its saver at the same point); a failure is
  // written to stderr, since nobody is left to return it to. Call finalize() to see it instead.
  ~AsyncSaver();

  // Finalizes the save in flight (returning its error, if any, without starting this one), plans this save with
  // every rank, stages this rank's share and starts writing it. `group` must stay alive until finalize() returns;
  // items' data only until save_async() returns.
  Status save_async(Collective& group, const std::string& root, const CheckpointInfo& info,
                    std::span<const SaveItem> items, const SaveOptions& options = {}, const Stager& stage = {});
  // Waits for the background write, then runs the commit collective. Ok when nothing is in flight.
  Status finalize();

  // Runs the commit behind the caller too (for a slow SaveOptions::before_commit): a collective, called once every
  // rank's write_finished(), that gathers the chunk tables and starts rank 0's before_commit and commit on a thread
  // of their own. commit_finished() then says whether rank 0's has ended (at once elsewhere), and finalize() joins it
  // and agrees on the result. An error here (a failed collective) ends the save: nothing is in flight after it.
  Status start_commit();
  bool commit_started() const;
  bool commit_finished() const;

  bool in_flight() const { return pending_ != nullptr; }
  // Whether this rank's background write has ended (written and synced, or failed), so that finalize() would go
  // straight to the commit: Megatron's non-blocking check before finalizing. Never blocks; false when nothing is in
  // flight. Each rank knows only its own write: the caller agrees with the others before calling finalize().
  bool write_finished() const;
  unsigned copy_threads() const { return copy_threads_; }
  const StagingPool& pool() const { return pool_; }

 private:
  struct Pending;
  Status stage_share(std::span<const SaveItem> items, std::span<StagingCopy> copies, const Stager& stage);
  unsigned copy_threads_;
  StagingPool pool_;
  std::unique_ptr<Pending> pending_;
};

}  // namespace trestle
