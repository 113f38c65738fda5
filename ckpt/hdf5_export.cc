#include "ckpt/hdf5_export.h"

#include <hdf5.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/save.h"

namespace trestle {
namespace {

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

Result<std::string> read_string_attribute(hid_t object, const char* name, const std::string& where) {
  if (H5Aexists(object, name) <= 0) return Status::Error(where + ": no '" + name + "' attribute");
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0)
    return Status::Error(where + ": attribute '" + name + "' is not a fixed-length string");
  std::string value(H5Tget_size(type.get()), '\0');
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

}  // namespace

Result<Hdf5Report> export_hdf5(const CheckpointReader& reader, const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as values with our messages
  const std::string temp = temporary_sibling(path);
  Hdf5Report report;
  {
    Handle file(H5Fcreate(temp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!file.ok()) return Status::Error(path + ": cannot create HDF5 file");
    nlohmann::json header = to_json(reader.manifest());
    header.erase("tensors");
    TRESTLE_RETURN_IF_ERROR(write_string_attribute(file.get(), "trestle_manifest", header.dump()).with_context(path));
    std::vector<std::byte> buffer;
    for (const auto& [name, t] : reader.manifest().tensors) {
      buffer.resize(static_cast<std::size_t>(numel(t.global_shape)) * dtype_size(t.dtype));
      const LoadRequest request{name, Piece{whole_box(t.global_shape), std::nullopt}, buffer.data()};
      TRESTLE_RETURN_IF_ERROR(reader.load({&request, 1}));
      TRESTLE_RETURN_IF_ERROR(
          write_dataset(file.get(), name, t.dtype, t.global_shape, buffer.data()).with_context(path));
      report.tensors += 1;
      report.bytes += buffer.size();
    }
    if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) return Status::Error(path + ": cannot flush HDF5 file");
  }
  TRESTLE_RETURN_IF_ERROR(commit_rename(temp, path));
  return report;
}

namespace {

struct Dataset {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> data;
};

Result<Dataset> read_dataset(hid_t file, const std::string& name, const std::string& path) {
  const std::string where = path + ": dataset '" + name + "'";
  Handle set(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return Status::Error(where + ": cannot open");
  TRESTLE_ASSIGN_OR_RETURN(const std::string dtype_text, read_string_attribute(set.get(), "dtype", where));
  const auto dtype = parse_dtype(dtype_text);
  if (!dtype) return Status::Error(where + ": unknown dtype attribute '" + dtype_text + "'");
  Handle space(H5Dget_space(set.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) return Status::Error(where + ": cannot read its shape");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  Dataset out{name, *dtype, Shape(dims.begin(), dims.end()), {}};
  Handle file_type(H5Dget_type(set.get()), H5Tclose);
  Handle expected(storage_type(*dtype), H5Tclose);
  if (H5Tget_size(file_type.get()) != dtype_size(*dtype) ||
      H5Tget_class(file_type.get()) != H5Tget_class(expected.get()))
    return Status::Error(where + ": stored type does not hold " + dtype_text + " values");
  const auto bytes = checked_nbytes(out.shape, dtype_size(*dtype));
  if (!bytes) return Status::Error(where + ": shape too large");
  out.data.resize(*bytes);
  if (*bytes && H5Dread(set.get(), expected.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data.data()) < 0)
    return Status::Error(where + ": cannot read");
  return out;
}

// Names of the root group's members, in name order (written without the iterate API, which changed in HDF5 1.12).
std::vector<std::string> member_names(hid_t file) {
  std::vector<std::string> names;
  H5G_info_t info{};
  if (H5Gget_info(file, &info) < 0) return names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t size = H5Lget_name_by_idx(file, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (size < 0) continue;
    std::string name(static_cast<std::size_t>(size) + 1, '\0');
    H5Lget_name_by_idx(file, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(), H5P_DEFAULT);
    name.resize(static_cast<std::size_t>(size));
    names.push_back(std::move(name));
  }
  return names;
}

}  // namespace

Result<Hdf5Report> import_hdf5(const std::string& path, const std::string& root,
                               std::optional<std::int64_t> iteration) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (!std::filesystem::exists(path)) return Status::Error(path + ": no such file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) return Status::Error(path + ": not an HDF5 file");
  TRESTLE_ASSIGN_OR_RETURN(const std::string header_text, read_string_attribute(file.get(), "trestle_manifest", path));
  nlohmann::json header = nlohmann::json::parse(header_text, nullptr, false);
  if (header.is_discarded()) return Status::Error(path + ": 'trestle_manifest' attribute is not JSON");
  header["tensors"] = nlohmann::json::object();
  TRESTLE_ASSIGN_OR_RETURN(const Manifest meta, manifest_from_json(header, path + " (trestle_manifest)"));

  const std::vector<std::string> names = member_names(file.get());
  std::vector<Dataset> datasets;
  std::vector<SaveItem> items;
  Hdf5Report report;
  for (const auto& name : names) {
    TRESTLE_ASSIGN_OR_RETURN(auto d, read_dataset(file.get(), name, path));
    datasets.push_back(std::move(d));
  }
  for (const auto& d : datasets) {
    items.push_back({d.name, d.dtype, d.shape, Piece{whole_box(d.shape), std::nullopt}, d.data.data()});
    report.tensors += 1;
    report.bytes += d.data.size();
  }
  CheckpointInfo info;
  info.iteration = iteration.value_or(meta.iteration);
  info.layout = meta.layout;
  info.model = meta.model;
  info.training = meta.training;
  SoloCollective solo;
  TRESTLE_RETURN_IF_ERROR(save_checkpoint(solo, root, info, items));
  return report;
}

}  // namespace trestle
