#include "ckpt/hdf5_export.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/checksum.h"
#include "ckpt/fault_point.h"
#include "ckpt/file_lock.h"
#include "ckpt/hex_digest.h"
#include "ckpt/json_file.h"
#include "ckpt/printable_text.h"
#include "ckpt/process_memory.h"
#include "ckpt/regular_file.h"
#include "ckpt/removed_on_signal.h"
#include "ckpt/save.h"
#include "ckpt/save_stream.h"

namespace trestle {
namespace {

// The group holding the carried files, each a 1-d u8 dataset with a "name" attribute (the name it is recorded under).
constexpr const char* kFilesGroup = "trestle_files";
constexpr const char* kHeaderDigest = "trestle_manifest_xxh3_64";  // the header's own digest (files since 2026-12-06)
constexpr int kMaxHeaderDepth = 64;  // nesting of the header's JSON (a manifest's is under 10)

// Owns an HDF5 identifier and closes it with the matching function.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// IEEE half precision as h5py writes float16: a 16-bit float with 1 sign, 5 exponent and 10 mantissa bits.
hid_t make_half_type() {
  const hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, 10, 5, 0, 10);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, 15);
  return t;
}

// Dtypes stored as the bits of unsigned integers (bf16 as u16; fp8 as u8), whichever sign a writer gave them.
bool bit_pattern(DType dtype) { return dtype == DType::kBF16 || dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2; }

// The file type a dtype is stored as (caller closes it).
hid_t storage_type(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return make_half_type();
    case DType::kF32:
      return H5Tcopy(H5T_IEEE_F32LE);
    case DType::kF64:
      return H5Tcopy(H5T_IEEE_F64LE);
    case DType::kI8:
      return H5Tcopy(H5T_STD_I8LE);
    case DType::kI16:
      return H5Tcopy(H5T_STD_I16LE);
    case DType::kI32:
      return H5Tcopy(H5T_STD_I32LE);
    case DType::kI64:
      return H5Tcopy(H5T_STD_I64LE);
    case DType::kU16:
    case DType::kBF16:
      return H5Tcopy(H5T_STD_U16LE);
    case DType::kU32:
      return H5Tcopy(H5T_STD_U32LE);
    case DType::kU64:
      return H5Tcopy(H5T_STD_U64LE);
    default:
      return H5Tcopy(H5T_STD_U8LE);  // u8, bool, fp8
  }
}

Status write_string_attribute(hid_t object, const char* name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), value.size() + 1);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), type.get(), value.c_str()) < 0)
    return Status::Error(std::string("cannot write HDF5 attribute '") + name + "'");
  return OkStatus();
}

// The most an attribute string may hold: the header of a checkpoint of 10^6 tensors is some hundreds of MB less.
constexpr std::size_t kMaxAttributeBytes = std::size_t{1} << 28;

// A fixed-length string attribute holding one string (a scalar, or one element), read whole.
Result<std::string> read_string_attribute(hid_t object, const char* name, const std::string& where) {
  if (H5Aexists(object, name) <= 0) return Status::Error(where + ": no '" + name + "' attribute");
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  if (!attr.ok()) return Status::Error(where + ": cannot open attribute '" + name + "'");
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0)
    return Status::Error(where + ": attribute '" + name + "' is not a fixed-length string");
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  const H5S_class_t kind = H5Sget_simple_extent_type(space.get());
  if (!(kind == H5S_SCALAR || (kind == H5S_SIMPLE && H5Sget_simple_extent_npoints(space.get()) == 1)))
    return Status::Error(where + ": attribute '" + name + "' holds " +
                         std::to_string(H5Sget_simple_extent_npoints(space.get())) + " strings; one is expected");
  const std::size_t size = H5Tget_size(type.get());
  if (size == 0 || size > kMaxAttributeBytes)
    return Status::Error(where + ": attribute '" + name + "' is a string of " + std::to_string(size) +
                         " bytes; at most " + std::to_string(kMaxAttributeBytes) + " are read");
  std::string value(size, '\0');
  if (H5Aread(attr.get(), type.get(), value.data()) < 0)
    return Status::Error(where + ": cannot read attribute '" + name + "'");
  value.resize(std::strlen(value.c_str()));
  return value;
}

Status write_dataset(hid_t file, const std::string& name, DType dtype, const Shape& shape, const std::byte* data) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space(
      shape.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
      H5Sclose);
  Handle type(storage_type(dtype), H5Tclose);
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  Handle set(H5Dcreate2(file, name.c_str(), type.get(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return Status::Error("tensor '" + name + "': cannot create HDF5 dataset");
  if (numel(shape) > 0 && H5Dwrite(set.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    return Status::Error("tensor '" + name + "': cannot write HDF5 dataset");
  return write_string_attribute(set.get(), "dtype", std::string(dtype_name(dtype)));
}

// The files the checkpoint carries (hf_files/...), each checked against the digest its manifest records.
Status write_carried_files(hid_t file, const CheckpointReader& reader) {
  const auto& files = reader.manifest().files;
  if (files.empty()) return OkStatus();
  Handle group(H5Gcreate2(file, kFilesGroup, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  if (!group.ok()) return Status::Error(std::string("cannot create HDF5 group '") + kFilesGroup + "'");
  std::size_t index = 0;
  for (const auto& [name, recorded] : files) {
    const std::string source = (std::filesystem::path(reader.directory()) / name).string();
    TRESTLE_ASSIGN_OR_RETURN(const std::string bytes, read_text_file(source, recorded.bytes));
    if (bytes.size() != recorded.bytes || xxh3_64(std::as_bytes(std::span(bytes))) != recorded.xxh3)
      return Status::Error(source + ": differs from the size and digest its manifest records");
    const std::string set_name = std::to_string(index++);
    const Shape shape{static_cast<std::int64_t>(bytes.size())};
    TRESTLE_RETURN_IF_ERROR(
        write_dataset(group.get(), set_name, DType::kU8, shape, reinterpret_cast<const std::byte*>(bytes.data())));
    Handle set(H5Dopen2(group.get(), set_name.c_str(), H5P_DEFAULT), H5Dclose);
    TRESTLE_RETURN_IF_ERROR(write_string_attribute(set.get(), "name", name));
  }
  return OkStatus();
}

// The export's file while it is written (temporary_sibling of the output), removed on every way out but its rename
// into place: a failed or interrupted export leaves no partial file behind, and the output is never touched until then.
class ExportTemporary {
 public:
  explicit ExportTemporary(const std::string& output) : path_(temporary_sibling(output)), removed_on_signal_(path_) {
    ::unlink(path_.c_str());  // a fresh file: whatever sits at the (predictable) name is not written through
  }
  ~ExportTemporary() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  ExportTemporary(const ExportTemporary&) = delete;
  ExportTemporary& operator=(const ExportTemporary&) = delete;
  const std::string& path() const { return path_; }

  // Syncs the closed file to disk (H5Fflush only hands it to the kernel) and renames it over `output`.
  Status commit(const std::string& output) {
    TRESTLE_RETURN_IF_ERROR(fault_point("fsync", path_));
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
      const Status error = Status::Error(path_ + ": cannot fsync: " + std::strerror(errno));
      if (fd >= 0) ::close(fd);
      return error;
    }
    ::close(fd);
    TRESTLE_RETURN_IF_ERROR(commit_rename(path_, output));
    removed_on_signal_.release();
    path_.clear();
    return OkStatus();
  }

 private:
  std::string path_;
  RemovedOnSignal removed_on_signal_;  // so is an export ended by SIGINT, SIGTERM or SIGHUP
};

}  // namespace

Result<Hdf5Report> export_hdf5(const CheckpointReader& reader, const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as values with our messages
  {
    // The output replaces a regular file only: a link would be replaced by a file (what it named left as it was),
    // which is not what its owner meant; convert refuses such destinations too.
    std::error_code ec;
    const auto status = std::filesystem::symlink_status(path, ec);
    if (std::filesystem::is_symlink(status))
      return Status::Error(path +
                           ": is a symbolic link; export writes a regular file and does not replace links "
                           "(remove it, or name the file it points to)");
    if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
      return Status::Error(path + ": exists and is not a regular file");
  }
  TRESTLE_ASSIGN_OR_RETURN(const FileLock writing, lock_output(path));  // (one export into `path` at a time)
  const RemovedOnSignal lock_removed_on_signal(writing.path());
  remove_dead_temporaries(path);  // those of exports killed before their rename
  ExportTemporary temp(path);
  Hdf5Report report;
  {
    Handle file(H5Fcreate(temp.path().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!file.ok()) return Status::Error(path + ": cannot create HDF5 file");
    nlohmann::json header = to_json(reader.manifest());
    for (auto& [name, entry] : header["tensors"].items()) entry.erase("chunks");  // the datasets hold the data
    std::vector<std::byte> buffer;
    for (const auto& [name, t] : reader.manifest().tensors) {
      // A dataset's name is a path in HDF5: '/' would make groups, "." and ".." name others, kFilesGroup the files'.
      if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos || name == kFilesGroup)
        return Status::Error(path + ": tensor '" + printable_text(name) +
                             "' cannot be a dataset's name in the file (HDF5 reads '/', '.' and '..' as paths; '" +
                             kFilesGroup + "' holds the carried files)");
      buffer.resize(static_cast<std::size_t>(numel(t.global_shape)) * dtype_size(t.dtype));
      const LoadRequest request{name, Piece{whole_box(t.global_shape), std::nullopt}, buffer.data()};
      TRESTLE_RETURN_IF_ERROR(reader.load({&request, 1}));
      TRESTLE_RETURN_IF_ERROR(
          write_dataset(file.get(), name, t.dtype, t.global_shape, buffer.data()).with_context(path));
      // The whole tensor's digest, which import checks: HDF5 keeps none of its own.
      header["tensors"][name]["xxh3_64"] = to_hex(xxh3_64(buffer));
      report.tensors += 1;
      report.bytes += buffer.size();
    }
    const std::string header_text = header.dump();
    TRESTLE_RETURN_IF_ERROR(write_string_attribute(file.get(), "trestle_manifest", header_text).with_context(path));
    TRESTLE_RETURN_IF_ERROR(
        write_string_attribute(file.get(), kHeaderDigest, to_hex(xxh3_64(std::as_bytes(std::span(header_text)))))
            .with_context(path));
    TRESTLE_RETURN_IF_ERROR(write_carried_files(file.get(), reader).with_context(path));
    if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) return Status::Error(path + ": cannot flush HDF5 file");
  }
  TRESTLE_RETURN_IF_ERROR(temp.commit(path));
  return report;
}

namespace {

// Whether a dataset's storage is allocated for all of it: every chunk written when chunked (HDF5's space status calls
// a compressed dataset partly allocated, its stored bytes being fewer than its data's), else its space allocated.
bool storage_complete(hid_t set, hid_t create, hid_t space, const std::vector<hsize_t>& dims) {
  if (H5Pget_layout(create) != H5D_CHUNKED) {
    H5D_space_status_t allocated{};
    return H5Dget_space_status(set, &allocated) >= 0 && allocated == H5D_SPACE_STATUS_ALLOCATED;
  }
  std::vector<hsize_t> chunk(dims.size());
  if (H5Pget_chunk(create, static_cast<int>(chunk.size()), chunk.data()) != static_cast<int>(dims.size())) return false;
  hsize_t chunks = 1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (chunk[i] == 0) return false;
    const hsize_t along = dims[i] / chunk[i] + (dims[i] % chunk[i] != 0);
    if (along > std::numeric_limits<hsize_t>::max() / chunks) return false;
    chunks *= along;
  }
  hsize_t written = 0;
  return H5Dget_num_chunks(set, space, &written) >= 0 && written == chunks;
}

// A group member stored in this file: a hard link (not a soft or external link, which would name an object elsewhere,
// in another file).
Status check_stored_here(hid_t group, const std::string& name, const std::string& where) {
  H5L_info_t link{};
  if (H5Lget_info(group, name.c_str(), &link, H5P_DEFAULT) < 0) return Status::Error(where + ": cannot read its link");
  if (link.type != H5L_TYPE_HARD)
    return Status::Error(where + ": is a" + (link.type == H5L_TYPE_EXTERNAL ? "n external" : " soft") +
                         " link; only datasets stored in the file itself are imported");
  return OkStatus();
}

// A dataset's dtype and shape, checked before anything is allocated for it: its stored type holds the dtype, and its
// storage is allocated in full (a dataset never written reads as its fill value) and, unless filtered (compressed),
// holds the bytes its shape needs, no more than the file has. `where` names it in errors.
Result<LayoutTensor> describe_dataset(hid_t group, const std::string& name, const std::string& where,
                                      std::uint64_t file_bytes) {
  TRESTLE_RETURN_IF_ERROR(check_stored_here(group, name, where));
  Handle set(H5Dopen2(group, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return Status::Error(where + ": cannot open");
  {
    // Data kept in other files (external raw storage, virtual datasets) would be read from wherever they name.
    Handle create(H5Dget_create_plist(set.get()), H5Pclose);
    const H5D_layout_t layout = H5Pget_layout(create.get());
    if (layout != H5D_CONTIGUOUS && layout != H5D_CHUNKED && layout != H5D_COMPACT)
      return Status::Error(where +
                           ": is a virtual dataset (its data in other datasets or files); only data stored in "
                           "the file itself are imported");
    if (H5Pget_external_count(create.get()) != 0)
      return Status::Error(where +
                           ": keeps its data in external files; only data stored in the file itself are "
                           "imported");
  }
  TRESTLE_ASSIGN_OR_RETURN(const std::string dtype_text, read_string_attribute(set.get(), "dtype", where));
  const auto dtype = parse_dtype(dtype_text);
  if (!dtype) return Status::Error(where + ": unknown dtype attribute '" + dtype_text + "'");
  Handle space(H5Dget_space(set.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) return Status::Error(where + ": cannot read its shape");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  LayoutTensor out{name, *dtype, Shape(dims.begin(), dims.end())};
  Handle file_type(H5Dget_type(set.get()), H5Tclose);
  Handle expected(storage_type(*dtype), H5Tclose);
  if (H5Tget_size(file_type.get()) != dtype_size(*dtype) ||
      H5Tget_class(file_type.get()) != H5Tget_class(expected.get()))
    return Status::Error(where + ": stored type does not hold " + dtype_text + " values");
  // Integers are read as their values: a signed value where the dtype is unsigned (or the reverse) would be clamped
  // (a bf16 weight's bits written as int16 lost every negative one). Bit patterns (bf16, fp8) are read as bits.
  if (H5Tget_class(file_type.get()) == H5T_INTEGER && !bit_pattern(*dtype) &&
      H5Tget_sign(file_type.get()) != H5Tget_sign(expected.get()))
    return Status::Error(where + ": stored as " + (H5Tget_sign(file_type.get()) == H5T_SGN_2 ? "signed" : "unsigned") +
                         " integers, which do not hold " + dtype_text + " values (its dtype attribute)");
  const auto bytes = checked_nbytes(out.shape, dtype_size(*dtype));
  if (!bytes) return Status::Error(where + ": shape too large");
  if (*bytes == 0) return out;
  const std::string holds = to_string(out.shape) + " " + dtype_text + " (" + std::to_string(*bytes) + " bytes)";
  Handle create(H5Dget_create_plist(set.get()), H5Pclose);
  if (!storage_complete(set.get(), create.get(), space.get(), dims))
    return Status::Error(where + ": its data were never written in full (storage not allocated), so it cannot hold " +
                         holds);
  const std::uint64_t stored = H5Dget_storage_size(set.get());
  if (stored > file_bytes || (H5Pget_nfilters(create.get()) <= 0 && stored < *bytes))
    return Status::Error(where + ": stores " + std::to_string(stored) + " bytes in a file of " +
                         std::to_string(file_bytes) + ", which cannot hold " + holds);
  // A compressed dataset's few stored bytes may declare any size: one larger than this machine's memory cannot be
  // staged (the import reads a tensor whole) and is refused before anything is allocated.
  const std::uint64_t memory = physical_memory_bytes();
  if (*bytes > memory)
    return Status::Error(where + ": holds " + holds + " (compressed into " + std::to_string(stored) +
                         " bytes), more than this machine's memory (" + std::to_string(memory) + " bytes)");
  return out;
}

// Reads a dataset describe_dataset accepted into `out` (its bytes exactly; a bit pattern's in whichever integer sign
// the file stores it, so that no value is converted).
Status read_dataset(hid_t group, const std::string& name, DType dtype, std::span<std::byte> out,
                    const std::string& where) {
  Handle set(H5Dopen2(group, name.c_str(), H5P_DEFAULT), H5Dclose);
  Handle memory(storage_type(dtype), H5Tclose);
  if (set.ok() && bit_pattern(dtype)) {
    Handle file_type(H5Dget_type(set.get()), H5Tclose);
    if (H5Tget_class(file_type.get()) == H5T_INTEGER) H5Tset_sign(memory.get(), H5Tget_sign(file_type.get()));
  }
  if (!set.ok() || (!out.empty() && H5Dread(set.get(), memory.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0))
    return Status::Error(where + ": cannot read");
  return OkStatus();
}

// Names of a group's members, in name order (written without the iterate API, which changed in HDF5 1.12).
std::vector<std::string> member_names(hid_t group) {
  std::vector<std::string> names;
  H5G_info_t info{};
  if (H5Gget_info(group, &info) < 0) return names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t size = H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (size < 0) continue;
    std::string name(static_cast<std::size_t>(size) + 1, '\0');
    H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(), H5P_DEFAULT);
    name.resize(static_cast<std::size_t>(size));
    names.push_back(std::move(name));
  }
  return names;
}

// The datasets against the header's list of tensors (each {"dtype", "global_shape", "xxh3_64"}, as export writes it;
// files exported before 2026-12-04 have no digest): the same names, dtypes and shapes. Returns the digests by name.
Result<std::map<std::string, std::uint64_t>> check_listed_tensors(const nlohmann::json& listed,
                                                                  const std::vector<LayoutTensor>& tensors,
                                                                  const std::string& path) {
  if (!listed.is_object()) return Status::Error(path + ": trestle_manifest's 'tensors' must be an object");
  std::map<std::string, const LayoutTensor*> present;
  for (const auto& t : tensors) present[t.name] = &t;
  std::map<std::string, std::uint64_t> digests;
  for (const auto& [name, entry] : listed.items()) {
    const std::string where = path + ": dataset '" + name + "'";
    const auto it = present.find(name);
    if (it == present.end()) return Status::Error(where + " is missing; trestle_manifest lists it as " + entry.dump());
    const LayoutTensor& t = *it->second;
    nlohmann::json found = {{"dtype", dtype_name(t.dtype)}, {"global_shape", t.shape}};
    if (entry.is_object() && entry.contains("xxh3_64")) {
      const nlohmann::json& digest = entry["xxh3_64"];
      const std::string text = digest.is_string() ? digest.get<std::string>() : std::string();
      if (!is_hex_digest(text))
        return Status::Error(where + ": trestle_manifest's xxh3_64 " + digest.dump() + " is not 16 hex digits");
      digests[name] = std::stoull(text, nullptr, 16);
      found["xxh3_64"] = digest;
    }
    if (entry != found)
      return Status::Error(where + " is " + found.dump() + "; trestle_manifest lists it as " + entry.dump());
    present.erase(it);
  }
  if (!present.empty())
    return Status::Error(path + ": dataset '" + present.begin()->first +
                         "' is not one of the tensors trestle_manifest lists");
  return digests;
}

// A new directory under the system's temporary directory, removed with its contents when this goes.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "trestle_import_XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The files carried in kFilesGroup, written into `scratch` for the save to copy: each recorded in the header's files
// with its size and digest, under a name the manifest accepts; every recorded file carried once.
Result<std::vector<CheckpointInfo::File>> carried_files(hid_t file, const Manifest& header, const ScratchDir& scratch,
                                                        const std::string& path, std::uint64_t file_bytes) {
  std::vector<CheckpointInfo::File> out;
  auto left = header.files;
  if (H5Lexists(file, kFilesGroup, H5P_DEFAULT) > 0) {
    TRESTLE_RETURN_IF_ERROR(check_stored_here(file, kFilesGroup, path + ": '" + std::string(kFilesGroup) + "'"));
    Handle group(H5Gopen2(file, kFilesGroup, H5P_DEFAULT), H5Gclose);
    if (!group.ok()) return Status::Error(path + ": '" + kFilesGroup + "' is not a group");
    if (scratch.path().empty()) return Status::Error(path + ": cannot create a temporary directory for its files");
    for (const auto& member : member_names(group.get())) {
      const std::string where = path + ": dataset '" + kFilesGroup + "/" + member + "'";
      TRESTLE_ASSIGN_OR_RETURN(const LayoutTensor t, describe_dataset(group.get(), member, where, file_bytes));
      if (t.dtype != DType::kU8 || t.shape.size() != 1)
        return Status::Error(where + ": a carried file must be 1-d u8, not " + to_string(t.shape) + " " +
                             std::string(dtype_name(t.dtype)));
      Handle set(H5Dopen2(group.get(), member.c_str(), H5P_DEFAULT), H5Dclose);
      TRESTLE_ASSIGN_OR_RETURN(const std::string name, read_string_attribute(set.get(), "name", where));
      TRESTLE_RETURN_IF_ERROR(check_recorded_file_name(name, where));
      const auto recorded = left.find(name);
      if (recorded == left.end())
        return Status::Error(where + ": file '" + name + "' is not recorded in trestle_manifest's files, or twice");
      if (static_cast<std::uint64_t>(t.shape[0]) != recorded->second.bytes)
        return Status::Error(where + ": file '" + name + "' has " + std::to_string(t.shape[0]) +
                             " bytes, trestle_manifest records " + std::to_string(recorded->second.bytes));
      std::string bytes(static_cast<std::size_t>(t.shape[0]), '\0');
      TRESTLE_RETURN_IF_ERROR(
          read_dataset(group.get(), member, DType::kU8, std::as_writable_bytes(std::span(bytes)), where));
      if (xxh3_64(std::as_bytes(std::span(bytes))) != recorded->second.xxh3)
        return Status::Error(where + ": file '" + name + "' differs from the digest trestle_manifest records");
      const std::string copy = scratch.path() + "/" + std::to_string(out.size());
      TRESTLE_RETURN_IF_ERROR(write_file_atomically(copy, bytes));
      out.push_back({name, copy});
      left.erase(recorded);
    }
  }
  if (!left.empty())
    return Status::Error(path + ": file '" + left.begin()->first +
                         "' is recorded in trestle_manifest but not carried in '" + kFilesGroup + "'");
  return out;
}

// Why H5Fopen refused `path`: "not an HDF5 file" when no superblock signature is where HDF5 looks for one (offset 0,
// 512, 1024, ...), else the innermost message of HDF5's error stack (a truncated or damaged file).
std::string why_not_opened(const std::string& path) {
  std::string innermost;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* error, void* out) -> herr_t {
        if (n == 0 && error->desc) *static_cast<std::string*>(out) = error->desc;
        return 0;
      },
      &innermost);
  static constexpr char kSignature[] = "\x89HDF\r\n\x1a\n";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  bool signed_file = false;
  if (fd >= 0) {
    char head[8];
    for (off_t at = 0; !signed_file && ::pread(fd, head, sizeof head, at) == static_cast<ssize_t>(sizeof head);
         at = at == 0 ? 512 : at * 2)
      signed_file = std::memcmp(head, kSignature, sizeof head) == 0;
    ::close(fd);
  }
  if (!signed_file) return path + ": not an HDF5 file (no HDF5 signature)";
  return path + ": an HDF5 file that HDF5 cannot open (truncated or damaged?)" +
         (innermost.empty() ? std::string() : ": " + innermost);
}

}  // namespace

Result<Hdf5Report> import_hdf5(const std::string& path, const std::string& root, std::optional<std::int64_t> iteration,
                               const Hdf5ImportCheck& check) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::Error(path + ": no such file");
  if (!S_ISREG(st.st_mode))  // (HDF5 would wait forever on a FIFO)
    return Status::Error(path + ": not a regular file (" + file_kind(st.st_mode) + ")");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) return Status::Error(why_not_opened(path));
  TRESTLE_ASSIGN_OR_RETURN(const std::string header_text, read_string_attribute(file.get(), "trestle_manifest", path));
  if (H5Aexists(file.get(), kHeaderDigest) > 0) {
    TRESTLE_ASSIGN_OR_RETURN(const std::string digest, read_string_attribute(file.get(), kHeaderDigest, path));
    if (digest != to_hex(xxh3_64(std::as_bytes(std::span(header_text)))))
      return Status::Error(path + ": its 'trestle_manifest' attribute differs from the digest " + kHeaderDigest +
                           " records (the file is damaged)");
  }
  int depth = 0;
  nlohmann::json header = nlohmann::json::parse(
      header_text,
      [&depth](int at, nlohmann::json::parse_event_t, nlohmann::json&) {
        depth = std::max(depth, at);
        return true;
      },
      false);
  if (header.is_discarded() || !header.is_object())
    return Status::Error(path + ": 'trestle_manifest' attribute is not a JSON object");
  if (depth > kMaxHeaderDepth)
    return Status::Error(path + ": 'trestle_manifest' nests " + std::to_string(depth) + " levels deep; at most " +
                         std::to_string(kMaxHeaderDepth) + " are read");
  const nlohmann::json listed = header.contains("tensors") ? header["tensors"] : nlohmann::json();
  header["tensors"] = nlohmann::json::object();
  TRESTLE_ASSIGN_OR_RETURN(const Manifest meta, manifest_from_json(header, path + " (trestle_manifest)"));

  std::error_code size_error;
  const std::uint64_t file_bytes = std::filesystem::file_size(path, size_error);
  if (size_error) return Status::Error(path + ": cannot read its size: " + size_error.message());
  std::vector<LayoutTensor> tensors;
  for (const auto& name : member_names(file.get())) {
    if (name == kFilesGroup) continue;
    if (printable_text(name) != name)
      return Status::Error(path + ": dataset '" + printable_text(name) +
                           "': its name is not printable UTF-8 text, which a tensor's name must be");
    TRESTLE_ASSIGN_OR_RETURN(auto t, describe_dataset(file.get(), name, path + ": dataset '" + name + "'", file_bytes));
    tensors.push_back(std::move(t));
  }
  std::map<std::string, std::uint64_t> digests;
  if (!listed.is_null()) {
    TRESTLE_ASSIGN_OR_RETURN(digests, check_listed_tensors(listed, tensors, path));
  }
  bool replace = false;
  if (check) {
    TRESTLE_ASSIGN_OR_RETURN(replace, check(meta, tensors));
  }

  CheckpointInfo info;
  info.iteration = iteration.value_or(meta.iteration);
  info.layout = meta.layout;
  info.model = meta.model;
  info.training = meta.training;
  const ScratchDir scratch;
  TRESTLE_ASSIGN_OR_RETURN(info.files, carried_files(file.get(), meta, scratch, path, file_bytes));
  std::vector<SaveItem> items;
  Hdf5Report report;
  for (const auto& t : tensors) {
    items.push_back({t.name, t.dtype, t.shape, Piece{whole_box(t.shape), std::nullopt}, streamed_data()});
    report.tensors += 1;
    report.bytes += items.back().nbytes();
  }
  // One tensor at a time, read straight into the writer's buffer.
  auto fill = [&](std::size_t index, std::span<std::byte> out) -> Status {
    const std::string where = path + ": dataset '" + items[index].name + "'";
    TRESTLE_RETURN_IF_ERROR(read_dataset(file.get(), items[index].name, items[index].dtype, out, where));
    const auto digest = digests.find(items[index].name);
    if (digest != digests.end() && xxh3_64(out) != digest->second)
      return Status::Error(where + ": its data differ from the digest trestle_manifest records (the file is damaged)");
    return OkStatus();
  };
  SoloCollective solo;
  SaveOptions options;
  options.overwrite = replace;
  TRESTLE_ASSIGN_OR_RETURN(const SavePlan plan, plan_save(solo, root, info.iteration, items));
  const auto written = write_rank_file_streaming(plan.temp_dir, solo.rank(), items, plan.to_write, fill, options);
  TRESTLE_RETURN_IF_ERROR(commit_save(solo, root, plan, info, items, written, options));
  return report;
}

}  // namespace trestle
