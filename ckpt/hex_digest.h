// Whether text is an XXH3-64 digest as Trestle writes it (to_hex, manifest_file_digest): 16 lower-case hexadecimal
// digits. For digests read back from files, which are checked before they are compared or parsed.
#pragma once

#include <string_view>

namespace trestle {

inline bool is_hex_digest(std::string_view text) {
  return text.size() == 16 && text.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

}  // namespace trestle
