// Byte sizes as people write them: "5GB" (10^9), "500MiB" (2^20), "1024"; and back for progress lines.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ckpt/status.h"

namespace trestle {

Result<std::uint64_t> parse_byte_size(std::string_view text);
std::string format_bytes(std::uint64_t bytes);  // "1.50 GiB"

}  // namespace trestle
