#include "ckpt/process_memory.h"

#include <sys/resource.h>

namespace trestle {

std::uint64_t peak_rss_bytes() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace trestle
