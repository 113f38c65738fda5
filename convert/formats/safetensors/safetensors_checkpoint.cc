#include "convert/formats/safetensors/safetensors_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt/file_name.h"
#include "ckpt/json_file.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<std::string> files_in(const std::string& dir, const std::string& suffix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    // Not only regular files: a FIFO or a dangling link named like one is refused by name when opened, not ignored.
    if (!it->is_directory(type_ec) && ends_with(it->path().filename().string(), suffix))
      out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// True for "<prefix>-00003-of-00009.safetensors": the name transformers gives a shard of
// "<prefix>.safetensors.index.json".
bool is_shard_name_of(const std::string& file, const std::string& prefix) {
  const std::string suffix = ".safetensors";
  if (file.size() <= prefix.size() + 1 + suffix.size() || file.compare(0, prefix.size() + 1, prefix + "-") != 0 ||
      !ends_with(file, suffix))
    return false;
  const std::string numbers = file.substr(prefix.size() + 1, file.size() - prefix.size() - 1 - suffix.size());
  const std::size_t of = numbers.find("-of-");
  auto digits = [](const std::string& s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return of != std::string::npos && digits(numbers.substr(0, of)) && digits(numbers.substr(of + 4));
}

}  // namespace

Result<std::map<std::string, std::string>> parse_safetensors_index(std::string_view text,
                                                                   const std::string& index_path) {
  TRESTLE_ASSIGN_OR_RETURN(const nlohmann::json index, parse_json_text(text, index_path));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    return Status::Error(index_path + ": expected an object with a 'weight_map' object");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) return Status::Error(index_path + ": weight_map['" + name + "'] is not a file name");
    const auto shard = file.get<std::string>();
    if (!is_plain_file_name(shard))
      return Status::Error(index_path + ": weight_map['" + name + "'] = '" + shard +
                           "' is not a file in the directory");
    map[name] = shard;
  }
  return map;
}

Status SafetensorsCheckpoint::add_file(SafetensorsFile file) {
  const std::size_t index = files_.size();
  files_.push_back(std::move(file));
  for (const auto& entry : files_.back().tensors()) {
    auto [it, inserted] = by_name_.try_emplace(entry.name, index, &entry);
    if (!inserted)
      return Status::Error("tensor '" + entry.name + "' is in both " + files_[it->second.first].path() + " and " +
                           files_.back().path());
    names_.push_back(entry.name);
  }
  return OkStatus();
}

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& path) {
  SafetensorsCheckpoint ckpt;
  ckpt.root_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::Error(path + ": no such file or directory");
  if (!fs::is_directory(path, ec)) {
    TRESTLE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    TRESTLE_RETURN_IF_ERROR(ckpt.add_file(std::move(file)));
    std::sort(ckpt.names_.begin(), ckpt.names_.end());
    return ckpt;
  }

  const auto indexes = files_in(path, ".safetensors.index.json");
  if (indexes.size() > 1) return Status::Error(path + ": several *.safetensors.index.json files; open one of them");
  if (indexes.empty()) {
    const auto shards = files_in(path, ".safetensors");
    if (shards.size() != 1)
      return Status::Error(path + ": expected one *.safetensors file or a *.safetensors.index.json, found " +
                           std::to_string(shards.size()) + " safetensors files and no index");
    TRESTLE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path + "/" + shards[0]));
    TRESTLE_RETURN_IF_ERROR(ckpt.add_file(std::move(file)));
    std::sort(ckpt.names_.begin(), ckpt.names_.end());
    return ckpt;
  }

  ckpt.index_path_ = path + "/" + indexes[0];
  TRESTLE_ASSIGN_OR_RETURN(const std::string index_text, read_text_file(ckpt.index_path_));
  TRESTLE_ASSIGN_OR_RETURN(const auto weight_map, parse_safetensors_index(index_text, ckpt.index_path_));
  std::vector<std::string> shard_names;
  for (const auto& [name, shard] : weight_map)
    if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) shard_names.push_back(shard);
  std::sort(shard_names.begin(), shard_names.end());
  if (weight_map.empty()) return Status::Error(ckpt.index_path_ + ": its weight_map lists no tensors");
  // model.safetensors beside model.safetensors.index.json: transformers loads the single file, other loaders the
  // index's shards. Which weights the directory means is unknowable, so neither is picked.
  const std::string single = indexes[0].substr(0, indexes[0].size() - std::string(".index.json").size());
  if (std::find(shard_names.begin(), shard_names.end(), single) == shard_names.end() &&
      fs::exists(fs::symlink_status(path + "/" + single, ec)))
    return Status::Error(path + ": holds both " + single + " and " + indexes[0] +
                         " with its shards, two sets of weights (transformers loads " + single +
                         ", other loaders the shards); remove the one that is not meant");
  // A shard of the index's own naming that it does not list would be left out of the model without a word.
  const std::string prefix = single.substr(0, single.size() - std::string(".safetensors").size());
  for (const auto& file : files_in(path, ".safetensors"))
    if (is_shard_name_of(file, prefix) && !std::binary_search(shard_names.begin(), shard_names.end(), file))
      return Status::Error(ckpt.index_path_ + ": does not list shard " + file +
                           " beside it, so its tensors would be left out; the index and shards disagree");
  for (const auto& shard : shard_names) {
    const std::string shard_path = path + "/" + shard;
    if (!fs::exists(shard_path, ec))
      return Status::Error(ckpt.index_path_ + ": names shard '" + shard + "', which does not exist");
    TRESTLE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(shard_path));
    TRESTLE_RETURN_IF_ERROR(ckpt.add_file(std::move(file)));
  }
  for (const auto& [name, shard] : weight_map) {
    auto it = ckpt.by_name_.find(name);
    if (it == ckpt.by_name_.end() || fs::path(ckpt.files_[it->second.first].path()).filename() != shard)
      return Status::Error(ckpt.index_path_ + ": maps tensor '" + name + "' to " + shard +
                           ", but that file has no such tensor");
  }
  for (const auto& name : ckpt.names_)
    if (!weight_map.count(name))
      return Status::Error(ckpt.index_path_ + ": tensor '" + name + "' of " +
                           ckpt.files_[ckpt.by_name_.at(name).first].path() + " is not in the weight_map");
  std::sort(ckpt.names_.begin(), ckpt.names_.end());
  return ckpt;
}

Result<SafetensorsCheckpoint::Located> SafetensorsCheckpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Status::Error(root_ + ": no tensor named '" + name + "'");
  return Located{&files_[it->second.first], it->second.second};
}

Result<ConstTensorView> SafetensorsCheckpoint::view(const std::string& name) const {
  TRESTLE_ASSIGN_OR_RETURN(Located at, find(name));
  return at.file->view(*at.entry);
}

}  // namespace trestle
