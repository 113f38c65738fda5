// torch.save archives: the zip (torch_zip.h) plus data.pkl (pickle_reader.h), with tensors recognised in the object
// tree (_rebuild_tensor_v2 or v3, optionally wrapped in _rebuild_parameter or _rebuild_from_type_v2) and their storages
// located in the archive. Views keep their storage offset and strides; copy_tensor() gathers any strided view into
// contiguous row-major order. Writing produces what torch.save writes for a single tensor or a pickled object.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/dtype.h"
#include "ckpt/shape.h"
#include "ckpt/strided_copy.h"
#include "convert/formats/torch/pickle_value.h"
#include "convert/formats/torch/torch_zip.h"

namespace trestle {

// A tensor inside a torch.save archive.
struct TorchTensorRef {
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<std::int64_t> stride;  // in elements
  std::int64_t storage_offset = 0;   // in elements
  std::string storage_key;           // "0", "1", ... (archive/data/<key>)
  std::uint64_t data_offset = 0;     // the storage's first byte, from the start of the archive bytes
  std::uint64_t storage_bytes = 0;
  bool contiguous() const;  // row-major with no gaps (storage_offset may be anything)
};

class TorchSaveArchive {
 public:
  // `bytes` must outlive the archive. `context` names the file (and item) in errors.
  static Result<TorchSaveArchive> parse(std::span<const std::byte> bytes, std::string context);

  const PickleValue* root() const { return doc_.root(); }
  const PickleDocument& document() const { return doc_; }
  const ZipArchive& zip() const { return zip_; }
  const std::string& context() const { return zip_.context(); }

  // The tensor `v` describes, nullopt when v is not a tensor, an error when it is a malformed one (naming it by `name`,
  // its key in the state dict, where given). Every view is checked to lie within its storage.
  Result<std::optional<TorchTensorRef>> tensor(const PickleValue* v, std::string_view name = {}) const;
  // Bytes of the archive (for a ref's data_offset).
  std::span<const std::byte> bytes() const { return bytes_; }
  // Copies the tensor's elements, in row-major order, to dst (numel × element size bytes).
  void copy_tensor(const TorchTensorRef& t, std::byte* dst) const;

 private:
  std::span<const std::byte> bytes_;
  ZipArchive zip_;
  PickleDocument doc_;
};

// The bytes of `torch.save(tensor)` for a contiguous tensor (layout, records and pickle as torch 2.x writes them).
std::string torch_save_tensor_bytes(DType dtype, const Shape& shape, std::span<const std::byte> data,
                                    const std::string& archive_name = "archive", std::string serialization_id = {});
// The bytes of `torch.save(obj)`: `storages[i]` is record data/<i>, the storage of the tensors made by
// torch_tensor_value(..., i) in obj (none for an object without tensors).
Result<std::string> torch_save_object_bytes(const PickleValue* obj, const std::string& archive_name = "archive",
                                            const std::vector<std::string>& storages = {});

// A contiguous CPU tensor as torch.save pickles it (_rebuild_tensor_v2, or v3 for fp8 and uint16/32/64, of storage
// record data/<storage>), in `doc`.
PickleValue* torch_tensor_value(PickleDocument& doc, DType dtype, const Shape& shape, std::size_t storage);
// The pickle (data.pkl) for one contiguous tensor whose storage is record "0".
std::string torch_tensor_pickle(DType dtype, const Shape& shape);
// The other small records torch.save adds, in its order around the data records.
void add_torch_save_header_records(TorchZipWriter& zip, std::string data_pkl);
// serialization_id: empty for a fresh one (torch writes 40 decimal digits that differ on every save).
void add_torch_save_trailer_records(TorchZipWriter& zip, std::uint32_t data_crc, std::string serialization_id = {});

// torch.<X>Storage class names and dtype names ("float8_e4m3fn") to our dtypes, and back.
std::optional<DType> dtype_from_torch_storage(const std::string& name);
std::string torch_storage_name(DType dtype);

}  // namespace trestle
