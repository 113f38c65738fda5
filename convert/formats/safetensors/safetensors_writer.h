// Streaming safetensors writers: the header is laid out up front from tensor specs, then each tensor's bytes are
// written as they become available (whole or in parts, any order) through the O_DIRECT range writer. Output goes to a
// temporary file that commit() syncs and renames into place, so an existing file is never half-overwritten.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ckpt/range_file_writer.h"
#include "ckpt/status.h"
#include "ckpt/tensor_view.h"
#include "convert/formats/safetensors/safetensors_header.h"

namespace trestle {

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(numel(shape)) * dtype_size(dtype); }
};

class SafetensorsWriter {
 public:
  // Orders tensors as the reference writer does (by its dtype order, widest first, then by name) so each is aligned
  // and the file is byte-identical to safetensors' for the same tensors and metadata.
  static Result<std::unique_ptr<SafetensorsWriter>> create(const std::string& path, std::vector<TensorSpec> specs,
                                                           const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();  // removes the temporary file unless committed
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return slots_.count(name) != 0; }
  Status write(const std::string& name, std::span<const std::byte> data);
  // Writes bytes [offset, offset + data.size()) of the tensor; the parts of a tensor must not overlap.
  Status write_part(const std::string& name, std::uint64_t offset, std::span<const std::byte> data);
  // Fails naming any tensor not completely written.
  Status check_complete() const;
  // check_complete(), then syncs and renames the file into place.
  Status commit();

 private:
  struct Slot {
    std::uint64_t file_offset = 0;
    std::uint64_t nbytes = 0;
    std::uint64_t written = 0;
  };
  SafetensorsWriter(std::string path, std::string temp_path, std::unique_ptr<RangeFileWriter> file)
      : path_(std::move(path)), temp_path_(std::move(temp_path)), file_(std::move(file)) {}
  std::string path_;
  std::string temp_path_;
  std::unique_ptr<RangeFileWriter> file_;
  bool committed_ = false;
  std::unordered_map<std::string, Slot> slots_;
};

// How save_pretrained cuts shards: tensors in the given order fill a shard until the next one would pass
// max_shard_bytes; a tensor larger than the limit gets a shard of its own, placed before the shard still being filled.
std::vector<std::vector<TensorSpec>> plan_safetensors_shards(const std::vector<TensorSpec>& specs,
                                                             std::uint64_t max_shard_bytes);

// A sharded Hugging Face checkpoint: "model.safetensors" when one shard suffices, otherwise
// "model-0000i-of-0000n.safetensors" plus "model.safetensors.index.json" (written last, on commit).
class ShardedSafetensorsWriter {
 public:
  static Result<std::unique_ptr<ShardedSafetensorsWriter>> create(const std::string& dir,
                                                                  const std::vector<TensorSpec>& specs,
                                                                  std::uint64_t max_shard_bytes,
                                                                  const std::map<std::string, std::string>& metadata,
                                                                  const std::string& prefix = "model");

  const std::vector<std::string>& shard_files() const { return shard_files_; }
  Status write(const std::string& name, std::span<const std::byte> data);
  Status write_part(const std::string& name, std::uint64_t offset, std::span<const std::byte> data);
  Status commit();

 private:
  Result<SafetensorsWriter*> shard_of(const std::string& name);
  std::string dir_;
  std::string prefix_;
  std::vector<std::string> shard_files_;
  std::vector<std::unique_ptr<SafetensorsWriter>> shards_;
  std::map<std::string, std::size_t> weight_map_;
  std::uint64_t total_bytes_ = 0;
  std::uint64_t total_parameters_ = 0;
};

}  // namespace trestle
