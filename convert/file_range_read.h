// Reading one byte range of a file into a page-aligned buffer, bypassing the page cache where the file was opened
// with O_DIRECT (the 4 KiB-aligned span around the range is read; the last block may run past the end of the file),
// else exactly the range. Errors name the file, what was read and the byte range.
#pragma once

#include <cstdint>
#include <string>

#include "ckpt/aligned_buffer.h"
#include "ckpt/io_queue.h"

namespace trestle {

// Reads [offset, offset + length) of `file` (opened at `path`) into `buffer`, growing it when too small; returns the
// range's first byte's position in the buffer.
Result<std::size_t> read_file_range(const OpenedFile& file, const std::string& path, std::uint64_t offset,
                                    std::uint64_t length, AlignedBuffer& buffer, const std::string& what);

}  // namespace trestle
