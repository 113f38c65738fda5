// Reading a small JSON file (manifest, config.json, index, metadata) whole: its size is checked against a limit before
// anything is allocated, a key twice in one object or nesting deeper than kMaxJsonDepth is refused, and errors name the
// file with the OS reason or the parser's complaint.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ckpt/status.h"

namespace trestle {

inline constexpr std::uint64_t kMaxJsonFileBytes = std::uint64_t{256} << 20;
inline constexpr int kMaxJsonDepth = 512;

// What strict reading refuses in `text`, found in one pass that builds nothing: the first key given twice in one
// object (`duplicate_key`, with `problem` describing it) or nesting deeper than kMaxJsonDepth; both empty when
// neither (invalid JSON is left to the parser, which says where).
struct JsonStrictness {
  std::string problem;
  std::string duplicate_key;
  int duplicate_depth = 0;  // 1: a key of the top-level object
};
JsonStrictness check_json_strictness(std::string_view text);

// The file's bytes, refused when larger than max_bytes.
Result<std::string> read_text_file(const std::string& path, std::uint64_t max_bytes = kMaxJsonFileBytes);

Result<nlohmann::json> read_json_file(const std::string& path, std::uint64_t max_bytes = kMaxJsonFileBytes);
// The same strict parsing of text already in memory; errors name `source`.
Result<nlohmann::json> parse_json_text(std::string_view text, const std::string& source);
// The same, keeping the keys in the file's order (for files written back, such as config.json).
Result<nlohmann::ordered_json> read_ordered_json_file(const std::string& path,
                                                      std::uint64_t max_bytes = kMaxJsonFileBytes);
Result<nlohmann::ordered_json> parse_ordered_json_text(std::string_view text, const std::string& source);

}  // namespace trestle
