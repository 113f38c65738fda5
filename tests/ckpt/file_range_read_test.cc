// Range reads (ckpt/file_range_read.h): the bytes of any range, read with O_DIRECT from the disk or copied from the
// page cache when the range is resident there, and range_in_page_cache telling the two apart.
#include "ckpt/file_range_read.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

using testing::TempDir;

constexpr std::uint64_t kBytes = (std::uint64_t{3} << 20) + 12345;

std::vector<std::byte> write_random_file(const std::string& path) {
  std::mt19937_64 rng(7);
  std::vector<std::byte> data(kBytes);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  EXPECT_EQ(::fdatasync(fd), 0);
  ::close(fd);
  return data;
}

void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
}

void read_all_buffered(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<char> sink(1 << 20);
  while (::read(fd, sink.data(), sink.size()) > 0) {
  }
  ::close(fd);
}

bool on_tmpfs(const std::string& path) {
  struct statfs st {};
  return ::statfs(path.c_str(), &st) == 0 && st.f_type == TMPFS_MAGIC;
}

// Reads [offset, offset + length) with read_file_range and checks it against the data written.
void expect_range(ReadFiles& files, const std::string& path, const std::vector<std::byte>& data, std::uint64_t offset,
                  std::uint64_t length) {
  auto file = files.get(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  AlignedBuffer buffer;
  auto at = read_file_range(*file, path, offset, length, buffer, "test range");
  ASSERT_TRUE(at.ok()) << at.status().message();
  EXPECT_EQ(std::memcmp(buffer.data() + *at, data.data() + offset, length), 0) << "offset " << offset;
}

TEST(FileRangeReadTest, ColdAndCachedRangesReadTheSameBytes) {
  TempDir dir;
  const std::string path = dir / "data.bin";
  const auto data = write_random_file(path);
  ReadFiles files;
  auto opened = files.get(path);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  const OpenedFile file = *opened;
  if (file.direct) {
    EXPECT_GE(file.cached_fd, 0) << "a file read with O_DIRECT keeps a buffered twin";
  }

  const bool tmpfs = on_tmpfs(dir.str());
  evict(path);
  if (!tmpfs) {
    EXPECT_FALSE(range_in_page_cache(file.cached_fd >= 0 ? file.cached_fd : file.fd, 4096, 1 << 20));
  }
  for (const auto& [offset, length] : std::vector<std::pair<std::uint64_t, std::uint64_t>>{
           {0, kBytes}, {1, 1 << 20}, {4095, 2 * 4096 + 3}, {kBytes - 17, 17}, {(1 << 20) + 5, 1 << 20}}) {
    evict(path);
    expect_range(files, path, data, offset, length);
  }

  read_all_buffered(path);
  EXPECT_TRUE(range_in_page_cache(file.cached_fd >= 0 ? file.cached_fd : file.fd, 4096, 1 << 20));
  for (const auto& [offset, length] : std::vector<std::pair<std::uint64_t, std::uint64_t>>{
           {0, kBytes}, {1, 1 << 20}, {4095, 2 * 4096 + 3}, {kBytes - 17, 17}, {(1 << 20) + 5, 1 << 20}})
    expect_range(files, path, data, offset, length);
}

TEST(FileRangeReadTest, PartlyCachedRangeIsNotCached) {
  TempDir dir;
  const std::string path = dir / "data.bin";
  write_random_file(path);
  if (on_tmpfs(dir.str())) GTEST_SKIP() << "tmpfs keeps every page resident";
  evict(path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<char> first(1 << 20);
  ASSERT_EQ(::pread(fd, first.data(), first.size(), 0), static_cast<ssize_t>(first.size()));
  ::posix_fadvise(fd, 1 << 20, 0, POSIX_FADV_DONTNEED);  // readahead past the first MiB dropped again
  EXPECT_TRUE(range_in_page_cache(fd, 0, 1 << 20));
  EXPECT_FALSE(range_in_page_cache(fd, 0, 2 << 20));
  EXPECT_TRUE(range_in_page_cache(fd, 0, 0));
  ::close(fd);
}

TEST(FileRangeReadTest, RangePastTheEndIsAnErrorNamingTheFile) {
  TempDir dir;
  const std::string path = dir / "data.bin";
  write_random_file(path);
  ReadFiles files;
  auto file = files.get(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  read_all_buffered(path);  // cached or not, the end of the file is where it is
  AlignedBuffer buffer;
  const auto result = read_file_range(*file, path, kBytes - 10, 20, buffer, "tensor 'w'");
  EXPECT_TRUE(fails_with(result, path + ": tensor 'w' (bytes "));
  EXPECT_TRUE(fails_with(result, "runs past the end of the file"));
}

}  // namespace
}  // namespace trestle
