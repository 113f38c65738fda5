#include "ckpt/range_file_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <vector>

namespace trestle {
namespace {

namespace fs = std::filesystem;

class RangeFileWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("trestle_range_writer_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<std::byte> pattern(std::size_t bytes, unsigned seed) {
    std::vector<std::byte> out(bytes);
    std::mt19937 rng(seed);
    for (auto& b : out) b = static_cast<std::byte>(rng());
    return out;
  }
  static std::vector<std::byte> read_all(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> out(raw.size());
    std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }
  IoOptions small_windows() const {
    IoOptions o;
    o.request_bytes = std::size_t{1} << 20;
    o.queue_depth = 16;
    return o;
  }

  fs::path dir_;
};

TEST_F(RangeFileWriterTest, RandomOrderPiecesMakeTheExactFile) {
  const std::size_t size = (std::size_t{9} << 20) + 12345;  // not a multiple of a page
  const auto expected = pattern(size, 1);
  // Pieces of odd sizes, written in a shuffled order.
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  std::mt19937 rng(7);
  for (std::size_t at = 0; at < size;) {
    const std::size_t len = std::min<std::size_t>(size - at, 1 + rng() % (3 << 20));
    pieces.emplace_back(at, len);
    at += len;
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  auto writer = RangeFileWriter::create((dir_ / "f.bin").string(), size, small_windows());
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  for (auto [at, len] : pieces) {
    ASSERT_TRUE((*writer)->write(at, std::span(expected).subspan(at, len)).ok());
  }
  EXPECT_EQ((*writer)->bytes_written(), size);
  ASSERT_TRUE((*writer)->finish().ok());
  EXPECT_EQ(read_all(dir_ / "f.bin"), expected);
}

TEST_F(RangeFileWriterTest, PartlyFilledWindowsSpillThroughThePageCache) {
  // 40 windows each half written first: more partial windows than staging, so the oldest are spilled.
  const std::size_t window = std::size_t{1} << 20, count = 40, size = window * count;
  const auto expected = pattern(size, 2);
  auto writer = RangeFileWriter::create((dir_ / "f.bin").string(), size, small_windows());
  ASSERT_TRUE(writer.ok());
  for (std::size_t w = 0; w < count; ++w)
    ASSERT_TRUE((*writer)->write(w * window, std::span(expected).subspan(w * window, window / 2)).ok());
  for (std::size_t w = count; w-- > 0;)
    ASSERT_TRUE((*writer)
                    ->write(w * window + window / 2, std::span(expected).subspan(w * window + window / 2, window / 2))
                    .ok());
  ASSERT_TRUE((*writer)->finish().ok());
  EXPECT_EQ(read_all(dir_ / "f.bin"), expected);
}

TEST_F(RangeFileWriterTest, BytesNeverWrittenReadAsZeros) {
  const std::size_t size = (std::size_t{3} << 20) + 100;
  const auto data = pattern(5000, 3);
  auto writer = RangeFileWriter::create((dir_ / "f.bin").string(), size, small_windows());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->write(10, data).ok());
  ASSERT_TRUE((*writer)->write(size - 50, std::span(data).first(50)).ok());
  ASSERT_TRUE((*writer)->finish().ok());
  std::vector<std::byte> expected(size);
  std::copy(data.begin(), data.end(), expected.begin() + 10);
  std::copy(data.begin(), data.begin() + 50, expected.end() - 50);
  EXPECT_EQ(read_all(dir_ / "f.bin"), expected);
}

TEST_F(RangeFileWriterTest, OverlapsAndOutOfRangeWritesAreErrors) {
  const auto data = pattern(4096, 4);
  auto writer = RangeFileWriter::create((dir_ / "f.bin").string(), 10000, small_windows());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->write(1000, std::span(data).first(1000)).ok());
  const Status overlap = (*writer)->write(1500, std::span(data).first(10));
  ASSERT_FALSE(overlap.ok());
  EXPECT_NE(overlap.message().find("overlap bytes [1000, 2000)"), std::string::npos) << overlap.message();
  EXPECT_NE(overlap.message().find("f.bin"), std::string::npos);
  const Status outside = (*writer)->write(9000, std::span(data).first(2000));
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.message().find("outside the file's 10000 bytes"), std::string::npos) << outside.message();
  EXPECT_TRUE((*writer)->write(2000, std::span(data).first(10)).ok());  // adjacent is fine
}

TEST_F(RangeFileWriterTest, BufferedModeWritesTheSameBytes) {
  IoOptions options = small_windows();
  options.direct = false;
  options.use_uring = false;
  const std::size_t size = (std::size_t{2} << 20) + 7;
  const auto expected = pattern(size, 5);
  auto writer = RangeFileWriter::create((dir_ / "f.bin").string(), size, options);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->write(size / 2, std::span(expected).subspan(size / 2)).ok());
  ASSERT_TRUE((*writer)->write(0, std::span(expected).first(size / 2)).ok());
  ASSERT_TRUE((*writer)->finish().ok());
  EXPECT_EQ(read_all(dir_ / "f.bin"), expected);
}

}  // namespace
}  // namespace trestle
