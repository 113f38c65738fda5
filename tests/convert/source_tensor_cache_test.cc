// SourceTensorCache: tensors at unaligned offsets (and one ending at an unaligned end of file) come back byte-exact,
// each is read once while it fits the budget, the budget evicts unpinned tensors but never pinned ones, concurrent
// pins of the same tensor share one read, read-ahead loads what the next pins want (once, within the budget, never
// evicting a tensor still wanted), and bad ranges or files fail naming the file and the tensor.
#include "convert/sources/source_tensor_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

namespace trestle {
namespace {

namespace fs = std::filesystem;

struct TestFile {
  std::string path;
  std::vector<std::byte> bytes;
};

// A file of `size` pseudo-random bytes.
TestFile make_file(const fs::path& dir, const std::string& name, std::size_t size) {
  fs::create_directories(dir);
  TestFile f{(dir / name).string(), std::vector<std::byte>(size)};
  std::mt19937 rng(static_cast<unsigned>(size));
  for (auto& b : f.bytes) b = static_cast<std::byte>(rng());
  std::ofstream(f.path, std::ios::binary)
      .write(reinterpret_cast<const char*>(f.bytes.data()), static_cast<std::streamsize>(size));
  return f;
}

StoredTensor u8_tensor(const TestFile& f, std::uint64_t offset, std::int64_t n) {
  return {"t@" + std::to_string(offset), f.path, offset, DType::kU8, {n}, std::nullopt};
}

void expect_bytes(const ConstTensorView& view, const TestFile& f, std::uint64_t offset) {
  ASSERT_NE(view.data, nullptr);
  ASSERT_EQ(0, std::memcmp(view.data, f.bytes.data() + offset, view.nbytes())) << "tensor at " << offset;
}

class SourceTensorCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("trestle-stc-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SourceTensorCacheTest, ReadsUnalignedTensorsExactlyAndEachOnce) {
  // 8-byte prefix like safetensors, tensors at odd offsets, the last ending at the (unaligned) end of the file.
  const auto f = make_file(dir_, "a.bin", 3 * 1'000'000 + 12'345);
  std::vector<StoredTensor> tensors = {u8_tensor(f, 8, 1'000'000), u8_tensor(f, 1'000'008, 7),
                                       u8_tensor(f, 1'000'015, 1'999'999),
                                       u8_tensor(f, 3'000'014, 12'331)};  // ends at the file's last byte
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes();
  SourceTensorCache cache(tensors, 64 << 20);
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::size_t index[] = {i};
      auto pin = cache.pin(index);
      ASSERT_TRUE(pin.ok()) << pin.status().message();
      expect_bytes(pin->views()[i], f, tensors[i].offset);
      for (std::size_t j = 0; j < tensors.size(); ++j) {
        if (j == i) continue;
        EXPECT_EQ(pin->views()[j].data, nullptr) << "only pinned tensors have data";
      }
    }
  }
  EXPECT_EQ(cache.bytes_read(), total) << "the second round is served from memory";
}

TEST_F(SourceTensorCacheTest, BudgetEvictsUnpinnedTensorsOnly) {
  const auto f = make_file(dir_, "b.bin", 400'000);
  const std::vector<StoredTensor> tensors = {u8_tensor(f, 100, 100'000), u8_tensor(f, 100'100, 100'000),
                                             u8_tensor(f, 200'100, 150'000)};
  SourceTensorCache cache(tensors, 128 << 10);  // holds one tensor, not two
  {
    const std::size_t a[] = {0};
    ASSERT_TRUE(cache.pin(a).ok());
  }
  {
    const std::size_t b[] = {1};
    ASSERT_TRUE(cache.pin(b).ok());  // evicts tensor 0
  }
  {
    const std::size_t a[] = {0};
    auto pin = cache.pin(a);  // read again
    ASSERT_TRUE(pin.ok());
    expect_bytes(pin->views()[0], f, 100);
  }
  EXPECT_EQ(cache.bytes_read(), 300'000u);
  EXPECT_LE(cache.peak_held_bytes(), std::uint64_t{128} << 10);

  // Pinned together, all three are held although they exceed the budget, and none is overwritten by another.
  const std::size_t all[] = {2, 0, 1, 0};
  auto pin = cache.pin(all);
  ASSERT_TRUE(pin.ok()) << pin.status().message();
  for (std::size_t i = 0; i < tensors.size(); ++i) expect_bytes(pin->views()[i], f, tensors[i].offset);
  EXPECT_GT(cache.peak_held_bytes(), std::uint64_t{128} << 10);
}

TEST_F(SourceTensorCacheTest, ReadAheadLoadsTheNextTensorsOnceWithinTheBudget) {
  const auto f = make_file(dir_, "r.bin", 1'000'000);
  std::vector<StoredTensor> tensors;
  for (int i = 0; i < 8; ++i) tensors.push_back(u8_tensor(f, 1 + 100'000 * static_cast<std::uint64_t>(i), 100'000));
  // Room for four tensors (each takes 25 or 26 pages); every tensor wanted by two pins (two ranks cutting pieces).
  const std::uint64_t kBudget = 4 * 26 * 4096;
  SourceTensorCache cache(tensors, kBudget);
  const std::vector<std::size_t> order = {0, 1, 2, 3, 4, 5, 6, 7};
  cache.read_ahead(order, std::vector<int>(tensors.size(), 2), 250'000, 2);
  {
    const std::size_t first[] = {0};
    auto pin = cache.pin(first);
    ASSERT_TRUE(pin.ok()) << pin.status().message();
    expect_bytes(pin->views()[0], f, 1);
  }
  // Pinning tensor 0 queued 1 and 2 (250 kB ahead), which load without being asked for.
  cache.wait_read_ahead_idle();
  EXPECT_EQ(cache.bytes_read(), 300'000u) << "read only as far ahead as asked";
  {
    const std::size_t next[] = {1, 2};
    auto pin = cache.pin(next);
    ASSERT_TRUE(pin.ok());
    expect_bytes(pin->views()[1], f, 100'001);
    expect_bytes(pin->views()[2], f, 200'001);
  }
  // That pin queued 3 and 4, but only 3 fits: 0, 1 and 2 are each wanted once more, so the read-ahead may not evict
  // them.
  cache.wait_read_ahead_idle();
  EXPECT_EQ(cache.bytes_read(), 400'000u) << "no wanted tensor evicted for a read-ahead";
  EXPECT_LE(cache.peak_held_bytes(), kBudget);
  // The second rank's pins of 0..3 are served from memory: at most the read-ahead of 4 and 5 is read meanwhile.
  for (std::size_t i = 0; i < 4; ++i) {
    const std::size_t one[] = {i};
    auto pin = cache.pin(one);
    ASSERT_TRUE(pin.ok());
    expect_bytes(pin->views()[i], f, tensors[i].offset);
  }
  EXPECT_LE(cache.bytes_read(), 600'000u);
  // The rest through both ranks' pins, byte-exact, within the budget.
  for (int rank = 0; rank < 2; ++rank)
    for (std::size_t i = 4; i < tensors.size(); ++i) {
      const std::size_t one[] = {i};
      auto pin = cache.pin(one);
      ASSERT_TRUE(pin.ok());
      expect_bytes(pin->views()[i], f, tensors[i].offset);
    }
  EXPECT_LE(cache.peak_held_bytes(), kBudget);
}

TEST_F(SourceTensorCacheTest, ConcurrentPinsShareOneRead) {
  const auto f = make_file(dir_, "c.bin", 6 << 20);
  std::vector<StoredTensor> tensors;
  for (std::uint64_t at = 3; at + 300'000 < f.bytes.size(); at += 300'001) tensors.push_back(u8_tensor(f, at, 300'000));
  SourceTensorCache cache(tensors, 64 << 20);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int k = 0; k < 200; ++k) {
        const std::size_t picks[] = {rng() % tensors.size(), rng() % tensors.size()};
        auto pin = cache.pin(picks);
        if (!pin.ok()) {
          ++failures;
          continue;
        }
        for (const std::size_t i : picks)
          if (std::memcmp(pin->views()[i].data, f.bytes.data() + tensors[i].offset, tensors[i].nbytes()) != 0)
            ++failures;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(cache.bytes_read(), tensors.size() * 300'000u) << "no tensor read twice";
}

TEST_F(SourceTensorCacheTest, BadRangesAndFilesFailNamingThem) {
  const auto f = make_file(dir_, "d.bin", 10'000);
  const std::vector<StoredTensor> tensors = {
      {"past_end", f.path, 9'000, DType::kF32, {500}, std::nullopt},
      {"missing", (dir_ / "nope.bin").string(), 0, DType::kU8, {4}, std::nullopt},
      u8_tensor(f, 1, 9'999)};
  SourceTensorCache cache(tensors, 1 << 20);
  const std::size_t first[] = {0};
  auto a = cache.pin(first);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("d.bin"), std::string::npos) << a.status().message();
  EXPECT_NE(a.status().message().find("past_end"), std::string::npos) << a.status().message();
  const std::size_t second[] = {1};
  auto b = cache.pin(second);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("nope.bin"), std::string::npos) << b.status().message();
  const std::size_t third[] = {2};
  auto c = cache.pin(third);  // the cache still works after failures
  ASSERT_TRUE(c.ok()) << c.status().message();
  expect_bytes(c->views()[2], f, 1);
}

// tmpfs refuses O_DIRECT: the cache falls back to buffered reads with the same results.
TEST_F(SourceTensorCacheTest, ReadsWhereODirectIsRefused) {
  ASSERT_TRUE(fs::is_directory("/dev/shm")) << "no /dev/shm (tmpfs) on this machine";
  const fs::path shm = fs::path("/dev/shm") / dir_.filename();
  const auto f = make_file(shm, "e.bin", 70'001);
  const std::vector<StoredTensor> tensors = {u8_tensor(f, 5, 40'000), u8_tensor(f, 40'005, 29'996)};
  SourceTensorCache cache(tensors, 1 << 20);
  const std::size_t both[] = {0, 1};
  auto pin = cache.pin(both);
  fs::remove_all(shm);
  ASSERT_TRUE(pin.ok()) << pin.status().message();
  expect_bytes(pin->views()[0], f, 5);
  expect_bytes(pin->views()[1], f, 40'005);
}

}  // namespace
}  // namespace trestle
