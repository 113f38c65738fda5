// Megatron-Core `torch_dist` checkpoints, i.e. PyTorch DCP directories: `.metadata` + `__{rank}_{i}.distcp` item files
// (each item a complete torch.save archive of one tensor chunk or one pickled object; raw bytes where DCP's
// safetensors serialization wrote them) + Megatron's `metadata.json` and `common.pt`.
//
// Reading presents a state dict of named tensors, each a global shape and dtype with chunks (boxes of the global
// tensor and where their bytes live), plus the non-tensor items; read_box() fills any box of a tensor from the chunks
// it overlaps (reshard on read). Writing takes per-rank pieces: each rank writes `__{rank}_0.distcp` with the
// project's FileWriter (tensor payloads 4 KiB-aligned inside torch.save-compatible zips), then rank 0 writes
// `.metadata` from every rank's item table. Names are left exactly as stored; mapping them is the bridge's job.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/file_writer.h"
#include "ckpt/io_options.h"
#include "ckpt/mapped_file.h"
#include "convert/formats/torch/dcp_metadata.h"
#include "convert/formats/torch/torch_save.h"

namespace trestle {

// A torch.save'd object (common.pt, a bytes item) kept with the bytes it points into.
struct TorchSavedObject {
  std::string context;
  std::shared_ptr<const std::string> bytes;  // owned copy of the archive
  std::shared_ptr<const TorchSaveArchive> archive;
  const PickleValue* root() const { return archive->root(); }
};

Result<TorchSavedObject> parse_torch_saved(std::string bytes, std::string context);

class DcpCheckpoint {
 public:
  struct OpenOptions {
    // The metadata file: ".metadata", or a rank's own "__<rank>.metadata" (what torch's FileSystemWriter writes when
    // saving without collectives).
    std::string metadata_name = ".metadata";
    // Whether tensors of dtypes Trestle cannot read are refused when opening (the converters, which read every tensor)
    // or only where read (a partial load: DcpMetadata::unreadable).
    bool refuse_unreadable = true;
  };
  // Opens a directory holding the metadata file; reads metadata.json and common.pt when present.
  static Result<DcpCheckpoint> open(const std::string& dir, const OpenOptions& options);
  static Result<DcpCheckpoint> open(const std::string& dir) { return open(dir, OpenOptions{}); }

  const std::string& directory() const { return dir_; }
  const DcpMetadata& metadata() const { return metadata_; }
  const std::optional<nlohmann::json>& megatron_metadata() const { return megatron_; }  // metadata.json
  const std::optional<TorchSavedObject>& common_state() const { return common_; }       // common.pt
  std::vector<std::string> files() const;  // the distinct item files, sorted
  std::string metadata_path() const;       // <dir>/.metadata (or the rank's), for errors

  // The raw bytes of a non-tensor item, and the same parsed as torch.save (when it is one).
  Result<std::string> read_bytes(const DcpBytesItem& item) const;
  Result<TorchSavedObject> read_object(const DcpBytesItem& item) const;

  // Fills `destination` (box.numel() elements of the tensor's dtype, row-major over the box) from every chunk the box
  // overlaps; fails naming the file, tensor and box when part of the box is stored nowhere, an item is malformed or a
  // torch.save record's data does not match its zip CRC-32 (each record is checked once).
  Status read_box(const std::string& name, const Box& box, std::byte* destination) const;

 private:
  // The item's bytes in the file's memory map (headers and small items are read through it).
  Result<std::span<const std::byte>> item_bytes(const DcpStorage& storage, const std::string& what) const;
  // Copies a strided region of an item's payload (starting at byte `at` of the file) into `destination`: large regions
  // read with O_DIRECT into a reused buffer, small ones from the memory map (`mapped`).
  Status copy_region(const std::string& file, std::uint64_t at, const std::byte* mapped,
                     const std::vector<std::int64_t>& src_stride, std::byte* destination,
                     const std::vector<std::int64_t>& dst_stride, const Shape& count, std::size_t element_size,
                     const std::string& what) const;

  // Checks the CRC-32 of the zip record of `size` bytes at byte `at` of `file` by reading it through, once per record.
  Status verify_record(const std::string& file, std::uint64_t at, std::uint64_t size, std::uint32_t expected,
                       const std::string& what) const;

  struct Files;  // the item files, mapped and opened for direct reads on first use, and read buffers; thread-safe

  std::string dir_;
  std::string metadata_name_ = ".metadata";
  DcpMetadata metadata_;
  std::optional<nlohmann::json> megatron_;
  std::optional<TorchSavedObject> common_;
  std::shared_ptr<Files> files_;
};

// One rank's part of a DCP save.
struct DcpTensorPiece {
  std::string name;
  DType dtype = DType::kF32;
  Shape global_shape;
  Box box;                          // this rank's chunk
  std::span<const std::byte> data;  // box.numel() elements, row-major
};
struct DcpObjectPiece {
  std::string name;
  std::string torch_saved;  // the item's bytes: torch_save_object_bytes(...) or any torch.save archive
};

// What one rank wrote; rank 0 gathers these (in any order) to write .metadata.
struct DcpRankItems {
  std::vector<DcpTensor> tensors;  // each with the chunks this rank stored
  std::vector<DcpBytesItem> bytes;
};

// Writes `<dir>/__{rank}_0.distcp` (replacing it) one item at a time, so only the item being added is in memory;
// finish() syncs the file and returns its item table.
class DcpRankFileWriter {
 public:
  static Result<DcpRankFileWriter> create(const std::string& dir, int rank, const IoOptions& io = {});
  Status add_object(const DcpObjectPiece& object);
  Status add_tensor(const DcpTensorPiece& piece);
  Result<DcpRankItems> finish();

 private:
  std::string file_, path_;
  std::unique_ptr<FileWriter> writer_;
  DcpRankItems items_;
};

// Writes `<dir>/__{rank}_0.distcp` (replacing it) and returns its item table.
Result<DcpRankItems> write_dcp_rank_file(const std::string& dir, int rank, const std::vector<DcpTensorPiece>& tensors,
                                         const std::vector<DcpObjectPiece>& objects, const IoOptions& io = {});
// Merges every rank's items (checking that the chunks of each tensor agree on dtype and shape and cover it exactly)
// and writes `<dir>/.metadata` atomically.
Status write_dcp_metadata_file(const std::string& dir, const std::vector<DcpRankItems>& ranks);
// Megatron's metadata.json for a torch_dist checkpoint.
Status write_megatron_metadata_json(const std::string& dir);

}  // namespace trestle
