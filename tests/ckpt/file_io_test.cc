// The file I/O engine: FileWriter and FileReader in every mode (io_uring or pread/pwrite, O_DIRECT or buffered,
// registered or not, ext4 and tmpfs), compared byte for byte with the data written; and the fallbacks, forced by a
// seccomp filter and a small RLIMIT_MEMLOCK as a sandbox or an unprivileged user would impose them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/file_reader.h"
#include "ckpt/file_writer.h"
#include "ckpt/io_log.h"
#include "ckpt/io_options.h"
#include "ckpt/mapped_file.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// Small requests and the shallowest queue, so a few MiB already span many requests and reuse staging buffers.
IoOptions small_options() {
  IoOptions o;
  o.request_bytes = kMiB;
  o.queue_depth = 16;
  return o;
}

struct Mode {
  const char* name;
  bool use_uring;
  bool direct;
  bool register_buffers;
};

constexpr Mode kModes[] = {
    {"UringDirect", true, true, true},     {"UringDirectUnregistered", true, true, false},
    {"UringBuffered", true, false, true},  {"SyncDirect", false, true, false},
    {"SyncBuffered", false, false, false},
};

IoOptions options_for(const Mode& mode) {
  IoOptions o = small_options();
  o.use_uring = mode.use_uring;
  o.direct = mode.direct;
  o.register_buffers = mode.register_buffers;
  return o;
}

// A forced path must show in the mode; the default path depends on the kernel, so it is not pinned here.
void expect_mode_honours(const std::string& mode, const Mode& wanted, const char* sync_call) {
  if (!wanted.use_uring) {
    EXPECT_EQ(mode.rfind(sync_call, 0), 0u) << mode;
  }
  if (!wanted.direct) {
    EXPECT_NE(mode.find("buffered"), std::string::npos) << mode;
  }
  if (!wanted.register_buffers) {
    EXPECT_EQ(mode.find("registered"), std::string::npos) << mode;
  }
}

// Writes `sizes` payloads of random bytes; returns the expected file image (zeros between payloads).
std::vector<std::byte> write_payloads(const std::string& path, const IoOptions& options,
                                      const std::vector<std::size_t>& sizes, std::vector<std::uint64_t>* offsets) {
  auto writer = FileWriter::create(path, options);
  EXPECT_TRUE(writer.ok()) << writer.status().message();
  if (!writer.ok()) return {};
  std::vector<std::byte> image;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto data = random_bytes(sizes[i], 1000 + i);
    auto offset = (*writer)->append(data);
    EXPECT_TRUE(offset.ok()) << offset.status().message();
    if (!offset.ok()) return {};
    EXPECT_EQ(*offset % 4096, 0u);
    EXPECT_EQ(*offset, align_up(image.size(), 4096)) << "payload " << i;
    image.resize(*offset);
    image.insert(image.end(), data.begin(), data.end());
    EXPECT_EQ((*writer)->size(), image.size());
    if (offsets) offsets->push_back(*offset);
  }
  const Status finished = (*writer)->finish();
  EXPECT_TRUE(finished.ok()) << finished.message();
  return image;
}

void expect_same(const std::vector<std::byte>& got, const std::byte* want, std::size_t n, const std::string& what) {
  ASSERT_EQ(got.size(), n) << what;
  const auto mismatch = std::mismatch(got.begin(), got.end(), want);
  EXPECT_TRUE(mismatch.first == got.end())
      << what << ": first difference at byte " << (mismatch.first - got.begin()) << " of " << n;
}

// Random ranges anywhere in the file, each into a destination at a random (mostly unaligned) address.
void expect_random_ranges(FileReader& reader, const std::vector<std::byte>& image, int count, std::uint64_t max_len,
                          std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<ReadRequest> requests;
  std::vector<std::uint64_t> at_in_arena;
  std::uint64_t arena_bytes = 0;
  for (int i = 0; i < count; ++i) {
    const std::uint64_t offset = rng() % (image.size() + 1);
    const std::uint64_t length = rng() % (std::min<std::uint64_t>(max_len, image.size() - offset) + 1);
    arena_bytes += rng() % 4096;  // a random misalignment of the destination
    at_in_arena.push_back(arena_bytes);
    requests.push_back({offset, length, nullptr});
    arena_bytes += length;
  }
  std::vector<std::byte> arena(arena_bytes + 1);
  for (std::size_t i = 0; i < requests.size(); ++i) requests[i].destination = arena.data() + at_in_arena[i];
  const Status status = reader.read(requests);
  ASSERT_TRUE(status.ok()) << status.message();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    ASSERT_EQ(std::memcmp(r.destination, image.data() + r.offset, r.length), 0)
        << "range [" << r.offset << ", " << r.offset + r.length << ") differs";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Every writer mode x every reader mode x {ext4 under /tmp, tmpfs under /dev/shm}.

using RoundTripParam = std::tuple<int, int, bool>;  // writer mode, reader mode, tmpfs

class FileIoRoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(FileIoRoundTrip, OddSizesReadBackByteForByte) {
  const auto [writer_index, reader_index, on_tmpfs] = GetParam();
  const Mode& writer_mode = kModes[writer_index];
  const Mode& reader_mode = kModes[reader_index];
  if (on_tmpfs) {
    ASSERT_TRUE(fs::is_directory("/dev/shm")) << "no /dev/shm (tmpfs) on this machine";
  }
  TempDir dir(on_tmpfs ? fs::path("/dev/shm") : fs::temp_directory_path());
  const std::string path = dir / "payloads.bin";

  const std::vector<std::size_t> sizes = {0, 1, 4095, 4096, 4097, 3 * kMiB + 7, 5, 0, 2 * kMiB};
  std::vector<std::uint64_t> offsets;
  {
    auto writer = FileWriter::create(path, options_for(writer_mode));
    ASSERT_TRUE(writer.ok()) << writer.status().message();
    expect_mode_honours((*writer)->mode(), writer_mode, "pwrite");
  }
  const auto image = write_payloads(path, options_for(writer_mode), sizes, &offsets);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(fs::file_size(path), image.size());

  auto reader = FileReader::open(path, options_for(reader_mode));
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  expect_mode_honours((*reader)->mode(), reader_mode, "pread");
  ASSERT_EQ((*reader)->file_size(), image.size());

  // Each payload where append said it is, into a destination one byte off alignment.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<std::byte> buffer(sizes[i] + 1);
    const ReadRequest request{offsets[i], sizes[i], buffer.data() + 1};
    const Status status = (*reader)->read({&request, 1});
    ASSERT_TRUE(status.ok()) << status.message();
    buffer.erase(buffer.begin());
    expect_same(buffer, image.data() + offsets[i], sizes[i], "payload " + std::to_string(i));
  }
  // The whole file in one aligned request: payloads and the zeros between them.
  AlignedBuffer whole(image.size());
  const ReadRequest all{0, image.size(), whole.data()};
  const Status status = (*reader)->read({&all, 1});
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(std::memcmp(whole.data(), image.data(), image.size()), 0);

  expect_random_ranges(**reader, image, 300, 600 << 10, 7);
}

std::string round_trip_name(const ::testing::TestParamInfo<RoundTripParam>& info) {
  const auto [w, r, tmpfs] = info.param;
  return std::string("Write") + kModes[w].name + "_Read" + kModes[r].name + (tmpfs ? "_Tmpfs" : "_Disk");
}

INSTANTIATE_TEST_SUITE_P(AllModes, FileIoRoundTrip,
                         ::testing::Combine(::testing::Range(0, 5), ::testing::Range(0, 5), ::testing::Bool()),
                         round_trip_name);

// ---------------------------------------------------------------------------------------------------------------
// The writer.

class FileWriterModes : public ::testing::TestWithParam<int> {};

// 40 MiB through 16 staging buffers of 1 MiB: every buffer is reused, so append must wait for completions.
TEST_P(FileWriterModes, ReusesStagingBuffersWhenTheQueueIsFull) {
  const Mode& mode = kModes[GetParam()];
  TempDir dir(fs::temp_directory_path());
  const std::string path = dir / "big.bin";
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 40; ++i) sizes.push_back(kMiB + 13 * static_cast<std::size_t>(i));
  std::vector<std::uint64_t> offsets;
  const auto image = write_payloads(path, options_for(mode), sizes, &offsets);
  ASSERT_FALSE(HasFailure());
  auto reader = FileReader::open(path, small_options());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  std::vector<std::byte> back(image.size());
  const ReadRequest all{0, image.size(), back.data()};
  const Status status = (*reader)->read({&all, 1});
  ASSERT_TRUE(status.ok()) << status.message();
  expect_same(back, image.data(), image.size(), "40 MiB file");
}

std::string mode_name(const ::testing::TestParamInfo<int>& info) { return kModes[info.param].name; }

INSTANTIATE_TEST_SUITE_P(AllModes, FileWriterModes, ::testing::Range(0, 5), mode_name);

TEST(FileWriterTest, EmptyFileHasSizeZero) {
  TempDir dir(fs::temp_directory_path());
  const std::string path = dir / "empty.bin";
  auto writer = FileWriter::create(path, small_options());
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  EXPECT_EQ((*writer)->size(), 0u);
  const Status status = (*writer)->finish();
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(fs::file_size(path), 0u);
}

TEST(FileWriterTest, CreateInMissingDirectoryNamesThePath) {
  TempDir dir(fs::temp_directory_path());
  const std::string path = dir / "no/such/dir/rank_00000.bin";
  auto writer = FileWriter::create(path, small_options());
  ASSERT_FALSE(writer.ok());
  EXPECT_NE(writer.status().message().find(path), std::string::npos) << writer.status().message();
  EXPECT_NE(writer.status().message().find("No such file or directory"), std::string::npos);
}

// /dev/full fails every write with ENOSPC: the failure must reach the caller, naming the file and a byte range.
TEST(FileWriterTest, FailedWritesSurfaceWithFileAndRange) {
  ASSERT_TRUE(fs::exists("/dev/full")) << "no /dev/full on this machine";
  auto writer = FileWriter::create("/dev/full", small_options());
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  const auto data = random_bytes(3 * kMiB, 1);
  Status failure;
  for (int i = 0; i < 20 && failure.ok(); ++i) {
    auto offset = (*writer)->append(data);
    if (!offset.ok()) failure = offset.status();
  }
  const Status finished = (*writer)->finish();
  if (failure.ok()) failure = finished;
  ASSERT_FALSE(failure.ok()) << "60 MiB written to /dev/full without an error";
  EXPECT_FALSE(finished.ok());
  EXPECT_NE(failure.message().find("/dev/full"), std::string::npos) << failure.message();
  EXPECT_NE(failure.message().find("bytes ["), std::string::npos) << failure.message();
  EXPECT_NE(failure.message().find(std::strerror(ENOSPC)), std::string::npos) << failure.message();
}

TEST(FileWriterTest, DestroyedWithoutFinishLeavesTheFile) {
  TempDir dir(fs::temp_directory_path());
  const std::string path = dir / "abandoned.bin";
  {
    auto writer = FileWriter::create(path, small_options());
    ASSERT_TRUE(writer.ok()) << writer.status().message();
    ASSERT_TRUE((*writer)->append(random_bytes(5 * kMiB + 3, 2)).ok());
  }
  EXPECT_TRUE(fs::exists(path));
}

TEST(FileWriterTest, UseAfterFinishIsAnError) {
  TempDir dir(fs::temp_directory_path());
  const std::string path = dir / "done.bin";
  auto writer = FileWriter::create(path, small_options());
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  ASSERT_TRUE((*writer)->append(random_bytes(10, 3)).ok());
  ASSERT_TRUE((*writer)->finish().ok());
  const auto again = (*writer)->append(random_bytes(10, 3));
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(path), std::string::npos);
  EXPECT_TRUE(fails_with((*writer)->finish(), "finish() called twice"));
  EXPECT_EQ(fs::file_size(path), 10u);
}

// ---------------------------------------------------------------------------------------------------------------
// The reader.

class FileReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "data.bin";
    image_ = write_payloads(path_, small_options(), {9 * kMiB + 1234}, nullptr);
    ASSERT_FALSE(HasFailure());
  }
  TempDir dir_;
  std::string path_;
  std::vector<std::byte> image_;
};

TEST_F(FileReaderTest, ReadPastTheEndNamesPathRangeAndSize) {
  auto reader = FileReader::open(path_, small_options());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  std::vector<std::byte> buffer(100);
  const std::uint64_t size = image_.size();
  const ReadRequest requests[] = {{0, 10, buffer.data()}, {size - 10, 20, buffer.data() + 10}};
  const Status status = (*reader)->read(requests);
  ASSERT_FALSE(status.ok());
  const std::string& message = status.message();
  EXPECT_NE(message.find(path_), std::string::npos) << message;
  EXPECT_NE(message.find("[" + std::to_string(size - 10) + ", " + std::to_string(size + 10) + ")"), std::string::npos)
      << message;
  EXPECT_NE(message.find(std::to_string(size) + " bytes"), std::string::npos) << message;

  const ReadRequest far{std::uint64_t{1} << 62, std::uint64_t{1} << 62, buffer.data()};  // offset + length overflows
  EXPECT_TRUE(fails_with((*reader)->read({&far, 1}), "past the end of the file"));
  const ReadRequest at_end{size, 0, nullptr};  // empty, at the end: fine
  EXPECT_TRUE((*reader)->read({&at_end, 1}).ok());
}

TEST_F(FileReaderTest, OpenMissingFileNamesThePath) {
  const std::string missing = dir_ / "missing.bin";
  auto reader = FileReader::open(missing, small_options());
  ASSERT_FALSE(reader.ok());
  EXPECT_NE(reader.status().message().find(missing), std::string::npos) << reader.status().message();
}

// Thousands of tiny ranges (as a tensor-parallel slice of rows asks for): coalesced into windows, copied out exactly.
TEST_F(FileReaderTest, ManySmallRangesInAnyOrder) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    auto reader = FileReader::open(path_, options_for(mode));
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    expect_random_ranges(**reader, image_, 20000, 300, 11);
  }
}

// One large unaligned range crosses many windows through the bounce buffers; when the destination lines up with the
// file's blocks the middle goes straight in. Both must give the same bytes, and so must overlapping requests.
TEST_F(FileReaderTest, LargeRangesBouncedStraightAndOverlapping) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    auto reader = FileReader::open(path_, options_for(mode));
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    const std::uint64_t offset = 13;
    const std::uint64_t length = 9 * kMiB - 5;
    AlignedBuffer arena(length + 8192);
    for (const std::uint64_t shift : {std::uint64_t{3}, std::uint64_t{13}}) {  // 13: congruent with the offset
      std::memset(arena.data(), 0xee, arena.size());
      const ReadRequest requests[] = {{offset, length, arena.data() + shift}};
      const Status status = (*reader)->read(requests);
      ASSERT_TRUE(status.ok()) << status.message();
      ASSERT_EQ(std::memcmp(arena.data() + shift, image_.data() + offset, length), 0) << "shift " << shift;
      EXPECT_EQ(arena.data()[shift - 1], std::byte{0xee}) << "wrote before the destination";
      EXPECT_EQ(arena.data()[shift + length], std::byte{0xee}) << "wrote past the destination";
    }
    std::vector<std::byte> a(3 * kMiB), b(3 * kMiB), c(100);
    const ReadRequest overlapping[] = {
        {kMiB + 5, a.size(), a.data()}, {kMiB + 100, b.size(), b.data()}, {kMiB + 50, c.size(), c.data()}};
    const Status status = (*reader)->read(overlapping);
    ASSERT_TRUE(status.ok()) << status.message();
    for (const ReadRequest& r : overlapping) {
      EXPECT_EQ(std::memcmp(r.destination, image_.data() + r.offset, r.length), 0) << "overlap at " << r.offset;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The fallbacks, each in a child process so the restrictions stay there ("threadsafe" death tests re-execute the
// binary, so the child's log_once has said nothing yet).

int child_failure(const std::string& why) {
  std::fprintf(stderr, "%s\n", why.c_str());
  return 1;
}

// Writes and reads back 5 MiB + 3 with the default options; returns 0 when the bytes match and both modes are as
// expected (never registered), printing the reason otherwise.
int round_trip_in_child(bool expect_uring, bool expect_direct) {
  const std::string path = (fs::temp_directory_path() / ("trestle_fallback_" + std::to_string(::getpid()))).string();
  const auto data = random_bytes(5 * kMiB + 3, 5);
  auto writer = FileWriter::create(path, IoOptions{});
  if (!writer.ok()) return child_failure(writer.status().message());
  std::fprintf(stderr, "writer mode: %s\n", (*writer)->mode());
  const auto offset = (*writer)->append(data);
  if (!offset.ok()) return child_failure(offset.status().message());
  const Status finished = (*writer)->finish();
  if (!finished.ok()) return child_failure(finished.message());
  auto reader = FileReader::open(path, IoOptions{});
  if (!reader.ok()) return child_failure(reader.status().message());
  std::fprintf(stderr, "reader mode: %s\n", (*reader)->mode());
  std::vector<std::byte> back(data.size());
  const ReadRequest request{0, back.size(), back.data()};
  const Status status = (*reader)->read({&request, 1});
  fs::remove(path);
  if (!status.ok()) return child_failure(status.message());
  if (back != data) return child_failure("the bytes read back differ from those written");
  for (const std::string mode : {(*writer)->mode(), (*reader)->mode()}) {
    const bool uring = mode.rfind("io_uring", 0) == 0;
    const bool direct = mode.find("O_DIRECT") != std::string::npos;
    if (uring != expect_uring || direct != expect_direct || mode.find("registered") != std::string::npos) {
      return child_failure("unexpected mode " + mode);
    }
  }
  return 0;
}

// What a sandbox does: io_uring_setup fails with ENOSYS, and opening with O_DIRECT with EINVAL.
bool refuse_io_uring_and_o_direct() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_openat, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[2])),  // the flags' low word (little-endian)
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, O_DIRECT, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// What an unprivileged user has: no CAP_IPC_LOCK and RLIMIT_MEMLOCK of 8 MiB, too little to pin 128 MiB of staging.
bool limit_locked_memory() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2]{};
  if (::syscall(SYS_capget, &header, caps) != 0) return false;
  caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  if (::syscall(SYS_capset, &header, caps) != 0) return false;
  const rlimit limit{8 * kMiB, 8 * kMiB};
  return ::setrlimit(RLIMIT_MEMLOCK, &limit) == 0;
}

#if defined(__x86_64__) || defined(__aarch64__)
TEST(FileIoFallbackTest, PwriteAndBufferedWhenIoUringAndODirectAreRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!refuse_io_uring_and_o_direct()) std::_Exit(child_failure("cannot install the seccomp filter") + 1);
        std::_Exit(round_trip_in_child(/*expect_uring=*/false, /*expect_direct=*/false));
      },
      ::testing::ExitedWithCode(0), "refuses O_DIRECT.*io_uring is unavailable.*writer mode: pwrite \\(buffered\\)");
}
#endif

TEST(FileIoFallbackTest, UnregisteredBuffersWhenLockedMemoryIsShort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!limit_locked_memory()) std::_Exit(child_failure("cannot drop CAP_IPC_LOCK or set RLIMIT_MEMLOCK") + 1);
        std::_Exit(round_trip_in_child(/*expect_uring=*/true, /*expect_direct=*/true));
      },
      ::testing::ExitedWithCode(0), "cannot register 32 I/O buffers of 4.00 MiB.*writer mode: io_uring\\+O_DIRECT");
}

// ---------------------------------------------------------------------------------------------------------------
// The small parts.

TEST(IoOptionsTest, ClampedIntoRange) {
  IoOptions o;
  o.request_bytes = 1;
  o.queue_depth = 1;
  EXPECT_EQ(o.clamped().request_bytes, kMiB);
  EXPECT_EQ(o.clamped().queue_depth, 16u);
  o.request_bytes = 100 * kMiB;
  o.queue_depth = 1000;
  EXPECT_EQ(o.clamped().request_bytes, 8 * kMiB);
  EXPECT_EQ(o.clamped().queue_depth, 64u);
  o.request_bytes = 5 * kMiB + 100;
  o.queue_depth = 40;
  EXPECT_EQ(o.clamped().request_bytes, 5 * kMiB);
  EXPECT_EQ(o.clamped().queue_depth, 40u);
  EXPECT_EQ(IoOptions{}.clamped().request_bytes, 4 * kMiB);
}

TEST(AlignedBufferTest, PageAlignedZeroedAndMovable) {
  AlignedBuffer buffer(10000);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % 4096, 0u);
  EXPECT_EQ(buffer.size(), 10000u);
  for (std::byte b : buffer.span()) ASSERT_EQ(b, std::byte{0});
  std::byte* data = buffer.data();
  AlignedBuffer moved(std::move(buffer));
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(buffer.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is the contract
  EXPECT_EQ(buffer.size(), 0u);
  AlignedBuffer empty(0);
  EXPECT_EQ(empty.size(), 0u);
}

TEST(IoLogTest, SaysEachKeyOnce) {
  const std::string key = "file_io_test." + std::to_string(::getpid());
  ::testing::internal::CaptureStderr();
  EXPECT_TRUE(log_once(key, "first"));
  EXPECT_FALSE(log_once(key, "second"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "trestle: first\n");
}

// A file truncated while mapped (a dataset re-preprocessed under a running job): reading past its new end raised
// SIGBUS, and the process died with a bare "Bus error". It exits 1 naming the file instead.
TEST(MappedFileDeathTest, AFileThatShrankWhileMappedIsNamed) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("trestle_shrunk_" + std::to_string(::getpid()) + ".bin")).string();
  const std::size_t size = 4 * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const std::vector<char> bytes(size, 'x');
    ASSERT_EQ(std::fwrite(bytes.data(), 1, size, f), size);
    std::fclose(f);
  }
  EXPECT_EXIT(
      {
        auto mapped = MappedFile::open(path);
        if (!mapped.ok()) std::_Exit(3);
        if (::truncate(path.c_str(), 0) != 0) std::_Exit(4);
        volatile char last = static_cast<char>(mapped->bytes()[size - 1]);
        (void)last;
        std::_Exit(5);
      },
      ::testing::ExitedWithCode(1),
      "trestle_shrunk_.*\\.bin: the file shrank .* while it was read through a memory map");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace trestle
