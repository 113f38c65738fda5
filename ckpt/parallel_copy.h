// A memcpy of many ranges on several threads: the staging copy of an asynchronous save, which the caller waits for.
// Ranges are cut into pieces of a few MiB that the threads take in turn, so one large tensor is shared too.
#pragma once

#include <cstddef>
#include <span>

namespace trestle {

struct CopyRange {
  const std::byte* source = nullptr;
  std::byte* destination = nullptr;
  std::size_t bytes = 0;
};

// Copies every range (ranges must not overlap one another's destinations) on up to `threads` threads, the calling
// thread among them; returns when all bytes are in place.
void parallel_copy(std::span<const CopyRange> ranges, unsigned threads);

}  // namespace trestle
