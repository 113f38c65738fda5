#include "ckpt/manifest.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>

#include "ckpt/checksum.h"
#include "ckpt/file_name.h"
#include "ckpt/json_file.h"

namespace trestle {
namespace {

using json = nlohmann::json;

json piece_to_json(const Piece& piece) {
  json out = {{"offset", piece.box.offset}, {"shape", piece.box.shape}};
  if (piece.flat) out["flat"] = {piece.flat->start, piece.flat->stop};
  return out;
}

}  // namespace

json chunk_to_json(const StoredChunk& c) {
  json out = piece_to_json(c.piece);
  out["file"] = c.file;
  out["byte_offset"] = c.byte_offset;
  out["stored_bytes"] = c.stored_bytes;
  out["codec"] = codec_name(c.codec);
  out["block_bytes"] = c.block_bytes;
  json sums = json::array();
  for (auto s : c.block_checksums) sums.push_back(to_hex(s));
  out["xxh3_64"] = sums;
  if (c.codec == Codec::kZstd) out["block_stored_bytes"] = c.block_stored_bytes;
  return out;
}

namespace {

// Small typed accessors that turn a wrong type into an error naming the field.
class Reader {
 public:
  Reader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}
  Status error(const std::string& what) const { return Status::Error(where_ + ": " + what); }
  bool has(const char* key) const { return object_.is_object() && object_.contains(key); }
  const json& at(const char* key) const { return object_.at(key); }

  Result<std::uint64_t> u64(const char* key) const {
    if (!has(key) || !at(key).is_number_unsigned())
      return error(std::string("'") + key + "' must be a non-negative integer");
    return at(key).get<std::uint64_t>();
  }
  Result<std::string> str(const char* key) const {
    if (!has(key) || !at(key).is_string()) return error(std::string("'") + key + "' must be a string");
    return at(key).get<std::string>();
  }
  Result<Shape> shape(const char* key) const {
    if (!has(key) || !at(key).is_array()) return error(std::string("'") + key + "' must be a list of integers");
    Shape out;
    for (const auto& v : at(key)) {
      if (!v.is_number_unsigned()) return error(std::string("'") + key + "' must be a list of non-negative integers");
      out.push_back(v.get<std::int64_t>());
    }
    return out;
  }

 private:
  const json& object_;
  std::string where_;
};

constexpr const char* kManifestChecksumKey = "manifest_xxh3_64";
constexpr std::uint64_t kZstdMaxRatio = (128 << 10) / 4;  // content bytes per stored byte, at most

Result<std::uint64_t> parse_hex(const json& value, const Reader& r) {
  if (!value.is_string() || value.get<std::string>().size() != 16) return r.error("checksums must be 16 hex digits");
  std::uint64_t out = 0;
  for (char c : value.get<std::string>()) {
    const int digit = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (digit < 0) return r.error("checksums must be 16 lower-case hex digits");
    out = (out << 4) | static_cast<std::uint64_t>(digit);
  }
  return out;
}

}  // namespace

Result<StoredChunk> chunk_from_json(const json& j, const TensorEntry& tensor, const std::string& where) {
  const Reader r(j, where);
  if (!j.is_object()) return r.error("chunk is not an object");
  StoredChunk c;
  TRESTLE_ASSIGN_OR_RETURN(c.piece.box.offset, r.shape("offset"));
  TRESTLE_ASSIGN_OR_RETURN(c.piece.box.shape, r.shape("shape"));
  if (!box_within(c.piece.box, tensor.global_shape))
    return r.error("box " + to_string(c.piece.box) + " is not within the global shape " +
                   to_string(tensor.global_shape));
  if (r.has("flat")) {
    const auto& f = r.at("flat");
    if (!f.is_array() || f.size() != 2 || !f[0].is_number_unsigned() || !f[1].is_number_unsigned())
      return r.error("'flat' must be [start, stop]");
    c.piece.flat = FlatRange{f[0].get<std::int64_t>(), f[1].get<std::int64_t>()};
    if (c.piece.flat->start > c.piece.flat->stop || c.piece.flat->stop > c.piece.box.numel())
      return r.error("flat range " + to_string(c.piece) + " is not within its box");
  }
  TRESTLE_ASSIGN_OR_RETURN(c.file, r.str("file"));
  if (!is_plain_file_name(c.file) || c.file.starts_with("."))
    return r.error("'file' = '" + c.file + "' is not a file name in the iteration directory");
  TRESTLE_ASSIGN_OR_RETURN(c.byte_offset, r.u64("byte_offset"));
  TRESTLE_ASSIGN_OR_RETURN(c.stored_bytes, r.u64("stored_bytes"));
  TRESTLE_ASSIGN_OR_RETURN(c.block_bytes, r.u64("block_bytes"));
  if (c.block_bytes == 0 || c.block_bytes % dtype_size(tensor.dtype) != 0)
    return r.error("'block_bytes' must be a positive multiple of the element size");
  TRESTLE_ASSIGN_OR_RETURN(const std::string codec, r.str("codec"));
  if (codec == "raw") c.codec = Codec::kRaw;
  else if (codec == "zstd") c.codec = Codec::kZstd;
  else return r.error("unknown codec '" + codec + "' (expected raw or zstd)");

  const std::uint64_t raw = raw_bytes(c, tensor.dtype);
  const std::uint64_t blocks = block_count(raw, c.block_bytes);
  if (!r.has("xxh3_64") || !r.at("xxh3_64").is_array() || r.at("xxh3_64").size() != blocks)
    return r.error("'xxh3_64' must list one checksum per block (" + std::to_string(blocks) + ")");
  for (const auto& s : r.at("xxh3_64")) {
    TRESTLE_ASSIGN_OR_RETURN(auto sum, parse_hex(s, r));
    c.block_checksums.push_back(sum);
  }
  if (c.codec == Codec::kRaw && c.stored_bytes != raw)
    return r.error("raw chunk stores " + std::to_string(c.stored_bytes) + " bytes but its piece needs " +
                   std::to_string(raw));
  if (c.codec == Codec::kZstd) {
    if (!r.has("block_stored_bytes") || !r.at("block_stored_bytes").is_array() ||
        r.at("block_stored_bytes").size() != blocks)
      return r.error("zstd chunk needs 'block_stored_bytes' with one size per block");
    std::uint64_t total = 0;
    for (const auto& s : r.at("block_stored_bytes")) {
      if (!s.is_number_unsigned()) return r.error("'block_stored_bytes' must be non-negative integers");
      c.block_stored_bytes.push_back(s.get<std::uint64_t>());
      total += c.block_stored_bytes.back();
    }
    if (total != c.stored_bytes) return r.error("'block_stored_bytes' do not add up to 'stored_bytes'");
    // A Zstandard frame holds at most 128 KiB of content per 4 stored bytes (an RLE block: a 3-byte header and the
    // byte), so a block claiming more is refused before anything is allocated for it.
    for (std::uint64_t b = 0; b < blocks; ++b) {
      const std::uint64_t raw_in_block = std::min(c.block_bytes, raw - b * c.block_bytes);
      if (raw_in_block / kZstdMaxRatio > c.block_stored_bytes[b])
        return r.error("zstd block " + std::to_string(b) + " stores " + std::to_string(c.block_stored_bytes[b]) +
                       " bytes, which no Zstandard frame decompresses to its " + std::to_string(raw_in_block) +
                       " raw bytes");
    }
  }
  return c;
}

Status check_exact_cover(const TensorEntry& tensor, const std::string& where) {
  // Chunks of one box: their flat ranges (the whole box when not flat) must not overlap.
  std::map<std::pair<Shape, Shape>, std::vector<std::pair<std::int64_t, std::int64_t>>> by_box;
  std::map<std::pair<Shape, Shape>, std::vector<const StoredChunk*>> chunks_of;
  std::int64_t held = 0;
  for (const auto& c : tensor.chunks) {
    const auto key = std::make_pair(c.piece.box.offset, c.piece.box.shape);
    by_box[key].emplace_back(c.piece.first_element(), c.piece.first_element() + c.piece.numel());
    chunks_of[key].push_back(&c);
    // Saturated: chunk counts come from the file (each chunk is within the tensor, so held passes it only on overlap).
    held = held > std::numeric_limits<std::int64_t>::max() - c.piece.numel() ? std::numeric_limits<std::int64_t>::max()
                                                                             : held + c.piece.numel();
  }
  for (auto& [key, ranges] : by_box) {
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second)
        return Status::Error(where + ": two chunks of box " + to_string(Box{key.first, key.second}) +
                             " hold the same elements (flat " + std::to_string(ranges[i].first) + " onwards)");
  }
  // Distinct boxes must share no element (checked element-wise only where the boxes intersect).
  std::vector<Box> boxes;
  std::vector<const std::vector<const StoredChunk*>*> chunks_in;
  for (const auto& [key, chunks] : chunks_of) {
    boxes.push_back(Box{key.first, key.second});
    chunks_in.push_back(&chunks);
  }
  std::optional<std::pair<const StoredChunk*, const StoredChunk*>> shared;
  for_each_intersecting_pair(boxes, [&](std::size_t a, std::size_t b) {
    for (const StoredChunk* x : *chunks_in[a])
      for (const StoredChunk* y : *chunks_in[b])
        if (shared_elements(x->piece, y->piece) > 0) {
          shared = {x, y};
          return false;
        }
    return true;
  });
  if (shared)
    return Status::Error(where + ": chunks " + to_string(shared->first->piece) + " and " +
                         to_string(shared->second->piece) + " overlap (every element must be stored exactly once)");
  if (held != numel(tensor.global_shape))
    return Status::Error(where + ": chunks hold " + std::to_string(held) + " of its " +
                         std::to_string(numel(tensor.global_shape)) + " elements (every element must be stored once)");
  return OkStatus();
}

std::string_view codec_name(Codec codec) { return codec == Codec::kZstd ? "zstd" : "raw"; }

std::uint64_t raw_bytes(const StoredChunk& chunk, DType dtype) {
  return static_cast<std::uint64_t>(chunk.piece.numel()) * dtype_size(dtype);
}

std::uint64_t block_count(std::uint64_t raw, std::uint64_t block_bytes) {
  return (raw + block_bytes - 1) / block_bytes;
}

json to_json(const Manifest& m) {
  json tensors = json::object();
  for (const auto& [name, t] : m.tensors) {
    json chunks = json::array();
    for (const auto& c : t.chunks) chunks.push_back(chunk_to_json(c));
    tensors[name] = {{"dtype", dtype_name(t.dtype)}, {"global_shape", t.global_shape}, {"chunks", chunks}};
  }
  json out = {{"format", "trestle"},        {"version", kManifestVersion}, {"iteration", m.iteration},
              {"world_size", m.world_size}, {"layout", m.layout},          {"model", m.model},
              {"training", m.training},     {"tensors", tensors}};
  if (!m.files.empty()) {
    json files = json::object();
    for (const auto& [name, f] : m.files) files[name] = {{"bytes", f.bytes}, {"xxh3_64", to_hex(f.xxh3)}};
    out["files"] = std::move(files);
  }
  return out;
}

Result<Manifest> manifest_from_json(const json& j, const std::string& source) {
  if (!j.is_object() || !j.contains("format") || j["format"] != "trestle")  // (any type compares; none throws)
    return Status::Error(source + ": not a Trestle manifest (expected \"format\": \"trestle\")");
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != kManifestVersion)
    return Status::Error(source + ": unsupported manifest version " +
                         (j.contains("version") ? j["version"].dump() : "(none)") + " (this build reads version " +
                         std::to_string(kManifestVersion) + ")");
  Manifest m;
  const Reader top(j, source);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t iteration, top.u64("iteration"));
  m.iteration = static_cast<std::int64_t>(iteration);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t world, top.u64("world_size"));
  if (world < 1 || world > (1u << 24)) return top.error("'world_size' must be between 1 and 2^24");
  m.world_size = static_cast<int>(world);
  if (j.contains("layout")) {
    if (!j["layout"].is_object()) return top.error("'layout' must be an object");
    m.layout = j["layout"];
  }
  for (const char* key : {"model", "training"})  // (absent or null: none)
    if (j.contains(key) && !j[key].is_null() && !j[key].is_object())
      return top.error("'" + std::string(key) + "' must be an object");
  if (j.contains("model")) m.model = j["model"];
  if (j.contains("training")) m.training = j["training"];
  if (!j.contains("tensors") || !j["tensors"].is_object()) return top.error("'tensors' must be an object");
  for (const auto& [name, t] : j["tensors"].items()) {
    const std::string where = source + ": tensor '" + name + "'";
    const Reader r(t, where);
    TensorEntry entry;
    TRESTLE_ASSIGN_OR_RETURN(const std::string dtype, r.str("dtype"));
    const auto parsed = parse_dtype(dtype);
    if (!parsed) return r.error("unknown dtype '" + dtype + "'");
    entry.dtype = *parsed;
    TRESTLE_ASSIGN_OR_RETURN(entry.global_shape, r.shape("global_shape"));
    if (!checked_nbytes(entry.global_shape, dtype_size(entry.dtype))) return r.error("global shape is too large");
    if (!r.has("chunks") || !r.at("chunks").is_array()) return r.error("'chunks' must be a list");
    std::size_t index = 0;
    for (const auto& c : r.at("chunks")) {
      TRESTLE_ASSIGN_OR_RETURN(auto chunk, chunk_from_json(c, entry, where + " chunk " + std::to_string(index++)));
      entry.chunks.push_back(std::move(chunk));
    }
    TRESTLE_RETURN_IF_ERROR(check_exact_cover(entry, where));
    m.tensors.emplace(name, std::move(entry));
  }
  if (j.contains("files")) {
    if (!j["files"].is_object()) return top.error("'files' must be an object");
    for (const auto& [name, f] : j["files"].items()) {
      const std::string where = source + ": file '" + name + "'";
      TRESTLE_RETURN_IF_ERROR(check_recorded_file_name(name, source));
      if (name == "manifest.json" || name.starts_with("rank_")) return Status::Error(where + ": name is reserved");
      const Reader r(f, where);
      RecordedFile file;
      TRESTLE_ASSIGN_OR_RETURN(file.bytes, r.u64("bytes"));
      if (!r.has("xxh3_64")) return r.error("'xxh3_64' is missing");
      TRESTLE_ASSIGN_OR_RETURN(file.xxh3, parse_hex(r.at("xxh3_64"), r));
      m.files.emplace(name, file);
    }
  }
  return m;
}

std::string manifest_file_text(const Manifest& manifest) {
  std::string text = to_json(manifest).dump(1);  // "{\n ... \n}"
  text.resize(text.size() - 2);                  // without its closing "\n}"
  const std::string sum = to_hex(xxh3_64(std::as_bytes(std::span(text.data(), text.size()))));
  return text + ",\n \"" + kManifestChecksumKey + "\": \"" + sum + "\"\n}\n";
}

Result<Manifest> read_manifest(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path));
  return manifest_from_text(text, path);
}

Result<std::string> manifest_file_digest(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path));
  return to_hex(xxh3_64(std::as_bytes(std::span(text.data(), text.size()))));
}

Result<Manifest> manifest_from_text(std::string_view text, const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const json j, parse_json_text(text, path));
  if (j.is_object() && j.contains(kManifestChecksumKey)) {
    const Reader top(j, path);
    TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t recorded, parse_hex(j[kManifestChecksumKey], top));
    const std::size_t key = text.rfind(std::string("\"") + kManifestChecksumKey + "\"");  // written last
    const std::size_t comma = key == std::string::npos ? std::string::npos : text.rfind(',', key);
    if (comma == std::string::npos)
      return Status::Error(path + ": '" + kManifestChecksumKey + "' must be the manifest's last member");
    const std::uint64_t found = xxh3_64(std::as_bytes(std::span(text.data(), comma)));
    if (found != recorded)
      return Status::Error(path + ": the manifest's bytes do not match its checksum (xxh3 " + to_hex(found) +
                           ", recorded " + to_hex(recorded) + "): the file is corrupt");
  }
  return manifest_from_json(j, path);
}

}  // namespace trestle
