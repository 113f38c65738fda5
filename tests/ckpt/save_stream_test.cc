// Streamed rank files: pieces produced on demand by a filler are saved through the ordinary plan / commit protocol
// (replicas written once) and load back exactly; a filler's error fails the save with the tensor and piece named.
#include "ckpt/save_stream.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <new>
#include <stdexcept>
#include <thread>

#include "ckpt/load.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Element (row, col) of tensor "t<k>" is k * 1000 + row * cols + col.
float value(int k, std::int64_t row, std::int64_t col, std::int64_t cols) {
  return static_cast<float>(k * 1000 + row * cols + col);
}

Status fill_box(int k, const Box& box, std::int64_t cols, std::span<std::byte> out) {
  std::size_t at = 0;
  for (std::int64_t r = box.offset[0]; r < box.offset[0] + box.shape[0]; ++r)
    for (std::int64_t c = box.offset[1]; c < box.offset[1] + box.shape[1]; ++c, at += sizeof(float)) {
      const float v = value(k, r, c, cols);
      std::memcpy(out.data() + at, &v, sizeof v);
    }
  return OkStatus();
}

// How rank 1's filler fails, if it does.
enum class Failure { kNone, kStatus, kBadAlloc, kException };

// Two ranks: t0 split by rows, t1 replicated on both (written once), streamed through fillers.
Status save_streamed(const std::string& root, Codec codec, Failure fail) {
  const Shape shape{6, 4};
  ThreadGroup group(2);
  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank)
    threads.emplace_back([&, rank] {
      auto member = group.member(rank);
      const Box half{{rank * 3, 0}, {3, 4}};
      std::vector<SaveItem> items = {
          {"t0", DType::kF32, shape, Piece{half, std::nullopt}, streamed_data()},
          {"t1", DType::kF32, shape, Piece{whole_box(shape), std::nullopt}, streamed_data()}};
      CheckpointInfo info;
      info.iteration = 5;
      auto plan = plan_save(*member, root, 5, items);
      if (!plan.ok()) {
        results[static_cast<std::size_t>(rank)] = plan.status();
        return;
      }
      SaveOptions options;
      options.codec = codec;
      std::uint64_t reported = 0;
      auto mine = write_rank_file_streaming(
          plan->temp_dir, rank, items, plan->to_write,
          [&](std::size_t i, std::span<std::byte> out) -> Status {
            if (rank == 1 && fail == Failure::kStatus) return Status::Error("source unreadable");
            if (rank == 1 && fail == Failure::kBadAlloc) throw std::bad_alloc();
            if (rank == 1 && fail == Failure::kException) throw std::runtime_error("source went away");
            return fill_box(static_cast<int>(i), items[i].piece.box, 4, out);
          },
          options, [&](std::uint64_t bytes) { reported += bytes; });
      if (mine.ok()) {
        EXPECT_EQ(reported, plan->bytes_to_write);
      }
      results[static_cast<std::size_t>(rank)] = commit_save(*member, root, *plan, info, items, mine, options);
    });
  for (auto& t : threads) t.join();
  for (const auto& s : results)
    if (!s.ok()) return s;
  return OkStatus();
}

TEST(SaveStreamTest, StreamedPiecesLoadBack) {
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    TempDir dir;
    ASSERT_TRUE(save_streamed(dir.path().string(), codec, Failure::kNone).ok());
    auto reader = CheckpointReader::open(dir.path().string());
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    EXPECT_EQ(reader->manifest().tensors.at("t0").chunks.size(), 2u);
    EXPECT_EQ(reader->manifest().tensors.at("t1").chunks.size(), 1u) << "the replicated tensor is written once";
    for (int k = 0; k < 2; ++k) {
      std::vector<float> got(24);
      const LoadRequest request{"t" + std::to_string(k), Piece{whole_box({6, 4}), std::nullopt},
                                reinterpret_cast<std::byte*>(got.data())};
      ASSERT_TRUE(reader->load({&request, 1}).ok());
      for (std::int64_t i = 0; i < 24; ++i) EXPECT_EQ(got[static_cast<std::size_t>(i)], value(k, i / 4, i % 4, 4));
    }
  }
}

TEST(SaveStreamTest, FillerErrorFailsTheSaveNamingThePiece) {
  TempDir dir;
  const Status s = save_streamed(dir.path().string(), Codec::kRaw, Failure::kStatus);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("source unreadable"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tensor '"), std::string::npos) << s.message();
  EXPECT_TRUE(fails_with(CheckpointReader::open(dir.path().string()), "no latest_checkpointed_iteration.txt"))
      << "nothing was committed";
}

// An allocation failure (or any exception) while a piece is staged terminated the writer thread, and the process.
TEST(SaveStreamTest, FillerThrowingFailsTheSaveNamingThePiece) {
  for (const auto& [failure, says] : {std::pair{Failure::kBadAlloc, "out of memory while staging or compressing it"},
                                      std::pair{Failure::kException, "source went away"}}) {
    TempDir dir;
    const Status s = save_streamed(dir.path().string(), Codec::kZstd, failure);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find(says), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank_00001.bin: tensor 't"), std::string::npos) << s.message();
    EXPECT_TRUE(fails_with(CheckpointReader::open(dir.path().string()), "no latest_checkpointed_iteration.txt"))
        << "nothing was committed";
  }
}

}  // namespace
}  // namespace trestle
