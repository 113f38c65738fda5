// Reading one byte range of a file into a page-aligned buffer, bypassing the page cache where the file was opened
// with O_DIRECT (the 4 KiB-aligned span around the range is read; the last block may run past the end of the file),
// else exactly the range. A range wholly in the page cache already (a file just written or read) is copied from there
// instead of read from the disk again. Errors name the file, what was read and the byte range.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/io_queue.h"
#include "ckpt/shape.h"

namespace trestle {

// Files opened for range reads (with O_DIRECT where the file system allows it, plus a buffered descriptor of the same
// file for ranges in the page cache) on first use and kept open until this goes away. Thread-safe.
class ReadFiles {
 public:
  ReadFiles() = default;
  ReadFiles(const ReadFiles&) = delete;
  ReadFiles& operator=(const ReadFiles&) = delete;
  ~ReadFiles();
  Result<OpenedFile> get(const std::string& path);

 private:
  std::mutex mu_;
  std::map<std::string, OpenedFile> files_;
};

// Reads [offset, offset + length) of `file` (opened at `path`) into `buffer`, growing it when too small; returns the
// range's first byte's position in the buffer.
Result<std::size_t> read_file_range(const OpenedFile& file, const std::string& path, std::uint64_t offset,
                                    std::uint64_t length, AlignedBuffer& buffer, const std::string& what);

// Whether every page of [offset, offset + length) of the file open at `fd` is in the page cache (mincore over a
// transient read-only map: no I/O, nothing faulted in). False on any error.
bool range_in_page_cache(int fd, std::uint64_t offset, std::uint64_t length);

// Bytes from a strided region's first element to its last (count extents, strides in elements); 0 when empty.
std::uint64_t strided_span_bytes(const Shape& count, const std::vector<std::int64_t>& stride, std::size_t element_size);

// Regions of at least this many bytes are worth a direct read; smaller ones are copied from a memory map.
inline constexpr std::uint64_t kDirectReadMinBytes = std::uint64_t{1} << 20;

// Copies a strided region whose first element is at byte `at` of `file` into `destination` (dst_stride), reading the
// region's span into `buffer` first.
Status copy_strided_from_file(const OpenedFile& file, const std::string& path, std::uint64_t at,
                              const std::vector<std::int64_t>& src_stride, std::byte* destination,
                              const std::vector<std::int64_t>& dst_stride, const Shape& count, std::size_t element_size,
                              AlignedBuffer& buffer, const std::string& what);

}  // namespace trestle
