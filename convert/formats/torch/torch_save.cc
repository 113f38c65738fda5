#include "convert/formats/torch/torch_save.h"

#include <cstring>
#include <random>

#include "ckpt/crc32.h"
#include "convert/formats/torch/pickle_reader.h"
#include "convert/formats/torch/pickle_writer.h"

namespace trestle {
namespace {

struct StorageName {
  const char* name;
  DType dtype;
};

constexpr StorageName kStorages[] = {
    {"FloatStorage", DType::kF32},     {"DoubleStorage", DType::kF64}, {"HalfStorage", DType::kF16},
    {"BFloat16Storage", DType::kBF16}, {"LongStorage", DType::kI64},   {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},     {"CharStorage", DType::kI8},    {"ByteStorage", DType::kU8},
    {"BoolStorage", DType::kBool},
};

// torch.save's calls that rebuild a tensor from a storage: _rebuild_tensor_v3 for the dtypes without a typed storage
// class (fp8, uint16/32/64: an UntypedStorage counted in bytes, the dtype the call's 7th argument).
bool is_rebuild_tensor(const std::string& cls) {
  return cls == "torch._utils._rebuild_tensor_v2" || cls == "torch._utils._rebuild_tensor_v3" ||
         cls == "torch._utils._rebuild_tensor";
}

constexpr const char* kUntypedStorage = "UntypedStorage";

// Unwraps _rebuild_parameter(tensor, ...) and _rebuild_from_type_v2(func, type, args, state) to the
// _rebuild_tensor_v2/v3 call; returns its argument tuple, or nullptr when v is not a tensor.
const PickleValue* rebuild_tensor_args(const PickleValue* v, int depth = 0) {
  if (!v || v->kind != PickleKind::kObject || !v->args || depth > 4) return nullptr;
  const std::string cls = v->class_name();
  const auto& args = v->args->items;
  if (is_rebuild_tensor(cls)) return v->args;
  if ((cls == "torch._utils._rebuild_parameter" || cls == "torch._utils._rebuild_parameter_with_state") &&
      !args.empty())
    return rebuild_tensor_args(args[0], depth + 1);
  if (cls == "torch._tensor._rebuild_from_type_v2" && args.size() >= 3 && args[0]->kind == PickleKind::kGlobal &&
      args[2]->kind == PickleKind::kTuple && is_rebuild_tensor(args[0]->class_name()))
    return args[2];
  return nullptr;
}

}  // namespace

std::optional<DType> dtype_from_torch_storage(const std::string& name) {
  for (const auto& s : kStorages)
    if (name == s.name) return s.dtype;
  return parse_dtype(name);
}

std::string torch_storage_name(DType dtype) {
  for (const auto& s : kStorages)
    if (s.dtype == dtype) return s.name;
  return {};
}

bool TorchTensorRef::contiguous() const {
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

Result<TorchSaveArchive> TorchSaveArchive::parse(std::span<const std::byte> bytes, std::string context) {
  if (bytes.size() >= 2 && static_cast<char>(bytes[0]) == '\x80')
    return Status::Error(context + ": a legacy (pre-1.6, non-zip) torch.save file; re-save it with a newer torch");
  TorchSaveArchive archive;
  archive.bytes_ = bytes;
  TRESTLE_ASSIGN_OR_RETURN(archive.zip_, ZipArchive::parse(bytes, std::move(context)));
  const std::string& ctx = archive.zip_.context();
  if (archive.zip_.prefix().empty()) return Status::Error(ctx + ": not a torch.save archive (no <name>/data.pkl)");
  if (const ZipEntry* order = archive.zip_.find("byteorder")) {
    TRESTLE_ASSIGN_OR_RETURN(auto raw, archive.zip_.read(*order));
    if (std::string_view(reinterpret_cast<const char*>(raw.data()), raw.size()) != "little")
      return Status::Error(ctx + ": byteorder is not 'little'; big-endian archives are not supported");
  }
  TRESTLE_ASSIGN_OR_RETURN(auto pkl, archive.zip_.read("data.pkl"));
  auto doc = parse_pickle(std::string_view(reinterpret_cast<const char*>(pkl.data()), pkl.size()));
  if (!doc.ok()) return doc.status().with_context(ctx + ": " + archive.zip_.prefix() + "data.pkl");
  archive.doc_ = std::move(doc).value();
  return archive;
}

Result<std::optional<TorchTensorRef>> TorchSaveArchive::tensor(const PickleValue* v, std::string_view name) const {
  const PickleValue* args = rebuild_tensor_args(v);
  if (!args) return std::optional<TorchTensorRef>();
  const std::string& ctx = context();
  const std::string tensor_name = name.empty() ? "tensor" : "tensor '" + std::string(name) + "'";
  auto bad = [&](const std::string& what) { return Status::Error(ctx + ": " + tensor_name + ": " + what); };
  if (args->items.size() < 4)
    return bad("_rebuild_tensor_v2 with " + std::to_string(args->items.size()) + " arguments");
  const PickleValue* storage = args->items[0];
  if (storage->kind != PickleKind::kPersistentId || !storage->pid || storage->pid->kind != PickleKind::kTuple ||
      storage->pid->items.size() < 5)
    return bad("storage is not a ('storage', type, key, location, numel) persistent id");
  const auto& pid = storage->pid->items;
  if (pid[0]->kind != PickleKind::kString || pid[0]->text != "storage") return bad("persistent id is not a storage");
  TorchTensorRef t;
  if (pid[1]->kind != PickleKind::kGlobal) return bad("storage type is not a class reference");
  const bool untyped = pid[1]->name == kUntypedStorage;
  if (untyped) {  // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, ...)
    if (args->items.size() < 7 || args->items[6]->kind != PickleKind::kGlobal)
      return bad("an UntypedStorage without the dtype _rebuild_tensor_v3 gives");
    const auto dtype = parse_dtype(args->items[6]->name);
    if (!dtype) return bad("unsupported dtype " + args->items[6]->class_name());
    t.dtype = *dtype;
  } else {
    const auto dtype = dtype_from_torch_storage(pid[1]->name);
    if (!dtype) return bad("unsupported storage type " + pid[1]->class_name());
    t.dtype = *dtype;
  }
  TRESTLE_ASSIGN_OR_RETURN(t.storage_key, pickle_string(pid[2], ctx + ": storage key"));
  TRESTLE_ASSIGN_OR_RETURN(std::int64_t numel, pickle_int(pid[4], ctx + ": storage numel"));
  if (untyped && numel >= 0) {  // counted in bytes
    if (numel % static_cast<std::int64_t>(dtype_size(t.dtype)) != 0)
      return bad("an UntypedStorage of " + std::to_string(numel) + " bytes for elements of " +
                 std::string(dtype_name(t.dtype)));
    numel /= static_cast<std::int64_t>(dtype_size(t.dtype));
  }
  TRESTLE_ASSIGN_OR_RETURN(t.storage_offset, pickle_int(args->items[1], ctx + ": storage offset"));
  TRESTLE_ASSIGN_OR_RETURN(t.shape, pickle_int_tuple(args->items[2], ctx + ": tensor size"));
  TRESTLE_ASSIGN_OR_RETURN(t.stride, pickle_int_tuple(args->items[3], ctx + ": tensor stride"));
  if (t.stride.size() != t.shape.size()) return bad("size and stride have different lengths");
  const ZipEntry* entry = zip_.find("data/" + t.storage_key);
  if (!entry) return bad("storage record data/" + t.storage_key + " is missing");
  const std::size_t es = dtype_size(t.dtype);
  if (numel < 0) return bad("storage data/" + t.storage_key + " declares " + std::to_string(numel) + " elements");
  if (static_cast<std::uint64_t>(numel) > entry->size / es)
    return bad("storage data/" + t.storage_key + " holds " + std::to_string(entry->size) + " bytes, fewer than " +
               std::to_string(numel) + " elements of " + std::string(dtype_name(t.dtype)));
  t.data_offset = entry->data_offset;
  t.storage_bytes = static_cast<std::uint64_t>(numel) * es;
  // The view must stay inside the storage: its lowest and highest element.
  std::int64_t lo = t.storage_offset, hi = t.storage_offset;
  bool empty = false;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0 || t.stride[d] < 0) return bad("negative size or stride");
    if (t.shape[d] == 0) empty = true;
    if (t.shape[d] > 0 && t.stride[d] > (INT64_MAX / 2) / t.shape[d]) return bad("stride overflows");
    if (t.shape[d] > 0) hi += (t.shape[d] - 1) * t.stride[d];
  }
  if (!checked_nbytes(t.shape, es)) return bad("shape " + to_string(t.shape) + " overflows");
  if (!empty && (lo < 0 || hi >= numel))
    return bad("view (offset " + std::to_string(t.storage_offset) + ", size " + to_string(t.shape) +
               ") reaches element " + std::to_string(hi) + " of a storage of " + std::to_string(numel));
  return std::optional<TorchTensorRef>(std::move(t));
}

void TorchSaveArchive::copy_tensor(const TorchTensorRef& t, std::byte* dst) const {
  const std::size_t es = dtype_size(t.dtype);
  const std::byte* src = bytes_.data() + t.data_offset + static_cast<std::uint64_t>(t.storage_offset) * es;
  strided_copy(src, t.stride, dst, contiguous_strides(t.shape), t.shape, es);
}

PickleValue* torch_tensor_value(PickleDocument& d, DType dtype, const Shape& shape, std::size_t storage) {
  std::vector<PickleValue*> size, stride;
  for (std::int64_t s : shape) size.push_back(d.integer(s));
  for (std::int64_t s : contiguous_strides(shape)) stride.push_back(d.integer(s));
  const std::string storage_class = torch_storage_name(dtype);
  // Dtypes without a typed storage class go as torch.save writes them: an UntypedStorage counted in bytes, rebuilt by
  // _rebuild_tensor_v3 with the dtype.
  const bool untyped = storage_class.empty();
  PickleValue* type = untyped ? d.global("torch.storage", kUntypedStorage) : d.global("torch", storage_class);
  const std::int64_t storage_size =
      untyped ? numel(shape) * static_cast<std::int64_t>(dtype_size(dtype)) : numel(shape);
  PickleValue* pid = d.persistent_id(d.tuple(
      {d.string("storage"), type, d.string(std::to_string(storage)), d.string("cpu"), d.integer(storage_size)}));
  PickleValue* hooks = d.dict();  // backward hooks: an empty OrderedDict
  hooks->text = "collections";
  hooks->name = "OrderedDict";
  std::vector<PickleValue*> args{pid, d.integer(0), d.tuple(size), d.tuple(stride), d.boolean(false), hooks};
  if (untyped) args.push_back(d.global("torch", std::string(torch_name(dtype).substr(6))));
  return d.object(d.global("torch._utils", untyped ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2"),
                  d.tuple(std::move(args)));
}

std::string torch_tensor_pickle(DType dtype, const Shape& shape) {
  PickleDocument d;
  return write_pickle(torch_tensor_value(d, dtype, shape, 0), 2).value();
}

void add_torch_save_header_records(TorchZipWriter& zip, std::string data_pkl) {
  zip.add("data.pkl", std::move(data_pkl));
  zip.add(".format_version", "1");
  zip.add(".storage_alignment", "64");
  zip.add("byteorder", "little");
}

void add_torch_save_trailer_records(TorchZipWriter& zip, std::uint32_t data_crc, std::string serialization_id) {
  zip.add("version", "3\n");
  if (!serialization_id.empty()) {
    zip.add(".data/serialization_id", std::move(serialization_id));
    return;
  }
  // PyTorchStreamWriter: 20 random decimal digits, then the combined crc of the records, zero-padded to 20.
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  const std::string random = std::to_string(rng() % 10000000000000000000ull);
  std::string id = std::string(20 - std::min<std::size_t>(20, random.size()), '0') + random;
  const std::string crc = std::to_string(data_crc);
  id += std::string(20 - crc.size(), '0') + crc;
  zip.add(".data/serialization_id", id);
}

std::string torch_save_tensor_bytes(DType dtype, const Shape& shape, std::span<const std::byte> data,
                                    const std::string& archive_name, std::string serialization_id) {
  TorchZipWriter zip(archive_name);
  add_torch_save_header_records(zip, torch_tensor_pickle(dtype, shape));
  zip.add("data/0", std::string(reinterpret_cast<const char*>(data.data()), data.size()));
  add_torch_save_trailer_records(zip, crc32(data), std::move(serialization_id));
  return zip_parts_to_bytes(zip.finish());
}

Result<std::string> torch_save_object_bytes(const PickleValue* obj, const std::string& archive_name,
                                            const std::vector<std::string>& storages) {
  TRESTLE_ASSIGN_OR_RETURN(std::string pkl, write_pickle(obj, 2));
  TorchZipWriter zip(archive_name);
  add_torch_save_header_records(zip, std::move(pkl));
  std::uint32_t crc = 0;
  for (std::size_t i = 0; i < storages.size(); ++i) {
    zip.add("data/" + std::to_string(i), storages[i]);
    crc = crc32(std::as_bytes(std::span(storages[i])), crc);
  }
  add_torch_save_trailer_records(zip, crc);
  return zip_parts_to_bytes(zip.finish());
}

}  // namespace trestle
