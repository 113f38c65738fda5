#include "train/data/blended_dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "train/data/md5.h"
#include "train/data/npy.h"

namespace trestle::data {
namespace fs = std::filesystem;

std::vector<double> normalize_weights(std::span<const double> weights) {
  double sum = 0;
  for (const double w : weights) sum += w;
  std::vector<double> out;
  for (const double w : weights) out.push_back(w / sum);
  return out;
}

BlendIndices build_blending_indices(std::span<const double> weights, std::int64_t size) {
  BlendIndices out;
  out.dataset_index.resize(static_cast<std::size_t>(size));
  out.dataset_sample_index.resize(static_cast<std::size_t>(size));
  std::vector<std::int64_t> drawn(weights.size(), 0);
  for (std::int64_t sample = 0; sample < size; ++sample) {
    const double at = std::max(static_cast<double>(sample), 1.0);
    std::size_t best = 0;
    double best_error = weights[0] * at - static_cast<double>(drawn[0]);
    for (std::size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * at - static_cast<double>(drawn[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    out.dataset_index[static_cast<std::size_t>(sample)] = static_cast<std::int64_t>(best);
    out.dataset_sample_index[static_cast<std::size_t>(sample)] = drawn[best]++;
  }
  return out;
}

BlendIndices build_exhaustive_blending_indices(std::span<const std::int64_t> sizes) {
  std::int64_t total = 0;
  std::set<std::size_t> unspent;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    total += sizes[d];
    if (sizes[d] > 0) unspent.insert(d);
  }
  std::vector<double> weights;
  for (const auto s : sizes) weights.push_back(static_cast<double>(s) / static_cast<double>(total));
  std::vector<std::int64_t> drawn(sizes.size(), 0);
  BlendIndices out;
  for (std::int64_t sample = 0; !unspent.empty(); ++sample) {
    const double at = std::max(static_cast<double>(sample), 1.0);
    std::size_t best = 0;
    double best_error = std::numeric_limits<double>::lowest();
    for (const std::size_t d : unspent) {
      const double error = weights[d] * at - static_cast<double>(drawn[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    out.dataset_index.push_back(static_cast<std::int64_t>(best));
    out.dataset_sample_index.push_back(drawn[best]++);
    if (drawn[best] == sizes[best]) unspent.erase(best);
  }
  return out;
}

Result<std::unique_ptr<BlendedDataset>> BlendedDataset::create(std::vector<std::unique_ptr<GptDataset>> datasets,
                                                               std::vector<double> weights,
                                                               std::optional<std::int64_t> size, Split split,
                                                               const std::string& path_to_cache) {
  if (datasets.empty() || datasets.size() != weights.size() || datasets.size() >= 32767)
    return Status::Error("blended dataset: " + std::to_string(datasets.size()) + " datasets and " +
                         std::to_string(weights.size()) + " weights");
  for (const double w : weights)
    if (!(w > 0)) return Status::Error("blended dataset: every weight must be positive");
  std::unique_ptr<BlendedDataset> out(new BlendedDataset());
  if (size) weights = normalize_weights(weights);
  auto& id = out->identifiers_;
  id["class"] = "BlendedDataset";
  id["datasets"] = nlohmann::ordered_json::array();
  for (const auto& d : datasets) id["datasets"].push_back(d->identifiers());
  id["split"] = split_name(split);
  if (size) {
    id["weights"] = weights;
    id["size"] = *size;
  } else {
    std::vector<std::int64_t> whole(weights.begin(), weights.end());
    id["weights"] = whole;
    id["size"] = nullptr;
  }
  out->datasets_ = std::move(datasets);

  const std::string base =
      path_to_cache.empty()
          ? std::string()
          : (fs::path(path_to_cache) / (md5_hex(out->description()) + "-BlendedDataset-" + split_name(split))).string();
  if (!base.empty() && fs::is_regular_file(base + "-description.txt") &&
      fs::is_regular_file(base + "-dataset_index.npy") && fs::is_regular_file(base + "-dataset_sample_index.npy")) {
    TRESTLE_ASSIGN_OR_RETURN(auto dataset_index, read_npy(base + "-dataset_index.npy"));
    TRESTLE_ASSIGN_OR_RETURN(auto sample_index, read_npy(base + "-dataset_sample_index.npy"));
    out->indices_ = {std::move(dataset_index.values), std::move(sample_index.values)};
  } else {
    if (size) {
      out->indices_ = build_blending_indices(weights, *size);
    } else {
      std::vector<std::int64_t> sizes(weights.begin(), weights.end());
      out->indices_ = build_exhaustive_blending_indices(sizes);
    }
    if (!base.empty()) {
      std::error_code ec;
      fs::create_directories(path_to_cache, ec);
      std::ofstream description(base + "-description.txt", std::ios::trunc);
      description << out->description();
      if (!description) return Status::Error(base + "-description.txt: cannot write");
      const std::size_t shape[1] = {out->indices_.dataset_index.size()};
      TRESTLE_RETURN_IF_ERROR(
          write_npy(base + "-dataset_index.npy", NpyDType::kInt16, shape, out->indices_.dataset_index));
      TRESTLE_RETURN_IF_ERROR(
          write_npy(base + "-dataset_sample_index.npy", NpyDType::kInt64, shape, out->indices_.dataset_sample_index));
    }
  }
  const auto& x = out->indices_;
  if (x.dataset_index.size() != x.dataset_sample_index.size())
    return Status::Error(base + ": dataset and sample indices differ in length");
  for (std::size_t i = 0; i < x.dataset_index.size(); ++i) {
    const auto d = x.dataset_index[i];
    if (d < 0 || static_cast<std::size_t>(d) >= out->datasets_.size() || x.dataset_sample_index[i] < 0 ||
        static_cast<std::size_t>(x.dataset_sample_index[i]) >= out->datasets_[static_cast<std::size_t>(d)]->size())
      return Status::Error("blended dataset " + std::string(split_name(split)) + ": sample " + std::to_string(i) +
                           " asks for sample " + std::to_string(x.dataset_sample_index[i]) + " of dataset " +
                           std::to_string(d) + ", which it does not have (raise the datasets' sizes)");
  }
  return out;
}

std::string BlendedDataset::description() const { return python_json_dumps(identifiers_); }

Result<Sample> BlendedDataset::sample(std::size_t i) const {
  if (i >= size())
    return Status::Error("blended dataset: sample " + std::to_string(i) + " of " + std::to_string(size()));
  return datasets_[static_cast<std::size_t>(indices_.dataset_index[i])]->sample(
      static_cast<std::size_t>(indices_.dataset_sample_index[i]));
}

}  // namespace trestle::data
