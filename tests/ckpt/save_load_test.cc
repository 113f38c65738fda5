// Save with one layout, load with another: thread ranks through ThreadGroup, every dtype, raw and zstd, corruption
// and commit-protocol failures.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/checkpoint_path.h"
#include "ckpt/load.h"
#include "ckpt/save.h"
#include "tests/support/global_tensor.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

using testing::GlobalTensor;

// Splits dim `dim` of the tensor into `parts` near-equal boxes.
std::vector<Piece> split(const Shape& shape, std::size_t dim, int parts) {
  std::vector<Piece> out;
  for (int i = 0; i < parts; ++i) out.push_back(testing::split_part(shape, dim, parts, i));
  return out;
}

// Runs fn(rank, collective) on `world` threads and returns each rank's status.
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

// Saves `tensors` from `world` ranks: rank r holds piece (r / replicas) of each tensor split along dim 0 into
// world / replicas parts (so `replicas` ranks hold each piece, as data-parallel replicas do).
Status save_split(const fs::path& root, std::int64_t iteration, const std::vector<GlobalTensor>& tensors, int world,
                  int replicas, const SaveOptions& options) {
  // Rank r's piece of a tensor: part r / replicas of dim 0 (0-d tensors are held whole by everyone).
  auto piece_of = [&](const GlobalTensor& t, int r) {
    if (t.shape.empty()) return Piece{whole_box(t.shape), std::nullopt};
    return split(t.shape, 0, world / replicas)[static_cast<std::size_t>(r / replicas)];
  };
  std::vector<std::vector<std::vector<std::byte>>> data(static_cast<std::size_t>(world));
  std::vector<std::vector<SaveItem>> items(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto& mine = data[static_cast<std::size_t>(r)];
    for (const auto& t : tensors) mine.push_back(t.extract(piece_of(t, r)));
    for (std::size_t i = 0; i < tensors.size(); ++i)
      items[static_cast<std::size_t>(r)].push_back(
          {tensors[i].name, tensors[i].dtype, tensors[i].shape, piece_of(tensors[i], r), mine[i].data()});
  }
  const auto results = run_ranks(world, [&](int r, Collective& c) {
    CheckpointInfo info;
    info.iteration = iteration;
    info.layout = {{"tp", world / replicas}, {"dp", replicas}};
    info.rank_state = {{"rng", r * 17}};
    return save_checkpoint(c, root.string(), info, items[static_cast<std::size_t>(r)], options);
  });
  for (const auto& s : results)
    if (!s.ok()) return s;
  return OkStatus();
}

std::vector<GlobalTensor> sample_tensors() {
  std::vector<GlobalTensor> out;
  unsigned seed = 1;
  for (DType d : kAllDTypes) out.emplace_back("t." + std::string(dtype_name(d)), d, Shape{12, 10}, seed++);
  out.emplace_back("big", DType::kF32, Shape{64, 96}, seed++);  // several blocks with small block sizes
  out.emplace_back("cube", DType::kBF16, Shape{8, 6, 10}, seed++);
  out.emplace_back("scalar", DType::kF32, Shape{}, seed++);
  return out;
}

void expect_loads(const fs::path& root, const std::vector<GlobalTensor>& tensors) {
  auto reader = CheckpointReader::open(root.string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  for (const auto& t : tensors) {
    std::vector<Piece> requests;
    if (t.shape.empty()) {
      requests.push_back({whole_box(t.shape), std::nullopt});
    } else {
      for (const auto& p : split(t.shape, t.shape.size() - 1, 3)) requests.push_back(p);  // a different split
      for (const auto& p : split(t.shape, 0, 5)) requests.push_back(p);
      Piece flat{whole_box(t.shape), FlatRange{7, t.shape[0] * t.shape[1] / 2 + 3}};
      requests.push_back(flat);
      Piece inner = split(t.shape, 1, 2)[1];
      inner.flat = FlatRange{3, inner.box.numel() - 2};
      requests.push_back(inner);
    }
    for (const auto& p : requests) {
      const auto expected = t.extract(p);
      std::vector<std::byte> got(expected.size(), std::byte{0x5a});
      const LoadRequest request{t.name, p, got.data()};
      const Status s = reader->load({&request, 1});
      ASSERT_TRUE(s.ok()) << s.message();
      ASSERT_EQ(got, expected) << t.name << " " << to_string(p);
    }
  }
}

class SaveLoad : public ::testing::TestWithParam<std::tuple<int, int, Codec>> {};

TEST_P(SaveLoad, AnyLayoutLoadsBitExactly) {
  const auto [world, replicas, codec] = GetParam();
  TempDir dir;
  SaveOptions options;
  options.codec = codec;
  options.block_bytes = 4096;
  const auto tensors = sample_tensors();
  const Status s = save_split(dir.path(), 100, tensors, world, replicas, options);
  ASSERT_TRUE(s.ok()) << s.message();
  expect_loads(dir.path(), tensors);

  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok());
  const Manifest& m = reader->manifest();
  EXPECT_EQ(m.world_size, world);
  EXPECT_EQ(m.training["ranks"].size(), static_cast<std::size_t>(world));
  EXPECT_EQ(m.training["ranks"][1 % world]["rng"], (1 % world) * 17);
  // Replicated pieces are stored once: one chunk per distinct piece.
  EXPECT_EQ(m.tensors.at("big").chunks.size(), static_cast<std::size_t>(world / replicas));
  LoadStats stats;
  const Status verified = reader->verify(&stats);
  EXPECT_TRUE(verified.ok()) << verified.message();
  EXPECT_GT(stats.blocks_verified, 0u);
}

INSTANTIATE_TEST_SUITE_P(Layouts, SaveLoad,
                         ::testing::Values(std::tuple{1, 1, Codec::kRaw}, std::tuple{2, 1, Codec::kRaw},
                                           std::tuple{4, 2, Codec::kRaw}, std::tuple{3, 3, Codec::kRaw},
                                           std::tuple{4, 1, Codec::kZstd}, std::tuple{2, 2, Codec::kZstd}));

TEST(SaveLoadErrors, CorruptBlockIsReportedWithFileAndTensor) {
  TempDir dir;
  const std::vector<GlobalTensor> tensors = {GlobalTensor("w", DType::kF32, Shape{32, 32}, 3)};
  SaveOptions options;
  options.block_bytes = 1024;
  ASSERT_TRUE(save_split(dir.path(), 5, tensors, 1, 1, options).ok());
  const fs::path file = dir.path() / iteration_dir_name(5) / rank_file_name(0);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2000);
    f.put('\x7f');
  }
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out(32 * 32 * 4);
  const LoadRequest request{"w", Piece{whole_box({32, 32}), std::nullopt}, out.data()};
  const Status s = reader->load({&request, 1});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(rank_file_name(0)), std::string::npos) << s.message();
  EXPECT_TRUE(
      fails_with(reader->verify(), "tensor 'w' chunk [0:32, 0:32] in rank_00000.bin block 1: checksum mismatch"));
  // A request that touches only intact blocks still loads.
  const LoadRequest first_rows{"w", Piece{Box{{0, 0}, {4, 32}}, std::nullopt}, out.data()};
  EXPECT_TRUE(reader->load({&first_rows, 1}).ok());
}

TEST(SaveLoadErrors, RequestsThatDoNotMatchTheCheckpoint) {
  TempDir dir;
  const std::vector<GlobalTensor> tensors = {GlobalTensor("w", DType::kF32, Shape{8, 8}, 3)};
  ASSERT_TRUE(save_split(dir.path(), 1, tensors, 2, 1, {}).ok());
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out(1024);
  const LoadRequest missing{"nope", Piece{whole_box({8, 8}), std::nullopt}, out.data()};
  EXPECT_NE(reader->load({&missing, 1}).message().find("'nope' is not in the checkpoint"), std::string::npos);
  const LoadRequest outside{"w", Piece{Box{{4, 0}, {8, 8}}, std::nullopt}, out.data()};
  EXPECT_NE(reader->load({&outside, 1}).message().find("not within the stored global shape [8, 8]"), std::string::npos);
}

TEST(CheckpointPath, ARootOrOneOfItsIterationDirectories) {
  TempDir dir;
  const std::vector<GlobalTensor> tensors = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 1)};
  ASSERT_TRUE(save_split(dir.path(), 10, tensors, 1, 1, {}).ok());
  ASSERT_TRUE(save_split(dir.path(), 20, tensors, 1, 1, {}).ok());
  const std::string root = dir.path().string(), ten = (dir.path() / iteration_dir_name(10)).string();
  const auto opened = [](const std::string& path, std::optional<std::int64_t> iteration) {
    auto reader = open_checkpoint_path(path, iteration);
    EXPECT_TRUE(reader.ok()) << path << ": " << reader.status().message();
    return reader.ok() ? reader->manifest().iteration : -1;
  };
  EXPECT_EQ(opened(root, std::nullopt), 20);  // the tracker's
  EXPECT_EQ(opened(root, 10), 10);
  EXPECT_EQ(opened(ten, std::nullopt), 10);
  EXPECT_EQ(opened(ten + "/", 10), 10);
  EXPECT_EQ(opened(ten + "/.", std::nullopt), 10);
  EXPECT_TRUE(fails_with(open_checkpoint_path(ten, 20), "is iteration 10, not 20"));
}

TEST(CommitProtocol, FailedSaveLeavesPreviousCheckpointIntact) {
  TempDir dir;
  const std::vector<GlobalTensor> good = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 1)};
  ASSERT_TRUE(save_split(dir.path(), 10, good, 2, 1, {}).ok());
  // Ranks disagree about the global shape: nothing may be committed.
  std::vector<std::byte> data(64 * 4);
  const auto results = run_ranks(2, [&](int r, Collective& c) {
    const SaveItem item{"w", DType::kF32, r == 0 ? Shape{8, 4} : Shape{8, 8},
                        Piece{Box{{r * 4, 0}, {4, 4}}, std::nullopt}, data.data()};
    CheckpointInfo info;
    info.iteration = 20;
    return save_checkpoint(c, dir.path().string(), info, {&item, 1});
  });
  for (const auto& s : results) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s.message();
  }
  EXPECT_EQ(*read_latest_iteration(dir.path().string()).value(), 10);
  EXPECT_FALSE(fs::exists(dir.path() / iteration_dir_name(20)));
  expect_loads(dir.path(), good);

  // Pieces that leave part of a tensor unsaved are refused too.
  const auto partial = run_ranks(1, [&](int, Collective& c) {
    const SaveItem item{"w", DType::kF32, Shape{8, 4}, Piece{Box{{0, 0}, {4, 4}}, std::nullopt}, data.data()};
    CheckpointInfo info;
    info.iteration = 30;
    return save_checkpoint(c, dir.path().string(), info, {&item, 1});
  });
  EXPECT_NE(partial[0].message().find("hold 16 of its 32 elements"), std::string::npos) << partial[0].message();
}

TEST(CommitProtocol, StaleTempDirsAreIgnoredThenRemovedAndIterationsNotOverwritten) {
  TempDir dir;
  const std::vector<GlobalTensor> t1 = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 1)};
  ASSERT_TRUE(save_split(dir.path(), 10, t1, 1, 1, {}).ok());
  // A crash mid-save leaves a temp dir: loading still finds iteration 10.
  fs::create_directories(dir.path() / ".tmp.iter_0000020.crashed");
  std::ofstream(dir.path() / ".tmp.iter_0000020.crashed" / "rank_00000.bin") << "partial";
  expect_loads(dir.path(), t1);
  const std::vector<GlobalTensor> t2 = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 2)};
  ASSERT_TRUE(save_split(dir.path(), 20, t2, 1, 1, {}).ok());
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp.iter_0000020.crashed"));
  expect_loads(dir.path(), t2);
  EXPECT_EQ(list_iterations(dir.path().string()), (std::vector<std::int64_t>{10, 20}));

  const Status again = save_split(dir.path(), 20, t1, 1, 1, {});
  EXPECT_NE(again.message().find("already exists"), std::string::npos) << again.message();
  expect_loads(dir.path(), t2);
  SaveOptions overwrite;
  overwrite.overwrite = true;
  ASSERT_TRUE(save_split(dir.path(), 20, t1, 1, 1, overwrite).ok());
  expect_loads(dir.path(), t1);
}

TEST(CommitProtocol, AnIterationReplacedWhileItIsReadIsSaidToBeSo) {
  // Another job saving the same iteration again swaps in its directory: a reader opened before then read the new files
  // against the old manifest and reported a checksum mismatch, as if the checkpoint were damaged.
  TempDir dir;
  const std::vector<GlobalTensor> first = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 1)};
  const std::vector<GlobalTensor> second = {GlobalTensor("w", DType::kF32, Shape{8, 4}, 2)};
  ASSERT_TRUE(save_split(dir.path(), 20, first, 1, 1, {}).ok());
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  SaveOptions overwrite;
  overwrite.overwrite = true;
  ASSERT_TRUE(save_split(dir.path(), 20, second, 1, 1, overwrite).ok());
  std::vector<std::byte> got(8 * 4 * sizeof(float));
  const LoadRequest request{"w", Piece{whole_box(Shape{8, 4}), std::nullopt}, got.data()};
  const Status loaded = reader->load({&request, 1});
  EXPECT_TRUE(fails_with(loaded, dir.path().string() + "/iter_0000020: replaced or removed while it was read " +
                                     "(another job saved iteration 20 again)"));
  EXPECT_TRUE(fails_with(reader->verify(), "replaced or removed while it was read"));
  expect_loads(dir.path(), second);  // (opened again: the new save, whole)
  // A damaged file of an iteration left in place is still damage.
  auto again = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(again.ok()) << again.status().message();
  {
    std::fstream rank_file(dir.path() / "iter_0000020" / "rank_00000.bin",
                           std::ios::in | std::ios::out | std::ios::binary);
    rank_file.seekp(0);
    rank_file.put('\x55');
  }
  EXPECT_TRUE(fails_with(again->verify(), "checksum mismatch"));
}

}  // namespace
}  // namespace trestle
