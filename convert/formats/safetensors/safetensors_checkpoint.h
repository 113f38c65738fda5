// A Hugging Face safetensors checkpoint: one file, a directory with one *.safetensors file, or a sharded directory
// with "<prefix>.safetensors.index.json". Every shard is mapped and validated on open, and the index must agree
// with the shards exactly (no missing shard, no shard named "<prefix>-N-of-M.safetensors" left unlisted, no tensor
// listed twice or left out, not an empty weight_map).
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "convert/formats/safetensors/safetensors_file.h"

namespace trestle {

class SafetensorsCheckpoint {
 public:
  struct Located {
    const SafetensorsFile* file;
    const SafetensorsEntry* entry;
  };

  static Result<SafetensorsCheckpoint> open(const std::string& path);

  const std::string& root() const { return root_; }              // the directory (or the file, when opened as one)
  const std::string& index_path() const { return index_path_; }  // empty when not sharded
  const std::vector<SafetensorsFile>& files() const { return files_; }
  const std::vector<std::string>& names() const { return names_; }  // sorted
  std::size_t size() const { return names_.size(); }

  Result<Located> find(const std::string& name) const;
  Result<ConstTensorView> view(const std::string& name) const;

 private:
  Status add_file(SafetensorsFile file);
  std::string root_;
  std::string index_path_;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, std::pair<std::size_t, const SafetensorsEntry*>> by_name_;
};

// The weight map of a *.safetensors.index.json's text: tensor name -> shard file (a plain name in the index's
// directory). Errors name `index_path`.
Result<std::map<std::string, std::string>> parse_safetensors_index(std::string_view text,
                                                                   const std::string& index_path);

}  // namespace trestle
