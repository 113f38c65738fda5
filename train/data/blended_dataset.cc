#include "train/data/blended_dataset.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <set>

#include "ckpt/atomic_file.h"
#include "ckpt/json_file.h"
#include "train/data/index_cache.h"
#include "train/data/md5.h"
#include "train/data/npy.h"

namespace trestle::data {
namespace fs = std::filesystem;
namespace {

constexpr const char* kCacheFiles[] = {"description.txt", "dataset_index.npy", "dataset_sample_index.npy"};

}  // namespace

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
  bool complete = false;
  if (!base.empty()) {
    TRESTLE_ASSIGN_OR_RETURN(complete, cache_complete(base, kCacheFiles));
  }
  if (complete) {
    // Megatron trusts a cache it finds; one that is not this blend's (damaged, or edited) is refused by name.
    const Status loaded = out->load_cache(base, size, weights);
    if (!loaded.ok())
      return Status::Error(loaded.message() + "; the cached blend does not match the datasets: delete it to rebuild");
  } else {
    if (size) {
      out->indices_ = build_blending_indices(weights, *size);
    } else {
      std::vector<std::int64_t> sizes(weights.begin(), weights.end());
      out->indices_ = build_exhaustive_blending_indices(sizes);
    }
    if (!base.empty()) TRESTLE_RETURN_IF_ERROR(out->write_cache(base, path_to_cache));
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

Status BlendedDataset::load_cache(const std::string& base, std::optional<std::int64_t> size,
                                  std::span<const double> weights) {
  const std::string description_path = base + "-description.txt";
  TRESTLE_ASSIGN_OR_RETURN(const std::string description, read_text_file(description_path));
  const std::string expected = this->description();
  if (description != expected)
    return Status::Error(description_path + ": not this blend's description (" +
                         first_difference(description, expected) + ")");
  const std::string dataset_path = base + "-dataset_index.npy", sample_path = base + "-dataset_sample_index.npy";
  TRESTLE_ASSIGN_OR_RETURN(auto dataset_index, read_npy(dataset_path));
  TRESTLE_ASSIGN_OR_RETURN(auto sample_index, read_npy(sample_path));
  // The blend's length: its size, or (exhaustive) the samples asked of each dataset, its weights.
  std::size_t length = 0;
  if (size) {
    length = static_cast<std::size_t>(*size);
  } else {
    for (const double w : weights) length += static_cast<std::size_t>(w);
  }
  for (const auto& [path, array] : {std::pair{&dataset_path, &dataset_index}, {&sample_path, &sample_index}}) {
    if (array->shape.size() == 1 && array->shape[0] == length) continue;
    std::string dims;
    for (const auto d : array->shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    return Status::Error(*path + ": expected a 1-D array of the blend's " + std::to_string(length) +
                         " samples, found shape (" + dims + ")");
  }
  // Both builders draw each dataset's samples in order: a sample's index within its dataset is the number of samples
  // drawn from that dataset before it.
  std::vector<std::int64_t> drawn(datasets_.size(), 0);
  for (std::size_t i = 0; i < length; ++i) {
    const std::int64_t d = dataset_index.values[i];
    if (d < 0 || static_cast<std::size_t>(d) >= datasets_.size())
      return Status::Error(dataset_path + ": sample " + std::to_string(i) + " names dataset " + std::to_string(d) +
                           " of " + std::to_string(datasets_.size()));
    if (sample_index.values[i] != drawn[static_cast<std::size_t>(d)]++)
      return Status::Error(sample_path + ": sample " + std::to_string(i) + " is sample " +
                           std::to_string(sample_index.values[i]) + " of dataset " + std::to_string(d) + ", expected " +
                           std::to_string(drawn[static_cast<std::size_t>(d)] - 1) + " (each dataset's in order)");
  }
  indices_ = {std::move(dataset_index.values), std::move(sample_index.values)};
  return OkStatus();
}

// Each file is written beside its name and renamed over it (write_npy too), so a link put there is replaced, not
// written through, and a killed build leaves no partial file under a final name.
Status BlendedDataset::write_cache(const std::string& base, const std::string& dir) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::Error(dir + ": cannot create: " + ec.message());
  remove_dead_temporaries(base + "-description.txt");
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(base + "-description.txt", description(), FaultPoints::kSkipped));
  const std::size_t shape[1] = {indices_.dataset_index.size()};
  TRESTLE_RETURN_IF_ERROR(write_npy(base + "-dataset_index.npy", NpyDType::kInt16, shape, indices_.dataset_index));
  return write_npy(base + "-dataset_sample_index.npy", NpyDType::kInt64, shape, indices_.dataset_sample_index);
}

Result<Sample> BlendedDataset::sample(std::size_t i) const {
  if (i >= size())
    return Status::Error("blended dataset: sample " + std::to_string(i) + " of " + std::to_string(size()));
  return datasets_[static_cast<std::size_t>(indices_.dataset_index[i])]->sample(
      static_cast<std::size_t>(indices_.dataset_sample_index[i]));
}

}  // namespace trestle::data
