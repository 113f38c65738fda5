// numpy's default_rng and megatron-core's mock data: the expected values below were printed by numpy 2.4.6 (the
// venv's) and are checked at scale against numpy itself and megatron-core's MockGPTDataset in test_data_megatron.py.
// Mock splits build in memory without a cache path and under MockGPTDataset's names with one.
#include "train/data/mock_gpt_dataset.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "train/data/gpt_data_builder.h"
#include "train/data/numpy_generator.h"

namespace trestle::data {
namespace {

using Ints = std::vector<std::int32_t>;

TEST(NumpySeedSequence, GeneratesNumpysState) {
  // numpy.random.SeedSequence(seed).generate_state(n, numpy.uint64)
  EXPECT_EQ(NumpySeedSequence(0).generate_state_uint64(4),
            (std::vector<std::uint64_t>{15793235383387715774ULL, 12390638538380655177ULL, 2361836109651742017ULL,
                                        3188717715514472916ULL}));
  EXPECT_EQ(NumpySeedSequence((1ULL << 40) + 7).generate_state_uint64(2),
            (std::vector<std::uint64_t>{974592680304384533ULL, 11164224302760304993ULL}));
}

TEST(NumpyGenerator, DrawsNumpysIntegers) {
  // numpy.random.default_rng(0).integers(1, 4096, size=8, dtype=numpy.int32): the mock data's first lengths.
  EXPECT_EQ(NumpyGenerator(0).integers_int32(1, 4096, 8), (Ints{3484, 2609, 2094, 1105, 1261, 168, 309, 68}));
  // Successive calls share the buffered high half of a 64-bit draw (odd sizes leave one buffered).
  NumpyGenerator g(12345);
  EXPECT_EQ(g.integers_int32(0, 10, 3), (Ints{6, 2, 7}));
  EXPECT_EQ(g.integers_int32(-5, 5, 3), (Ints{-2, -3, 2}));
  // A seed of two 32-bit words; the full int32 range (raw draws), a one-value range (no draw), a wide range.
  NumpyGenerator h((1ULL << 40) + 7);
  EXPECT_EQ(h.integers_int32(-(1LL << 31), 1LL << 31, 3), (Ints{-1260510806, 1416535584, 470316661}));
  EXPECT_EQ(h.integers_int32(7, 8, 2), (Ints{7, 7}));
  EXPECT_EQ(h.integers_int32(0, (1LL << 31) - 1, 3), (Ints{548263652, 36529601, 330263047}));
}

TEST(MockGptLowLevelDataset, HoldsMegatronsDocuments) {
  const MockGptLowLevelDataset mock({.vocab_size = 1000, .eod = 7});
  ASSERT_EQ(mock.sequence_count(), 100000u);
  EXPECT_FALSE(mock.path().has_value());
  const auto lengths = mock.sequence_lengths();
  EXPECT_EQ(lengths[0], 3484);
  EXPECT_EQ(lengths[99999], 769);  // numpy: ...integers(1, 4096, size=100000, dtype=numpy.int32)[-1]
  std::vector<std::int64_t> tokens;
  ASSERT_TRUE(mock.read(0, 0, std::nullopt, tokens).ok());
  ASSERT_EQ(tokens.size(), 3484u);
  EXPECT_EQ(tokens[0], 1);
  EXPECT_EQ(tokens[998], 999);
  EXPECT_EQ(tokens[999], 0);  // (999 + 1) % 1000
  EXPECT_EQ(tokens[3482], 3483 % 1000);
  EXPECT_EQ(tokens[3483], 7);  // the end-of-document token
  tokens.clear();
  ASSERT_TRUE(mock.read(0, 3482, 2, tokens).ok());
  EXPECT_EQ(tokens, (std::vector<std::int64_t>{483, 7}));
  EXPECT_TRUE(fails_with(mock.read(0, 3483, 2, tokens), "which has 3484"));
  EXPECT_TRUE(fails_with(mock.read(100000, 0, 1, tokens), "sequence 100000 of 100000"));
}

GptDataOptions mock_options(const std::string& cache) {
  GptDataOptions options;
  options.mock = MockDataTokenizer{.vocab_size = 5000, .eod = 0};
  options.split = "969,30,1";  // megatron-core's mock config replaces it with 1,1,1
  options.samples = {std::int64_t{100}, std::int64_t{10}, std::int64_t{10}};
  options.config.sequence_length = 1024;
  options.config.random_seed = 3;
  options.config.path_to_cache = cache;
  return options;
}

TEST(MockGptSplits, BuildInMemoryWithoutACachePath) {
  const testing::TempDir dir;
  const auto here = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  auto built = build_gpt_splits(mock_options(""));
  std::filesystem::current_path(here);
  ASSERT_TRUE(built.ok()) << built.status().message();
  for (const auto& split : built->splits) ASSERT_NE(split, nullptr);
  const auto& train = dynamic_cast<const GptDataset&>(*built->splits[0]);
  EXPECT_EQ(train.class_name(), "MockGPTDataset");
  EXPECT_EQ(train.identifiers()["split"], "1,1,1");
  EXPECT_TRUE(train.identifiers()["dataset_path"].is_null());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));  // nothing cached
  auto sample = train.sample(0);
  ASSERT_TRUE(sample.ok());
  EXPECT_EQ(sample->tokens.size(), 1025u);
}

TEST(MockGptSplits, CacheUnderMockGptDatasetNamesAndReload) {
  const testing::TempDir dir;
  auto built = build_gpt_splits(mock_options(dir.path().string()));
  ASSERT_TRUE(built.ok()) << built.status().message();
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_NE(entry.path().filename().string().find("-MockGPTDataset-"), std::string::npos);
    ++files;
  }
  EXPECT_EQ(files, 12u);  // four per split
  auto again = build_gpt_splits(mock_options(dir.path().string()));
  ASSERT_TRUE(again.ok()) << again.status().message();
  const auto& train = dynamic_cast<const GptDataset&>(*again->splits[0]);
  EXPECT_TRUE(train.loaded_from_cache());
  EXPECT_EQ(train.sample(5)->tokens, built->splits[0]->sample(5)->tokens);
}

TEST(MockGptSplits, RefuseADataPathToo) {
  auto options = mock_options("");
  options.blend.prefixes = {"somewhere"};
  EXPECT_TRUE(fails_with(build_gpt_splits(options), "exclude each other"));
  options = mock_options("");
  options.mock->vocab_size = 0;
  EXPECT_TRUE(fails_with(build_gpt_splits(options), "vocabulary size"));
}

}  // namespace
}  // namespace trestle::data
