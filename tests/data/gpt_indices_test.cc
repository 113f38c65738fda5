// GPT dataset indices: numpy's legacy shuffle, the sample index walk, epochs and the separated last epoch, splits,
// blending, MD5 and .npy files (megatron-core itself is compared in tests/interop/test_data_megatron.py).
#include "train/data/gpt_indices.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>

#include "tests/support/status_matchers.h"
#include "train/data/blended_dataset.h"
#include "train/data/md5.h"
#include "train/data/npy.h"
#include "train/data/numpy_random.h"
#include "train/data/python_float.h"
#include "train/data/split.h"

namespace trestle::data {
namespace {

TEST(NumpyRandomState, ShuffleMatchesNumpy) {
  // numpy.random.RandomState(1234).shuffle(numpy.arange(10, dtype=numpy.int32))
  std::vector<std::int32_t> a(10);
  std::iota(a.begin(), a.end(), 0);
  NumpyRandomState r(1234);
  r.shuffle(std::span<std::int32_t>(a));
  EXPECT_EQ(a, (std::vector<std::int32_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
  // RandomState(0).shuffle(arange(100000, dtype=uint32)): first five and last three.
  std::vector<std::uint32_t> b(100000);
  std::iota(b.begin(), b.end(), 0u);
  NumpyRandomState r0(0);
  r0.shuffle(std::span<std::uint32_t>(b));
  EXPECT_EQ(std::vector<std::uint32_t>(b.begin(), b.begin() + 5),
            (std::vector<std::uint32_t>{3582, 60498, 53227, 21333, 3885}));
  EXPECT_EQ(std::vector<std::uint32_t>(b.end() - 3, b.end()), (std::vector<std::uint32_t>{42613, 43567, 68268}));
}

TEST(GptIndices, SampleIndexWalksDocuments) {
  // Three documents of 5, 3 and 8 tokens, sequence length 4 (samples of 5 tokens sharing one with the next).
  const std::vector<std::int32_t> lengths = {5, 3, 8};
  const std::vector<std::int32_t> documents = {0, 1, 2};
  GptIndexOptions o;
  o.sequence_length = 4;
  auto x = build_gpt_indices(lengths, documents, std::nullopt, o);
  ASSERT_TRUE(x.ok()) << x.status().message();
  EXPECT_EQ(x->num_epochs, 1);
  EXPECT_EQ(x->sample_count(), 3u);  // (16 - 1) / 4
  std::vector<std::int32_t> flat;
  for (auto d : x->document_index)
    flat.insert(flat.end(), static_cast<std::size_t>(lengths[static_cast<std::size_t>(d)]),
                static_cast<std::int32_t>(d));
  // Every boundary advances 4 tokens through the shuffled concatenation.
  for (std::size_t s = 0; s + 1 < x->sample_index.size() / 2; ++s) {
    std::int64_t begin = 0, end = 0;
    for (std::int64_t p = 0; p < x->sample_index[2 * s]; ++p)
      begin += lengths[static_cast<std::size_t>(x->document_index[static_cast<std::size_t>(p)])];
    for (std::int64_t p = 0; p < x->sample_index[2 * s + 2]; ++p)
      end += lengths[static_cast<std::size_t>(x->document_index[static_cast<std::size_t>(p)])];
    EXPECT_EQ((end + x->sample_index[2 * s + 3]) - (begin + x->sample_index[2 * s + 1]), 4) << "sample " << s;
  }
  std::vector<std::int64_t> shuffle = x->shuffle_index;
  std::sort(shuffle.begin(), shuffle.end());
  EXPECT_EQ(shuffle, (std::vector<std::int64_t>{0, 1, 2}));
}

TEST(GptIndices, EpochsAndSeparateLastEpoch) {
  const std::vector<std::int32_t> lengths(10, 41);  // 410 tokens: 102 samples of 4 per epoch
  std::vector<std::int32_t> documents(10);
  std::iota(documents.begin(), documents.end(), 0);
  GptIndexOptions o;
  o.sequence_length = 4;
  auto few = build_gpt_indices(lengths, documents, 110, o);  // 2 epochs, the second used for 8 of 102 samples
  ASSERT_TRUE(few.ok());
  EXPECT_EQ(few->num_epochs, 2);
  // The separated last epoch's documents are shuffled on their own: each half holds every document once.
  std::vector<std::int64_t> first(few->document_index.begin(), few->document_index.begin() + 10);
  std::sort(first.begin(), first.end());
  EXPECT_EQ(first, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  // ... and the shuffle index keeps the last epoch's samples at the end.
  const auto before = static_cast<std::size_t>((410 - 1) / 4);
  for (std::size_t i = before; i < few->shuffle_index.size(); ++i)
    EXPECT_GE(few->shuffle_index[i], static_cast<std::int64_t>(before));
  EXPECT_TRUE(fails_with(build_gpt_indices(lengths, std::vector<std::int32_t>{}, 5, o),
                         "the exposed documents hold no tokens"));  // no tokens: refused (Megatron never ends)
  // One token an epoch and one-token samples build, as megatron-core builds them.
  EXPECT_TRUE(build_gpt_indices(std::vector<std::int32_t>{1}, std::vector<std::int32_t>{0}, 5, o).ok());
  o.sequence_length = 1;
  EXPECT_TRUE(build_gpt_indices(lengths, documents, 5, o).ok());
  o.sequence_length = 0;
  EXPECT_TRUE(fails_with(build_gpt_indices(lengths, documents, 5, o), "sequence length must be at least 1"));
  o.sequence_length = 4;
  EXPECT_TRUE(fails_with(build_gpt_indices(lengths, std::vector<std::int32_t>{12}, 5, o),
                         "document 12 outside the dataset's 10 sequences"));
  // The epoch count, exactly the fewest epochs whose tokens reach the samples' (the extra token included) ...
  for (const std::int64_t samples : {0, 1, 102, 103, 204, 205, 1000})
    EXPECT_EQ(count_epochs(410, samples, o), std::max<std::int64_t>(1, (samples * 4 + 1 + 409) / 410)) << samples;
  // ... is Megatron's int32: past 2^31 - 1 epochs it wrapped around to a far smaller index (4,294,967,395 one-token
  // samples of a one-token document built 100), which is refused now, as is a token count past int64.
  o.sequence_length = 1;
  const std::vector<std::int32_t> one_token{1}, document_0{0};
  EXPECT_TRUE(fails_with(build_gpt_indices(one_token, document_0, 4'294'967'395, o),
                         "4294967395 samples of 1 tokens need more than 2147483647 epochs"));
  EXPECT_TRUE(fails_with(build_gpt_indices(one_token, document_0, std::numeric_limits<std::int64_t>::max(), o),
                         "need more than 2147483647 epochs"));
  EXPECT_EQ(count_epochs(1, 2'147'483'646, o), 2'147'483'647);  // the most there are: the samples + the extra token
  // Indices larger than any machine's memory (2e9 epochs of 1,000 documents: 22 TiB) are refused before any is built;
  // they ran out of memory part way.
  const std::vector<std::int32_t> thousand_tokens(1000, 1);
  std::vector<std::int32_t> thousand_documents(1000);
  std::iota(thousand_documents.begin(), thousand_documents.end(), 0);
  EXPECT_TRUE(fails_with(build_gpt_indices(thousand_tokens, thousand_documents, 2'000'000'000'000, o),
                         "2000000000000 samples of 1 tokens need indices of about"));
}

TEST(Split, MatrixAndRanges) {
  auto m = parse_split("969,30,1");
  ASSERT_TRUE(m.ok());
  EXPECT_DOUBLE_EQ((*m)[0]->second, 0.969);
  EXPECT_EQ(split_range(*(*m)[0], 1000), (std::pair<std::size_t, std::size_t>{0, 969}));
  EXPECT_EQ(split_range(*(*m)[2], 1000), (std::pair<std::size_t, std::size_t>{999, 1000}));
  EXPECT_EQ(split_range(*(*m)[2], 100).first, split_range(*(*m)[2], 100).second);  // 0 documents: the builder refuses
  auto two = parse_split("98,2");
  ASSERT_TRUE(two.ok());
  EXPECT_FALSE((*two)[2].has_value());
  EXPECT_EQ(split_range({0.0, 0.5}, 5).second, 2u);  // round half to even, as Python's round()
  EXPECT_TRUE(fails_with(parse_split("0,0,0"), "--split '0,0,0': the weights sum to 0"));
  // Each run of digits and dots is float()'s: "1.2.3" is not 1.2.
  EXPECT_TRUE(fails_with(parse_split("1.2.3,1,1"), "--split '1.2.3,1,1': '1.2.3' is not a number"));
}

TEST(PythonFloat, ReadsWhatFloatReads) {
  EXPECT_EQ(python_float(" 1.5 "), 1.5);
  EXPECT_EQ(python_float("+2e3"), 2000.0);
  EXPECT_EQ(python_float("1_000.5"), 1000.5);
  EXPECT_EQ(python_float(".5"), 0.5);
  EXPECT_EQ(python_float("5."), 5.0);
  EXPECT_TRUE(std::isinf(*python_float("-Infinity")));
  EXPECT_TRUE(std::isinf(*python_float("1e400")));  // overflow: inf, as float('1e400')
  EXPECT_TRUE(std::isnan(*python_float("nan")));
  const auto tiny = python_float("1e-320");  // a subnormal, as float('1e-320')
  ASSERT_TRUE(tiny.has_value());
  EXPECT_GT(*tiny, 0.0);
  for (const char* bad : {"", " ", "1.2.3", "0x10", "0x1p3", "1__0", "_1", "1_", "nan(1)", "1e", "e5", "1,5", "--1"})
    EXPECT_FALSE(python_float(bad).has_value()) << bad;
}

TEST(Blending, GreedyShares) {
  const std::vector<double> w = {0.3, 0.7};
  auto b = build_blending_indices(w, 10);
  // megatron-core helpers.build_blending_indices(..., [0.3, 0.7], 2, 10, False)
  EXPECT_EQ(b.dataset_index, (std::vector<std::int64_t>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(b.dataset_sample_index, (std::vector<std::int64_t>{0, 0, 1, 2, 1, 3, 4, 2, 5, 6}));
  const std::vector<std::int64_t> sizes = {2, 3};
  auto e = build_exhaustive_blending_indices(sizes);
  EXPECT_EQ(e.dataset_index.size(), 5u);
  EXPECT_EQ(std::count(e.dataset_index.begin(), e.dataset_index.end(), 0), 2);
}

TEST(Md5, KnownDigests) {
  EXPECT_EQ(md5_hex(""), "d41d8cd98f00b204e9800998ecf8427e");
  EXPECT_EQ(md5_hex("The quick brown fox jumps over the lazy dog"), "9e107d9d372bb6826bd81d3542a419d6");
}

TEST(Npy, RoundTripAndHeaderAlignment) {
  const auto path =
      (std::filesystem::temp_directory_path() / ("trestle_npy_" + std::to_string(::getpid()) + ".npy")).string();
  const std::vector<std::int64_t> values = {1, -2, 3, 4, 5, 6};
  const std::size_t shape[2] = {3, 2};
  ASSERT_TRUE(write_npy(path, NpyDType::kInt32, shape, values).ok());
  EXPECT_EQ(std::filesystem::file_size(path) % 64, 24u);  // 64-byte header, then 24 data bytes
  auto back = read_npy(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->shape, (std::vector<std::size_t>{3, 2}));
  EXPECT_EQ(back->values, values);
  EXPECT_TRUE(
      fails_with(write_npy(path, NpyDType::kUint32, shape, values), "value -2 does not fit <u4"));  // -2 does not fit
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace trestle::data
