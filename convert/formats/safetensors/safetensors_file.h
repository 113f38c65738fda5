// One safetensors file, memory-mapped and validated on open; tensors are zero-copy views into the map.
#pragma once

#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ckpt/mapped_file.h"
#include "ckpt/tensor_view.h"
#include "convert/formats/safetensors/safetensors_header.h"

namespace trestle {

class SafetensorsFile {
 public:
  // Fails with "<path>: <what is wrong>" for any malformed file.
  static Result<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::vector<SafetensorsEntry>& tensors() const { return header_.tensors; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  std::uint64_t data_start() const { return header_.data_start; }
  std::uint64_t file_size() const { return file_.size(); }

  const SafetensorsEntry* find(const std::string& name) const;
  // Zero-copy view; valid while this object lives. Fails naming the file when the tensor is absent.
  Result<ConstTensorView> view(const std::string& name) const;
  ConstTensorView view(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile(MappedFile file, SafetensorsHeader header);
  MappedFile file_;
  SafetensorsHeader header_;
  std::unordered_map<std::string, std::size_t> index_;
};

}  // namespace trestle
