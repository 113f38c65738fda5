// PyTorch DCP's `.metadata`: a pickled Metadata (state_dict_metadata of TensorStorageMetadata / BytesStorageMetadata,
// storage_data mapping MetadataIndex -> _StorageInfo), read into plain structs and written back as torch writes it
// (protocol 4, module torch.distributed.checkpoint). Both module paths are accepted on read
// (torch.distributed.checkpoint and the older torch.distributed._shard.checkpoint).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/dtype.h"
#include "ckpt/status.h"

namespace trestle {

// Where an item's bytes live: [offset, offset + length) of `file` (relative to the checkpoint directory).
struct DcpStorage {
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::vector<std::string> transforms;  // DCP storage extensions applied to the item (none by default)
};

struct DcpChunk {
  Box box;  // within the tensor's global shape
  DcpStorage storage;
};

struct DcpTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<DcpChunk> chunks;
};

// A non-tensor value (torch.save'd object, or Megatron's sharded objects / common state).
struct DcpBytesItem {
  std::string name;
  DcpStorage storage;
};

struct DcpMetadata {
  std::vector<DcpTensor> tensors;   // in the order of state_dict_metadata
  std::vector<DcpBytesItem> bytes;  // likewise
  std::string version;              // "1.0.0" (absent in older checkpoints: empty)
  std::string module;               // the module path the classes were pickled under
  // Tensors listed but not readable here (name, why: a dtype Trestle has no equivalent of), left out of `tensors`.
  std::vector<std::pair<std::string, std::string>> unreadable;
  const DcpTensor* find_tensor(const std::string& name) const;
  // Why a tensor `tensors` lacks is not there: "no tensor 'x'", or that it is listed with a dtype Trestle cannot read.
  std::string missing_tensor(const std::string& name) const;
  const DcpBytesItem* find_bytes(const std::string& name) const;
};

// Errors name `context` (the .metadata path) and the tensor or entry that is malformed: chunks outside the tensor,
// storage entries missing for a chunk, unknown dtypes, ...
Result<DcpMetadata> parse_dcp_metadata(std::string_view pickle_bytes, const std::string& context);
// The pickle torch 2.x writes for this metadata (classes under torch.distributed.checkpoint).
Result<std::string> write_dcp_metadata(const DcpMetadata& metadata);

}  // namespace trestle
