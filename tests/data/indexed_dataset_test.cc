// The indexed dataset reader and writer: a round trip, and hostile .idx files (truncated, huge counts, offsets past
// the end of .bin, bad document indices) refused with an error naming the file instead of a wild read.
#include "train/data/indexed_dataset.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <span>

#include "tests/support/status_matchers.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

class IndexedDatasetTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("trestle_data_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
    prefix_ = (dir_ / "ds").string();
    auto writer = IndexedDatasetWriter::create(prefix_, TokenDType::kUint16);
    ASSERT_TRUE(writer.ok());
    const std::vector<std::int64_t> a = {1, 2, 3, 65535}, b = {7, 8, 9, 10, 11};
    const std::vector<std::int32_t> a_lengths = {4}, b_lengths = {2, 3};
    ASSERT_TRUE(writer->add_document(a, a_lengths).ok());
    ASSERT_TRUE(writer->add_document(b, b_lengths).ok());
    ASSERT_TRUE(writer->finalize().ok());
    idx_ = read(prefix_ + ".idx");
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  // Writes a damaged copy of the index as PREFIX2.idx (with the same .bin) and returns the open error.
  std::string open_damaged(const std::string& idx) {
    const std::string damaged = (dir_ / "bad").string();
    fs::copy_file(prefix_ + ".bin", damaged + ".bin", fs::copy_options::overwrite_existing);
    std::ofstream(damaged + ".idx", std::ios::binary | std::ios::trunc) << idx;
    auto opened = IndexedDataset::open(damaged);
    EXPECT_FALSE(opened.ok());
    const std::string message = opened.ok() ? "" : opened.status().message();
    EXPECT_NE(message.find("bad.idx"), std::string::npos) << message;
    return message;
  }
  // The index written for prefix, kept in the fixture so views of it stay valid.
  const std::string& idx_for(const std::string& prefix) { return other_idx_ = read(prefix + ".idx"); }
  template <class T>
  std::string patched(std::size_t offset, T value) {
    std::string copy = idx_;
    std::memcpy(copy.data() + offset, &value, sizeof(T));
    return copy;
  }

  fs::path dir_;
  std::string prefix_;
  std::string idx_;
  std::string other_idx_;
};

TEST_F(IndexedDatasetTest, RoundTrip) {
  auto ds = IndexedDataset::open(prefix_);
  ASSERT_TRUE(ds.ok()) << ds.status().message();
  EXPECT_EQ(ds->dtype(), TokenDType::kUint16);
  EXPECT_EQ(ds->sequence_count(), 3u);
  EXPECT_EQ(ds->document_count(), 2u);
  EXPECT_EQ(ds->token_count(), 9u);
  EXPECT_EQ(ds->sequence_pointer(2), 12);  // (4 + 2) uint16 tokens before it
  EXPECT_EQ(ds->document_index(1), 1);
  std::vector<std::int64_t> tokens;
  ASSERT_TRUE(ds->read(0, 2, std::nullopt, tokens).ok());
  ASSERT_TRUE(ds->read(2, 1, 2, tokens).ok());
  EXPECT_EQ(tokens, (std::vector<std::int64_t>{3, 65535, 10, 11}));
  EXPECT_TRUE(
      fails_with(ds->read(2, 1, 3, tokens), "ds: tokens [1, 4) of sequence 2 which has 3"));  // past the sequence's end
  EXPECT_TRUE(fails_with(ds->read(3, 0, 0, tokens), "ds: sequence 3 of 3"));
  EXPECT_EQ(idx_.size(), 34u + 3 * 12 + 3 * 8);
}

TEST_F(IndexedDatasetTest, WriterRefusesIdsOutsideTheDtype) {
  auto writer = IndexedDatasetWriter::create((dir_ / "w").string(), TokenDType::kUint16);
  ASSERT_TRUE(writer.ok());
  const std::vector<std::int64_t> tokens = {65536};
  EXPECT_TRUE(fails_with(writer->add_document(tokens), "w.bin: token id 65536 does not fit uint16"));
  const std::vector<std::int32_t> wrong = {2};
  EXPECT_TRUE(fails_with(writer->add_document(std::vector<std::int64_t>{1}, wrong),
                         "document of 1 tokens given sequence lengths summing to 2"));
}

TEST_F(IndexedDatasetTest, TruncatedIndex) {
  EXPECT_NE(open_damaged(idx_.substr(0, 20)).find("shorter than"), std::string::npos);
  EXPECT_NE(open_damaged(idx_.substr(0, idx_.size() - 4)).find("bytes"), std::string::npos);
}

TEST_F(IndexedDatasetTest, BadMagicVersionDtype) {
  EXPECT_NE(open_damaged("XXIDIDX" + idx_.substr(7)).find("MMIDIDX"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::uint64_t>(9, 2)).find("version 2"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::uint8_t>(17, 42)).find("dtype code 42"), std::string::npos);
}

TEST_F(IndexedDatasetTest, HugeCounts) {
  EXPECT_NE(open_damaged(patched<std::uint64_t>(18, ~0ULL)).find("more than its"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::uint64_t>(26, 1ULL << 61)).find("more than its"), std::string::npos);
}

TEST_F(IndexedDatasetTest, PointersAndLengthsPastTheBin) {
  const std::size_t pointers = 34 + 3 * 4;
  EXPECT_NE(open_damaged(patched<std::int64_t>(pointers + 8 * 2, 1 << 20)).find("starts at byte 1048576"),
            std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int64_t>(pointers + 8, -8)).find("lies outside"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int32_t>(34, 1 << 30)).find("lies outside"), std::string::npos);
}

// Megatron writes sequences back to back; pointers that overlap (or leave gaps, or split a token) with every sequence
// still inside the .bin were read as given.
TEST_F(IndexedDatasetTest, PointersThatDoNotFollowTheSizes) {
  const std::size_t pointers = 34 + 3 * 4;  // sequences of 4, 2 and 3 uint16 tokens: at bytes 0, 8 and 12
  EXPECT_NE(open_damaged(patched<std::int64_t>(pointers + 8, 6))
                .find("sequence 1 starts at byte 6 of " + prefix_.substr(0, prefix_.size() - 2) +
                      "bad.bin, but the sequences before it end at byte 8"),
            std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int64_t>(pointers + 16, 13)).find("sequence 2 starts at byte 13"),
            std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int64_t>(pointers, 2)).find("sequence 0 starts at byte 2"), std::string::npos);
}

TEST_F(IndexedDatasetTest, BadDocumentIndices) {
  const std::size_t documents = 34 + 3 * 12;
  EXPECT_NE(open_damaged(patched<std::int64_t>(documents, 1)).find("document index 0"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int64_t>(documents + 8, 9)).find("document index 1"), std::string::npos);
  EXPECT_NE(open_damaged(patched<std::int64_t>(documents + 16, 2)).find("last document index"), std::string::npos);
}

TEST_F(IndexedDatasetTest, FromBytesChecksAsOpenDoes) {
  const std::string bin = read(prefix_ + ".bin");
  const auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  auto ds = IndexedDataset::from_bytes(bytes(idx_), bytes(bin), "mem");
  ASSERT_TRUE(ds.ok()) << ds.status().message();
  std::vector<std::int64_t> tokens;
  ASSERT_TRUE(ds->read(1, 0, std::nullopt, tokens).ok());
  EXPECT_EQ(tokens, (std::vector<std::int64_t>{7, 8}));
  auto short_bin = IndexedDataset::from_bytes(bytes(idx_), bytes(bin.substr(0, bin.size() - 2)), "mem");
  ASSERT_FALSE(short_bin.ok());
  EXPECT_NE(short_bin.status().message().find("mem.bin"), std::string::npos) << short_bin.status().message();
}

// Found by fuzz/megatron_idx: a float64 or float32 token beyond int64 (or NaN) was converted to an id regardless,
// which is undefined behaviour; reading it is an error now.
TEST_F(IndexedDatasetTest, FloatTokensThatHoldNoId) {
  for (const TokenDType dtype : {TokenDType::kFloat64, TokenDType::kFloat32}) {
    const std::string prefix = (dir_ / "float").string();
    auto writer = IndexedDatasetWriter::create(prefix, dtype);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->add_document(std::vector<std::int64_t>{5, -3, 7}).ok());
    ASSERT_TRUE(writer->finalize().ok());
    std::string bin = read(prefix + ".bin");
    auto ds =
        IndexedDataset::from_bytes(std::as_bytes(std::span(idx_for(prefix))), std::as_bytes(std::span(bin)), prefix);
    ASSERT_TRUE(ds.ok()) << ds.status().message();
    std::vector<std::int64_t> tokens;
    ASSERT_TRUE(ds->read(0, 0, std::nullopt, tokens).ok());
    EXPECT_EQ(tokens, (std::vector<std::int64_t>{5, -3, 7}));
    // (a fraction was truncated to an id, as numpy's astype does: 1.5 read as token 1)
    for (const double bad : {1e30, -1e30, std::numeric_limits<double>::quiet_NaN(), 0x1p63, 1.5, -0.25}) {
      if (dtype == TokenDType::kFloat64) {
        std::memcpy(bin.data() + 8, &bad, 8);
      } else {
        const auto narrow = static_cast<float>(bad);
        std::memcpy(bin.data() + 4, &narrow, 4);
      }
      tokens.clear();
      const Status read_bad = ds->read(0, 0, std::nullopt, tokens);
      ASSERT_FALSE(read_bad.ok()) << bad;
      EXPECT_NE(read_bad.message().find("token 1 of sequence 0"), std::string::npos) << read_bad.message();
      EXPECT_TRUE(tokens.empty());
    }
  }
}

// An index whose sequences are all empty has a 0-byte .bin, mapped as no memory at all: reading stays inside it.
TEST_F(IndexedDatasetTest, EmptyBin) {
  const std::string prefix = (dir_ / "empty").string();
  auto writer = IndexedDatasetWriter::create(prefix, TokenDType::kInt32);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->add_document(std::vector<std::int64_t>{}).ok());
  ASSERT_TRUE(writer->finalize().ok());
  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status().message();
  std::vector<std::int64_t> tokens;
  EXPECT_TRUE(ds->read(0, 0, std::nullopt, tokens).ok());
  EXPECT_TRUE(tokens.empty());
}

// The writer works on temporary siblings renamed into place when finalized: a failed (unfinished) write leaves an
// existing dataset as it was and creates nothing; a FIFO, directory or link where an output goes is refused.
TEST_F(IndexedDatasetTest, AnUnfinishedWriterLeavesTheDatasetAsItWas) {
  const std::string bin = read(prefix_ + ".bin");
  {
    auto writer = IndexedDatasetWriter::create(prefix_, TokenDType::kUint16);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->add_document(std::vector<std::int64_t>{1, 2}).ok());
  }
  EXPECT_EQ(read(prefix_ + ".bin"), bin);
  EXPECT_EQ(read(prefix_ + ".idx"), idx_);
  {
    auto writer = IndexedDatasetWriter::create((dir_ / "fresh").string(), TokenDType::kUint16);
    ASSERT_TRUE(writer.ok());
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ds.bin", "ds.idx"}));
}

TEST_F(IndexedDatasetTest, AStagedPairIsCommittedTogetherAndAnInterruptedCommitIsNamed) {
  const std::string bin = read(prefix_ + ".bin");
  auto writer = IndexedDatasetWriter::create(prefix_, TokenDType::kUint16);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->add_document(std::vector<std::int64_t>{7, 8, 9}).ok());
  auto staged = writer->stage();
  ASSERT_TRUE(staged.ok()) << staged.status().message();
  ASSERT_EQ(staged->size(), 2u);
  EXPECT_EQ(read(prefix_ + ".bin"), bin) << "staging replaces nothing";
  // A commit killed after setting the old pair aside and moving the new .bin in: no .idx, so no mixed pair is read.
  ASSERT_EQ(std::rename((prefix_ + ".idx").c_str(), set_aside_name(prefix_ + ".idx").c_str()), 0);
  ASSERT_EQ(std::rename((prefix_ + ".bin").c_str(), set_aside_name(prefix_ + ".bin").c_str()), 0);
  ASSERT_EQ(std::rename((*staged)[0].temp.c_str(), (*staged)[0].path.c_str()), 0);
  EXPECT_TRUE(
      fails_with(IndexedDataset::open(prefix_), "an interrupted `trestle preprocess` left the previous dataset"));
  // Committing the rest completes the new pair and removes the old one.
  ASSERT_TRUE(commit_renames({(*staged)[1]}).ok());
  auto opened = IndexedDataset::open(prefix_);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  EXPECT_EQ(opened->sequence_count(), 1u);
  EXPECT_FALSE(fs::exists(set_aside_name(prefix_ + ".idx")));
}

TEST_F(IndexedDatasetTest, WriterRefusesOutputsThatAreNoRegularFiles) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo((fifo + ".bin").c_str(), 0644), 0);
  EXPECT_TRUE(fails_with(IndexedDatasetWriter::create(fifo, TokenDType::kUint16),
                         "fifo.bin: not a regular file (a FIFO); refusing to replace it"));
  const std::string linked = (dir_ / "linked").string();
  fs::create_symlink(prefix_ + ".idx", linked + ".idx");
  EXPECT_TRUE(fails_with(IndexedDatasetWriter::create(linked, TokenDType::kUint16),
                         "linked.idx: a symbolic link; refusing to replace it"));
  EXPECT_EQ(read(prefix_ + ".idx"), idx_);
}

TEST(IndexedDatasetNames, PrefixFromPaths) {
  EXPECT_EQ(dataset_prefix("a/b_text_document.idx"), "a/b_text_document");
  EXPECT_EQ(dataset_prefix("a/b.bin"), "a/b");
  EXPECT_EQ(dataset_prefix("a/b"), "a/b");
  EXPECT_EQ(optimal_token_dtype(50257), TokenDType::kUint16);
  EXPECT_EQ(optimal_token_dtype(65500), TokenDType::kInt32);
}

}  // namespace
}  // namespace trestle::data
