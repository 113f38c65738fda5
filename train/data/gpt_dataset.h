// Megatron-Core's GPTDataset over one split of an indexed dataset (or MockGPTDataset over the mock data, a low-level
// dataset without a path): its indices (gpt_indices.h) built from the seed or loaded from Megatron's cache files, and
// sample(i) returning the sequence_length + 1 token ids Megatron's __getitem__ reads for training sample i. Immutable
// once built; sample() is safe from many threads. Cache files are read only when they are regular files and their
// indices match the dataset, and are written by rename.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "train/data/gpt_indices.h"
#include "train/data/gpt_low_level_dataset.h"
#include "train/data/indexed_dataset.h"
#include "train/data/split.h"

namespace trestle::data {

// One training sample as megatron-core's _query_document_sample_shuffle_indices reads it.
struct Sample {
  std::vector<std::int64_t> tokens;  // sequence_length + 1 ids, padded with the pad id past the data's end
  // The tokens read from each document the sample spans, in order, before the padding (its document_lengths; the
  // extra token for the last label counts in the last part). A document part may be empty.
  std::vector<std::int64_t> document_lengths;
};

// What a trainer reads: a numbered sequence of training samples.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual std::size_t size() const = 0;
  virtual Result<Sample> sample(std::size_t i) const = 0;
};

struct GptDatasetConfig {
  std::int32_t sequence_length = 0;
  std::uint32_t random_seed = 1234;
  bool add_extra_token_to_sequence = true;
  bool drop_last_partial_validation_sequence = true;
  std::int64_t pad_token_id = -1;  // Megatron's _PAD_TOKEN_ID
  // The split string and matrix and the tokenizer's identity enter the description Megatron hashes to name its
  // cache files ("tokenizer" is the tokenizer's unique_identifiers as JSON); an empty split: none (both null).
  std::string split = "969, 30, 1";
  SplitMatrix split_matrix{};
  nlohmann::ordered_json tokenizer_identity = nullptr;
  // Where the cached indices live: empty means Megatron's default, PREFIX/cache/GPTDataset_indices (for mock data,
  // which has no prefix: build in memory, as megatron-core does without a path_to_cache).
  std::string path_to_cache;
  bool use_cache = true;  // false: build in memory, read and write no cache files
};

class GptDataset : public SampleSource {
 public:
  // documents: the sequence ids this split exposes; num_samples: nullopt for one epoch.
  static Result<std::unique_ptr<GptDataset>> create(std::shared_ptr<const GptLowLevelDataset> dataset,
                                                    std::vector<std::int32_t> documents,
                                                    std::optional<std::int64_t> num_samples, Split split,
                                                    const GptDatasetConfig& config);

  std::size_t size() const override { return indices_.sample_count(); }
  Result<Sample> sample(std::size_t i) const override;

  const GptIndices& indices() const { return indices_; }
  // Megatron's unique_identifiers (the description is their JSON with indent 4; its MD5 names the cache files).
  const nlohmann::ordered_json& identifiers() const { return identifiers_; }
  std::string description() const;
  // Megatron's class name: "GPTDataset", or "MockGPTDataset" over the mock data.
  const std::string& class_name() const { return class_name_; }
  std::string cache_base() const;  // PATH_TO_CACHE/<md5>-<class name>-<split>
  bool loaded_from_cache() const { return loaded_from_cache_; }

 private:
  GptDataset() = default;
  GptIndexOptions index_options() const;
  // Loads the cached indices when all four cache files are there, refusing a cache that does not match the dataset
  // (another description, or indices check_gpt_indices rejects); otherwise builds them and writes the cache.
  Status load_or_build(std::optional<std::int64_t> num_samples);
  bool cached() const;  // whether the indices are read from and written to cache files
  Status load_cache(const std::string& base, std::optional<std::int64_t> num_samples);
  Status write_cache(const std::string& base) const;

  std::shared_ptr<const GptLowLevelDataset> dataset_;
  std::string class_name_;
  std::vector<std::int32_t> documents_;
  Split split_ = Split::kTrain;
  GptDatasetConfig config_;
  nlohmann::ordered_json identifiers_;
  GptIndices indices_;
  bool loaded_from_cache_ = false;
};

// json.dumps(value, indent=4) as Python writes it (ASCII-escaped).
std::string python_json_dumps(const nlohmann::ordered_json& value);
// Megatron's split_matrix as JSON: [[0, 0.969], [0.969, 0.999], ...] with nulls for empty splits.
nlohmann::ordered_json split_matrix_json(const SplitMatrix& matrix);

}  // namespace trestle::data
