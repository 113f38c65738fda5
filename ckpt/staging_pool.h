// The staging pool of an asynchronous save: one page-aligned host allocation, touched once when made so that copies
// into it run at memory speed rather than page-fault speed, reused by every later save and replaced only when a save
// needs more bytes than it holds. Where the memory comes from is pluggable (pinned memory for device-to-host copies);
// the default asks the kernel to lock it (mlock) and carries on unlocked when RLIMIT_MEMLOCK refuses.
// Not thread-safe: the owner reserves; copies into disjoint ranges of it may run on any threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "ckpt/status.h"

namespace trestle {

// Memory handed to the pool: `size` bytes at `data`, page-aligned and already touched, kept alive by `owner`.
struct PoolMemory {
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::shared_ptr<void> owner;
  bool locked = false;  // pinned or mlocked: never paged out
};
using PoolAllocator = std::function<Result<PoolMemory>(std::size_t bytes)>;

// Page-aligned, zero-filled (touched) memory, mlock()ed when the limit allows it. Fails only when out of memory.
Result<PoolMemory> allocate_locked_if_allowed(std::size_t bytes);

class StagingPool {
 public:
  explicit StagingPool(PoolAllocator allocate = allocate_locked_if_allowed) : allocate_(std::move(allocate)) {}

  // At least `bytes` bytes of touched memory. Reuses the current allocation when it is large enough; otherwise frees
  // it and allocates anew (so earlier spans are invalid). Fails naming the size when the allocator fails.
  Result<std::span<std::byte>> reserve(std::size_t bytes);

  std::size_t capacity() const { return memory_.size; }
  bool locked() const { return memory_.locked; }
  std::uint64_t allocations() const { return allocations_; }  // how many times memory was (re)allocated

 private:
  PoolAllocator allocate_;
  PoolMemory memory_;
  std::uint64_t allocations_ = 0;
};

}  // namespace trestle
