// Writes one new file sequentially: each payload starts at the next 4 KiB boundary (zeros between payloads), is
// copied into page-aligned staging buffers allocated once, and goes out in large requests through io_uring with
// O_DIRECT, falling back to pwrite and to buffered I/O where the system refuses (said once per process).
// finish() makes the file durable; errors name the file and the byte range. Not thread-safe: one thread writes.
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

class FileWriter {
 public:
  // Creates (or truncates) `path`. Staging is options.queue_depth buffers of options.request_bytes (after clamped()).
  static Result<std::unique_ptr<FileWriter>> create(const std::string& path, const IoOptions& options = {});

  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  // Without finish(): waits for requests in flight, closes, and leaves the file as it is (the caller decides).
  ~FileWriter();

  // Places `data` at the next 4096-aligned offset and returns that offset. Blocks only when every staging buffer is
  // in flight. A failed earlier request is reported here (or by finish()).
  Result<std::uint64_t> append(std::span<const std::byte> data);
  std::uint64_t size() const { return size_; }  // the logical end: the last payload's end
  // Writes what is staged, waits for everything, sets the file to size(), fdatasyncs and closes. Call once.
  Status finish();

  const std::string& path() const { return path_; }
  // "io_uring+O_DIRECT (registered)", "io_uring+O_DIRECT", "pwrite+O_DIRECT", "pwrite (buffered)", ...
  const char* mode() const { return mode_.c_str(); }

 private:
  FileWriter(std::string path, const IoOptions& options, OpenedFile file, AlignedBuffer staging);
  Status put(const std::byte* source, std::uint64_t bytes);  // appends bytes (zeros when source is null) to the stream
  void submit_current(std::size_t bytes);
  Status reclaim_one();
  Status drain();
  void preallocate(std::uint64_t end);

  std::string path_;
  IoOptions options_;
  int fd_;
  bool direct_;
  AlignedBuffer staging_;           // queue_depth slices of request_bytes
  std::unique_ptr<IoQueue> queue_;  // declared after staging_: drained before the buffers go away
  std::string mode_;
  std::vector<unsigned> free_slices_;
  int current_ = -1;                 // the slice being filled, or -1
  std::size_t fill_ = 0;             // bytes in the current slice
  std::uint64_t stream_offset_ = 0;  // file offset where the current (or next) slice goes
  std::uint64_t size_ = 0;
  std::uint64_t allocated_ = 0;  // the file is preallocated up to here
  bool can_preallocate_ = true;
  bool closed_ = false;
  Status error_;  // the first failure; sticky
};

}  // namespace trestle
