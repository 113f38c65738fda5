#include "ckpt/staging_pool.h"

#include <sys/mman.h>

#include <new>

#include "ckpt/aligned_buffer.h"
#include "ckpt/byte_size.h"
#include "ckpt/io_log.h"

namespace trestle {

Result<PoolMemory> allocate_locked_if_allowed(std::size_t bytes) {
  std::shared_ptr<AlignedBuffer> buffer;
  try {
    buffer = std::make_shared<AlignedBuffer>(bytes);  // zero-filled: every page is touched here, once
  } catch (const std::bad_alloc&) {
    return Status::Error("cannot allocate " + format_bytes(bytes) + " of staging memory");
  }
  const bool locked = bytes > 0 && ::mlock(buffer->data(), bytes) == 0;
  if (!locked && bytes > 0)
    log_once("staging-mlock",
             "staging pool not locked in memory (mlock refused, see RLIMIT_MEMLOCK); saves work the same");
  std::byte* data = buffer->data();
  // munlock happens implicitly when the buffer is freed.
  return PoolMemory{data, bytes, std::move(buffer), locked};
}

Result<std::span<std::byte>> StagingPool::reserve(std::size_t bytes) {
  if (bytes == 0) return std::span<std::byte>();
  if (bytes > memory_.size) {
    memory_ = PoolMemory{};  // free the old allocation before making the larger one
    auto memory = allocate_(bytes);
    if (!memory.ok()) return memory.status().with_context("staging pool");
    if (memory->size < bytes)
      return Status::Error("staging pool: the allocator returned " + format_bytes(memory->size) + " for " +
                           format_bytes(bytes));
    memory_ = std::move(memory).value();
    ++allocations_;
  }
  return std::span<std::byte>(memory_.data, bytes);
}

}  // namespace trestle
