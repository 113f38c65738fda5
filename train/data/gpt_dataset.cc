#include "train/data/gpt_dataset.h"

#include <filesystem>

#include "ckpt/atomic_file.h"
#include "ckpt/json_file.h"
#include "train/data/index_cache.h"
#include "train/data/md5.h"
#include "train/data/npy.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kCacheFiles[] = {"description.txt", "document_index.npy", "sample_index.npy",
                                       "shuffle_index.npy"};

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value) { return value.dump(4, ' ', /*ensure_ascii=*/true); }

nlohmann::ordered_json split_matrix_json(const SplitMatrix& matrix) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  bool first = true;
  for (const auto& bookends : matrix) {
    if (!bookends) {
      out.push_back(nullptr);
    } else if (first && bookends->first == 0.0) {
      out.push_back({0, bookends->second});  // Megatron's cumulative sum starts from the integer 0
    } else {
      out.push_back({bookends->first, bookends->second});
    }
    first = false;
  }
  return out;
}

Result<std::unique_ptr<GptDataset>> GptDataset::create(std::shared_ptr<const GptLowLevelDataset> dataset,
                                                       std::vector<std::int32_t> documents,
                                                       std::optional<std::int64_t> num_samples, Split split,
                                                       const GptDatasetConfig& config) {
  std::unique_ptr<GptDataset> out(new GptDataset());
  out->dataset_ = std::move(dataset);
  const std::optional<std::string> path = out->dataset_->path();
  out->class_name_ = path ? "GPTDataset" : "MockGPTDataset";
  out->documents_ = std::move(documents);
  out->split_ = split;
  out->config_ = config;
  auto& id = out->identifiers_;
  id["class"] = out->class_name_;
  id["dataset_path"] = path ? nlohmann::ordered_json(*path) : nlohmann::ordered_json(nullptr);
  id["num_samples"] = num_samples ? nlohmann::ordered_json(*num_samples) : nlohmann::ordered_json(nullptr);
  id["index_split"] = split_name(split);
  id["random_seed"] = config.random_seed;
  id["sequence_length"] = config.sequence_length;
  // Built from a split's own blend (megatron-core's blend_per_split), the config has neither.
  id["split"] = config.split.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(config.split);
  id["split_matrix"] = config.split.empty() ? nlohmann::ordered_json(nullptr) : split_matrix_json(config.split_matrix);
  id["tokenizer"] = config.tokenizer_identity;
  TRESTLE_RETURN_IF_ERROR(
      out->load_or_build(num_samples).with_context(out->dataset_->name() + " (" + split_name(split) + " split)"));
  return out;
}

std::string GptDataset::description() const { return python_json_dumps(identifiers_); }

bool GptDataset::cached() const { return config_.use_cache && (dataset_->path() || !config_.path_to_cache.empty()); }

std::string GptDataset::cache_base() const {
  const std::string dir =
      config_.path_to_cache.empty()
          ? (fs::path(dataset_->path().value_or("")) / "cache" / (class_name_ + "_indices")).string()
          : config_.path_to_cache;
  return (fs::path(dir) / (md5_hex(description()) + "-" + class_name_ + "-" + split_name(split_))).string();
}

GptIndexOptions GptDataset::index_options() const {
  GptIndexOptions options;
  options.sequence_length = config_.sequence_length;
  options.random_seed = config_.random_seed;
  options.add_extra_token_to_sequence = config_.add_extra_token_to_sequence;
  options.drop_last_partial_sequence = split_ != Split::kValid || config_.drop_last_partial_validation_sequence;
  return options;
}

Status GptDataset::load_or_build(std::optional<std::int64_t> num_samples) {
  if (!cached()) {
    TRESTLE_ASSIGN_OR_RETURN(indices_,
                             build_gpt_indices(dataset_->sequence_lengths(), documents_, num_samples, index_options()));
    return OkStatus();
  }
  const std::string base = cache_base();
  TRESTLE_ASSIGN_OR_RETURN(const bool complete, cache_complete(base, kCacheFiles));
  if (complete) {
    // Megatron trusts a cache it finds; we refuse one that does not match the dataset (re-preprocessed under the same
    // prefix, or damaged) rather than rebuild it behind the user's back.
    const Status loaded = load_cache(base, num_samples);
    if (!loaded.ok())
      return Status::Error(loaded.message() + "; the cached indices do not match the dataset: delete " +
                           fs::path(base).parent_path().string() + " to rebuild them");
    loaded_from_cache_ = true;
    return OkStatus();
  }
  TRESTLE_ASSIGN_OR_RETURN(indices_,
                           build_gpt_indices(dataset_->sequence_lengths(), documents_, num_samples, index_options()));
  return write_cache(base);
}

Status GptDataset::load_cache(const std::string& base, std::optional<std::int64_t> num_samples) {
  const std::string description_path = base + "-description.txt";
  TRESTLE_ASSIGN_OR_RETURN(const std::string description, read_text_file(description_path));
  const std::string expected = this->description();
  if (description != expected)
    return Status::Error(description_path + ": not this dataset's description (" +
                         first_difference(description, expected) + ")");
  GptIndexNames names;
  names.document_index = base + "-document_index.npy";
  names.sample_index = base + "-sample_index.npy";
  names.shuffle_index = base + "-shuffle_index.npy";
  TRESTLE_ASSIGN_OR_RETURN(auto document_index, read_npy(names.document_index));
  TRESTLE_ASSIGN_OR_RETURN(auto sample_index, read_npy(names.sample_index));
  TRESTLE_ASSIGN_OR_RETURN(auto shuffle_index, read_npy(names.shuffle_index));
  if (document_index.shape.size() != 1) return Status::Error(names.document_index + ": expected a 1-D array");
  if (sample_index.shape.size() != 2 || sample_index.shape[1] != 2)
    return Status::Error(names.sample_index + ": expected shape (samples + 1, 2)");
  if (shuffle_index.shape.size() != 1) return Status::Error(names.shuffle_index + ": expected a 1-D array");
  GptIndices loaded;
  loaded.document_index = std::move(document_index.values);
  loaded.sample_index = std::move(sample_index.values);
  loaded.shuffle_index = std::move(shuffle_index.values);
  loaded.sample_index_is_int64 = sample_index.dtype == NpyDType::kInt64;
  loaded.shuffle_index_is_int64 = shuffle_index.dtype == NpyDType::kInt64;
  const auto lengths = dataset_->sequence_lengths();
  const GptIndexOptions options = index_options();
  TRESTLE_RETURN_IF_ERROR(check_gpt_indices(loaded, lengths, documents_, num_samples, options, names));
  loaded.num_epochs = count_epochs(tokens_per_epoch(lengths, documents_), num_samples, options);
  indices_ = std::move(loaded);
  return OkStatus();
}

// Each file is written beside its name and renamed over it, so a link put there is replaced, not written through,
// and a killed build leaves no partial file under a final name (the next run finds the set incomplete and rebuilds).
Status GptDataset::write_cache(const std::string& base) const {
  const std::string dir = fs::path(base).parent_path().string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::Error(dir + ": cannot create: " + ec.message());
  const std::size_t documents[1] = {indices_.document_index.size()};
  const std::size_t samples[2] = {indices_.sample_index.size() / 2, 2};
  const std::size_t shuffle[1] = {indices_.shuffle_index.size()};
  remove_dead_temporaries(base + "-description.txt");
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(base + "-description.txt", description(), FaultPoints::kSkipped));
  TRESTLE_RETURN_IF_ERROR(
      write_npy(base + "-document_index.npy", NpyDType::kInt32, documents, indices_.document_index));
  TRESTLE_RETURN_IF_ERROR(write_npy(base + "-sample_index.npy",
                                    indices_.sample_index_is_int64 ? NpyDType::kInt64 : NpyDType::kInt32, samples,
                                    indices_.sample_index));
  return write_npy(base + "-shuffle_index.npy", indices_.shuffle_index_is_int64 ? NpyDType::kInt64 : NpyDType::kUint32,
                   shuffle, indices_.shuffle_index);
}

Result<Sample> GptDataset::sample(std::size_t i) const {
  if (i >= size())
    return Status::Error(dataset_->name() + ": sample " + std::to_string(i) + " of " + std::to_string(size()));
  const std::int64_t extra = config_.add_extra_token_to_sequence ? 1 : 0;
  const auto at = static_cast<std::size_t>(indices_.shuffle_index[i]);
  const std::int64_t first = indices_.sample_index[2 * at];
  const std::int64_t first_offset = indices_.sample_index[2 * at + 1];
  const std::int64_t last = indices_.sample_index[2 * at + 2];
  const std::int64_t last_offset = indices_.sample_index[2 * at + 3];
  const auto want = static_cast<std::size_t>(config_.sequence_length + extra);
  Sample out;
  std::vector<std::int64_t>& tokens = out.tokens;
  tokens.reserve(want);
  for (std::int64_t position = first; position <= last; ++position) {
    const auto sequence = static_cast<std::size_t>(indices_.document_index[static_cast<std::size_t>(position)]);
    const auto offset = static_cast<std::size_t>(position == first ? first_offset : 0);
    std::optional<std::size_t> length;
    if (position == last) {
      const std::int64_t end = last_offset + extra;
      if (end < static_cast<std::int64_t>(offset))
        return Status::Error(dataset_->name() + ": sample " + std::to_string(i) + " ends before it starts");
      length = static_cast<std::size_t>(end) - offset;
    }
    const std::size_t before = tokens.size();
    TRESTLE_RETURN_IF_ERROR(dataset_->read(sequence, offset, length, tokens));
    out.document_lengths.push_back(static_cast<std::int64_t>(tokens.size() - before));
  }
  if (tokens.size() > want)
    return Status::Error(dataset_->name() + ": sample " + std::to_string(i) + " has " + std::to_string(tokens.size()) +
                         " tokens, expected " + std::to_string(want));
  tokens.resize(want, config_.pad_token_id);
  return out;
}

}  // namespace trestle::data
