#include "train/data/npy.h"

#include <charconv>
#include <cstring>
#include <limits>
#include <regex>

#include "ckpt/atomic_file.h"
#include "ckpt/json_file.h"

namespace trestle::data {
namespace {

constexpr std::size_t kAlign = 64;

const char* descr(NpyDType dtype) {
  switch (dtype) {
    case NpyDType::kInt16:
      return "<i2";
    case NpyDType::kInt32:
      return "<i4";
    case NpyDType::kUint32:
      return "<u4";
    case NpyDType::kInt64:
      return "<i8";
  }
  return "?";
}

std::size_t item_size(NpyDType dtype) {
  switch (dtype) {
    case NpyDType::kInt16:
      return 2;
    case NpyDType::kInt32:
    case NpyDType::kUint32:
      return 4;
    case NpyDType::kInt64:
      return 8;
  }
  return 0;
}

bool fits(NpyDType dtype, std::int64_t v) {
  switch (dtype) {
    case NpyDType::kInt16:
      return v >= -32768 && v <= 32767;
    case NpyDType::kInt32:
      return v >= std::numeric_limits<std::int32_t>::min() && v <= std::numeric_limits<std::int32_t>::max();
    case NpyDType::kUint32:
      return v >= 0 && v <= std::numeric_limits<std::uint32_t>::max();
    case NpyDType::kInt64:
      return true;
  }
  return false;
}

template <class T>
void put(std::string& out, std::int64_t v) {
  const T narrow = static_cast<T>(v);
  out.append(reinterpret_cast<const char*>(&narrow), sizeof(T));
}

template <class T>
std::int64_t get(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return static_cast<std::int64_t>(v);
}

}  // namespace

Status write_npy(const std::string& path, NpyDType dtype, std::span<const std::size_t> shape,
                 std::span<const std::int64_t> values) {
  std::size_t count = 1;
  std::string shape_text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    count *= shape[i];
    shape_text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  shape_text += shape.size() == 1 ? ",)" : ")";
  if (count != values.size())
    return Status::Error(path + ": " + std::to_string(values.size()) + " values for shape " + shape_text);
  std::string header =
      std::string("{'descr': '") + descr(dtype) + "', 'fortran_order': False, 'shape': " + shape_text + ", }";
  const std::size_t padding = kAlign - ((8 + 2 + header.size() + 1) % kAlign);
  header.append(padding, ' ');
  header += '\n';

  std::string out("\x93NUMPY\x01\x00", 8);
  const auto header_length = static_cast<std::uint16_t>(header.size());
  out.append(reinterpret_cast<const char*>(&header_length), 2);
  out += header;
  out.reserve(out.size() + count * item_size(dtype));
  for (const auto v : values) {
    if (!fits(dtype, v)) return Status::Error(path + ": value " + std::to_string(v) + " does not fit " + descr(dtype));
    switch (dtype) {
      case NpyDType::kInt16:
        put<std::int16_t>(out, v);
        break;
      case NpyDType::kInt32:
        put<std::int32_t>(out, v);
        break;
      case NpyDType::kUint32:
        put<std::uint32_t>(out, v);
        break;
      case NpyDType::kInt64:
        put<std::int64_t>(out, v);
        break;
    }
  }
  remove_dead_temporaries(path);
  return write_file_atomically(path, out, FaultPoints::kSkipped);
}

Result<NpyArray> read_npy(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string bytes, read_text_file(path, std::numeric_limits<std::uint64_t>::max()));
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0 || bytes[6] != 1)
    return Status::Error(path + ": not a version 1 .npy file");
  std::uint16_t header_length;
  std::memcpy(&header_length, bytes.data() + 8, 2);
  if (10u + header_length > bytes.size()) return Status::Error(path + ": truncated .npy header");
  const std::string header = bytes.substr(10, header_length);
  static const std::regex kHeader(R"(\{'descr': '([<|]\w\d)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \})");
  std::smatch m;
  if (!std::regex_search(header, m, kHeader)) return Status::Error(path + ": unsupported .npy header: " + header);
  NpyArray array;
  const std::string type = m[1];
  if (type == "<i2") array.dtype = NpyDType::kInt16;
  else if (type == "<i4") array.dtype = NpyDType::kInt32;
  else if (type == "<u4") array.dtype = NpyDType::kUint32;
  else if (type == "<i8") array.dtype = NpyDType::kInt64;
  else return Status::Error(path + ": unsupported .npy dtype " + type);
  const std::string dims = m[2];
  const std::size_t item = item_size(array.dtype);
  const std::size_t data_at = 10u + header_length;
  const std::size_t most = (bytes.size() - data_at) / item;  // a dimension or count past this cannot be the file's
  std::size_t count = 1;
  for (std::size_t at = 0; at < dims.size();) {
    const std::size_t comma = dims.find(',', at);
    const std::string dim = dims.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const std::size_t digits = dim.find_first_not_of(' ');
    if (digits != std::string::npos) {
      const char* last = dim.data() + dim.find_last_not_of(' ') + 1;
      std::size_t n = 0;
      const auto [end, error] = std::from_chars(dim.data() + digits, last, n);
      if (error != std::errc() || end != last || (n != 0 && count > most / n))
        return Status::Error(path + ": .npy shape (" + dims + ") holds more values than the file's " +
                             std::to_string(bytes.size() - data_at) + " data bytes");
      array.shape.push_back(n);
      count *= n;
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (bytes.size() - data_at != count * item)
    return Status::Error(path + ": " + std::to_string(bytes.size() - data_at) + " data bytes for " +
                         std::to_string(count) + " values of " + type);
  array.values.resize(count);
  const char* p = bytes.data() + data_at;
  for (std::size_t i = 0; i < count; ++i, p += item) {
    switch (array.dtype) {
      case NpyDType::kInt16:
        array.values[i] = get<std::int16_t>(p);
        break;
      case NpyDType::kInt32:
        array.values[i] = get<std::int32_t>(p);
        break;
      case NpyDType::kUint32:
        array.values[i] = get<std::uint32_t>(p);
        break;
      case NpyDType::kInt64:
        array.values[i] = get<std::int64_t>(p);
        break;
    }
  }
  return array;
}

}  // namespace trestle::data
