// Writes a new file of known size from byte ranges that arrive in any order (a safetensors file filled tensor by
// tensor). The file is cut into aligned windows of one request each; a window goes out through io_uring with O_DIRECT
// as soon as all its bytes have arrived. When every staging window holds a partial one, the oldest is written through
// the page cache instead, so memory stays bounded whatever the order. Staging is allocated at the first write and
// released once every byte is out. finish() makes the file durable. Not thread-safe: one thread writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/io_options.h"
#include "ckpt/io_queue.h"
#include "ckpt/status.h"

namespace trestle {

class RangeFileWriter {
 public:
  // Creates (or truncates) `path`, which will hold exactly `size` bytes.
  static Result<std::unique_ptr<RangeFileWriter>> create(const std::string& path, std::uint64_t size,
                                                         const IoOptions& options = {});
  RangeFileWriter(const RangeFileWriter&) = delete;
  RangeFileWriter& operator=(const RangeFileWriter&) = delete;
  // Without finish(): waits for requests in flight and closes; the file is left as it is (the caller removes it).
  ~RangeFileWriter();

  // Places `data` at `offset`. Ranges must lie inside the file and must not overlap earlier ones (an error if they
  // do). Blocks only when every staging window is in flight.
  Status write(std::uint64_t offset, std::span<const std::byte> data);
  std::uint64_t size() const { return size_; }
  std::uint64_t bytes_written() const { return written_; }
  // Writes what is staged (bytes never written read as zeros), waits, fdatasyncs and closes. Call once.
  Status finish();

  const std::string& path() const { return path_; }
  const char* mode() const { return mode_.c_str(); }

 private:
  struct Window {
    int slice = -1;
    std::uint64_t filled = 0;
    std::uint64_t age = 0;
  };
  RangeFileWriter(std::string path, std::uint64_t size, const IoOptions& options, OpenedFile file);
  Status start_staging();
  void stop_staging();
  Result<Window*> window_for(std::uint64_t index);
  Status claim_range(std::uint64_t start, std::uint64_t end);
  void zero_gaps(std::uint64_t index, std::byte* slice) const;
  std::uint64_t window_length(std::uint64_t index) const;
  void submit(std::uint64_t index, Window& window);
  Status spill_oldest();
  Status write_buffered(std::uint64_t offset, const std::byte* data, std::uint64_t bytes);
  Status reclaim_one();
  Status drain();

  std::string path_;
  std::uint64_t size_;
  IoOptions options_;
  int fd_;
  bool direct_;
  int buffered_fd_ = -1;  // the same file without O_DIRECT, for spilled windows
  AlignedBuffer staging_;
  std::unique_ptr<IoQueue> queue_;  // declared after staging_: drained before the buffers go away
  std::vector<unsigned> free_slices_;
  std::map<std::uint64_t, Window> open_;           // windows being filled, by index
  std::set<std::uint64_t> spilled_;                // windows written through the page cache; later bytes go there too
  std::map<std::uint64_t, std::uint64_t> ranges_;  // every byte range written so far (start -> end), merged
  std::uint64_t clock_ = 0;
  std::uint64_t written_ = 0;
  std::string mode_;
  bool closed_ = false;
  Status error_;  // the first failure; sticky
};

}  // namespace trestle
