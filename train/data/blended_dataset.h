// Megatron-Core's BlendedDataset: samples drawn from several datasets so that, at every prefix of the blend, each
// dataset's share stays closest to its weight (helpers.cpp's greedy max-error rule), or exactly the given number
// of samples from each when no size is set. Cached under Megatron's names (<md5>-BlendedDataset-<split>-...).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "train/data/gpt_dataset.h"

namespace trestle::data {

struct BlendIndices {
  std::vector<std::int64_t> dataset_index;         // which dataset each sample comes from (int16 on disk)
  std::vector<std::int64_t> dataset_sample_index;  // the sample within that dataset
};

// Weights divided by their sum, as Megatron's normalize().
std::vector<double> normalize_weights(std::span<const double> weights);
BlendIndices build_blending_indices(std::span<const double> normalized_weights, std::int64_t size);
BlendIndices build_exhaustive_blending_indices(std::span<const std::int64_t> sizes);

class BlendedDataset : public SampleSource {
 public:
  // weights: normalized when size is set, else whole numbers of samples per dataset. path_to_cache empty: no cache
  // (Megatron caches a blend only under an explicit path).
  static Result<std::unique_ptr<BlendedDataset>> create(std::vector<std::unique_ptr<GptDataset>> datasets,
                                                        std::vector<double> weights, std::optional<std::int64_t> size,
                                                        Split split, const std::string& path_to_cache);

  std::size_t size() const override { return indices_.dataset_index.size(); }
  Result<Sample> sample(std::size_t i) const override;

  const BlendIndices& indices() const { return indices_; }
  const GptDataset& dataset(std::size_t i) const { return *datasets_[i]; }
  std::size_t dataset_count() const { return datasets_.size(); }
  std::string description() const;

 private:
  BlendedDataset() = default;
  // The cached blend at base (Megatron's names), checked: this blend's description, 1-D arrays of its length, datasets
  // that exist and each dataset's samples in order.
  Status load_cache(const std::string& base, std::optional<std::int64_t> size, std::span<const double> weights);
  Status write_cache(const std::string& base, const std::string& dir) const;
  std::vector<std::unique_ptr<GptDataset>> datasets_;
  nlohmann::ordered_json identifiers_;
  BlendIndices indices_;
};

}  // namespace trestle::data
