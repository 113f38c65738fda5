#include "ckpt/async_saver.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <thread>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/parallel_copy.h"

namespace trestle {

struct AsyncSaver::Pending {
  Collective* group = nullptr;
  std::string root;
  CheckpointInfo info;
  SaveOptions options;
  SavePlan plan;
  std::vector<SaveItem> items;  // the caller's items; those this rank writes point into the pool
  Result<RankChunks> written = Status::Error("the rank file was not written");
  std::atomic<bool> write_ended{false};  // set by the writer once `written` holds its result
  std::thread writer;
  std::optional<PreparedCommit> prepared;  // once start_commit() has gathered the chunk tables
  Status committed;                        // rank 0: the committer's result
  std::atomic<bool> commit_ended{false};   // set by the committer once `committed` holds it
  std::thread committer;
};

AsyncSaver::AsyncSaver(unsigned copy_threads, PoolAllocator allocate)
    : copy_threads_(copy_threads > 0 ? copy_threads : std::max(1u, std::thread::hardware_concurrency())),
      pool_(std::move(allocate)) {}

AsyncSaver::~AsyncSaver() {
  if (!pending_) return;
  const std::int64_t iteration = pending_->info.iteration;
  const Status status = finalize();
  if (!status.ok())
    std::fprintf(stderr, "trestle: asynchronous save of iteration %lld failed: %s\n", static_cast<long long>(iteration),
                 status.message().c_str());
}

// Gives each piece this rank writes a 4 KiB-aligned slot of the pool and fills the slots.
Status AsyncSaver::stage_share(std::span<const SaveItem> items, std::span<StagingCopy> copies, const Stager& stage) {
  std::size_t total = 0;
  for (const StagingCopy& c : copies) total = align_up(total, kIoAlignment) + items[c.item].nbytes();
  TRESTLE_ASSIGN_OR_RETURN(const std::span<std::byte> pool, pool_.reserve(total));
  std::size_t offset = 0;
  for (StagingCopy& c : copies) {
    offset = align_up(offset, kIoAlignment);
    c.destination = pool.subspan(offset, items[c.item].nbytes());
    offset += c.destination.size();
  }
  if (stage) return stage(items, copies);
  std::vector<CopyRange> ranges;
  for (const StagingCopy& c : copies)
    ranges.push_back({items[c.item].data, c.destination.data(), c.destination.size()});
  parallel_copy(ranges, copy_threads_);
  return OkStatus();
}

Status AsyncSaver::save_async(Collective& group, const std::string& root, const CheckpointInfo& info,
                              std::span<const SaveItem> items, const SaveOptions& options, const Stager& stage) {
  TRESTLE_RETURN_IF_ERROR(finalize());
  auto pending = std::make_unique<Pending>();
  pending->group = &group;
  pending->root = root;
  pending->info = info;
  pending->options = options;
  pending->items.assign(items.begin(), items.end());
  TRESTLE_ASSIGN_OR_RETURN(pending->plan, plan_save(group, root, info.iteration, items));

  std::vector<StagingCopy> copies;
  for (std::size_t index : pending->plan.to_write) copies.push_back({index, {}});
  const Status staged = stage_share(items, copies, stage);
  if (!staged.ok()) {
    // The other ranks go on to commit: join them with this rank's error so that the save fails everywhere.
    const Result<RankChunks> failed = staged.with_context("staging iteration " + std::to_string(info.iteration));
    return commit_save(group, root, pending->plan, info, items, failed, options);
  }

  for (SaveItem& item : pending->items) item.data = nullptr;  // only staged bytes may be read from now on
  for (const StagingCopy& c : copies) pending->items[c.item].data = c.destination.data();
  Pending* p = pending.get();
  p->writer = std::thread([p, rank = group.rank()] {
    p->written = write_rank_file(p->plan.temp_dir, rank, p->items, p->plan.to_write, p->options);
    p->write_ended.store(true, std::memory_order_release);
  });
  pending_ = std::move(pending);
  return OkStatus();
}

bool AsyncSaver::write_finished() const {
  return pending_ != nullptr && pending_->write_ended.load(std::memory_order_acquire);
}

Status AsyncSaver::start_commit() {
  if (!pending_ || pending_->prepared) return OkStatus();
  Pending* p = pending_.get();
  p->writer.join();
  auto prepared = gather_commit(*p->group, p->root, p->plan, p->info, p->items, p->written, p->options);
  if (!prepared.ok()) {
    pending_.reset();
    return prepared.status();
  }
  p->prepared = std::move(prepared).value();
  if (p->group->rank() != 0) {
    p->commit_ended.store(true, std::memory_order_release);  // only rank 0 commits
    return OkStatus();
  }
  p->committer = std::thread([p] {
    p->committed = finish_commit(0, *p->prepared, p->options);
    p->commit_ended.store(true, std::memory_order_release);
  });
  return OkStatus();
}

bool AsyncSaver::commit_started() const { return pending_ != nullptr && pending_->prepared.has_value(); }

bool AsyncSaver::commit_finished() const {
  return commit_started() && pending_->commit_ended.load(std::memory_order_acquire);
}

Status AsyncSaver::finalize() {
  if (!pending_) return OkStatus();
  const std::unique_ptr<Pending> p = std::move(pending_);
  if (!p->prepared) {
    p->writer.join();
    return commit_save(*p->group, p->root, p->plan, p->info, p->items, p->written, p->options);
  }
  if (p->committer.joinable()) p->committer.join();
  return agree_commit(*p->group, p->info.iteration, p->committed);
}

}  // namespace trestle
