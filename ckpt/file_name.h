// Whether a name read from a file (a manifest's chunk file, an index's shard, a metadata's relative path) names a file
// directly inside one directory: not empty, not "." or "..", no '/', and no NUL (which would end the path the OS sees
// early, so "a.bin\0x" would open a.bin under another name).
#pragma once

#include <string_view>

namespace trestle {

inline bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find_first_of(std::string_view("/\0", 2)) == name.npos;
}

}  // namespace trestle
