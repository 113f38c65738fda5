// The safetensors header: parsing with full validation, and serialisation as the reference writer lays it out.
// Layout: u64 little-endian header length N, N bytes of JSON (space-padded to a multiple of 8), then the data
// buffer, which the tensors' data_offsets cover exactly, without holes or overlaps.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/dtype.h"
#include "ckpt/shape.h"
#include "ckpt/status.h"

namespace trestle {

inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;  // the reference reader's limit

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::uint64_t begin = 0;  // byte offsets relative to the start of the data buffer
  std::uint64_t end = 0;
  std::uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // in data-buffer order
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  // file offset of the data buffer: 8 + header length
};

// Validates the first bytes of a file of `file_size` bytes (at least the 8-byte prefix and the header).
// Errors say what is wrong and name the tensor; callers prefix the file name.
Result<SafetensorsHeader> parse_safetensors_header(std::string_view file_prefix, std::uint64_t file_size);

// Entries given in data order with offsets already assigned; returns the 8-byte prefix plus padded JSON.
std::string serialize_safetensors_header(const std::vector<SafetensorsEntry>& tensors,
                                         const std::map<std::string, std::string>& metadata);

}  // namespace trestle
