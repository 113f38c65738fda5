#include "ckpt/kill_point.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>

namespace trestle {
namespace {

struct KillPointConfig {
  long long kill_at = 0;  // 0: never
  int trace_fd = -1;
};

const KillPointConfig& config() {
  static const KillPointConfig c = [] {
    KillPointConfig out;
    if (const char* n = std::getenv("TRESTLE_TEST_KILL_POINT")) out.kill_at = std::atoll(n);
    if (const char* file = std::getenv("TRESTLE_TEST_KILL_TRACE")) {
      std::string path = file;  // "%p" stands for the process id: one trace per worker of a multi-process run
      if (const auto at = path.find("%p"); at != std::string::npos) path.replace(at, 2, std::to_string(::getpid()));
      out.trace_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    }
    return out;
  }();
  return c;
}

std::atomic<long long> passed{0};

}  // namespace

void kill_point(const char* what) {
  const KillPointConfig& c = config();
  if (c.kill_at <= 0 && c.trace_fd < 0) return;
  const long long n = ++passed;
  if (c.trace_fd >= 0) {
    const std::string line = std::string(what) + "\n";  // one O_APPEND write per point: lines never interleave
    [[maybe_unused]] const ssize_t written = ::write(c.trace_fd, line.data(), line.size());
  }
  if (n == c.kill_at) ::kill(::getpid(), SIGKILL);
}

}  // namespace trestle
