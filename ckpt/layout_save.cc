#include "ckpt/layout_save.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "ckpt/collective.h"
#include "ckpt/progress.h"
#include "ckpt/save_stream.h"

namespace trestle {

std::vector<const RankPiece*> distinct_pieces(const std::vector<std::vector<RankPiece>>& ranks) {
  std::set<std::tuple<std::size_t, Shape, std::int64_t>> seen;
  std::vector<const RankPiece*> out;
  for (const auto& pieces : ranks)
    for (const auto& p : pieces)
      if (seen.insert({p.tensor, p.piece.box.offset, p.piece.flat ? p.piece.flat->start : -1}).second)
        out.push_back(&p);
  return out;
}

std::uint64_t distinct_piece_bytes(const std::vector<LayoutTensor>& tensors,
                                   const std::vector<std::vector<RankPiece>>& ranks) {
  std::uint64_t total = 0;
  for (const RankPiece* p : distinct_pieces(ranks))
    total += static_cast<std::uint64_t>(p->piece.numel()) * dtype_size(tensors[p->tensor].dtype);
  return total;
}

namespace {

// Lets ranks write in rank order, at most `limit` at once, so neighbouring ranks (the tensor-parallel ranks of a
// stage, which cut their pieces from the same source tensors) write together. Every rank enters and leaves once.
class OrderedAdmission {
 public:
  explicit OrderedAdmission(int limit) : limit_(std::max(1, limit)) {}
  void enter(int rank) {
    std::unique_lock lock(mu_);
    turn_.wait(lock, [&] { return rank == next_ && active_ < limit_; });
    ++next_;
    ++active_;
    turn_.notify_all();
  }
  void leave() {
    std::lock_guard lock(mu_);
    --active_;
    turn_.notify_all();
  }

 private:
  const int limit_;
  std::mutex mu_;
  std::condition_variable turn_;
  int next_ = 0;
  int active_ = 0;
};

}  // namespace

Result<LayoutSaveReport> save_layout(const std::string& root, const CheckpointInfo& info,
                                     const std::vector<LayoutTensor>& tensors,
                                     const std::vector<std::vector<RankPiece>>& ranks, const RankPieceFiller& fill,
                                     const LayoutSaveOptions& options) {
  const int world = static_cast<int>(ranks.size());
  ThreadGroup group(world);
  OrderedAdmission writers(options.concurrent_writers);
  std::atomic<std::uint64_t> done{0};
  std::atomic<int> finished{0};
  std::vector<Status> results(ranks.size());
  std::vector<LayoutSaveReport> written(ranks.size());

  auto run_rank = [&](int rank) {
    auto member = group.member(rank);
    const auto& pieces = ranks[static_cast<std::size_t>(rank)];
    std::vector<SaveItem> items;
    for (const auto& p : pieces) {
      const LayoutTensor& t = tensors[p.tensor];
      items.push_back({t.name, t.dtype, t.shape, p.piece, streamed_data()});
    }
    // A cancelled operation (ckpt/progress.h) stops each rank at its next piece.
    auto fill_item = [&](std::size_t index, std::span<std::byte> out) {
      TRESTLE_RETURN_IF_ERROR(cancelled());
      return fill(pieces[index], out);
    };
    Status status;
    auto planned = plan_save(*member, root, info.iteration, items);
    writers.enter(rank);
    if (!planned.ok()) writers.leave();
    if (planned.ok()) {
      auto mine = write_rank_file_streaming(planned->temp_dir, rank, items, planned->to_write, fill_item, options.save,
                                            [&](std::uint64_t bytes) { done += bytes; });
      writers.leave();
      if (mine.ok()) written[static_cast<std::size_t>(rank)] = {mine->bytes_written, mine->chunks.size()};
      status = commit_save(*member, root, *planned, info, items, mine, options.save);
    } else {
      status = planned.status();
    }
    results[static_cast<std::size_t>(rank)] = status;
    ++finished;
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(run_rank, r);
  Progress progress(options.progress_label, distinct_piece_bytes(tensors, ranks), options.progress);
  std::uint64_t shown = 0;
  // A cancellation noticed here stops the ranks at their next piece (their fill fails); ranks that had written every
  // piece already commit, and the caller notices it at its own next check.
  while (finished.load() < world) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::uint64_t now = done.load();
    (void)progress.advance(now - shown);
    shown = now;
  }
  for (auto& t : threads) t.join();
  (void)progress.advance(done.load() - shown);
  for (int r = 0; r < world; ++r)
    if (!results[static_cast<std::size_t>(r)].ok())
      return results[static_cast<std::size_t>(r)].with_context("rank " + std::to_string(r));
  progress.finish();
  LayoutSaveReport report;
  for (const auto& w : written) {
    report.bytes_written += w.bytes_written;
    report.pieces_written += w.pieces_written;
  }
  return report;
}

}  // namespace trestle
