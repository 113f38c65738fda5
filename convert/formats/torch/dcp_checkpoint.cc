#include "convert/formats/torch/dcp_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "ckpt/atomic_file.h"
#include "ckpt/crc32.h"
#include "ckpt/file_range_read.h"
#include "ckpt/file_writer.h"
#include "ckpt/json_file.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;

}  // namespace

Result<TorchSavedObject> parse_torch_saved(std::string bytes, std::string context) {
  TorchSavedObject out;
  out.context = context;
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  TRESTLE_ASSIGN_OR_RETURN(auto archive,
                           TorchSaveArchive::parse(std::as_bytes(std::span(owned->data(), owned->size())), context));
  out.bytes = std::move(owned);
  out.archive = std::make_shared<const TorchSaveArchive>(std::move(archive));
  return out;
}

Result<DcpCheckpoint> DcpCheckpoint::open(const std::string& dir, const OpenOptions& options) {
  DcpCheckpoint ckpt;
  ckpt.dir_ = dir;
  ckpt.files_ = std::make_shared<Files>();
  const std::string& md_name = options.metadata_name;
  const bool rank_metadata =
      md_name.size() > 11 && md_name.starts_with("__") && md_name.ends_with(".metadata") &&
      std::all_of(md_name.begin() + 2, md_name.end() - 9, [](char c) { return c >= '0' && c <= '9'; });
  if (md_name != ".metadata" && !rank_metadata)
    return Status::Error(dir + ": '" + md_name + "' is not a DCP metadata file name (.metadata or __<rank>.metadata)");
  ckpt.metadata_name_ = md_name;
  const std::string md_path = ckpt.metadata_path();
  for (const std::string& own : {md_name, std::string("metadata.json"), std::string("common.pt")})
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link((fs::path(dir) / own).string()));
  TRESTLE_ASSIGN_OR_RETURN(std::string raw, read_text_file(md_path));
  TRESTLE_ASSIGN_OR_RETURN(ckpt.metadata_, parse_dcp_metadata(raw, md_path));
  if (options.refuse_unreadable && !ckpt.metadata_.unreadable.empty())
    return Status::Error(md_path + ": " + ckpt.metadata_.missing_tensor(ckpt.metadata_.unreadable.front().first));
  // Each tensor's chunks hold it exactly (as PyTorch's planner checks before it saves): an overlap that keeps the
  // element count would otherwise read as a silently shifted tensor.
  for (const DcpTensor& t : ckpt.metadata_.tensors) {
    std::vector<Box> boxes;
    boxes.reserve(t.chunks.size());
    for (const DcpChunk& c : t.chunks) boxes.push_back(c.box);
    // (a rank's own metadata lists its pieces alone: disjoint, but not the whole tensor)
    TRESTLE_RETURN_IF_ERROR(check_boxes(t.shape, boxes, md_path + ": tensor '" + t.name + "'", !rank_metadata));
  }
  // Its item files are its own: regular files in the directory, never links (which could lead out of it).
  for (const std::string& name : ckpt.files()) {
    const fs::path path = fs::path(dir) / name;
    std::error_code ec;
    const fs::file_status status = fs::symlink_status(path, ec);
    if (fs::is_symlink(status))
      return Status::Error(path.string() + ": a symbolic link (links are not followed), named by " + md_path);
    if (fs::exists(status) && !fs::is_regular_file(status))
      return Status::Error(path.string() + ": not a regular file, named by " + md_path);
  }
  const fs::path json_path = fs::path(dir) / "metadata.json";
  std::error_code ec;
  if (fs::exists(json_path, ec)) {
    TRESTLE_ASSIGN_OR_RETURN(ckpt.megatron_, read_json_file(json_path.string()));
    const auto& m = *ckpt.megatron_;
    if (!m.is_object() || !m.contains("sharded_backend") || m["sharded_backend"] != "torch_dist")
      return Status::Error(json_path.string() + ": sharded_backend is not \"torch_dist\"");
  }
  const fs::path common = fs::path(dir) / "common.pt";
  if (fs::exists(common, ec)) {
    TRESTLE_ASSIGN_OR_RETURN(std::string bytes, read_text_file(common.string()));
    TRESTLE_ASSIGN_OR_RETURN(ckpt.common_, parse_torch_saved(std::move(bytes), common.string()));
  }
  return ckpt;
}

std::string DcpCheckpoint::metadata_path() const { return (fs::path(dir_) / metadata_name_).string(); }

std::vector<std::string> DcpCheckpoint::files() const {
  std::set<std::string> names;
  for (const auto& t : metadata_.tensors)
    for (const auto& c : t.chunks) names.insert(c.storage.file);
  for (const auto& b : metadata_.bytes) names.insert(b.storage.file);
  return {names.begin(), names.end()};
}

struct DcpCheckpoint::Files {
  std::mutex mu;  // mapped, buffers and verified
  std::map<std::string, MappedFile> mapped;
  ReadFiles direct;
  std::vector<AlignedBuffer> buffers;                        // free read buffers, one per concurrent reader at most
  std::set<std::pair<std::string, std::uint64_t>> verified;  // zip records (file, offset) whose CRC-32 matched
};

Result<std::span<const std::byte>> DcpCheckpoint::item_bytes(const DcpStorage& storage, const std::string& what) const {
  const std::string path = (fs::path(dir_) / storage.file).string();
  if (!storage.transforms.empty())
    return Status::Error(path + ": " + what + " is stored through DCP extensions (" + storage.transforms.front() +
                         "), which are not supported");
  std::unique_lock lock(files_->mu);
  auto it = files_->mapped.find(storage.file);
  if (it == files_->mapped.end()) {
    // Payloads of 1 MiB and more are read with O_DIRECT (copy_region): only headers and small items come through
    // the map, so it must not read ahead.
    auto file = MappedFile::open(path, /*random_access=*/true);
    if (!file.ok())
      return Status::Error(file.status().message() + " (the file of " + what + " in " + metadata_path() + ")");
    it = files_->mapped.emplace(storage.file, std::move(*file)).first;
  }
  lock.unlock();  // map nodes stay where they are
  const auto bytes = it->second.bytes();
  if (storage.offset > bytes.size() || storage.length > bytes.size() - storage.offset)
    return Status::Error(path + ": " + what + " at [" + std::to_string(storage.offset) + ", +" +
                         std::to_string(storage.length) + ") runs past the end of the file (" +
                         std::to_string(bytes.size()) + " bytes), as " + metadata_path() + " records it");
  return bytes.subspan(storage.offset, storage.length);
}

Result<std::string> DcpCheckpoint::read_bytes(const DcpBytesItem& item) const {
  TRESTLE_ASSIGN_OR_RETURN(auto bytes, item_bytes(item.storage, "item '" + item.name + "'"));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

Result<TorchSavedObject> DcpCheckpoint::read_object(const DcpBytesItem& item) const {
  TRESTLE_ASSIGN_OR_RETURN(std::string bytes, read_bytes(item));
  return parse_torch_saved(std::move(bytes),
                           (fs::path(dir_) / item.storage.file).string() + " item '" + item.name + "'");
}

Status DcpCheckpoint::copy_region(const std::string& file, std::uint64_t at, const std::byte* mapped,
                                  const std::vector<std::int64_t>& src_stride, std::byte* destination,
                                  const std::vector<std::int64_t>& dst_stride, const Shape& count,
                                  std::size_t element_size, const std::string& what) const {
  const std::uint64_t span = strided_span_bytes(count, src_stride, element_size);
  if (span < kDirectReadMinBytes) {
    strided_copy(mapped, src_stride, destination, dst_stride, count, element_size);
    return OkStatus();
  }
  const std::string path = (fs::path(dir_) / file).string();
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile opened, files_->direct.get(path));
  AlignedBuffer buffer;  // a free one when there is one; the read grows it as needed
  {
    std::lock_guard lock(files_->mu);
    if (!files_->buffers.empty()) {
      buffer = std::move(files_->buffers.back());
      files_->buffers.pop_back();
    }
  }
  const Status status =
      copy_strided_from_file(opened, path, at, src_stride, destination, dst_stride, count, element_size, buffer, what);
  std::lock_guard lock(files_->mu);
  files_->buffers.push_back(std::move(buffer));
  return status;
}

namespace {

Status corrupt_record(const std::string& path, const std::string& what, std::uint32_t got, std::uint32_t expected) {
  return Status::Error(path + ": " + what + ": the data's CRC-32 is " + std::to_string(got) + ", its zip record says " +
                       std::to_string(expected) + " (the file is corrupt)");
}

// The CRC-32 of a strided region's elements in row-major order (runs along the last dimension are contiguous).
std::uint32_t crc32_of_region(const std::byte* base, const std::vector<std::int64_t>& stride, const Shape& count,
                              std::size_t element_size) {
  if (count.empty()) return crc32(std::span(base, element_size));
  for (auto n : count)
    if (n == 0) return crc32({});
  const std::size_t dims = count.size();
  const std::size_t run = static_cast<std::size_t>(count.back()) * element_size;
  std::vector<std::int64_t> index(dims - 1, 0);
  std::uint32_t crc = 0;
  while (true) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d + 1 < dims; ++d) offset += index[d] * stride[d];
    crc = crc32(std::span(base + offset * static_cast<std::int64_t>(element_size), run), crc);
    std::size_t d = dims - 1;
    while (d > 0 && ++index[d - 1] == count[d - 1]) index[--d] = 0;
    if (d == 0) break;
  }
  return crc;
}

}  // namespace

Status DcpCheckpoint::verify_record(const std::string& file, std::uint64_t at, std::uint64_t size,
                                    std::uint32_t expected, const std::string& what) const {
  {
    std::lock_guard lock(files_->mu);
    if (files_->verified.count({file, at})) return OkStatus();
  }
  const std::string path = (fs::path(dir_) / file).string();
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile opened, files_->direct.get(path));
  AlignedBuffer buffer;
  {
    std::lock_guard lock(files_->mu);
    if (!files_->buffers.empty()) {
      buffer = std::move(files_->buffers.back());
      files_->buffers.pop_back();
    }
  }
  constexpr std::uint64_t kWindow = std::uint64_t{16} << 20;
  std::uint32_t crc = 0;
  Status status = OkStatus();
  for (std::uint64_t done = 0; done < size && status.ok(); done += kWindow) {
    const std::uint64_t n = std::min(kWindow, size - done);
    auto first = read_file_range(opened, path, at + done, n, buffer, what);
    if (!first.ok()) status = first.status();
    else crc = crc32(std::span(buffer.data() + *first, static_cast<std::size_t>(n)), crc);
  }
  std::lock_guard lock(files_->mu);
  files_->buffers.push_back(std::move(buffer));
  if (!status.ok()) return status;
  if (crc != expected) return corrupt_record(path, what, crc, expected);
  files_->verified.insert({file, at});
  return OkStatus();
}

Status DcpCheckpoint::read_box(const std::string& name, const Box& box, std::byte* destination) const {
  const DcpTensor* t = metadata_.find_tensor(name);
  if (!t) return Status::Error(metadata_path() + ": " + metadata_.missing_tensor(name));
  if (box.offset.size() != t->shape.size() || box.shape.size() != t->shape.size() || !box_within(box, t->shape))
    return Status::Error(dir_ + ": tensor '" + name + "': box " + to_string(box) + " is not within its shape " +
                         to_string(t->shape));
  const std::size_t es = dtype_size(t->dtype);
  const auto dst_stride = contiguous_strides(box.shape);
  std::int64_t covered = 0;
  for (const auto& chunk : t->chunks) {
    const auto overlap = intersect(box, chunk.box);
    if (!overlap || overlap->numel() == 0) continue;
    const std::string what = "tensor '" + name + "' chunk " + to_string(chunk.box);
    const std::string path = (fs::path(dir_) / chunk.storage.file).string();
    TRESTLE_ASSIGN_OR_RETURN(auto bytes, item_bytes(chunk.storage, what));
    // The chunk as a strided source: a torch.save'd tensor, or raw row-major bytes (DCP's safetensors format).
    const std::byte* base = nullptr;
    std::vector<std::int64_t> src_stride;
    std::optional<TorchSaveArchive> archive;
    std::optional<std::uint32_t> record_crc;  // set when the read covers the whole zip record, which it then checks
    const ZipEntry* record = nullptr;
    if (bytes.size() >= 4 && std::memcmp(bytes.data(), "PK\x03\x04", 4) == 0) {
      auto parsed = TorchSaveArchive::parse(bytes, path + " " + what);
      if (!parsed.ok()) return parsed.status();
      archive = std::move(parsed).value();
      TRESTLE_ASSIGN_OR_RETURN(auto ref, archive->tensor(archive->root()));
      if (!ref)
        return Status::Error(path + ": " + what + ": the item holds " + pickle_repr(archive->root(), 80) +
                             ", not a tensor");
      if (ref->dtype != t->dtype || ref->shape != chunk.box.shape)
        return Status::Error(path + ": " + what + ": the item holds a " + std::string(dtype_name(ref->dtype)) + " " +
                             to_string(ref->shape) + " tensor, expected " + std::string(dtype_name(t->dtype)) + " " +
                             to_string(chunk.box.shape));
      base = bytes.data() + ref->data_offset + static_cast<std::uint64_t>(ref->storage_offset) * es;
      src_stride = ref->stride;
      record = archive->zip().find("data/" + ref->storage_key);
      if (record && *overlap == chunk.box && ref->contiguous() && ref->storage_offset == 0 &&
          record->size == static_cast<std::uint64_t>(chunk.box.numel()) * es)
        record_crc = record->crc32;
    } else {
      const std::uint64_t expected = static_cast<std::uint64_t>(chunk.box.numel()) * es;
      // torch's FileSystemWriter(serialization_format=SAFETENSORS) records each tensor at the start of the rank's
      // safetensors blob (its 8-byte header length, then '{'), with the tensor's length: its bytes lie elsewhere, where
      // only that header says. torch's own FileSystemReader cannot read it either; read as raw bytes it was the
      // header's bytes as numbers.
      if (bytes.size() >= 9 && static_cast<char>(bytes[8]) == '{') {
        std::uint64_t header = 0;
        for (int i = 7; i >= 0; --i)
          header = (header << 8) | static_cast<std::uint8_t>(bytes[static_cast<std::size_t>(i)]);
        if (header >= 2 && header < (std::uint64_t{1} << 40))
          return Status::Error(path + ": " + what + ": the item is the start of a safetensors file (torch's " +
                               "SerializationFormat.SAFETENSORS, whose .metadata does not say where each tensor's " +
                               "bytes lie), not the chunk's bytes; save with the default torch_save format");
      }
      if (bytes.size() != expected)
        return Status::Error(path + ": " + what + ": item of " + std::to_string(bytes.size()) +
                             " bytes is neither a torch.save archive nor the chunk's " + std::to_string(expected) +
                             " raw bytes");
      base = bytes.data();
      src_stride = contiguous_strides(chunk.box.shape);
    }
    std::int64_t src_off = 0, dst_off = 0;
    for (std::size_t d = 0; d < box.shape.size(); ++d) {
      src_off += (overlap->offset[d] - chunk.box.offset[d]) * src_stride[d];
      dst_off += (overlap->offset[d] - box.offset[d]) * dst_stride[d];
    }
    const std::byte* first = base + src_off * static_cast<std::int64_t>(es);
    TRESTLE_RETURN_IF_ERROR(copy_region(
        chunk.storage.file, chunk.storage.offset + static_cast<std::uint64_t>(first - bytes.data()), first, src_stride,
        destination + dst_off * static_cast<std::int64_t>(es), dst_stride, overlap->shape, es, what));
    release_mapped(bytes);  // only headers were read through the map; drop them from this process
    // Every byte read comes from a zip record whose CRC-32 is checked once: over what was just copied when that is the
    // whole record, else by reading the record through once more.
    if (record) {
      const std::uint64_t record_at = chunk.storage.offset + record->data_offset;
      if (record_crc) {
        const std::uint32_t got =
            crc32_of_region(destination + dst_off * static_cast<std::int64_t>(es), dst_stride, overlap->shape, es);
        if (got != *record_crc) return corrupt_record(path, what, got, *record_crc);
        std::lock_guard lock(files_->mu);
        files_->verified.insert({chunk.storage.file, record_at});
      } else {
        TRESTLE_RETURN_IF_ERROR(verify_record(chunk.storage.file, record_at, record->size, record->crc32, what));
      }
    }
    covered += overlap->numel();
  }
  if (covered != box.numel())
    return Status::Error(dir_ + ": tensor '" + name + "': chunks cover " + std::to_string(covered) + " of the " +
                         std::to_string(box.numel()) + " elements of box " + to_string(box) +
                         (covered < box.numel() ? " (part of it is stored nowhere)" : " (chunks overlap)"));
  return OkStatus();
}

Result<DcpRankFileWriter> DcpRankFileWriter::create(const std::string& dir, int rank, const IoOptions& io) {
  DcpRankFileWriter w;
  w.file_ = "__" + std::to_string(rank) + "_0.distcp";
  w.path_ = (fs::path(dir) / w.file_).string();
  TRESTLE_ASSIGN_OR_RETURN(w.writer_, FileWriter::create(w.path_, io));
  return w;
}

// Each item starts on a 4 KiB boundary (FileWriter's append); gaps between items are zeros that no item covers.
Status DcpRankFileWriter::add_object(const DcpObjectPiece& o) {
  TRESTLE_ASSIGN_OR_RETURN(std::uint64_t at,
                           writer_->append(std::as_bytes(std::span(o.torch_saved.data(), o.torch_saved.size()))));
  items_.bytes.push_back({o.name, {file_, at, o.torch_saved.size(), {}}});
  return OkStatus();
}

Status DcpRankFileWriter::add_tensor(const DcpTensorPiece& p) {
  const std::size_t es = dtype_size(p.dtype);
  if (p.box.shape.size() != p.global_shape.size() || !box_within(p.box, p.global_shape) ||
      p.data.size() != static_cast<std::size_t>(p.box.numel()) * es)
    return Status::Error(path_ + ": tensor '" + p.name + "': piece " + to_string(p.box) + " with " +
                         std::to_string(p.data.size()) + " bytes does not fit global shape " +
                         to_string(p.global_shape));
  // torch.save(chunk), with the payload record aligned to 4 KiB so it goes straight out with O_DIRECT:
  // [header records, padded] [payload: whole 4 KiB blocks] [payload tail + trailer records + directory].
  TorchZipWriter zip;
  add_torch_save_header_records(zip, torch_tensor_pickle(p.dtype, p.box.shape));
  const std::uint32_t data_crc = crc32(p.data);
  zip.add_external("data/0", p.data.size(), data_crc, kIoAlignment);
  add_torch_save_trailer_records(zip, data_crc);
  auto parts = zip.finish();
  if (parts.size() != 3 || parts[1].external < 0 || parts[0].bytes.size() % kIoAlignment != 0)
    return Status::Error(path_ + ": internal: unexpected zip layout for '" + p.name + "'");
  TRESTLE_ASSIGN_OR_RETURN(std::uint64_t at,
                           writer_->append(std::as_bytes(std::span(parts[0].bytes.data(), parts[0].bytes.size()))));
  const std::size_t bulk = p.data.size() / kIoAlignment * kIoAlignment;
  if (bulk) TRESTLE_RETURN_IF_ERROR(writer_->append(p.data.first(bulk)).status());
  std::string tail(reinterpret_cast<const char*>(p.data.data()) + bulk, p.data.size() - bulk);
  tail += parts[2].bytes;
  TRESTLE_RETURN_IF_ERROR(writer_->append(std::as_bytes(std::span(tail.data(), tail.size()))).status());
  const std::uint64_t length = parts[0].bytes.size() + p.data.size() + parts[2].bytes.size();
  DcpTensor t;
  t.name = p.name;
  t.dtype = p.dtype;
  t.shape = p.global_shape;
  t.chunks.push_back({p.box, {file_, at, length, {}}});
  items_.tensors.push_back(std::move(t));
  return OkStatus();
}

Result<DcpRankItems> DcpRankFileWriter::finish() {
  TRESTLE_RETURN_IF_ERROR(writer_->finish());
  return std::move(items_);
}

Result<DcpRankItems> write_dcp_rank_file(const std::string& dir, int rank, const std::vector<DcpTensorPiece>& tensors,
                                         const std::vector<DcpObjectPiece>& objects, const IoOptions& io) {
  TRESTLE_ASSIGN_OR_RETURN(auto writer, DcpRankFileWriter::create(dir, rank, io));
  for (const auto& o : objects) TRESTLE_RETURN_IF_ERROR(writer.add_object(o));
  for (const auto& p : tensors) TRESTLE_RETURN_IF_ERROR(writer.add_tensor(p));
  return writer.finish();
}

Status write_dcp_metadata_file(const std::string& dir, const std::vector<DcpRankItems>& ranks) {
  DcpMetadata md;
  std::map<std::string, std::size_t> index;
  for (const auto& r : ranks) {
    for (const auto& t : r.tensors) {
      auto [it, added] = index.emplace(t.name, md.tensors.size());
      if (added) {
        md.tensors.push_back(t);
        continue;
      }
      DcpTensor& merged = md.tensors[it->second];
      if (merged.dtype != t.dtype || merged.shape != t.shape)
        return Status::Error(dir + ": tensor '" + t.name + "' is " + std::string(dtype_name(t.dtype)) + " " +
                             to_string(t.shape) + " on one rank and " + std::string(dtype_name(merged.dtype)) + " " +
                             to_string(merged.shape) + " on another");
      merged.chunks.insert(merged.chunks.end(), t.chunks.begin(), t.chunks.end());
    }
    for (const auto& b : r.bytes)
      if (!md.find_bytes(b.name)) md.bytes.push_back(b);
  }
  for (const auto& t : md.tensors) {
    std::int64_t total = 0;
    for (std::size_t i = 0; i < t.chunks.size(); ++i) {
      total += t.chunks[i].box.numel();
      for (std::size_t j = 0; j < i; ++j)
        if (const auto o = intersect(t.chunks[i].box, t.chunks[j].box); o && o->numel() > 0)
          return Status::Error(dir + ": tensor '" + t.name + "': chunks " + to_string(t.chunks[j].box) + " and " +
                               to_string(t.chunks[i].box) + " overlap (replicas must be written once)");
    }
    if (total != numel(t.shape))
      return Status::Error(dir + ": tensor '" + t.name + "': chunks hold " + std::to_string(total) + " of its " +
                           std::to_string(numel(t.shape)) + " elements");
  }
  TRESTLE_ASSIGN_OR_RETURN(std::string pickle, write_dcp_metadata(md));
  return write_file_atomically((fs::path(dir) / ".metadata").string(), pickle);
}

Status write_megatron_metadata_json(const std::string& dir) {
  const nlohmann::json j = {{"sharded_backend", "torch_dist"},
                            {"sharded_backend_version", 1},
                            {"common_backend", "torch"},
                            {"common_backend_version", 1}};
  return write_file_atomically((fs::path(dir) / "metadata.json").string(), j.dump());
}

}  // namespace trestle
