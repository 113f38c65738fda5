// The train/valid/test GPT datasets of a Megatron data setup (--data-path [weight] prefix ..., --split, samples per
// split; or each split from a blend of its own, --train-data-path / --valid-data-path / --test-data-path, every
// document of those datasets in that split), built as megatron-core's BlendedMegatronDatasetBuilder builds them: one
// prefix gives GPT datasets, a weighted blend gives per-prefix GPT datasets (sized with Megatron's 0.5% surplus)
// under a BlendedDataset. A split that would get no documents is refused (megatron-core loops forever on it). With
// --mock-data (megatron-core's mock config) the splits are MockGPTDatasets over the mock documents
// (mock_gpt_dataset.h).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "train/data/gpt_dataset.h"
#include "train/data/mock_gpt_dataset.h"

namespace trestle::data {

struct DataBlend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;  // nullopt: blend by dataset size
};

// Megatron's --data-path list: "p1 p2" or "w1 p1 w2 p2" (get_blend_from_list).
Result<DataBlend> parse_data_path(const std::vector<std::string>& words);

struct GptDataOptions {
  DataBlend blend;  // --data-path; empty with blend_per_split
  // --train-data-path, --valid-data-path, --test-data-path (megatron-core's blend_per_split): a split without one is
  // left out. `split` is then not used (megatron-core's config has none).
  std::array<std::optional<DataBlend>, 3> blend_per_split;
  std::string split = "969, 30, 1";  // Megatron-LM's default, spaces included (it enters the cache files' names)
  std::array<std::optional<std::int64_t>, 3> samples;  // train, valid, test; nullopt: one epoch
  GptDatasetConfig config;                             // split and split_matrix are filled in from `split`
  double mid_level_dataset_surplus = 0.005;
  // Megatron's --mock-data, with the tokenizer's vocab_size and eod: the splits are drawn from the mock documents and
  // both blends stay empty. megatron-core's config then sets its split to kMockDataSplit whatever `split` says (and
  // caches the indices only when config.path_to_cache is given); so does build_gpt_splits.
  std::optional<MockDataTokenizer> mock;
};

inline constexpr const char* kMockDataSplit = "1,1,1";

struct GptSplits {
  std::array<std::unique_ptr<SampleSource>, 3> splits;  // null where the split is empty
};

Result<GptSplits> build_gpt_splits(const GptDataOptions& options);

}  // namespace trestle::data
