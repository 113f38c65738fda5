// AsyncSaver against save_checkpoint: the same bytes on disk, buffers free to change once save_async returns, one
// save in flight at a time, errors from finalize with the previous checkpoint intact, a pool that is reused, and a
// commit started behind the caller (start_commit) that finalize joins and agrees on.
#include "ckpt/async_saver.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/load.h"
#include "tests/support/global_tensor.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::GlobalTensor;
using testing::TempDir;

// Rank r's copy of its pieces: tensors split along dim 0 into world / replicas parts, `replicas` ranks per part.
struct RankState {
  std::vector<std::vector<std::byte>> data;
  std::vector<SaveItem> items;
};

RankState rank_state(const std::vector<GlobalTensor>& tensors, int world, int replicas, int rank) {
  RankState s;
  for (const auto& t : tensors) {
    const Piece piece = t.shape.empty() ? Piece{whole_box(t.shape), std::nullopt}
                                        : testing::split_part(t.shape, 0, world / replicas, rank / replicas);
    s.data.push_back(t.extract(piece));
    s.items.push_back({t.name, t.dtype, t.shape, piece, nullptr});
  }
  for (std::size_t i = 0; i < s.items.size(); ++i) s.items[i].data = s.data[i].data();
  return s;
}

std::vector<Status> run_ranks(int world, const std::function<Status(int, Collective&)>& fn) {
  ThreadGroup group(world);
  std::vector<Status> results(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto member = group.member(r);
      results[static_cast<std::size_t>(r)] = fn(r, *member);
    });
  for (auto& t : threads) t.join();
  return results;
}

void expect_all_ok(const std::vector<Status>& results) {
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s.message();
}

CheckpointInfo info_for(std::int64_t iteration, int rank) {
  CheckpointInfo info;
  info.iteration = iteration;
  info.rank_state = {{"rank", rank}};
  return info;
}

std::vector<GlobalTensor> sample_tensors(unsigned seed) {
  std::vector<GlobalTensor> out;
  for (DType d : kAllDTypes) out.emplace_back("t." + std::string(dtype_name(d)), d, Shape{12, 10}, seed++);
  out.emplace_back("big", DType::kF32, Shape{512, 300}, seed++);
  out.emplace_back("scalar", DType::kF32, Shape{}, seed++);
  return out;
}

void expect_loads(const fs::path& root, std::int64_t iteration, const std::vector<GlobalTensor>& tensors) {
  auto reader = CheckpointReader::open(root.string(), iteration);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  for (const auto& t : tensors) {
    std::vector<std::byte> got(t.bytes.size(), std::byte{0x5a});
    const LoadRequest request{t.name, Piece{whole_box(t.shape), std::nullopt}, got.data()};
    const Status s = reader->load({&request, 1});
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(got, t.bytes) << t.name << " of iteration " << iteration;
  }
  EXPECT_TRUE(reader->verify().ok());
}

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(AsyncSaver, WritesTheSameCheckpointAsSaveCheckpoint) {
  TempDir dir;
  const auto tensors = sample_tensors(1);
  SaveOptions options;
  options.block_bytes = 4096;
  for (const auto& [world, replicas] : {std::pair{1, 1}, std::pair{4, 2}}) {
    const fs::path sync_root = dir.path() / ("sync" + std::to_string(world));
    const fs::path async_root = dir.path() / ("async" + std::to_string(world));
    expect_all_ok(run_ranks(world, [&](int r, Collective& c) {
      const RankState s = rank_state(tensors, world, replicas, r);
      return save_checkpoint(c, sync_root.string(), info_for(7, r), s.items, options);
    }));
    expect_all_ok(run_ranks(world, [&](int r, Collective& c) {
      const RankState s = rank_state(tensors, world, replicas, r);
      AsyncSaver saver;
      TRESTLE_RETURN_IF_ERROR(saver.save_async(c, async_root.string(), info_for(7, r), s.items, options));
      const Status done = saver.finalize();
      // Each rank stages only the pieces it writes: with replicas, less than it holds.
      std::uint64_t held = 0;
      for (const auto& item : s.items) held += item.nbytes();
      if (replicas > 1 && saver.pool().capacity() >= held)
        return Status::Error("rank staged replicas it does not write");
      return done;
    }));
    for (const auto& entry : fs::directory_iterator(sync_root / iteration_dir_name(7))) {
      const fs::path twin = async_root / iteration_dir_name(7) / entry.path().filename();
      ASSERT_TRUE(fs::exists(twin)) << twin;
      EXPECT_EQ(file_bytes(entry.path()), file_bytes(twin)) << entry.path().filename() << " with " << world << " ranks";
    }
    expect_loads(async_root, 7, tensors);
  }
}

TEST(AsyncSaver, CallerMayOverwriteItsBuffersOnceSaveAsyncReturns) {
  TempDir dir;
  const auto tensors = sample_tensors(2);
  RankState s = rank_state(tensors, 1, 1, 0);
  SoloCollective solo;
  AsyncSaver saver(2);
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(1, 0), s.items).ok());
  EXPECT_TRUE(saver.in_flight());
  for (auto& bytes : s.data) std::fill(bytes.begin(), bytes.end(), std::byte{0xff});  // the next training step
  const Status done = saver.finalize();
  ASSERT_TRUE(done.ok()) << done.message();
  EXPECT_FALSE(saver.in_flight());
  expect_loads(dir.path(), 1, tensors);
}

TEST(AsyncSaver, SecondSaveWaitsForTheFirstAndBothCommit) {
  TempDir dir;
  const auto first = sample_tensors(3), second = sample_tensors(40);
  expect_all_ok(run_ranks(2, [&](int r, Collective& c) {
    AsyncSaver saver;
    const RankState a = rank_state(first, 2, 1, r);
    TRESTLE_RETURN_IF_ERROR(saver.save_async(c, dir.path().string(), info_for(100, r), a.items));
    const RankState b = rank_state(second, 2, 1, r);
    TRESTLE_RETURN_IF_ERROR(saver.save_async(c, dir.path().string(), info_for(200, r), b.items));
    return saver.finalize();
  }));
  EXPECT_EQ(list_iterations(dir.path().string()), (std::vector<std::int64_t>{100, 200}));
  EXPECT_EQ(*read_latest_iteration(dir.path().string()).value(), 200);
  expect_loads(dir.path(), 100, first);
  expect_loads(dir.path(), 200, second);
}

// Polls until `done` holds (a bounded wait).
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return done();
}

// Polls write_finished() until it holds (a bounded wait: the write is small).
bool write_ends(const AsyncSaver& saver) {
  return eventually([&] { return saver.write_finished(); });
}

TEST(AsyncSaver, DestructorFinalizesASaveWrittenOrCommitting) {
  TempDir dir;
  const auto tensors = sample_tensors(5);
  SaveOptions slow_commit;
  slow_commit.before_commit = [](const std::string&, const Manifest&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return OkStatus();
  };
  for (const bool committing : {false, true}) {
    const std::int64_t iteration = committing ? 4 : 3;
    {
      const RankState s = rank_state(tensors, 1, 1, 0);
      SoloCollective solo;
      AsyncSaver saver;
      ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(iteration, 0), s.items, slow_commit).ok());
      if (committing) {
        ASSERT_TRUE(write_ends(saver) && saver.start_commit().ok());
      }
    }
    expect_loads(dir.path(), iteration, tensors);
  }
}

TEST(AsyncSaver, WriteFinishedTellsWhenFinalizeWouldOnlyCommit) {
  TempDir dir;
  const auto tensors = sample_tensors(9);
  const RankState s = rank_state(tensors, 1, 1, 0);
  SoloCollective solo;
  AsyncSaver saver;
  EXPECT_FALSE(saver.write_finished());  // nothing in flight
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(4, 0), s.items).ok());
  ASSERT_TRUE(write_ends(saver));
  // Written, not committed: the poll itself commits nothing.
  EXPECT_TRUE(saver.in_flight());
  EXPECT_TRUE(list_iterations(dir.path().string()).empty());
  ASSERT_TRUE(saver.finalize().ok());
  EXPECT_FALSE(saver.write_finished());
  EXPECT_EQ(*read_latest_iteration(dir.path().string()).value(), 4);
  expect_loads(dir.path(), 4, tensors);
}

TEST(AsyncSaver, StartCommitRunsRank0sBeforeCommitAndCommitBehindTheCaller) {
  TempDir dir;
  const auto tensors = sample_tensors(11);
  std::atomic<bool> entered{false}, release{false};
  SaveOptions options;
  options.before_commit = [&](const std::string& temp_dir, const Manifest& manifest) -> Status {
    entered = true;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::ofstream(temp_dir + "/extra.txt") << "iteration " << manifest.iteration;
    return OkStatus();
  };
  expect_all_ok(run_ranks(2, [&](int r, Collective& c) -> Status {
    const RankState s = rank_state(tensors, 2, 1, r);
    AsyncSaver saver;
    TRESTLE_RETURN_IF_ERROR(saver.save_async(c, dir.path().string(), info_for(6, r), s.items, options));
    if (!write_ends(saver)) return Status::Error("the write did not end");
    EXPECT_FALSE(saver.commit_started());
    TRESTLE_RETURN_IF_ERROR(saver.start_commit());
    EXPECT_TRUE(saver.commit_started());
    EXPECT_TRUE(saver.in_flight());
    if (r == 0) {
      // start_commit() returned while before_commit still runs: nothing is committed yet.
      EXPECT_TRUE(eventually([&] { return entered.load(); }));
      EXPECT_FALSE(saver.commit_finished());
      EXPECT_TRUE(list_iterations(dir.path().string()).empty());
      release = true;
      EXPECT_TRUE(eventually([&] { return saver.commit_finished(); }));
      // Committed by rank 0's thread before any rank agreed on it.
      EXPECT_EQ(list_iterations(dir.path().string()), (std::vector<std::int64_t>{6}));
    } else {
      EXPECT_TRUE(saver.commit_finished());  // only rank 0 commits
    }
    TRESTLE_RETURN_IF_ERROR(saver.finalize());
    EXPECT_FALSE(saver.in_flight());
    return OkStatus();
  }));
  EXPECT_EQ(*read_latest_iteration(dir.path().string()).value(), 6);
  EXPECT_EQ(file_bytes(dir.path() / iteration_dir_name(6) / "extra.txt"), "iteration 6");
  expect_loads(dir.path(), 6, tensors);
}

TEST(AsyncSaver, AStartedCommitsFailureComesFromFinalizeOnEveryRankAndLeavesNothing) {
  TempDir dir;
  const auto tensors = sample_tensors(12);
  SaveOptions options;
  options.before_commit = [](const std::string&, const Manifest&) { return Status::Error("disk full"); };
  const auto results = run_ranks(2, [&](int r, Collective& c) -> Status {
    const RankState s = rank_state(tensors, 2, 1, r);
    AsyncSaver saver;
    TRESTLE_RETURN_IF_ERROR(saver.save_async(c, dir.path().string(), info_for(2, r), s.items, options));
    if (!write_ends(saver)) return Status::Error("the write did not end");
    TRESTLE_RETURN_IF_ERROR(saver.start_commit());
    return saver.finalize();
  });
  for (const auto& s : results) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("commit of iteration 2 failed: disk full"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(list_iterations(dir.path().string()).empty());
  for (const auto& entry : fs::directory_iterator(dir.path()))  // no staging directory of the failed save is left
    EXPECT_EQ(entry.path().filename().string().find("iter"), std::string::npos) << entry.path();
}

// Limits the size of files this process may write (writes beyond it fail with EFBIG) for the test's duration.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    previous_signal_ = std::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &previous_);
    rlimit limited = previous_;
    limited.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limited);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &previous_);
    std::signal(SIGXFSZ, previous_signal_);
  }

 private:
  rlimit previous_{};
  void (*previous_signal_)(int) = nullptr;
};

TEST(AsyncSaver, WriteErrorSurfacesFromFinalizeAndKeepsThePreviousCheckpoint) {
  TempDir dir;
  const auto small = sample_tensors(6);
  const std::vector<GlobalTensor> large = {GlobalTensor("w", DType::kF32, Shape{1024, 1024}, 7)};  // 4 MiB
  SoloCollective solo;
  AsyncSaver saver;
  const RankState a = rank_state(small, 1, 1, 0);
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(1, 0), a.items).ok());
  ASSERT_TRUE(saver.finalize().ok());
  {
    const FileSizeLimit limit(1 << 20);
    const RankState b = rank_state(large, 1, 1, 0);
    const Status started = saver.save_async(solo, dir.path().string(), info_for(2, 0), b.items);
    ASSERT_TRUE(started.ok()) << started.message();  // planning and staging write no large file
    EXPECT_TRUE(write_ends(saver));                  // a failed write has ended too
    const Status done = saver.finalize();
    ASSERT_FALSE(done.ok());
    EXPECT_NE(done.message().find("commit of iteration 2 failed"), std::string::npos) << done.message();
    EXPECT_NE(done.message().find(rank_file_name(0)), std::string::npos) << done.message();
  }
  EXPECT_EQ(*read_latest_iteration(dir.path().string()).value(), 1);
  EXPECT_EQ(list_iterations(dir.path().string()), (std::vector<std::int64_t>{1}));
  expect_loads(dir.path(), 1, small);
  // The saver is usable again and the next save commits.
  const RankState c = rank_state(large, 1, 1, 0);
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(3, 0), c.items).ok());
  ASSERT_TRUE(saver.finalize().ok());
  expect_loads(dir.path(), 3, large);
}

TEST(AsyncSaver, PlanErrorsComeFromSaveAsyncWithNothingInFlight) {
  TempDir dir;
  std::ofstream(dir.path() / "file") << "not a directory";
  const auto tensors = sample_tensors(8);
  const RankState s = rank_state(tensors, 1, 1, 0);
  SoloCollective solo;
  AsyncSaver saver;
  const Status started = saver.save_async(solo, (dir.path() / "file" / "ckpt").string(), info_for(1, 0), s.items);
  EXPECT_FALSE(started.ok());
  EXPECT_NE(started.message().find("cannot create checkpoint directory"), std::string::npos) << started.message();
  EXPECT_FALSE(saver.in_flight());
  EXPECT_TRUE(saver.finalize().ok());
}

TEST(AsyncSaver, CommitErrorsComeFromFinalize) {
  TempDir dir;
  const auto tensors = sample_tensors(9);
  const RankState s = rank_state(tensors, 1, 1, 0);
  SoloCollective solo;
  AsyncSaver saver;
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(4, 0), s.items).ok());
  ASSERT_TRUE(saver.finalize().ok());
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(4, 0), s.items).ok());
  const Status again = saver.finalize();
  EXPECT_NE(again.message().find("already exists"), std::string::npos) << again.message();
  expect_loads(dir.path(), 4, tensors);
}

TEST(AsyncSaver, StagingErrorsFailTheSaveOnEveryRank) {
  TempDir dir;
  const auto tensors = sample_tensors(10);
  const auto results = run_ranks(2, [&](int r, Collective& c) {
    const RankState s = rank_state(tensors, 2, 1, r);
    AsyncSaver saver;
    const Stager refuse_on_rank_1 = [&](std::span<const SaveItem>, std::span<const StagingCopy>) {
      return r == 1 ? Status::Error("device lost") : OkStatus();
    };
    TRESTLE_RETURN_IF_ERROR(saver.save_async(c, dir.path().string(), info_for(1, r), s.items, {}, refuse_on_rank_1));
    return saver.finalize();
  });
  for (const auto& s : results) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("device lost"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(list_iterations(dir.path().string()).empty());
}

TEST(AsyncSaver, PoolIsAllocatedOnceAndGrowsOnlyForALargerState) {
  TempDir dir;
  SoloCollective solo;
  std::size_t allocated = 0;
  AsyncSaver saver(2, [&](std::size_t bytes) {
    allocated += bytes;
    return allocate_locked_if_allowed(bytes);
  });
  const auto tensors = sample_tensors(11);
  for (std::int64_t iteration = 1; iteration <= 3; ++iteration) {
    const RankState s = rank_state(tensors, 1, 1, 0);
    ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(iteration, 0), s.items).ok());
  }
  ASSERT_TRUE(saver.finalize().ok());
  EXPECT_EQ(saver.pool().allocations(), 1u);
  const std::size_t capacity = saver.pool().capacity();
  EXPECT_EQ(allocated, capacity);

  std::vector<GlobalTensor> larger = tensors;
  larger.emplace_back("extra", DType::kF32, Shape{256, 256}, 12);
  const RankState s = rank_state(larger, 1, 1, 0);
  ASSERT_TRUE(saver.save_async(solo, dir.path().string(), info_for(4, 0), s.items).ok());
  ASSERT_TRUE(saver.finalize().ok());
  EXPECT_EQ(saver.pool().allocations(), 2u);
  EXPECT_GT(saver.pool().capacity(), capacity);
  expect_loads(dir.path(), 2, tensors);
  expect_loads(dir.path(), 4, larger);
}

}  // namespace
}  // namespace trestle
