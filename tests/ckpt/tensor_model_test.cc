// The tensor model: dtype table, shapes, byte sizes, tensor views, checksums and atomic file replacement.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/checksum.h"
#include "ckpt/dtype.h"
#include "ckpt/shape.h"
#include "ckpt/tensor_view.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;

// The table written out independently of ckpt/dtype.cc, so a wrong entry there fails here.
struct DTypeRow {
  DType dtype;
  std::size_t size;
  bool floating;
  const char* name;
  const char* safetensors;
  const char* torch;
};

constexpr DTypeRow kExpected[] = {
    {DType::kBool, 1, false, "bool", "BOOL", "torch.bool"},
    {DType::kU8, 1, false, "u8", "U8", "torch.uint8"},
    {DType::kI8, 1, false, "i8", "I8", "torch.int8"},
    {DType::kI16, 2, false, "i16", "I16", "torch.int16"},
    {DType::kU16, 2, false, "u16", "U16", "torch.uint16"},
    {DType::kI32, 4, false, "i32", "I32", "torch.int32"},
    {DType::kU32, 4, false, "u32", "U32", "torch.uint32"},
    {DType::kI64, 8, false, "i64", "I64", "torch.int64"},
    {DType::kU64, 8, false, "u64", "U64", "torch.uint64"},
    {DType::kF16, 2, true, "f16", "F16", "torch.float16"},
    {DType::kBF16, 2, true, "bf16", "BF16", "torch.bfloat16"},
    {DType::kF32, 4, true, "f32", "F32", "torch.float32"},
    {DType::kF64, 8, true, "f64", "F64", "torch.float64"},
    {DType::kF8E4M3, 1, true, "f8_e4m3", "F8_E4M3", "torch.float8_e4m3fn"},
    {DType::kF8E5M2, 1, true, "f8_e5m2", "F8_E5M2", "torch.float8_e5m2"},
};

TEST(DTypeTest, TableMatchesTheFormats) {
  for (const auto& row : kExpected) {
    SCOPED_TRACE(row.name);
    EXPECT_EQ(dtype_size(row.dtype), row.size);
    EXPECT_EQ(is_floating(row.dtype), row.floating);
    EXPECT_EQ(dtype_name(row.dtype), row.name);
    EXPECT_EQ(safetensors_name(row.dtype), row.safetensors);
    EXPECT_EQ(torch_name(row.dtype), row.torch);
  }
}

TEST(DTypeTest, AllDTypesListsEachTypeOnce) {
  std::set<DType> seen(std::begin(kAllDTypes), std::end(kAllDTypes));
  EXPECT_EQ(seen.size(), std::size(kAllDTypes));
  EXPECT_EQ(std::size(kAllDTypes), std::size(kExpected));
  for (const auto& row : kExpected) EXPECT_TRUE(seen.count(row.dtype)) << row.name;
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    const std::string torch(torch_name(d));
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
    EXPECT_EQ(parse_dtype(safetensors_name(d)), d);
    EXPECT_EQ(parse_dtype(torch), d);
    EXPECT_EQ(parse_dtype(torch.substr(std::string("torch.").size())), d);
    EXPECT_EQ(dtype_from_safetensors(safetensors_name(d)), d);
  }
}

TEST(DTypeTest, NamesAreDistinct) {
  std::set<std::string_view> names, safetensors, torch;
  for (DType d : kAllDTypes) {
    EXPECT_TRUE(names.insert(dtype_name(d)).second) << dtype_name(d);
    EXPECT_TRUE(safetensors.insert(safetensors_name(d)).second) << safetensors_name(d);
    EXPECT_TRUE(torch.insert(torch_name(d)).second) << torch_name(d);
  }
}

TEST(DTypeTest, TorchAliasesAreAccepted) {
  EXPECT_EQ(parse_dtype("float"), DType::kF32);
  EXPECT_EQ(parse_dtype("torch.float"), DType::kF32);
  EXPECT_EQ(parse_dtype("half"), DType::kF16);
  EXPECT_EQ(parse_dtype("double"), DType::kF64);
  EXPECT_EQ(parse_dtype("long"), DType::kI64);
  EXPECT_EQ(parse_dtype("int"), DType::kI32);
  EXPECT_EQ(parse_dtype("short"), DType::kI16);
  EXPECT_EQ(parse_dtype("fp16"), DType::kF16);
  EXPECT_EQ(parse_dtype("fp32"), DType::kF32);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
}

TEST(DTypeTest, UnknownNamesAreRejected) {
  for (const char* name : {"", "torch.", "f128", "float128", "BF 16", "complex64", "torch.complex64", "F8_E8M0", "fp8"})
    EXPECT_EQ(parse_dtype(name), std::nullopt) << "'" << name << "'";
  // Safetensors names are case-sensitive and do not include our or torch's spellings.
  for (const char* name : {"bf16", "bfloat16", "torch.bfloat16", "f32", "float32", "", "F128"})
    EXPECT_EQ(dtype_from_safetensors(name), std::nullopt) << "'" << name << "'";
}

TEST(ShapeTest, Numel) {
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({0, 3}), 0);
  EXPECT_EQ(numel({7}), 7);
  EXPECT_EQ(numel({2, 3, 4}), 24);
  EXPECT_EQ(numel({4096, 11008}), 4096LL * 11008);
}

TEST(ShapeTest, CheckedNbytes) {
  EXPECT_EQ(checked_nbytes({}, 4), 4u);
  EXPECT_EQ(checked_nbytes({0, 3}, 2), 0u);
  EXPECT_EQ(checked_nbytes({2, 3}, 8), 48u);
  EXPECT_EQ(checked_nbytes({-1, 3}, 4), std::nullopt);
  EXPECT_EQ(checked_nbytes({3, -1}, 4), std::nullopt);
  EXPECT_EQ(checked_nbytes({1LL << 32, 1LL << 32}, 1), std::nullopt);
  EXPECT_EQ(checked_nbytes({1LL << 31, 1LL << 31}, 2), std::nullopt);  // 2^63 does not fit the signed limit
  EXPECT_EQ(checked_nbytes({1LL << 31, 1LL << 31}, 1), 1ULL << 62);
  const auto max = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(checked_nbytes({max}, 1), static_cast<std::uint64_t>(max));
  EXPECT_EQ(checked_nbytes({max}, 2), std::nullopt);
  EXPECT_EQ(checked_nbytes({max, max, 0}, 1), std::nullopt);  // overflows before the zero
  EXPECT_EQ(checked_nbytes({0, max, max}, 8), 0u);
}

TEST(ShapeTest, ToString) {
  EXPECT_EQ(to_string(Shape{}), "[]");
  EXPECT_EQ(to_string(Shape{5}), "[5]");
  EXPECT_EQ(to_string(Shape{4096, 11008}), "[4096, 11008]");
  EXPECT_EQ(to_string(Shape{0, 3}), "[0, 3]");
}

TEST(ByteSizeTest, ParsesDecimalAndBinaryUnits) {
  struct Case {
    const char* text;
    std::uint64_t bytes;
  };
  const Case cases[] = {
      {"5GB", 5'000'000'000ULL},
      {"500MiB", 500ULL << 20},
      {"1024", 1024},
      {"0", 0},
      {"1B", 1},
      {"2KB", 2000},
      {"2KiB", 2048},
      {"3MB", 3'000'000},
      {"1GiB", 1ULL << 30},
      {"2TB", 2'000'000'000'000},
      {"1TiB", 1ULL << 40},
      {"5gb", 5'000'000'000ULL},
      {"5 GB", 5'000'000'000ULL},
      {"1.5GB", 1'500'000'000ULL},
      {"0.5KiB", 512},
      {"200KB", 200'000},
      {"10000000000", 10'000'000'000ULL},
  };
  for (const auto& c : cases) {
    auto parsed = parse_byte_size(c.text);
    ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.status().message();
    EXPECT_EQ(*parsed, c.bytes) << c.text;
  }
}

TEST(ByteSizeTest, RejectsNonSizes) {
  for (const char* text : {"abc", "5XB", "", "GB", "-5", "-5GB", "1.2.3GB", ".", "5 G B x", "5GBs", "0x10", "1e3",
                           "99999999999999999999TB", "18446744073709551616", "1e300"}) {
    auto parsed = parse_byte_size(text);
    EXPECT_FALSE(parsed.ok()) << "'" << text << "' parsed as " << (parsed.ok() ? *parsed : 0);
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find(std::string("'") + text + "'"), std::string::npos)
          << parsed.status().message();
    }
  }
}

TEST(ByteSizeTest, ErrorsSayWhatIsWrong) {
  EXPECT_NE(parse_byte_size("abc").status().message().find("not a size"), std::string::npos);
  EXPECT_NE(parse_byte_size("5XB").status().message().find("unknown unit"), std::string::npos);
  EXPECT_NE(parse_byte_size("9300000TB").status().message().find("too large"), std::string::npos);
}

TEST(ByteSizeTest, LargestSizesDoNotWrap) {
  auto eight_eb = parse_byte_size("8EB");  // no exabyte unit
  EXPECT_TRUE(fails_with(eight_eb, "'8EB' has an unknown unit"));
  auto big = parse_byte_size("9000000TB");  // 9e18 < 2^63
  ASSERT_TRUE(big.ok()) << big.status().message();
  EXPECT_EQ(*big, 9'000'000'000'000'000'000ULL);
  EXPECT_TRUE(fails_with(parse_byte_size("9300000TB"), "'9300000TB' is too large"));  // 9.3e18 > 2^63
}

TEST(ByteSizeTest, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3ULL << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(5ULL << 40), "5.00 TiB");
}

TEST(TensorViewTest, SizesAndBytes) {
  std::vector<std::byte> buffer(2 * 3 * 2);
  TensorView view{DType::kBF16, {2, 3}, buffer.data()};
  EXPECT_EQ(view.numel(), 6);
  EXPECT_EQ(view.nbytes(), 12u);
  EXPECT_EQ(view.bytes().data(), buffer.data());
  EXPECT_EQ(view.bytes().size(), 12u);
  view.bytes()[5] = std::byte{0x7f};
  ConstTensorView read_only = view;
  EXPECT_EQ(read_only.data, buffer.data());
  EXPECT_EQ(read_only.shape, view.shape);
  EXPECT_EQ(read_only.dtype, DType::kBF16);
  EXPECT_EQ(read_only.bytes()[5], std::byte{0x7f});

  const TensorView scalar{DType::kF64, {}, buffer.data()};
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.nbytes(), 8u);
  const TensorView empty{DType::kF32, {0, 3}, nullptr};
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.nbytes(), 0u);
  EXPECT_TRUE(empty.bytes().empty());
}

std::span<const std::byte> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

TEST(ChecksumTest, KnownXxh3Values) {
  // Reference values from the Python xxhash package (xxh3_64_hexdigest).
  EXPECT_EQ(to_hex(xxh3_64(as_bytes(""))), "2d06800538d394c2");
  EXPECT_EQ(to_hex(xxh3_64(as_bytes("abc"))), "78af5f94892f3950");
  std::string pattern;
  for (int r = 0; r < 5; ++r)
    for (int i = 0; i < 256; ++i) pattern += static_cast<char>(i);
  EXPECT_EQ(to_hex(xxh3_64(as_bytes(pattern))), "4844b009e164352e");
}

TEST(ChecksumTest, HexIsSixteenLowerCaseDigits) {
  EXPECT_EQ(to_hex(0), "0000000000000000");
  EXPECT_EQ(to_hex(0xABCULL), "0000000000000abc");
  EXPECT_EQ(to_hex(0xFFFFFFFFFFFFFFFFULL), "ffffffffffffffff");
  EXPECT_EQ(to_hex(0x0123456789ABCDEFULL), "0123456789abcdef");
}

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "trestle_atomic_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  fs::path dir_;
};

TEST_F(AtomicFileTest, TemporarySiblingIsHiddenBesideTheTarget) {
  const std::string temp = temporary_sibling((dir_ / "manifest.json").string());
  EXPECT_EQ(fs::path(temp).parent_path(), dir_);
  EXPECT_EQ(fs::path(temp).filename().string(), ".manifest.json.tmp." + std::to_string(::getpid()));
}

TEST_F(AtomicFileTest, WritesAndReplacesLeavingNoTemporary) {
  const auto path = (dir_ / "latest.txt").string();
  ASSERT_TRUE(write_file_atomically(path, "1200").ok());
  EXPECT_EQ(read(path), "1200");
  ASSERT_TRUE(write_file_atomically(path, std::string("1400\0x", 6)).ok());
  EXPECT_EQ(read(path), std::string("1400\0x", 6));
  ASSERT_TRUE(write_file_atomically(path, "").ok());
  EXPECT_EQ(read(path), "");
  EXPECT_EQ(entries(), std::vector<std::string>{"latest.txt"});
}

TEST_F(AtomicFileTest, FailureNamesThePath) {
  const auto path = (dir_ / "missing" / "file.json").string();
  const Status status = write_file_atomically(path, "x");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find((dir_ / "missing").string()), std::string::npos) << status.message();
  EXPECT_TRUE(entries().empty());
  EXPECT_TRUE(fails_with(fsync_directory((dir_ / "missing").string()), "missing: cannot open directory"));
  EXPECT_TRUE(fsync_directory(dir_.string()).ok());
}

TEST_F(AtomicFileTest, CommitRenameMovesTheTemporaryIntoPlace) {
  const auto path = (dir_ / "data.bin").string();
  const auto temp = temporary_sibling(path);
  std::ofstream(temp) << "new";
  std::ofstream(path) << "old";
  ASSERT_TRUE(commit_rename(temp, path).ok());
  EXPECT_EQ(read(path), "new");
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_TRUE(
      fails_with(commit_rename(temp, path), "data.bin: cannot rename into place"));  // the temporary is gone now
  EXPECT_EQ(read(path), "new");
}

TEST_F(AtomicFileTest, CommitRenamesReplacesFilesTogetherOrNotAtAll) {
  const auto bin = (dir_ / "ds.bin").string(), idx = (dir_ / "ds.idx").string();
  std::ofstream(bin) << "old bin";
  std::ofstream(idx) << "old idx";
  std::ofstream(set_aside_name(idx)) << "left by an interrupted commit";
  std::ofstream(temporary_sibling(bin)) << "new bin";
  std::ofstream(temporary_sibling(idx)) << "new idx";
  ASSERT_TRUE(commit_renames({{temporary_sibling(bin), bin}, {temporary_sibling(idx), idx}}).ok());
  EXPECT_EQ(read(bin), "new bin");
  EXPECT_EQ(read(idx), "new idx");
  EXPECT_EQ(entries(), (std::vector<std::string>{"ds.bin", "ds.idx"}));
  // The second file fails to go into place (its temporary is missing): the first is put back, nothing is left over.
  std::ofstream(temporary_sibling(bin)) << "newer bin";
  const Status failed = commit_renames({{temporary_sibling(bin), bin}, {temporary_sibling(idx), idx}});
  EXPECT_TRUE(fails_with(failed, "ds.idx: cannot rename into place"));
  EXPECT_EQ(read(bin), "new bin");
  EXPECT_EQ(read(idx), "new idx");
  EXPECT_EQ(entries(), (std::vector<std::string>{"ds.bin", "ds.idx"}));
  // A file that is new to the directory is removed again.
  const auto extra = (dir_ / "ds_title.bin").string();
  std::ofstream(temporary_sibling(extra)) << "title";
  EXPECT_FALSE(commit_renames({{temporary_sibling(extra), extra}, {temporary_sibling(idx), idx}}).ok());
  EXPECT_EQ(entries(), (std::vector<std::string>{"ds.bin", "ds.idx"}));
}

TEST(StatusTest, ContextAndResults) {
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_TRUE(OkStatus().with_context("file").ok());
  const Status error = Status::Error("bad").with_context("a.safetensors");
  EXPECT_FALSE(error.ok());
  EXPECT_EQ(error.message(), "a.safetensors: bad");
  Result<int> value = 3;
  EXPECT_TRUE(value.ok());
  EXPECT_EQ(*value, 3);
  Result<int> failed = Status::Error("no");
  EXPECT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().message(), "no");
  Result<int> from_ok = OkStatus();  // a programming error, reported instead of pretending to hold a value
  EXPECT_TRUE(fails_with(from_ok, "internal: Result built from an ok Status"));
}

}  // namespace
}  // namespace trestle
