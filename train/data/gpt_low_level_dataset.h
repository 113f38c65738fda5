// What a GptDataset reads its documents from, as megatron-core's GPTDataset reads its "low-level dataset": an
// indexed dataset on disk (IndexedLowLevelDataset) or the mock data of --mock-data (mock_gpt_dataset.h). Both are
// immutable and safe to read from many threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/status.h"
#include "train/data/indexed_dataset.h"

namespace trestle::data {

class GptLowLevelDataset {
 public:
  virtual ~GptLowLevelDataset() = default;
  // The dataset's prefix on disk; nullopt for Megatron's mock data (megatron-core's dataset_path None, whose GPT
  // datasets are MockGPTDataset and are cached only under an explicit path_to_cache).
  virtual std::optional<std::string> path() const = 0;
  virtual std::string name() const = 0;  // for errors: the prefix, or "mock data"
  virtual std::size_t sequence_count() const = 0;
  virtual std::vector<std::int32_t> sequence_lengths() const = 0;
  // Tokens [offset, offset + length) of one sequence appended to out (length nullopt: to the sequence's end); fails
  // naming the dataset when the range is outside the sequence.
  virtual Status read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
                      std::vector<std::int64_t>& out) const = 0;
};

class IndexedLowLevelDataset final : public GptLowLevelDataset {
 public:
  explicit IndexedLowLevelDataset(std::shared_ptr<const IndexedDataset> dataset) : dataset_(std::move(dataset)) {}

  std::optional<std::string> path() const override { return dataset_->prefix(); }
  std::string name() const override { return dataset_->prefix(); }
  std::size_t sequence_count() const override { return dataset_->sequence_count(); }
  std::vector<std::int32_t> sequence_lengths() const override { return dataset_->sequence_lengths(); }
  Status read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
              std::vector<std::int64_t>& out) const override {
    return dataset_->read(sequence, offset, length, out);
  }

 private:
  std::shared_ptr<const IndexedDataset> dataset_;
};

}  // namespace trestle::data
