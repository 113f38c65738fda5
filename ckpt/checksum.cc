#include "ckpt/checksum.h"

#include <xxhash.h>

#include <cstdio>

namespace trestle {

std::uint64_t xxh3_64(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string to_hex(std::uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace trestle
