#include "ckpt/chunk_codec.h"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "ckpt/checksum.h"

namespace trestle {
namespace {

// Runs work(i) for i in [0, n) on up to `threads` threads.
template <class Work>
void parallel_for(std::size_t n, unsigned threads, Work work) {
  const unsigned count = static_cast<unsigned>(std::min<std::size_t>(std::max(1u, threads), n));
  if (count <= 1) {
    for (std::size_t i = 0; i < n; ++i) work(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < count; ++t)
    pool.emplace_back([&] {
      for (std::size_t i; (i = next.fetch_add(1)) < n;) work(i);
    });
  for (auto& th : pool) th.join();
}

std::span<const std::byte> block_of(std::span<const std::byte> raw, std::uint64_t block_bytes, std::size_t i) {
  const std::uint64_t begin = i * block_bytes;
  return raw.subspan(begin, std::min<std::uint64_t>(block_bytes, raw.size() - begin));
}

}  // namespace

std::vector<std::uint64_t> block_checksums(std::span<const std::byte> raw, std::uint64_t block_bytes,
                                           unsigned threads) {
  std::vector<std::uint64_t> sums(block_count(raw.size(), block_bytes));
  parallel_for(sums.size(), threads, [&](std::size_t i) { sums[i] = xxh3_64(block_of(raw, block_bytes, i)); });
  return sums;
}

Result<ZstdBlocks> zstd_encode_blocks(std::span<const std::byte> raw, std::uint64_t block_bytes, int level,
                                      unsigned threads) {
  const std::size_t n = block_count(raw.size(), block_bytes);
  std::vector<std::vector<std::byte>> frames(n);
  std::vector<std::string> errors(n);
  ZstdBlocks out;
  out.checksums.resize(n);
  parallel_for(n, threads, [&](std::size_t i) {
    const auto block = block_of(raw, block_bytes, i);
    out.checksums[i] = xxh3_64(block);
    frames[i].resize(ZSTD_compressBound(block.size()));
    const std::size_t size = ZSTD_compress(frames[i].data(), frames[i].size(), block.data(), block.size(), level);
    if (ZSTD_isError(size)) errors[i] = ZSTD_getErrorName(size);
    else frames[i].resize(size);
  });
  for (std::size_t i = 0; i < n; ++i) {
    if (!errors[i].empty())
      return Status::Error("zstd compression of block " + std::to_string(i) + " failed: " + errors[i]);
    out.block_stored_bytes.push_back(frames[i].size());
    out.stored.insert(out.stored.end(), frames[i].begin(), frames[i].end());
  }
  return out;
}

Status decode_block(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw, std::uint64_t checksum,
                    const std::string& where) {
  if (codec == Codec::kRaw) {
    if (stored.size() != raw.size()) return Status::Error(where + ": block size mismatch");
    if (!raw.empty() && raw.data() != stored.data()) std::memcpy(raw.data(), stored.data(), raw.size());
  } else {
    const std::size_t size = ZSTD_decompress(raw.data(), raw.size(), stored.data(), stored.size());
    if (ZSTD_isError(size)) return Status::Error(where + ": corrupt zstd block: " + ZSTD_getErrorName(size));
    if (size != raw.size())
      return Status::Error(where + ": zstd block holds " + std::to_string(size) + " bytes, expected " +
                           std::to_string(raw.size()));
  }
  const std::uint64_t actual = xxh3_64(raw);
  if (actual != checksum)
    return Status::Error(where + ": checksum mismatch (stored xxh3-64 " + to_hex(checksum) + ", data has " +
                         to_hex(actual) + ")");
  return OkStatus();
}

}  // namespace trestle
