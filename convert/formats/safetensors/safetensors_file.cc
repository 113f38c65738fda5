#include "convert/formats/safetensors/safetensors_file.h"

namespace trestle {

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(MappedFile file, MappedFile::open(path));
  const auto bytes = file.bytes();
  const std::string_view prefix(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  auto header = parse_safetensors_header(prefix, bytes.size());
  if (!header.ok()) return header.status().with_context(path);
  return SafetensorsFile(std::move(file), std::move(header).value());
}

SafetensorsFile::SafetensorsFile(MappedFile file, SafetensorsHeader header)
    : file_(std::move(file)), header_(std::move(header)) {
  for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

Result<ConstTensorView> SafetensorsFile::view(const std::string& name) const {
  const auto* entry = find(name);
  if (!entry) return Status::Error(path() + ": no tensor named '" + name + "'");
  return view(*entry);
}

ConstTensorView SafetensorsFile::view(const SafetensorsEntry& entry) const {
  return {entry.dtype, entry.shape, file_.bytes().data() + header_.data_start + entry.begin};
}

}  // namespace trestle
