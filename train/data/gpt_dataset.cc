#include "train/data/gpt_dataset.h"

#include <filesystem>
#include <fstream>

#include "train/data/md5.h"
#include "train/data/npy.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

bool all_files_exist(const std::string& base) {
  for (const char* affix : {"description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"})
    if (!fs::is_regular_file(base + "-" + affix)) return false;
  return true;
}

Status check_loaded(const GptIndices& x, std::size_t sequences, const std::string& base) {
  const std::size_t positions = x.document_index.size();
  for (const auto d : x.document_index)
    if (d < 0 || static_cast<std::size_t>(d) >= sequences)
      return Status::Error(base + "-document_index.npy: sequence " + std::to_string(d) + " outside the dataset's " +
                           std::to_string(sequences));
  if (x.sample_index.size() < 2) return Status::Error(base + "-sample_index.npy: empty");
  for (std::size_t i = 0; i < x.sample_index.size(); i += 2)
    if (x.sample_index[i] < 0 || static_cast<std::size_t>(x.sample_index[i]) >= positions || x.sample_index[i + 1] < 0)
      return Status::Error(base + "-sample_index.npy: entry " + std::to_string(i / 2) + " outside the document index");
  for (const auto s : x.shuffle_index)
    if (s < 0 || static_cast<std::size_t>(s) >= x.sample_count())
      return Status::Error(base + "-shuffle_index.npy: sample " + std::to_string(s) + " outside the " +
                           std::to_string(x.sample_count()) + " samples");
  if (x.shuffle_index.size() != x.sample_count())
    return Status::Error(base + "-shuffle_index.npy: " + std::to_string(x.shuffle_index.size()) + " entries for " +
                         std::to_string(x.sample_count()) + " samples");
  return OkStatus();
}

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

Result<std::unique_ptr<GptDataset>> GptDataset::create(std::shared_ptr<const IndexedDataset> dataset,
                                                       std::vector<std::int32_t> documents,
                                                       std::optional<std::int64_t> num_samples, Split split,
                                                       const GptDatasetConfig& config) {
  std::unique_ptr<GptDataset> out(new GptDataset());
  out->dataset_ = std::move(dataset);
  out->documents_ = std::move(documents);
  out->split_ = split;
  out->config_ = config;
  auto& id = out->identifiers_;
  id["class"] = "GPTDataset";
  id["dataset_path"] = out->dataset_->prefix();
  id["num_samples"] = num_samples ? nlohmann::ordered_json(*num_samples) : nlohmann::ordered_json(nullptr);
  id["index_split"] = split_name(split);
  id["random_seed"] = config.random_seed;
  id["sequence_length"] = config.sequence_length;
  id["split"] = config.split;
  id["split_matrix"] = split_matrix_json(config.split_matrix);
  id["tokenizer"] = config.tokenizer_identity;
  TRESTLE_RETURN_IF_ERROR(out->load_or_build(num_samples).with_context(out->dataset_->prefix()));
  return out;
}

std::string GptDataset::description() const { return python_json_dumps(identifiers_); }

std::string GptDataset::cache_base() const {
  const std::string dir = config_.path_to_cache.empty()
                              ? (fs::path(dataset_->prefix()) / "cache" / "GPTDataset_indices").string()
                              : config_.path_to_cache;
  return (fs::path(dir) / (md5_hex(description()) + "-GPTDataset-" + split_name(split_))).string();
}

Status GptDataset::load_or_build(std::optional<std::int64_t> num_samples) {
  const std::string base = config_.use_cache ? cache_base() : std::string();
  if (config_.use_cache && all_files_exist(base)) {
    TRESTLE_ASSIGN_OR_RETURN(auto document_index, read_npy(base + "-document_index.npy"));
    TRESTLE_ASSIGN_OR_RETURN(auto sample_index, read_npy(base + "-sample_index.npy"));
    TRESTLE_ASSIGN_OR_RETURN(auto shuffle_index, read_npy(base + "-shuffle_index.npy"));
    if (sample_index.shape.size() != 2 || sample_index.shape[1] != 2)
      return Status::Error(base + "-sample_index.npy: expected shape (samples + 1, 2)");
    indices_.document_index = std::move(document_index.values);
    indices_.sample_index = std::move(sample_index.values);
    indices_.shuffle_index = std::move(shuffle_index.values);
    indices_.sample_index_is_int64 = sample_index.dtype == NpyDType::kInt64;
    indices_.shuffle_index_is_int64 = shuffle_index.dtype == NpyDType::kInt64;
    TRESTLE_RETURN_IF_ERROR(check_loaded(indices_, dataset_->sequence_count(), base));
    loaded_from_cache_ = true;
    return OkStatus();
  }
  GptIndexOptions options;
  options.sequence_length = config_.sequence_length;
  options.random_seed = config_.random_seed;
  options.add_extra_token_to_sequence = config_.add_extra_token_to_sequence;
  options.drop_last_partial_sequence = split_ != Split::kValid || config_.drop_last_partial_validation_sequence;
  const auto lengths = dataset_->sequence_lengths();
  TRESTLE_ASSIGN_OR_RETURN(indices_, build_gpt_indices(lengths, documents_, num_samples, options));
  if (!config_.use_cache) return OkStatus();

  std::error_code ec;
  fs::create_directories(fs::path(base).parent_path(), ec);
  if (ec) return Status::Error(fs::path(base).parent_path().string() + ": cannot create: " + ec.message());
  {
    std::ofstream description(base + "-description.txt", std::ios::trunc);
    description << this->description();
    if (!description) return Status::Error(base + "-description.txt: cannot write");
  }
  const std::size_t documents[1] = {indices_.document_index.size()};
  const std::size_t samples[2] = {indices_.sample_index.size() / 2, 2};
  const std::size_t shuffle[1] = {indices_.shuffle_index.size()};
  TRESTLE_RETURN_IF_ERROR(
      write_npy(base + "-document_index.npy", NpyDType::kInt32, documents, indices_.document_index));
  TRESTLE_RETURN_IF_ERROR(write_npy(base + "-sample_index.npy",
                                    indices_.sample_index_is_int64 ? NpyDType::kInt64 : NpyDType::kInt32, samples,
                                    indices_.sample_index));
  return write_npy(base + "-shuffle_index.npy", indices_.shuffle_index_is_int64 ? NpyDType::kInt64 : NpyDType::kUint32,
                   shuffle, indices_.shuffle_index);
}

Result<std::vector<std::int64_t>> GptDataset::sample(std::size_t i) const {
  if (i >= size())
    return Status::Error(dataset_->prefix() + ": sample " + std::to_string(i) + " of " + std::to_string(size()));
  const std::int64_t extra = config_.add_extra_token_to_sequence ? 1 : 0;
  const auto at = static_cast<std::size_t>(indices_.shuffle_index[i]);
  const std::int64_t first = indices_.sample_index[2 * at];
  const std::int64_t first_offset = indices_.sample_index[2 * at + 1];
  const std::int64_t last = indices_.sample_index[2 * at + 2];
  const std::int64_t last_offset = indices_.sample_index[2 * at + 3];
  const auto want = static_cast<std::size_t>(config_.sequence_length + extra);
  std::vector<std::int64_t> tokens;
  tokens.reserve(want);
  for (std::int64_t position = first; position <= last; ++position) {
    const auto sequence = static_cast<std::size_t>(indices_.document_index[static_cast<std::size_t>(position)]);
    const auto offset = static_cast<std::size_t>(position == first ? first_offset : 0);
    std::optional<std::size_t> length;
    if (position == last) {
      const std::int64_t end = last_offset + extra;
      if (end < static_cast<std::int64_t>(offset))
        return Status::Error(dataset_->prefix() + ": sample " + std::to_string(i) + " ends before it starts");
      length = static_cast<std::size_t>(end) - offset;
    }
    TRESTLE_RETURN_IF_ERROR(dataset_->read(sequence, offset, length, tokens));
  }
  if (tokens.size() > want)
    return Status::Error(dataset_->prefix() + ": sample " + std::to_string(i) + " has " +
                         std::to_string(tokens.size()) + " tokens, expected " + std::to_string(want));
  tokens.resize(want, config_.pad_token_id);
  return tokens;
}

}  // namespace trestle::data
