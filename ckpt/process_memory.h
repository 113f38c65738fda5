// What this process's memory use has been: the peak resident set size, for reports and benchmarks.
#pragma once

#include <cstdint>

namespace trestle {

// Peak resident set size of this process so far, in bytes.
std::uint64_t peak_rss_bytes();

}  // namespace trestle
