#include "tools/load_directory.h"

#include <charconv>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <system_error>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/load.h"
#include "convert/bridge/megatron_args.h"
#include "convert/sources/canonical_source.h"

namespace trestle::cli {

namespace fs = std::filesystem;

std::string iteration_directory(const std::string& root, std::optional<std::int64_t> step) {
  if (!step) {
    const auto tracker = read_tracker(root);  // a bad one is reported when the root is read as a Trestle checkpoint
    if (!tracker.ok() || !tracker->present) return root;
    return tracked_iteration_dir(root, *tracker);  // Megatron's release/ too
  }
  return (fs::path(root) / iteration_dir_name(*step)).string();
}

bool is_torch_dist(const std::string& directory) {
  std::error_code error;
  return fs::exists(fs::path(directory) / ".metadata", error) &&
         fs::exists(fs::path(directory) / "metadata.json", error) &&
         !fs::exists(fs::path(directory) / "manifest.json", error);
}

bool is_legacy_megatron(const std::string& directory) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error))
    if (entry.path().filename().string().starts_with("mp_rank_") && entry.is_directory(error)) return true;
  return false;
}

namespace {

// --seq-length (or --encoder-seq-length) in a trainer's recorded command line: "--seq-length S" or "--seq-length=S".
std::optional<std::int64_t> recorded_seq_length(const nlohmann::json& argv) {
  if (!argv.is_array()) return std::nullopt;
  auto number = [](std::string_view text) -> std::optional<std::int64_t> {
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error != std::errc() || end != text.data() + text.size() || value < 1) return std::nullopt;
    return value;
  };
  std::optional<std::int64_t> found;  // (the last one given, as a parser takes it)
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (!argv[i].is_string()) continue;
    const std::string& word = argv[i].get_ref<const std::string&>();
    for (std::string_view flag : {"--seq-length", "--encoder-seq-length"}) {
      if (word == flag && i + 1 < argv.size() && argv[i + 1].is_string()) {
        if (const auto v = number(argv[i + 1].get_ref<const std::string&>())) found = v;
      } else if (word.starts_with(std::string(flag) + "=")) {
        if (const auto v = number(std::string_view(word).substr(flag.size() + 1))) found = v;
      }
    }
  }
  return found;
}

}  // namespace

Result<std::optional<std::int64_t>> checkpoint_seq_length(const std::string& root, std::optional<std::int64_t> step) {
  std::error_code error;
  if (!fs::is_directory(root, error)) return std::optional<std::int64_t>();
  if (!step) TRESTLE_RETURN_IF_ERROR(read_tracker(root).status());  // (a damaged tracker: said, not passed over)
  const std::string dir = iteration_directory(root, step);
  if (!fs::is_directory(dir, error)) return std::optional<std::int64_t>();
  if (is_torch_dist(dir)) {
    TRESTLE_ASSIGN_OR_RETURN(const nlohmann::json kept, read_torch_dist_run_args(dir, std::nullopt));
    return kept_seq_length(kept);
  }
  if (is_legacy_megatron(dir)) {
    TRESTLE_ASSIGN_OR_RETURN(const nlohmann::json kept, read_legacy_run_args(dir));
    return kept_seq_length(kept);
  }
  if (!fs::exists(fs::path(dir) / "manifest.json", error)) return std::optional<std::int64_t>();
  TRESTLE_ASSIGN_OR_RETURN(const CheckpointReader reader, CheckpointReader::open_directory(dir));
  const nlohmann::json& training = reader.manifest().training;
  if (const auto kept = training.find("megatron_args"); kept != training.end())
    if (const auto seq = kept_seq_length(*kept)) return seq;
  const auto argv = training.find("args");
  return argv == training.end() ? std::optional<std::int64_t>() : recorded_seq_length(*argv);
}

}  // namespace trestle::cli
