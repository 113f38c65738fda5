// megatron-core's MockGPTLowLevelDataset, the documents of Megatron's --mock-data: 100000 documents whose lengths are
// numpy.random.default_rng(0).integers(1, 4096, 100000, dtype=int32) (megatron-core's hard-coded seed, count and
// maximum length), document i being 1, 2, ..., length - 1 modulo the vocabulary size, then the end-of-document token.
#pragma once

#include <cstdint>

#include "train/data/gpt_low_level_dataset.h"

namespace trestle::data {

// The two tokenizer properties the mock documents use.
struct MockDataTokenizer {
  std::int64_t vocab_size = 0;
  std::int64_t eod = 0;
};

class MockGptLowLevelDataset final : public GptLowLevelDataset {
 public:
  static constexpr std::uint64_t kSeed = 0;
  static constexpr std::size_t kSize = 100000;
  static constexpr std::int32_t kMaxSequenceLength = 4096;

  // vocab_size must be positive.
  explicit MockGptLowLevelDataset(const MockDataTokenizer& tokenizer);

  std::optional<std::string> path() const override { return std::nullopt; }
  std::string name() const override { return "mock data"; }
  std::size_t sequence_count() const override { return lengths_.size(); }
  std::vector<std::int32_t> sequence_lengths() const override { return lengths_; }
  Status read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
              std::vector<std::int64_t>& out) const override;

 private:
  MockDataTokenizer tokenizer_;
  std::vector<std::int32_t> lengths_;
};

}  // namespace trestle::data
