// CRC-32 (reflected, polynomial 0xEDB88320: zip's and zlib's), by carry-less multiplication where the CPU has
// PCLMULQDQ and slice-by-8 tables elsewhere. crc32(b, crc32(a)) == crc32(a + b).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace trestle {

std::uint32_t crc32(std::span<const std::byte> data, std::uint32_t crc = 0);

}  // namespace trestle
