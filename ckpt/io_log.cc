#include "ckpt/io_log.h"

#include <cstdio>
#include <mutex>
#include <set>
#include <string>

namespace trestle {

bool log_once(std::string_view key, std::string_view message) {
  static std::mutex mutex;
  static std::set<std::string, std::less<>> said;
  std::lock_guard lock(mutex);
  if (said.contains(key)) return false;
  said.emplace(key);
  std::fprintf(stderr, "trestle: %.*s\n", static_cast<int>(message.size()), message.data());
  return true;
}

}  // namespace trestle
