// The submission engine under FileWriter and FileReader: reads and writes on one file descriptor, up to a fixed
// number in flight, through io_uring where the kernel allows it and synchronous pread/pwrite where it does not (said
// once). Partial transfers are continued; each completion carries its caller's tag and, on failure, a message naming
// the file and the byte range. Not thread-safe: one thread drives a queue.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "ckpt/status.h"

namespace trestle {

struct IoRequest {
  enum class Kind { kRead, kWrite };
  Kind kind = Kind::kRead;
  std::byte* buffer = nullptr;  // source of a write, destination of a read
  std::uint64_t length = 0;     // bytes to transfer, below 2 GiB
  std::uint64_t offset = 0;     // file offset
  std::uint64_t required = 0;   // a read may stop at end of file once it has these bytes; a write requires `length`
  int buffer_index = -1;        // the registered buffer holding [buffer, buffer + length), or -1
  std::uint64_t tag = 0;        // handed back with the completion
};

struct IoCompletion {
  std::uint64_t tag = 0;
  Status status;
};

struct OpenedFile {
  int fd = -1;
  bool direct = false;  // O_DIRECT is in effect
  int cached_fd = -1;   // where set, a buffered descriptor of the same file for ranges already in the page cache
};

// Opens `path` with `flags`, adding O_DIRECT when `direct`; where the file system refuses O_DIRECT (EINVAL) it opens
// buffered and says so once. `what` names the action in the error ("create", "open").
Result<OpenedFile> open_for_io(const std::string& path, int flags, bool direct, const char* what);

class IoQueue {
 public:
  // io_uring with `depth` entries when `use_uring` and the kernel allows it, else pread/pwrite. `region` is cut into
  // slices of `slice_bytes`, registered with io_uring (fixed reads and writes) when `register_buffers` and the kernel
  // allows it. Never fails: each refusal falls back and is logged once.
  static std::unique_ptr<IoQueue> create(int fd, std::string path, unsigned depth, std::span<std::byte> region,
                                         std::size_t slice_bytes, bool use_uring, bool register_buffers);
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;
  virtual ~IoQueue() = default;  // implementations wait for what is still in flight

  virtual bool uses_uring() const = 0;
  virtual bool registered() const = 0;
  unsigned depth() const { return depth_; }
  unsigned in_flight() const { return in_flight_; }

  virtual void submit(const IoRequest& request) = 0;  // requires in_flight() < depth(); may only queue it
  virtual void flush() = 0;                           // hands queued requests to the kernel
  virtual IoCompletion wait() = 0;                    // requires in_flight() > 0; flushes first

  // "io_uring+O_DIRECT (registered)", "io_uring (buffered)", "pwrite+O_DIRECT", "pread (buffered)", ...
  std::string describe(bool direct, const char* sync_call) const;

 protected:
  IoQueue(int fd, std::string path, unsigned depth) : fd_(fd), path_(std::move(path)), depth_(depth) {}
  // The message for a failed transfer of [offset, offset + length).
  Status transfer_error(const IoRequest& request, const std::string& reason) const;

  int fd_;
  std::string path_;
  unsigned depth_;
  unsigned in_flight_ = 0;
};

}  // namespace trestle
