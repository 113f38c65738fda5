// What this process's memory use has been (the peak resident set size, for reports and benchmarks), and how much the
// machine has.
#pragma once

#include <cstdint>

namespace trestle {

// Peak resident set size of this process so far, in bytes.
std::uint64_t peak_rss_bytes();

// The machine's physical memory in bytes (0 when unknown). A buffer larger than this cannot be filled.
std::uint64_t physical_memory_bytes();

}  // namespace trestle
