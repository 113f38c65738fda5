// How FileWriter and FileReader talk to the disk: request size, queue depth, and switches that force the
// fallback paths (the defaults are the fast path; each switch exists so tests can pin a mode).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "ckpt/aligned_buffer.h"

namespace trestle {

struct IoOptions {
  std::size_t request_bytes = std::size_t{4} << 20;  // bytes per read/write request; clamped to 1..8 MiB, 4 KiB steps
  unsigned queue_depth = 32;                         // requests in flight; clamped to 16..64
  bool direct = true;                                // O_DIRECT (falls back to buffered where the file system refuses)
  bool use_uring = true;                             // io_uring (falls back to pread/pwrite where the kernel refuses)
  bool register_buffers = true;                      // register staging buffers with io_uring (fixed reads/writes)

  // The options as the engine uses them: request_bytes and queue_depth brought into range.
  IoOptions clamped() const {
    IoOptions out = *this;
    constexpr std::size_t kMinRequest = std::size_t{1} << 20;
    constexpr std::size_t kMaxRequest = std::size_t{8} << 20;
    out.request_bytes = align_down(std::clamp(request_bytes, kMinRequest, kMaxRequest), kIoAlignment);
    out.queue_depth = std::clamp(queue_depth, 16u, 64u);
    return out;
  }
};

// Reading a checkpoint tensor by tensor: small I/O staging and bounce buffers, so memory stays near the largest tensor.
inline constexpr std::uint64_t kReadBufferBytes = 32ull << 20;
inline constexpr std::uint64_t kReadStagingBytes = 2 * 16ull << 20;  // two open files x 16 requests of 1 MiB
inline IoOptions streaming_read_options() {
  IoOptions io;
  io.request_bytes = std::size_t{1} << 20;
  io.queue_depth = 16;
  return io;
}

}  // namespace trestle
