// libFuzzer target: a Megatron indexed dataset (.idx and .bin) through IndexedDataset::from_bytes, the checks open()
// runs on the maps, then every sequence's first and last tokens, its mode and every document index read back.
// The input packs both files: a little-endian u32 with the .idx size, the .idx, then the .bin (the seeds are real
// pairs written by megatron-core's IndexedDatasetBuilder and by `trestle preprocess`, packed so). Each file is copied
// into its own heap buffer, so a read past either one is an ASan report rather than a quiet read of the next bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "train/data/indexed_dataset.h"

namespace {

void read_back(const trestle::data::IndexedDataset& dataset) {
  std::vector<std::int64_t> tokens;
  for (std::size_t i = 0; i < dataset.sequence_count(); ++i) {
    const auto length = static_cast<std::size_t>(dataset.sequence_length(i));
    tokens.clear();
    (void)dataset.read(i, 0, std::min<std::size_t>(length, 4), tokens);
    if (length > 0) (void)dataset.read(i, length - 1, std::nullopt, tokens);
    (void)dataset.read(i, length, 1, tokens);  // one past the end: refused
    (void)dataset.sequence_mode(i);
  }
  (void)dataset.read(dataset.sequence_count(), 0, std::nullopt, tokens);
  for (std::size_t i = 0; i <= dataset.document_count(); ++i) (void)dataset.document_index(i);
  (void)dataset.sequence_lengths();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  std::uint32_t idx_size = 0;
  std::memcpy(&idx_size, data, 4);
  if (idx_size > size - 4) return 0;
  const std::vector<std::byte> idx(reinterpret_cast<const std::byte*>(data + 4),
                                   reinterpret_cast<const std::byte*>(data + 4 + idx_size));
  const std::vector<std::byte> bin(reinterpret_cast<const std::byte*>(data + 4 + idx_size),
                                   reinterpret_cast<const std::byte*>(data + size));
  auto dataset = trestle::data::IndexedDataset::from_bytes(idx, bin, "fuzz");
  if (dataset.ok()) read_back(*dataset);
  return 0;
}
