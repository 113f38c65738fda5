// xxh3-64 checksums of byte ranges (the checkpoint format's per-block checksum), and their hex spelling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace trestle {

std::uint64_t xxh3_64(std::span<const std::byte> bytes);
std::string to_hex(std::uint64_t value);  // 16 lower-case hex digits

}  // namespace trestle
