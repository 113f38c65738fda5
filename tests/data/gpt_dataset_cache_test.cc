// The GPT dataset's index cache against damaged, stale and hostile files: check_gpt_indices accepts whatever the
// builder builds and refuses damaged indices naming the entry; GptDataset refuses a FIFO or symbolic link where a
// cache file should be (without waiting on or writing through it), a cache left by another dataset at the same
// prefix, and in-range but wrong values, naming the file. (megatron-core's own caches: test_data_megatron.py.)
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "train/data/gpt_dataset.h"
#include "train/data/gpt_indices.h"
#include "train/data/npy.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

std::vector<std::int32_t> iota_documents(std::int32_t begin, std::int32_t end) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(end - begin));
  std::iota(out.begin(), out.end(), begin);
  return out;
}

TEST(CheckGptIndices, AcceptsWhatTheBuilderBuilds) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::int32_t> lengths(1 + random() % 40);
    for (auto& length : lengths) length = static_cast<std::int32_t>(random() % 4 == 0 ? random() % 2 : random() % 30);
    const auto begin = static_cast<std::int32_t>(random() % lengths.size());
    const auto end = begin + 1 + static_cast<std::int32_t>(random() % (lengths.size() - begin));
    const auto documents = iota_documents(begin, end);
    GptIndexOptions o;
    o.sequence_length = 2 + static_cast<std::int32_t>(random() % 9);
    o.random_seed = random();
    o.add_extra_token_to_sequence = random() % 2 == 0;
    o.drop_last_partial_sequence = random() % 2 == 0;
    std::optional<std::int64_t> samples;
    if (random() % 3 != 0) samples = static_cast<std::int64_t>(random() % 200);
    auto x = build_gpt_indices(lengths, documents, samples, o);
    if (!x.ok()) continue;  // too few tokens
    const Status checked = check_gpt_indices(*x, lengths, documents, samples, o);
    EXPECT_TRUE(checked.ok()) << "trial " << trial << ": " << checked.message();
  }
}

class CheckDamagedIndices : public ::testing::Test {
 protected:
  void SetUp() override {
    o_.sequence_length = 4;
    auto x = build_gpt_indices(lengths_, documents_, 20, o_);
    ASSERT_TRUE(x.ok());
    x_ = *x;
    ASSERT_TRUE(check_gpt_indices(x_, lengths_, documents_, 20, o_).ok());
  }
  Status check() const { return check_gpt_indices(x_, lengths_, documents_, 20, o_); }

  const std::vector<std::int32_t> lengths_ = {5, 3, 8, 9, 2, 7, 6};
  const std::vector<std::int32_t> documents_ = iota_documents(1, 6);  // 29 tokens an epoch: 3 epochs for 20 samples
  GptIndexOptions o_;
  GptIndices x_;
};

TEST_F(CheckDamagedIndices, DocumentIndex) {
  std::fill(x_.document_index.begin(), x_.document_index.end(), 1);
  EXPECT_TRUE(fails_with(
      check(),
      "document_index: entry 3 is sequence 1 again: expected each of the split's documents once in each of 3 epochs"));
  x_.document_index.back() = 6;
  x_.document_index[0] = 6;
  EXPECT_TRUE(fails_with(check(), "document_index: entry 0 is sequence 6, not one of the split's documents"));
  x_.document_index.pop_back();
  EXPECT_TRUE(fails_with(check(), "document_index: 14 entries, expected 15"));
}

TEST_F(CheckDamagedIndices, SampleIndexAllZeros) {
  std::fill(x_.sample_index.begin(), x_.sample_index.end(), 0);
  EXPECT_TRUE(fails_with(check(), "sample_index: sample 0 (entries 0 to 1) spans 0 tokens"));
}

TEST_F(CheckDamagedIndices, ZeroLengthSample) {
  x_.sample_index[2 * 5] = x_.sample_index[2 * 4];
  x_.sample_index[2 * 5 + 1] = x_.sample_index[2 * 4 + 1];
  EXPECT_TRUE(fails_with(check(),
                         "sample_index: sample 4 (entries 4 to 5) spans 0 tokens of the document index, "
                         "expected the sequence length 4"));
}

TEST_F(CheckDamagedIndices, SampleIndexBackwardsOffsetsAndCount) {
  GptIndices saved = x_;
  x_.sample_index[2 * 3] = x_.sample_index[2 * 2] - 1;
  EXPECT_TRUE(fails_with(check(), "sample_index: entry 3 is at document index position"));
  EXPECT_TRUE(fails_with(check(), "expected rows that never go backwards"));
  x_ = saved;
  x_.sample_index[2 * 3 + 1] = 1000;
  EXPECT_TRUE(fails_with(check(), "sample_index: entry 3 has offset 1000, outside sequence"));
  x_ = saved;
  x_.sample_index[1] = 1;
  EXPECT_TRUE(fails_with(check(), "sample_index: entry 0 is (0, 1), expected (0, 0)"));
  x_ = saved;
  x_.sample_index.resize(x_.sample_index.size() - 2);
  EXPECT_TRUE(fails_with(check(), "sample_index: 21 rows, expected 22"));
}

TEST_F(CheckDamagedIndices, ShuffleIndex) {
  std::fill(x_.shuffle_index.begin(), x_.shuffle_index.end(), 0);
  EXPECT_TRUE(
      fails_with(check(), "shuffle_index: entry 1 is sample 0 again: expected a permutation of the 21 samples"));
  x_.shuffle_index[0] = 21;
  EXPECT_TRUE(fails_with(check(), "shuffle_index: entry 0 is sample 21, outside the 21 samples"));
}

TEST(CheckGptIndices, PartialLastSampleOnlyWhenKept) {
  const std::vector<std::int32_t> lengths = {5, 3, 8};  // 16 tokens: 15 / 4 = 3 samples and a partial fourth
  const auto documents = iota_documents(0, 3);
  GptIndexOptions o;
  o.sequence_length = 4;
  o.drop_last_partial_sequence = false;
  auto x = build_gpt_indices(lengths, documents, std::nullopt, o);
  ASSERT_TRUE(x.ok());
  ASSERT_EQ(x->sample_count(), 4u);
  EXPECT_TRUE(check_gpt_indices(*x, lengths, documents, std::nullopt, o).ok());
  o.drop_last_partial_sequence = true;
  EXPECT_TRUE(fails_with(check_gpt_indices(*x, lengths, documents, std::nullopt, o), "5 rows, expected 4"));
  x->sample_index.resize(x->sample_index.size() - 2);
  x->shuffle_index = {0, 1, 2};
  EXPECT_TRUE(check_gpt_indices(*x, lengths, documents, std::nullopt, o).ok());
}

class GptDatasetCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = (dir_ / "ds").string();
    write_dataset(20);
    config_.sequence_length = 8;
    config_.split = "100,0,0";
  }

  // 30 sequences of `length` tokens (re-preprocessing with another tokenizer changes lengths, not the count).
  void write_dataset(std::int32_t length) {
    auto writer = IndexedDatasetWriter::create(prefix_, TokenDType::kUint16);
    ASSERT_TRUE(writer.ok());
    for (std::int32_t d = 0; d < 30; ++d) {
      std::vector<std::int64_t> tokens(static_cast<std::size_t>(length + d % 7));
      std::iota(tokens.begin(), tokens.end(), d);
      const std::vector<std::int32_t> lengths = {static_cast<std::int32_t>(tokens.size())};
      ASSERT_TRUE(writer->add_document(tokens, lengths).ok());
    }
    ASSERT_TRUE(writer->finalize().ok());
  }
  Result<std::unique_ptr<GptDataset>> create() {
    auto dataset = IndexedDataset::open(prefix_);
    if (!dataset.ok()) return dataset.status();
    return GptDataset::create(
        std::make_shared<const IndexedLowLevelDataset>(std::make_shared<const IndexedDataset>(std::move(*dataset))),
        iota_documents(0, 30), 100, Split::kTrain, config_);
  }
  // Builds the cache and returns its base (PREFIX/cache/GPTDataset_indices/<md5>-GPTDataset-train).
  std::string build_cache() {
    auto built = create();
    EXPECT_TRUE(built.ok()) << built.status().message();
    if (!built.ok()) return "";
    EXPECT_FALSE((*built)->loaded_from_cache());
    return (*built)->cache_base();
  }
  static void write_values(const std::string& path, std::vector<std::int64_t> values, bool two_columns) {
    const std::size_t rows[2] = {two_columns ? values.size() / 2 : values.size(), 2};
    ASSERT_TRUE(write_npy(path, NpyDType::kInt64, std::span(rows, two_columns ? 2 : 1), values).ok());
  }
  static std::vector<std::int64_t> read_values(const std::string& path) {
    auto array = read_npy(path);
    EXPECT_TRUE(array.ok()) << array.status().message();
    return array.ok() ? array->values : std::vector<std::int64_t>{};
  }

  ::trestle::testing::TempDir temp_;
  const fs::path& dir_ = temp_.path();
  std::string prefix_;
  GptDatasetConfig config_;
};

TEST_F(GptDatasetCacheTest, ACacheItWroteLoadsAndAPartOneIsRebuilt) {
  const std::string base = build_cache();
  auto again = create();
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_TRUE((*again)->loaded_from_cache());
  EXPECT_GT((*again)->indices().num_epochs, 1);
  fs::remove(base + "-shuffle_index.npy");  // a build killed before its last file: rebuilt
  auto rebuilt = create();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().message();
  EXPECT_FALSE((*rebuilt)->loaded_from_cache());
  for (const auto& entry : fs::directory_iterator(fs::path(base).parent_path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
}

TEST_F(GptDatasetCacheTest, AFifoWhereACacheFileShouldBeIsRefusedNotWaitedOn) {
  const std::string base = build_cache();
  for (const char* affix : {"-sample_index.npy", "-description.txt"}) {
    const std::string path = base + affix;
    const std::string saved = path + ".saved";
    fs::rename(path, saved);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
    EXPECT_TRUE(fails_with(create(), path + ": not a regular file (a FIFO) where a cache file should be"));
    fs::remove(path);
    fs::rename(saved, path);
  }
  const std::string fifo = (dir_ / "fifo.npy").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_TRUE(fails_with(read_npy(fifo), "not a regular file (a FIFO)"));
}

TEST_F(GptDatasetCacheTest, ASymlinkWhereACacheFileShouldBeIsRefusedAndNeverWrittenThrough) {
  const std::string base = build_cache();
  const fs::path outside = dir_ / "outside";
  fs::create_directories(outside);
  const std::string path = base + "-sample_index.npy";
  fs::remove(path);
  fs::create_symlink(outside / "victim.npy", path);  // dangling, pointing outside the cache directory
  EXPECT_TRUE(fails_with(create(), path + ": a symbolic link where a cache file should be"));
  EXPECT_FALSE(fs::exists(outside / "victim.npy"));
  // Writing a cache file replaces a link put at its name rather than writing through it.
  const std::vector<std::int64_t> values = {1, 2, 3};
  write_values(path, values, false);
  EXPECT_FALSE(fs::is_symlink(path));
  EXPECT_FALSE(fs::exists(outside / "victim.npy"));
  EXPECT_EQ(read_values(path), values);
}

TEST_F(GptDatasetCacheTest, AStaleCacheFromAnotherDatasetAtThePrefixIsRefused) {
  const std::string base = build_cache();
  write_dataset(22);  // re-preprocessed under the same prefix: same description, other lengths
  EXPECT_TRUE(fails_with(create(), base + "-sample_index.npy: "));
  EXPECT_TRUE(fails_with(create(), "the cached indices do not match the dataset: delete " +
                                       fs::path(base).parent_path().string() + " to rebuild them"));
}

TEST_F(GptDatasetCacheTest, ADescriptionThatIsNotTheDatasetsIsRefused) {
  const std::string base = build_cache();
  std::ofstream(base + "-description.txt", std::ios::trunc) << "{\n    \"class\": \"GPTDataset\",\n}";
  EXPECT_TRUE(fails_with(create(), base + "-description.txt: not this dataset's description (line 3 is '}', "
                                          "expected '    \"dataset_path\": "));
}

TEST_F(GptDatasetCacheTest, DamagedValuesInRangeAreRefusedNamingTheFile) {
  const std::string base = build_cache();
  const std::string documents = base + "-document_index.npy", samples = base + "-sample_index.npy",
                    shuffle = base + "-shuffle_index.npy";
  const auto document_index = read_values(documents), sample_index = read_values(samples),
             shuffle_index = read_values(shuffle);

  write_values(samples, std::vector<std::int64_t>(sample_index.size(), 0), true);
  EXPECT_TRUE(fails_with(create(), samples + ": sample 0 (entries 0 to 1) spans 0 tokens"));
  auto empty_sample = sample_index;
  empty_sample[2 * 8] = empty_sample[2 * 7];
  empty_sample[2 * 8 + 1] = empty_sample[2 * 7 + 1];
  write_values(samples, empty_sample, true);
  EXPECT_TRUE(fails_with(create(), samples + ": sample 7 (entries 7 to 8) spans 0 tokens"));
  write_values(samples, sample_index, true);

  write_values(shuffle, std::vector<std::int64_t>(shuffle_index.size(), 0), false);
  EXPECT_TRUE(fails_with(create(), shuffle + ": entry 1 is sample 0 again: expected a permutation"));
  write_values(shuffle, shuffle_index, false);

  write_values(documents, std::vector<std::int64_t>(document_index.size(), 0), false);
  EXPECT_TRUE(fails_with(create(), documents + ": entry "));
  EXPECT_TRUE(fails_with(create(), "is sequence 0 again: expected each of the split's documents once in each of"));
  write_values(documents, document_index, false);

  auto restored = create();
  ASSERT_TRUE(restored.ok()) << restored.status().message();
  EXPECT_TRUE((*restored)->loaded_from_cache());
}

TEST(Npy, AShapeLargerThanTheFileIsRefused) {
  const ::trestle::testing::TempDir dir;
  const auto path = dir / "shape.npy";
  const std::vector<std::int64_t> values = {1, 2, 3, 4};
  const std::size_t shape[2] = {2, 2};
  ASSERT_TRUE(write_npy(path, NpyDType::kInt64, shape, values).ok());
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string huge = "(9223372036854775810, 2)";  // 2^63 + 2 rows: the count wraps to 4 in 64 bits
  const auto at = bytes.find("(2, 2)");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 6, huge);
  bytes.erase(bytes.find('\n') - (huge.size() - 6), huge.size() - 6);  // keep the header's length
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_TRUE(fails_with(read_npy(path), "holds more values than the file's 32 data bytes"));
}

}  // namespace
}  // namespace trestle::data
