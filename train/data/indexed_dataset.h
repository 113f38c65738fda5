// Megatron's indexed dataset (PREFIX.idx + PREFIX.bin), read through memory maps and written byte-for-byte as
// megatron-core's IndexedDatasetBuilder writes it.
//
// .idx layout (little-endian): "MMIDIDX\0\0", u64 version 1, u8 dtype code, u64 sequence count S, u64 document
// count D (= documents + 1), i32 lengths[S], i64 byte pointers into .bin[S], i64 document indices[D] (the first
// sequence of each document, then S), and, for multimodal datasets only, i8 modes[S]. .bin is the token stream.
// Every count, length and pointer is checked against the file sizes when the dataset is opened, so a damaged or
// hostile file fails with its name instead of reading outside the maps. An open IndexedDataset is immutable and
// safe to read from many threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/mapped_file.h"
#include "ckpt/removed_on_signal.h"
#include "ckpt/status.h"

namespace trestle::data {

// Megatron's DType codes for the .bin tokens.
enum class TokenDType : std::uint8_t {
  kUint8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUint16 = 8,
};
std::size_t token_dtype_size(TokenDType dtype);
const char* token_dtype_name(TokenDType dtype);  // numpy's name: "uint16", "int32", ...
// The dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32.
TokenDType optimal_token_dtype(std::int64_t vocab_size);

std::string idx_path(const std::string& prefix);  // PREFIX.idx
std::string bin_path(const std::string& prefix);  // PREFIX.bin
// PREFIX from PREFIX, PREFIX.idx or PREFIX.bin.
std::string dataset_prefix(const std::string& path);

class IndexedDataset {
 public:
  static Result<IndexedDataset> open(const std::string& prefix);
  // The same checks over an index and token stream already in memory, which the caller keeps alive (and unchanged)
  // while the dataset lives; errors name PREFIX.idx and PREFIX.bin.
  static Result<IndexedDataset> from_bytes(std::span<const std::byte> idx, std::span<const std::byte> bin,
                                           const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  std::size_t sequence_count() const { return sequence_count_; }
  std::size_t document_count() const { return document_index_count_ - 1; }
  std::uint64_t token_count() const { return token_count_; }
  bool multimodal() const { return modes_offset_.has_value(); }

  std::int32_t sequence_length(std::size_t sequence) const;
  std::int64_t sequence_pointer(std::size_t sequence) const;  // byte offset in .bin
  std::int8_t sequence_mode(std::size_t sequence) const;      // 0 unless multimodal
  // Entry i of the document indices (0 .. document_count() inclusive): the first sequence of document i.
  std::int64_t document_index(std::size_t i) const;
  // All sequence lengths, copied out of the (unaligned) map.
  std::vector<std::int32_t> sequence_lengths() const;

  // Tokens [offset, offset + length) of one sequence, widened to int64 and appended to out; length nullopt means
  // to the end of the sequence. Fails naming the dataset when the range is outside the sequence.
  Status read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
              std::vector<std::int64_t>& out) const;

 private:
  IndexedDataset(std::string prefix, std::span<const std::byte> idx, std::span<const std::byte> bin)
      : prefix_(std::move(prefix)), idx_(idx), bin_(bin) {}
  Status validate();

  std::string prefix_;
  // The maps when opened from files; idx_ and bin_ view them (a MappedFile's bytes stay put when it moves).
  std::optional<MappedFile> idx_file_;
  std::optional<MappedFile> bin_file_;
  std::span<const std::byte> idx_;
  std::span<const std::byte> bin_;
  TokenDType dtype_ = TokenDType::kInt32;
  std::size_t sequence_count_ = 0;
  std::size_t document_index_count_ = 0;
  std::size_t lengths_offset_ = 0;
  std::size_t pointers_offset_ = 0;
  std::size_t documents_offset_ = 0;
  std::optional<std::size_t> modes_offset_;
  std::uint64_t token_count_ = 0;
};

// Writes PREFIX.bin while documents are added and PREFIX.idx on finalize(), as IndexedDatasetBuilder does.
// Writes PREFIX.bin and PREFIX.idx as temporary siblings and renames them into place in finalize(): a writer
// destroyed unfinished (a failed run) leaves what was there before untouched and nothing new; so does a run ended by
// SIGINT, SIGTERM or SIGHUP before its files are committed (ckpt/removed_on_signal.h). An existing PREFIX.bin or
// .idx that is not a regular file (a FIFO, a directory, a symbolic link) is refused, never written through.
class IndexedDatasetWriter {
 public:
  static Result<IndexedDatasetWriter> create(const std::string& prefix, TokenDType dtype);
  IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) noexcept;
  ~IndexedDatasetWriter();

  // One document made of sequences of the given lengths (they sum to tokens.size()). Token ids must fit the dtype.
  Status add_document(std::span<const std::int64_t> tokens, std::span<const std::int32_t> sequence_lengths);
  Status add_document(std::span<const std::int64_t> tokens);  // one sequence
  // Flushes .bin and writes .idx; the writer is closed afterwards. The pair replaces an existing one as a unit
  // (commit_renames): a failure leaves the old pair, a crash never pairs an old file with a new one.
  Status finalize();
  // finalize's first half: the .bin and .idx written and synced as temporaries, which the caller commits with
  // commit_renames (beside other writers' files, to replace them all as one unit) or removes with remove_staged.
  Result<std::vector<StagedFile>> stage();

  std::uint64_t token_count() const { return token_count_; }
  std::size_t document_count() const { return document_indices_.size() - 1; }

 private:
  IndexedDatasetWriter(std::string prefix, TokenDType dtype, std::FILE* bin);
  Status flush_buffer();
  void discard();  // closes and removes the temporary files

  std::string prefix_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  // The temporaries, registered until the writer goes: between stage() and the caller's commit_renames() a signal
  // still removes them (once renamed into place, there is nothing left at their names).
  RemovedOnSignal bin_removed_on_signal_;
  RemovedOnSignal idx_removed_on_signal_;
  std::vector<std::byte> buffer_;
  std::vector<std::int32_t> sequence_lengths_;
  std::vector<std::int64_t> document_indices_{0};
  std::uint64_t token_count_ = 0;
};

}  // namespace trestle::data
