// Block encoding of chunk data: raw bytes are cut into blocks of block_bytes, each checksummed (xxh3-64 of the raw
// bytes) and, with the zstd codec, compressed as an independent frame so partial reads decode only what they touch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/status.h"

namespace trestle {

std::vector<std::uint64_t> block_checksums(std::span<const std::byte> raw, std::uint64_t block_bytes,
                                           unsigned threads = 1);

struct ZstdBlocks {
  std::vector<std::byte> stored;  // frames back to back
  std::vector<std::uint64_t> block_stored_bytes;
  std::vector<std::uint64_t> checksums;
};
// Compresses blocks in parallel on `threads` threads; level as zstd's (3 is its default).
Result<ZstdBlocks> zstd_encode_blocks(std::span<const std::byte> raw, std::uint64_t block_bytes, int level,
                                      unsigned threads);

// Decodes one stored block into `raw` (its exact raw size) and verifies its checksum; `where` names the tensor,
// chunk and file in errors.
Status decode_block(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw, std::uint64_t checksum,
                    const std::string& where);

}  // namespace trestle
