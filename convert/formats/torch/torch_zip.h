// The zip subset of torch.save archives. Reading: stored (uncompressed) entries, zip64 sizes and offsets, data
// descriptors, and the archive's top-level directory ("archive/", or the file's stem for older torch.save to a path).
// Writing: PyTorchStreamWriter's layout byte for byte — local headers without sizes (data descriptors follow the
// data), an "FB" extra field of 'Z's so each record's data starts aligned, zip64 end records always present — with
// the alignment selectable per record so large tensor payloads can sit on 4 KiB boundaries for O_DIRECT writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct ZipEntry {
  std::string name;               // full name, prefix included ("archive/data/0")
  std::uint64_t data_offset = 0;  // from the start of the archive
  std::uint64_t size = 0;
  std::uint32_t crc32 = 0;
  std::uint16_t method = 0;  // 0: stored; anything else is refused when the entry is read
};

// A parsed central directory over bytes the caller keeps alive (a mapped file or a slice of one).
class ZipArchive {
 public:
  // `context` names the file (and item) in errors. Every offset and size is checked against the archive's bytes.
  static Result<ZipArchive> parse(std::span<const std::byte> bytes, std::string context);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  const std::string& prefix() const { return prefix_; }  // "archive/" (with the slash)
  const std::string& context() const { return context_; }
  // Finds "<prefix><name>"; nullptr when absent.
  const ZipEntry* find(std::string_view name) const;
  // The stored bytes of an entry; fails for compressed entries.
  Result<std::span<const std::byte>> read(const ZipEntry& entry) const;
  Result<std::span<const std::byte>> read(std::string_view name) const;

 private:
  std::span<const std::byte> bytes_;
  std::string context_;
  std::string prefix_;
  std::vector<ZipEntry> entries_;
};

// Lays out an archive the way torch.save does. Records are added in order; a record's bytes are either given now
// or supplied by the caller when streaming (then its size and crc32 are given up front).
class TorchZipWriter {
 public:
  explicit TorchZipWriter(std::string archive_name = "archive") : archive_name_(std::move(archive_name)) {}

  void add(std::string name, std::string data, std::uint64_t alignment = 64);
  // Returns the record's index; finish() marks where its payload goes.
  std::size_t add_external(std::string name, std::uint64_t size, std::uint32_t crc32, std::uint64_t alignment = 64);

  // The archive as consecutive parts: inline bytes, or the payload of an external record (bytes empty, `external`
  // its index). Concatenated they are the archive.
  struct Part {
    std::string bytes;
    int external = -1;
    std::uint64_t size = 0;
  };
  std::vector<Part> finish() const;

 private:
  struct Record {
    std::string name;
    std::string data;
    bool external = false;
    std::uint64_t size = 0;
    std::uint32_t crc32 = 0;
    std::uint64_t alignment = 64;
  };
  std::string archive_name_;
  std::vector<Record> records_;
};

// Concatenates finish()'s parts when every record is inline.
std::string zip_parts_to_bytes(const std::vector<TorchZipWriter::Part>& parts);

}  // namespace trestle
