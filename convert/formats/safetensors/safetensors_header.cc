#include "convert/formats/safetensors/safetensors_header.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "ckpt/json_file.h"

namespace trestle {
namespace {

using json = nlohmann::json;

std::string supported_dtypes() {
  std::string out;
  for (DType d : kAllDTypes) out += (out.empty() ? "" : ", ") + std::string(safetensors_name(d));
  return out;
}

Result<std::uint64_t> read_length_prefix(std::string_view prefix, std::uint64_t file_size) {
  if (file_size < 8 || prefix.size() < 8)
    return Status::Error("file is " + std::to_string(file_size) + " bytes, too short for the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
  if (n > file_size - 8)
    return Status::Error("header length " + std::to_string(n) + " runs past the end of the file (" +
                         std::to_string(file_size) + " bytes)");
  if (n > kSafetensorsMaxHeaderBytes)
    return Status::Error("header length " + std::to_string(n) + " exceeds the limit of " +
                         std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  return n;
}

// Parses the JSON, reporting duplicated top-level keys.
Result<json> parse_json_object(std::string_view text) {
  if (text.empty() || text.front() != '{') return Status::Error("header does not start with a JSON object '{'");
  // The JSON parser takes a NUL byte for the end of its input, so "{...}\0\0" would pass; the format pads the header
  // with spaces only, and the reference reader refuses anything else after the JSON ("trailing characters").
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    return Status::Error("header holds a NUL byte at byte " + std::to_string(8 + nul) +
                         " of the file; only spaces may pad the JSON to the header length");
  json header;
  try {
    header = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return Status::Error(std::string("header is not valid JSON: ") + e.what());
  }
  const JsonStrictness strictness = check_json_strictness(text);
  if (strictness.duplicate_depth == 1)
    return Status::Error("tensor name '" + strictness.duplicate_key + "' appears twice in the header");
  if (!strictness.problem.empty()) return Status::Error("header: " + strictness.problem);
  if (!header.is_object()) return Status::Error("header is not a JSON object");
  return header;
}

Result<std::map<std::string, std::string>> parse_metadata(const json& value) {
  std::map<std::string, std::string> metadata;
  if (!value.is_object()) return Status::Error("__metadata__ must be an object of strings");
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) return Status::Error("__metadata__['" + key + "'] is not a string");
    metadata[key] = item.get<std::string>();
  }
  return metadata;
}

Result<SafetensorsEntry> parse_entry(const std::string& name, const json& value) {
  auto fail = [&](const std::string& what) { return Status::Error("tensor '" + name + "': " + what); };
  if (!value.is_object()) return fail("entry is not a JSON object");
  if (!value.contains("dtype")) return fail("missing string field 'dtype'");
  if (!value["dtype"].is_string())
    return fail("field 'dtype' is " + value["dtype"].dump(-1).substr(0, 40) + ", not a string");
  const auto dtype_text = value["dtype"].get<std::string>();
  const auto dtype = dtype_from_safetensors(dtype_text);
  if (!dtype) return fail("unknown dtype '" + dtype_text + "' (supported: " + supported_dtypes() + ")");

  SafetensorsEntry entry;
  entry.name = name;
  entry.dtype = *dtype;
  if (!value.contains("shape")) return fail("missing list field 'shape'");
  if (!value["shape"].is_array())
    return fail("field 'shape' is " + value["shape"].dump(-1).substr(0, 40) + ", not a list");
  for (const auto& extent : value["shape"]) {
    if (!extent.is_number_unsigned())
      return fail("shape " + value["shape"].dump() + " is not a list of non-negative integers");
    entry.shape.push_back(static_cast<std::int64_t>(std::min<std::uint64_t>(extent.get<std::uint64_t>(), INT64_MAX)));
  }
  const auto& offsets = value.contains("data_offsets") ? value["data_offsets"] : json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    return fail("data_offsets must be [begin, end] with non-negative integers");
  entry.begin = offsets[0].get<std::uint64_t>();
  entry.end = offsets[1].get<std::uint64_t>();
  if (entry.begin > entry.end) return fail("data_offsets " + offsets.dump() + " end before they begin");

  const auto expected = checked_nbytes(entry.shape, dtype_size(entry.dtype));
  if (!expected) return fail("shape " + to_string(entry.shape) + " is too large");
  if (*expected != entry.nbytes())
    return fail("data_offsets " + offsets.dump() + " hold " + std::to_string(entry.nbytes()) + " bytes but " +
                dtype_text + " " + to_string(entry.shape) + " needs " + std::to_string(*expected));
  return entry;
}

// The data buffer must be covered exactly: entries sorted by offset follow each other without holes or overlaps. A
// tensor past the buffer's end is named first (the hole it left is its doing).
Status check_coverage(std::vector<SafetensorsEntry>& tensors, std::uint64_t buffer_size) {
  for (const auto& t : tensors) {
    if (t.end > buffer_size)
      return Status::Error("tensor '" + t.name + "': data_offsets [" + std::to_string(t.begin) + ", " +
                           std::to_string(t.end) + "] run past the data buffer (" + std::to_string(buffer_size) +
                           " bytes)");
  }
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const auto& a, const auto& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::uint64_t cursor = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& t : tensors) {
    if (t.begin < cursor)
      return Status::Error("tensor '" + t.name + "': data_offsets [" + std::to_string(t.begin) + ", " +
                           std::to_string(t.end) + "] overlap tensor '" + previous->name + "'");
    if (t.begin > cursor)
      return Status::Error("bytes [" + std::to_string(cursor) + ", " + std::to_string(t.begin) +
                           ") of the data buffer belong to no tensor (before tensor '" + t.name + "')");
    cursor = t.end;
    previous = &t;
  }
  if (cursor != buffer_size)
    return Status::Error("data buffer has " + std::to_string(buffer_size - cursor) +
                         " trailing bytes that belong to no tensor");
  return OkStatus();
}

}  // namespace

Result<SafetensorsHeader> parse_safetensors_header(std::string_view file_prefix, std::uint64_t file_size) {
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t length, read_length_prefix(file_prefix, file_size));
  if (file_prefix.size() < 8 + length) return Status::Error("internal: header bytes not supplied");
  TRESTLE_ASSIGN_OR_RETURN(json header, parse_json_object(file_prefix.substr(8, length)));

  SafetensorsHeader out;
  out.data_start = 8 + length;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      TRESTLE_ASSIGN_OR_RETURN(out.metadata, parse_metadata(value));
      continue;
    }
    TRESTLE_ASSIGN_OR_RETURN(auto entry, parse_entry(name, value));
    out.tensors.push_back(std::move(entry));
  }
  TRESTLE_RETURN_IF_ERROR(check_coverage(out.tensors, file_size - out.data_start));
  return out;
}

std::string serialize_safetensors_header(const std::vector<SafetensorsEntry>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  // Keys in data order with __metadata__ first, as the reference writer emits them.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", safetensors_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace trestle
