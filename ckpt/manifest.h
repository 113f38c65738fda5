// manifest.json of a Trestle checkpoint iteration (format "trestle", version 1): what every tensor is (dtype,
// canonical global shape) and where each stored piece of it lives (file, byte offset, codec, per-block checksums),
// plus model config, parallel layout and training state as plain JSON (recorded here, interpreted by the modules
// above). Parsing validates everything it reads.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/dtype.h"
#include "ckpt/recorded_file.h"
#include "ckpt/status.h"

namespace trestle {

inline constexpr int kManifestVersion = 1;
inline constexpr std::uint64_t kDefaultBlockBytes = 4ull << 20;  // checksum / compression block of raw bytes

enum class Codec { kRaw, kZstd };
std::string_view codec_name(Codec codec);

// One stored piece. The raw bytes of the piece (piece.numel() × dtype size, row-major within the box, from the
// flat start when flat) are cut into blocks of block_bytes; each block is stored raw or as one zstd frame, back to
// back from byte_offset, and carries the xxh3-64 of its raw bytes.
struct StoredChunk {
  Piece piece;
  std::string file;  // relative to the iteration directory
  std::uint64_t byte_offset = 0;
  std::uint64_t stored_bytes = 0;
  Codec codec = Codec::kRaw;
  std::uint64_t block_bytes = kDefaultBlockBytes;
  std::vector<std::uint64_t> block_checksums;
  std::vector<std::uint64_t> block_stored_bytes;  // zstd only: size of each frame
};

struct TensorEntry {
  DType dtype = DType::kF32;
  Shape global_shape;
  std::vector<StoredChunk> chunks;
};

struct Manifest {
  std::int64_t iteration = 0;
  nlohmann::json layout = nlohmann::json::object();  // the parallel layout that wrote it (parallel/layout)
  int world_size = 1;
  nlohmann::json model = nlohmann::json::object();     // architecture and sizes
  nlohmann::json training = nlohmann::json::object();  // consumed samples, RNG state per rank, scheduler, ...
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, RecordedFile> files;  // whole files carried in the iteration (recorded_file.h), by name
};

nlohmann::json to_json(const Manifest& manifest);
nlohmann::json chunk_to_json(const StoredChunk& chunk);
// Validates one chunk of `tensor` (its dtype and global shape must be set); `where` prefixes errors.
Result<StoredChunk> chunk_from_json(const nlohmann::json& json, const TensorEntry& tensor, const std::string& where);
// Validates types, dtypes, boxes within the global shape, flat ranges within boxes, block tables matching sizes
// and file names inside the directory. `source` names the file in errors.
// Every tensor's chunks must hold each element exactly once (no overlap, no gap).
Result<Manifest> manifest_from_json(const nlohmann::json& json, const std::string& source);
// The exact-cover rule for one tensor; `where` prefixes errors.
Status check_exact_cover(const TensorEntry& tensor, const std::string& where);
// manifest.json's text: to_json(manifest) with a last member "manifest_xxh3_64", the XXH3-64 of the file's bytes
// before the comma that precedes it (docs/format.md, section 2), so that corruption anywhere in it is caught.
std::string manifest_file_text(const Manifest& manifest);
// Reads manifest.json; its "manifest_xxh3_64", when present, must match its bytes (a manifest without one, as Trestle
// wrote before it had them, is read unchecked). manifest_from_text: the same from the file's text; `path` names it.
Result<Manifest> read_manifest(const std::string& path);
Result<Manifest> manifest_from_text(std::string_view text, const std::string& path);
// The XXH3-64 (16 lower-case hex digits) of manifest.json's whole bytes: the identity of a checkpoint iteration (what
// an adapter checkpoint records of its base).
Result<std::string> manifest_file_digest(const std::string& path);

// Bytes of the raw (uncompressed) data of a chunk, and the number of blocks it is cut into.
std::uint64_t raw_bytes(const StoredChunk& chunk, DType dtype);
std::uint64_t block_count(std::uint64_t raw, std::uint64_t block_bytes);

}  // namespace trestle
