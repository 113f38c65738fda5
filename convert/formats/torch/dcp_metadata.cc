#include "convert/formats/torch/dcp_metadata.h"

#include <random>
#include <unordered_map>

#include "ckpt/file_name.h"
#include "convert/formats/torch/pickle_reader.h"
#include "convert/formats/torch/pickle_writer.h"

namespace trestle {
namespace {

constexpr const char* kModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFilesystem = "torch.distributed.checkpoint.filesystem";

bool has_class(const PickleValue* v, const std::string& name) {
  if (!v || v->kind != PickleKind::kObject) return false;
  const std::string cls = v->class_name();
  return cls.size() > name.size() && cls.compare(cls.size() - name.size(), name.size(), name) == 0 &&
         cls[cls.size() - name.size() - 1] == '.';
}

// TensorProperties' state is a tuple (dtype, layout, requires_grad, memory_format, pin_memory[, strides]) in
// torch >= 2.1, and a dict of its fields before.
// The dtype's name in torch ("bfloat16", "complex64").
Result<std::string> properties_dtype(const PickleValue* props, const std::string& what) {
  const PickleValue* dtype = nullptr;
  if (props && props->state && props->state->kind == PickleKind::kTuple && !props->state->items.empty())
    dtype = props->state->items[0];
  else if (props) dtype = props->attr("dtype");
  if (!dtype || dtype->kind != PickleKind::kGlobal || dtype->text != "torch")
    return Status::Error(what + ": properties carry no torch dtype");
  return dtype->name;
}

Result<DcpStorage> parse_storage(const PickleValue* info, const std::string& what) {
  DcpStorage s;
  TRESTLE_ASSIGN_OR_RETURN(s.file, pickle_string(info->attr("relative_path"), what + ".relative_path"));
  TRESTLE_ASSIGN_OR_RETURN(std::int64_t offset, pickle_int(info->attr("offset"), what + ".offset"));
  TRESTLE_ASSIGN_OR_RETURN(std::int64_t length, pickle_int(info->attr("length"), what + ".length"));
  if (offset < 0 || length < 0) return Status::Error(what + ": negative offset or length");
  s.offset = static_cast<std::uint64_t>(offset);
  s.length = static_cast<std::uint64_t>(length);
  if (const PickleValue* t = info->attr("transform_descriptors"); t && t->is_sequence())
    for (const PickleValue* d : t->items) {
      TRESTLE_ASSIGN_OR_RETURN(std::string name, pickle_string(d, what + ".transform_descriptors"));
      s.transforms.push_back(std::move(name));
    }
  if (!is_plain_file_name(s.file))
    return Status::Error(what + ": relative_path '" + s.file + "' is not a file name in the checkpoint directory");
  return s;
}

std::string offsets_key(const std::string& fqn, const Shape& offsets) { return fqn + "\n" + to_string(offsets); }

}  // namespace

const DcpTensor* DcpMetadata::find_tensor(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::string DcpMetadata::missing_tensor(const std::string& name) const {
  for (const auto& [listed, why] : unreadable)
    if (listed == name) return "tensor '" + name + "' has " + why;
  return "no tensor '" + name + "'";
}

const DcpBytesItem* DcpMetadata::find_bytes(const std::string& name) const {
  for (const auto& b : bytes)
    if (b.name == name) return &b;
  return nullptr;
}

Result<DcpMetadata> parse_dcp_metadata(std::string_view pickle_bytes, const std::string& context) {
  auto doc = parse_pickle(pickle_bytes);
  if (!doc.ok()) return doc.status().with_context(context);
  const PickleValue* root = doc->root();
  auto fail = [&](const std::string& what) { return Status::Error(context + ": " + what); };
  if (!has_class(root, "Metadata")) return fail("not a DCP Metadata object (found " + pickle_repr(root, 80) + ")");
  DcpMetadata md;
  md.module = root->cls->text;
  if (const PickleValue* v = root->attr("version"); v && v->kind == PickleKind::kString) md.version = v->text;
  const PickleValue* sdm = root->attr("state_dict_metadata");
  const PickleValue* storage = root->attr("storage_data");
  if (!sdm || sdm->kind != PickleKind::kDict) return fail("Metadata.state_dict_metadata is missing or not a dict");
  if (!storage || storage->kind != PickleKind::kDict) return fail("Metadata.storage_data is missing or not a dict");

  // storage_data: MetadataIndex(fqn, offset, index) -> _StorageInfo.
  std::unordered_map<std::string, DcpStorage> by_index;
  for (const auto& [index, info] : storage->entries) {
    if (!has_class(index, "MetadataIndex") || !has_class(info, "_StorageInfo"))
      return fail("storage_data holds " + pickle_repr(index, 80) + " -> " + pickle_repr(info, 80) +
                  ", expected MetadataIndex -> _StorageInfo");
    TRESTLE_ASSIGN_OR_RETURN(std::string fqn, pickle_string(index->attr("fqn"), context + ": MetadataIndex.fqn"));
    Shape offsets;
    if (const PickleValue* off = index->attr("offset"); off && off->kind != PickleKind::kNone) {
      TRESTLE_ASSIGN_OR_RETURN(offsets, pickle_int_tuple(off, context + ": MetadataIndex.offset of '" + fqn + "'"));
    }
    TRESTLE_ASSIGN_OR_RETURN(DcpStorage s, parse_storage(info, context + ": storage of '" + fqn + "'"));
    by_index[offsets_key(fqn, offsets)] = std::move(s);
  }

  for (const auto& [key, value] : sdm->entries) {
    TRESTLE_ASSIGN_OR_RETURN(std::string fqn, pickle_string(key, context + ": state_dict_metadata key"));
    const std::string what = context + ": '" + fqn + "'";
    if (has_class(value, "BytesStorageMetadata")) {
      auto it = by_index.find(offsets_key(fqn, {}));
      if (it == by_index.end()) return fail("bytes entry '" + fqn + "' has no storage_data entry");
      md.bytes.push_back({fqn, it->second});
      continue;
    }
    if (!has_class(value, "TensorStorageMetadata"))
      return fail("'" + fqn + "' is " + pickle_repr(value, 80) +
                  ", expected TensorStorageMetadata or BytesStorageMetadata");
    DcpTensor t;
    t.name = fqn;
    TRESTLE_ASSIGN_OR_RETURN(const std::string dtype, properties_dtype(value->attr("properties"), what));
    if (const auto parsed = parse_dtype(dtype)) {
      t.dtype = *parsed;
    } else {  // refused where it is read, not here: a load of the other tensors goes on without it
      md.unreadable.push_back({fqn, "dtype torch." + dtype + ", which Trestle does not store"});
      continue;
    }
    TRESTLE_ASSIGN_OR_RETURN(t.shape, pickle_int_tuple(value->attr("size"), what + " size"));
    if (!checked_nbytes(t.shape, dtype_size(t.dtype)))
      return fail("'" + fqn + "' has an invalid size " + to_string(t.shape));
    const PickleValue* chunks = value->attr("chunks");
    if (!chunks || !chunks->is_sequence()) return fail("'" + fqn + "' has no chunk list");
    for (const PickleValue* c : chunks->items) {
      DcpChunk chunk;
      TRESTLE_ASSIGN_OR_RETURN(chunk.box.offset, pickle_int_tuple(c->attr("offsets"), what + " chunk offsets"));
      TRESTLE_ASSIGN_OR_RETURN(chunk.box.shape, pickle_int_tuple(c->attr("sizes"), what + " chunk sizes"));
      if (chunk.box.offset.size() != t.shape.size() || chunk.box.shape.size() != t.shape.size() ||
          !box_within(chunk.box, t.shape))
        return fail("'" + fqn + "' chunk " + to_string(chunk.box) + " lies outside the tensor " + to_string(t.shape));
      auto it = by_index.find(offsets_key(fqn, chunk.box.offset));
      if (it == by_index.end())
        return fail("'" + fqn + "' chunk " + to_string(chunk.box) + " has no storage_data entry");
      chunk.storage = it->second;
      t.chunks.push_back(std::move(chunk));
    }
    md.tensors.push_back(std::move(t));
  }
  return md;
}

namespace {

// Builds Python objects of the torch.distributed.checkpoint classes.
class MetadataBuilder {
 public:
  PickleValue* build(const DcpMetadata& md) {
    std::vector<std::pair<PickleValue*, PickleValue*>> sdm, storage, planner;
    for (const auto& t : md.tensors) {
      PickleValue* fqn = d_.string(t.name);
      std::vector<PickleValue*> chunks;
      for (const auto& c : t.chunks)
        chunks.push_back(dataclass(kModule, "ChunkStorageMetadata",
                                   {{"offsets", size(c.box.offset)}, {"sizes", size(c.box.shape)}}));
      PickleValue* meta =
          dataclass(kModule, "TensorStorageMetadata",
                    {{"properties", properties(t)}, {"size", size(t.shape)}, {"chunks", d_.list(chunks)}});
      sdm.emplace_back(fqn, meta);
      planner.emplace_back(fqn, path(t.name));
      for (std::size_t i = 0; i < t.chunks.size(); ++i)
        storage.emplace_back(dataclass(kModule, "MetadataIndex",
                                       {{"fqn", fqn},
                                        {"offset", size(t.chunks[i].box.offset)},
                                        {"index", d_.integer(static_cast<std::int64_t>(i))}}),
                             info(t.chunks[i].storage));
    }
    for (const auto& b : md.bytes) {
      PickleValue* fqn = d_.string(b.name);
      sdm.emplace_back(fqn, dataclass(kModule, "BytesStorageMetadata", {}));
      planner.emplace_back(fqn, path(b.name));
      storage.emplace_back(dataclass(kModule, "MetadataIndex", {{"fqn", fqn}, {"index", d_.none()}}), info(b.storage));
    }
    PickleValue* storage_meta = dataclass(kModule, "StorageMeta",
                                          {{"checkpoint_id", d_.none()},
                                           {"save_id", d_.string(uuid())},
                                           {"load_id", d_.none()},
                                           {"modules", d_.list({})}});
    return dataclass(kModule, "Metadata",
                     {{"state_dict_metadata", d_.dict(sdm)},
                      {"planner_data", d_.dict(planner)},
                      {"storage_data", d_.dict(storage)},
                      {"storage_meta", storage_meta},
                      {"version", d_.string(md.version.empty() ? "1.0.0" : md.version)}});
  }

 private:
  // A dataclass instance as pickle writes it: cls.__new__(cls) then BUILD with its __dict__.
  PickleValue* dataclass(const char* module, const char* name,
                         std::vector<std::pair<const char*, PickleValue*>> fields) {
    std::vector<std::pair<PickleValue*, PickleValue*>> state;
    for (auto& [k, v] : fields) state.emplace_back(d_.string(k), v);
    return d_.object(d_.global(module, name), d_.tuple({}), d_.dict(std::move(state)), PickleCall::kNewObj);
  }

  PickleValue* size(const Shape& s) {
    std::vector<PickleValue*> items;
    for (std::int64_t v : s) items.push_back(d_.integer(v));
    return d_.object(d_.global("torch", "Size"), d_.tuple({d_.tuple(items)}));
  }

  PickleValue* properties(const DcpTensor& t) {
    std::vector<PickleValue*> strides;
    std::int64_t s = 1;
    strides.resize(t.shape.size());
    for (std::size_t i = t.shape.size(); i-- > 0;) {
      strides[i] = d_.integer(s);
      s *= t.shape[i];
    }
    PickleValue* layout =
        d_.object(d_.global("torch.serialization", "_get_layout"), d_.tuple({d_.string("torch.strided")}));
    PickleValue* memory_format = d_.object(d_.global(kModule, "_MEM_FORMAT_ENCODING"), d_.tuple({d_.integer(0)}));
    PickleValue* state = d_.tuple({d_.global("torch", std::string(torch_name(t.dtype).substr(6))), layout,
                                   d_.boolean(false), memory_format, d_.boolean(false), d_.tuple(strides)});
    return d_.object(d_.global(kModule, "TensorProperties"), d_.tuple({}), state, PickleCall::kNewObj);
  }

  PickleValue* info(const DcpStorage& s) {
    std::vector<std::pair<const char*, PickleValue*>> fields = {
        {"relative_path", d_.string(s.file)},
        {"offset", d_.integer(static_cast<std::int64_t>(s.offset))},
        {"length", d_.integer(static_cast<std::int64_t>(s.length))}};
    if (!s.transforms.empty()) {
      std::vector<PickleValue*> names;
      for (const auto& t : s.transforms) names.push_back(d_.string(t));
      fields.emplace_back("transform_descriptors", d_.list(names));
    }
    return dataclass(kFilesystem, "_StorageInfo", std::move(fields));
  }

  PickleValue* path(const std::string& fqn) {  // the default planner's flattening: the key's path in nested dicts
    std::vector<PickleValue*> parts;
    std::size_t start = 0;
    while (true) {
      const std::size_t dot = fqn.find('.', start);
      parts.push_back(d_.string(fqn.substr(start, dot == std::string::npos ? std::string::npos : dot - start)));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return d_.tuple(parts);
  }

  static std::string uuid() {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    const char* hex = "0123456789abcdef";
    std::string out;
    for (int i = 0; i < 32; ++i) {
      if (i == 8 || i == 12 || i == 16 || i == 20) out += '-';
      out += hex[rng() % 16];
    }
    return out;
  }

 public:
  PickleDocument d_;
};

}  // namespace

Result<std::string> write_dcp_metadata(const DcpMetadata& metadata) {
  MetadataBuilder builder;
  const PickleValue* root = builder.build(metadata);
  return write_pickle(root, 4);
}

}  // namespace trestle
