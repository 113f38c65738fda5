#include "convert/formats/safetensors/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/atomic_file.h"

namespace trestle {
namespace {

// The position of a dtype in the safetensors crate's Dtype enum, which orders types by alignment. The reference
// writer lays tensors out by descending rank, then by name, so every tensor is aligned and files match byte for byte.
int reference_rank(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return 0;
    case DType::kU8:
      return 4;
    case DType::kI8:
      return 5;
    case DType::kF8E5M2:
      return 6;
    case DType::kF8E4M3:
      return 7;
    case DType::kI16:
      return 9;
    case DType::kU16:
      return 10;
    case DType::kF16:
      return 11;
    case DType::kBF16:
      return 12;
    case DType::kI32:
      return 13;
    case DType::kU32:
      return 14;
    case DType::kF32:
      return 15;
    case DType::kF64:
      return 17;
    case DType::kI64:
      return 18;
    case DType::kU64:
      return 19;
  }
  return 0;
}

}  // namespace

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::create(
    const std::string& path, std::vector<TensorSpec> specs, const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& s : specs) {
    if (!names.insert(s.name).second) return Status::Error(path + ": tensor '" + s.name + "' given twice");
    if (s.name == "__metadata__") return Status::Error(path + ": '__metadata__' is reserved, not a tensor name");
  }
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    const auto ra = reference_rank(a.dtype), rb = reference_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  std::vector<SafetensorsEntry> entries;
  std::uint64_t cursor = 0;
  for (const auto& s : specs) {
    const auto bytes = checked_nbytes(s.shape, dtype_size(s.dtype));
    if (!bytes) return Status::Error(path + ": tensor '" + s.name + "' has an invalid shape " + to_string(s.shape));
    entries.push_back({s.name, s.dtype, s.shape, cursor, cursor + *bytes});
    cursor += *bytes;
  }
  const std::string header = serialize_safetensors_header(entries, metadata);

  const std::string temp = temporary_sibling(path);
  TRESTLE_ASSIGN_OR_RETURN(auto file, RangeFileWriter::create(temp, header.size() + cursor));
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter(path, temp, std::move(file)));
  for (const auto& e : entries) writer->slots_[e.name] = {header.size() + e.begin, e.nbytes(), 0};
  TRESTLE_RETURN_IF_ERROR(writer->file_->write(0, std::as_bytes(std::span(header.data(), header.size()))));
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() {
  file_.reset();
  if (!committed_) ::unlink(temp_path_.c_str());
}

Status SafetensorsWriter::write(const std::string& name, std::span<const std::byte> data) {
  auto it = slots_.find(name);
  if (it != slots_.end() && data.size() != it->second.nbytes)
    return Status::Error(path_ + ": tensor '" + name + "' expects " + std::to_string(it->second.nbytes) +
                         " bytes, got " + std::to_string(data.size()));
  return write_part(name, 0, data);
}

Status SafetensorsWriter::write_part(const std::string& name, std::uint64_t offset, std::span<const std::byte> data) {
  if (committed_) return Status::Error(path_ + ": write after commit");
  auto it = slots_.find(name);
  if (it == slots_.end()) return Status::Error(path_ + ": tensor '" + name + "' is not part of this file");
  Slot& slot = it->second;
  if (offset > slot.nbytes || data.size() > slot.nbytes - offset || slot.written + data.size() > slot.nbytes)
    return Status::Error(path_ + ": tensor '" + name + "': bytes [" + std::to_string(offset) + ", " +
                         std::to_string(offset + data.size()) + ") exceed its " + std::to_string(slot.nbytes) +
                         " bytes or were already written");
  TRESTLE_RETURN_IF_ERROR(file_->write(slot.file_offset + offset, data));
  slot.written += data.size();
  return OkStatus();
}

Status SafetensorsWriter::check_complete() const {
  std::vector<std::string> missing;
  for (const auto& [name, slot] : slots_)
    if (slot.written != slot.nbytes) missing.push_back(name);
  if (!missing.empty()) {
    std::sort(missing.begin(), missing.end());
    std::string list;
    for (std::size_t i = 0; i < missing.size() && i < 10; ++i) list += (i ? ", " : "") + missing[i];
    return Status::Error(path_ + ": " + std::to_string(missing.size()) + " tensor(s) not completely written: " + list);
  }
  return OkStatus();
}

Status SafetensorsWriter::commit() {
  if (committed_) return OkStatus();
  TRESTLE_RETURN_IF_ERROR(check_complete());
  TRESTLE_RETURN_IF_ERROR(file_->finish());
  file_.reset();
  TRESTLE_RETURN_IF_ERROR(commit_rename(temp_path_, path_));
  committed_ = true;
  return OkStatus();
}

std::vector<std::vector<TensorSpec>> plan_safetensors_shards(const std::vector<TensorSpec>& specs,
                                                             std::uint64_t max_shard_bytes) {
  // As huggingface_hub's split_state_dict_into_shards_factory: an oversized tensor is appended as a shard of its own
  // at once, while the shard being filled stays open (so it comes after it) until the next tensor would overflow it.
  std::vector<std::vector<TensorSpec>> shards;
  std::vector<TensorSpec> current;
  std::uint64_t current_bytes = 0;
  for (const auto& s : specs) {
    const auto bytes = s.nbytes();
    if (bytes > max_shard_bytes) {
      shards.push_back({s});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(s);
    current_bytes += bytes;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  return shards;
}

Result<std::unique_ptr<ShardedSafetensorsWriter>> ShardedSafetensorsWriter::create(
    const std::string& dir, const std::vector<TensorSpec>& specs, std::uint64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata, const std::string& prefix) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Error(dir + ": cannot create directory: " + ec.message());
  auto writer = std::unique_ptr<ShardedSafetensorsWriter>(new ShardedSafetensorsWriter());
  writer->dir_ = dir;
  writer->prefix_ = prefix;
  const auto plan = plan_safetensors_shards(specs, max_shard_bytes);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    char numbers[48];
    std::snprintf(numbers, sizeof numbers, "-%05zu-of-%05zu", i + 1, plan.size());
    const std::string name = prefix + (plan.size() == 1 ? "" : numbers) + ".safetensors";
    writer->shard_files_.push_back(name);
    TRESTLE_ASSIGN_OR_RETURN(auto shard, SafetensorsWriter::create(dir + "/" + name, plan[i], metadata));
    writer->shards_.push_back(std::move(shard));
    for (const auto& s : plan[i]) {
      writer->weight_map_[s.name] = i;
      writer->total_bytes_ += s.nbytes();
      writer->total_parameters_ += static_cast<std::uint64_t>(numel(s.shape));
    }
  }
  return writer;
}

Result<SafetensorsWriter*> ShardedSafetensorsWriter::shard_of(const std::string& name) {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) return Status::Error(dir_ + ": tensor '" + name + "' is not part of this checkpoint");
  return shards_[it->second].get();
}

Status ShardedSafetensorsWriter::write(const std::string& name, std::span<const std::byte> data) {
  TRESTLE_ASSIGN_OR_RETURN(SafetensorsWriter * shard, shard_of(name));
  return shard->write(name, data);
}

Status ShardedSafetensorsWriter::write_part(const std::string& name, std::uint64_t offset,
                                            std::span<const std::byte> data) {
  TRESTLE_ASSIGN_OR_RETURN(SafetensorsWriter * shard, shard_of(name));
  return shard->write_part(name, offset, data);
}

Status ShardedSafetensorsWriter::commit() {
  // Every shard must be complete before the first one is renamed into place: a failed commit leaves no shard behind.
  for (auto& shard : shards_) TRESTLE_RETURN_IF_ERROR(shard->check_complete());
  for (auto& shard : shards_) TRESTLE_RETURN_IF_ERROR(shard->commit());
  if (shards_.size() == 1) return OkStatus();
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_parameters", total_parameters_}, {"total_size", total_bytes_}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (const auto& [name, shard] : weight_map_) index["weight_map"][name] = shard_files_[shard];
  return write_file_atomically(dir_ + "/" + prefix_ + ".safetensors.index.json", index.dump(2) + "\n");
}

}  // namespace trestle
