#include "train/data/gpt_data_builder.h"

#include <cmath>

#include "train/data/blended_dataset.h"
#include "train/data/python_float.h"

namespace trestle::data {
namespace {

using DatasetSplits = std::array<std::unique_ptr<GptDataset>, 3>;

// megatron-core's _build_megatron_dataset_splits: one GPT dataset per split the matrix selects, over its range of the
// low-level dataset's sequences.
Result<DatasetSplits> build_dataset_splits(std::shared_ptr<const GptLowLevelDataset> dataset,
                                           const GptDatasetConfig& config,
                                           const std::array<std::optional<std::int64_t>, 3>& samples) {
  const std::string prefix = dataset->name();
  DatasetSplits out;
  for (const Split split : kSplits) {
    const auto s = static_cast<std::size_t>(split);
    if (!config.split_matrix[s]) continue;
    const auto [begin, end] = split_range(*config.split_matrix[s], dataset->sequence_count());
    if (begin == end && config.split.empty())
      return Status::Error(prefix + ": the dataset has no documents for the " + split_name(split) + " split");
    if (begin == end)
      return Status::Error(prefix + ": --split " + config.split + " gives the " + split_name(split) +
                           " split none of its " + std::to_string(dataset->sequence_count()) +
                           " documents; use a larger corpus or a split whose every nonzero part gets a document "
                           "(a 0 part, as in 98,2,0, leaves a split out)");
    std::vector<std::int32_t> documents;
    for (std::size_t d = begin; d < end; ++d) documents.push_back(static_cast<std::int32_t>(d));
    TRESTLE_ASSIGN_OR_RETURN(out[s], GptDataset::create(dataset, std::move(documents), samples[s], split, config));
  }
  return out;
}

Result<DatasetSplits> build_dataset_splits(const std::string& prefix, const GptDatasetConfig& config,
                                           const std::array<std::optional<std::int64_t>, 3>& samples) {
  TRESTLE_ASSIGN_OR_RETURN(auto opened, IndexedDataset::open(prefix));
  auto dataset =
      std::make_shared<const IndexedLowLevelDataset>(std::make_shared<const IndexedDataset>(std::move(opened)));
  return build_dataset_splits(std::move(dataset), config, samples);
}

}  // namespace

Result<DataBlend> parse_data_path(const std::vector<std::string>& words) {
  if (words.empty()) return Status::Error("--data-path: no dataset prefix");
  DataBlend blend;
  if (words.size() % 2 == 0) {
    std::vector<double> weights;
    std::vector<std::string> prefixes;
    bool all_numbers = true;
    for (std::size_t i = 0; i < words.size(); i += 2) {
      // Megatron tries float() on every other word: all numbers make a weighted blend, else every word is a prefix.
      const auto weight = python_float(words[i]);
      weights.push_back(weight.value_or(0));
      if (!weight) all_numbers = false;
      prefixes.push_back(words[i + 1]);
    }
    if (all_numbers) {
      // Megatron normalises the weights, each of which must be above 0; NaN, infinities and sums that overflow blend
      // nothing.
      double total = 0;
      for (std::size_t k = 0; k < weights.size(); ++k) {
        if (!std::isfinite(weights[k]) || !(weights[k] > 0))
          return Status::Error("the weight of '" + prefixes[k] + "' is " + words[2 * k] +
                               "; weights must be finite numbers above 0");
        total += weights[k];
      }
      if (!std::isfinite(total)) return Status::Error("the weights' sum overflows");
      blend.prefixes = std::move(prefixes);
      blend.weights = std::move(weights);
      return blend;
    }
  }
  blend.prefixes = words;
  return blend;
}

namespace {

using SampleCounts = std::array<std::optional<std::int64_t>, 3>;

// The splits of `blend` that `config.split_matrix` selects, `samples` each: megatron-core's path for a blend (its
// shortcut for one prefix built alone taken when `one_prefix_alone`).
Result<GptSplits> build_blend_splits(const DataBlend& blend, bool one_prefix_alone, const GptDataOptions& options,
                                     const GptDatasetConfig& config, const SampleCounts& samples,
                                     const std::string& flag) {
  const auto& prefixes = blend.prefixes;
  if (prefixes.empty()) return Status::Error(flag + ": no dataset prefix");
  GptSplits out;
  if (prefixes.size() == 1 && one_prefix_alone) {
    TRESTLE_ASSIGN_OR_RETURN(auto splits, build_dataset_splits(prefixes[0], config, samples));
    for (std::size_t s = 0; s < 3; ++s) out.splits[s] = std::move(splits[s]);
    return out;
  }

  std::vector<double> weights;
  std::vector<std::array<std::int64_t, 3>> target(prefixes.size());
  std::vector<DatasetSplits> per_prefix;
  if (blend.weights) {
    if (blend.weights->size() != prefixes.size()) return Status::Error(flag + ": one weight per prefix");
    weights = normalize_weights(*blend.weights);
    for (const auto& size : samples)
      if (!size) return Status::Error(flag + " with weights needs a sample count for every split");
  }
  for (std::size_t d = 0; d < prefixes.size(); ++d) {
    SampleCounts buffer;
    if (blend.weights) {
      for (std::size_t s = 0; s < 3; ++s) {
        const double wanted = std::ceil(static_cast<double>(*samples[s]) * weights[d]);
        target[d][s] = static_cast<std::int64_t>(wanted);
        buffer[s] = static_cast<std::int64_t>(std::ceil(wanted * (1 + options.mid_level_dataset_surplus)));
      }
    }
    TRESTLE_ASSIGN_OR_RETURN(auto splits, build_dataset_splits(prefixes[d], config, buffer));
    per_prefix.push_back(std::move(splits));
  }
  for (const Split split : kSplits) {
    const auto s = static_cast<std::size_t>(split);
    if (!config.split_matrix[s]) continue;
    std::vector<std::unique_ptr<GptDataset>> datasets;
    for (auto& splits : per_prefix) datasets.push_back(std::move(splits[s]));
    std::optional<std::int64_t> size;
    std::vector<double> split_weights;
    if (blend.weights) {
      split_weights = weights;
      std::int64_t sum = 0;
      for (const auto& t : target) sum += t[s];
      size = sum;
    } else {
      std::int64_t sum = 0;
      for (const auto& d : datasets) {
        split_weights.push_back(static_cast<double>(d->size()));
        sum += static_cast<std::int64_t>(d->size());
      }
      if (samples[s]) size = std::min(*samples[s], sum);
    }
    TRESTLE_ASSIGN_OR_RETURN(out.splits[s], BlendedDataset::create(std::move(datasets), split_weights, size, split,
                                                                   config.use_cache ? config.path_to_cache : ""));
  }
  return out;
}

// megatron-core's mock path: the config's split forced to "1,1,1", the splits built from the mock documents as from one
// prefix.
Result<GptSplits> build_mock_splits(const GptDataOptions& options, bool per_split) {
  if (!options.blend.prefixes.empty() || per_split)
    return Status::Error(
        "--mock-data and --data-path / --train-data-path / --valid-data-path / --test-data-path "
        "exclude each other");
  if (options.mock->vocab_size <= 0)
    return Status::Error("--mock-data needs the tokenizer's vocabulary size (got " +
                         std::to_string(options.mock->vocab_size) + ")");
  GptDatasetConfig config = options.config;
  config.split = kMockDataSplit;
  TRESTLE_ASSIGN_OR_RETURN(config.split_matrix, parse_split(config.split));
  auto dataset = std::make_shared<const MockGptLowLevelDataset>(*options.mock);
  TRESTLE_ASSIGN_OR_RETURN(auto splits, build_dataset_splits(std::move(dataset), config, options.samples));
  GptSplits out;
  for (std::size_t s = 0; s < 3; ++s) out.splits[s] = std::move(splits[s]);
  return out;
}

}  // namespace

Result<GptSplits> build_gpt_splits(const GptDataOptions& options) {
  GptDatasetConfig config = options.config;
  bool per_split = false;
  for (const auto& blend : options.blend_per_split) per_split = per_split || blend.has_value();
  if (options.mock) return build_mock_splits(options, per_split);
  if (!per_split) {
    config.split = options.split;
    TRESTLE_ASSIGN_OR_RETURN(config.split_matrix, parse_split(options.split));
    return build_blend_splits(options.blend, !options.blend.weights, options, config, options.samples, "--data-path");
  }
  if (!options.blend.prefixes.empty())
    return Status::Error("--data-path and --train-data-path / --valid-data-path / --test-data-path exclude each other");
  // megatron-core's blend_per_split: each split built alone, as the only split of its datasets (all of their
  // documents), the other splits' sizes 0; its config has no split string or matrix.
  config.split.clear();
  GptSplits out;
  for (const Split split : kSplits) {
    const auto s = static_cast<std::size_t>(split);
    if (!options.blend_per_split[s]) continue;
    config.split_matrix = {};
    config.split_matrix[s] = std::make_pair(0.0, 1.0);
    SampleCounts samples{std::int64_t{0}, std::int64_t{0}, std::int64_t{0}};
    samples[s] = options.samples[s];
    const std::string flag = "--" + std::string(split_name(split)) + "-data-path";
    TRESTLE_ASSIGN_OR_RETURN(auto built,
                             build_blend_splits(*options.blend_per_split[s], true, options, config, samples, flag));
    out.splits[s] = std::move(built.splits[s]);
  }
  return out;
}

}  // namespace trestle::data
