// Reads byte ranges of an existing file in batches: through io_uring with O_DIRECT where allowed (else pread,
// else buffered; said once per process), via page-aligned bounce buffers allocated once. Nearby small ranges are
// coalesced into one request; large aligned ranges go straight into their destination. Errors name the file and the
// byte range. Not thread-safe: one read() at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/io_options.h"
#include "ckpt/io_queue.h"
#include "ckpt/status.h"

namespace trestle {

struct ReadRequest {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::byte* destination = nullptr;  // any alignment; receives exactly `length` bytes
};

class FileReader {
 public:
  static Result<std::unique_ptr<FileReader>> open(const std::string& path, const IoOptions& options = {});

  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  ~FileReader();

  // Fills every request's destination, or fails naming the file and the first range that could not be read (ranges
  // past the end of the file fail before any I/O). Requests may come in any order and may overlap.
  Status read(std::span<const ReadRequest> requests);

  std::uint64_t file_size() const { return file_size_; }
  const std::string& path() const { return path_; }
  // "io_uring+O_DIRECT (registered)", "io_uring+O_DIRECT", "pread+O_DIRECT", "pread (buffered)", ...
  const char* mode() const { return mode_.c_str(); }

 private:
  // A part of a request served from a bounce buffer.
  struct Piece {
    std::uint64_t offset;
    std::uint64_t length;
    std::byte* destination;
  };
  // One I/O: a window into a bounce buffer (its pieces are copied out on completion), or straight into a destination.
  struct Op {
    std::uint64_t offset;
    std::uint64_t length;
    std::uint64_t required;
    std::byte* destination;   // straight reads; null for windows
    std::size_t first_piece;  // windows: pieces_[first_piece, first_piece + piece_count)
    std::size_t piece_count;
    unsigned bounce = 0;  // windows: the bounce slice while in flight
  };

  FileReader(std::string path, const IoOptions& options, OpenedFile file, std::uint64_t size, AlignedBuffer bounce);
  Status check_bounds(std::span<const ReadRequest> requests) const;
  void plan(std::span<const ReadRequest> requests);
  void plan_windows();
  Status execute();

  std::string path_;
  IoOptions options_;
  int fd_;
  bool direct_;
  std::uint64_t file_size_;
  AlignedBuffer bounce_;            // queue_depth slices of request_bytes
  std::unique_ptr<IoQueue> queue_;  // declared after bounce_: drained before the buffers go away
  std::string mode_;
  // Scratch for read(), kept to reuse its capacity.
  std::vector<Piece> loose_;   // bounced parts of requests, before they are grouped into windows
  std::vector<Piece> pieces_;  // the same, grouped by window
  std::vector<Op> ops_;
  std::vector<unsigned> free_bounce_;
};

}  // namespace trestle
