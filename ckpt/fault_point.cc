#include "ckpt/fault_point.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

namespace trestle {
namespace {

struct FaultConfig {
  long long kill_at = 0;  // 0: never
  long long fail_at = 0;
  long long hang_at = 0;
  std::string hold_at;  // a hold_point's name; empty: none
  std::string hold_file;
  int fail_errno = EIO;
  int trace_fd = -1;
  long long max_transfer = -1;  // -1: no cap
};

long long point_number(const char* variable) {
  const char* value = std::getenv(variable);
  return value ? std::atoll(value) : 0;
}

int errno_named(std::string_view name) {
  if (name == "ENOSPC") return ENOSPC;
  if (name == "EDQUOT") return EDQUOT;
  if (name == "EROFS") return EROFS;
  return EIO;
}

const FaultConfig& config() {
  static const FaultConfig c = [] {
    FaultConfig out;
    out.kill_at = point_number("TRESTLE_TEST_KILL_POINT");
    out.fail_at = point_number("TRESTLE_TEST_FAIL_POINT");
    out.hang_at = point_number("TRESTLE_TEST_HANG_POINT");
    const char* hold_at = std::getenv("TRESTLE_TEST_HOLD_AT");
    const char* hold_file = std::getenv("TRESTLE_TEST_HOLD_FILE");
    if (hold_at && hold_file) {
      out.hold_at = hold_at;
      out.hold_file = hold_file;
    }
    if (const char* cap = std::getenv("TRESTLE_TEST_MAX_TRANSFER")) out.max_transfer = std::max(0LL, std::atoll(cap));
    if (const char* name = std::getenv("TRESTLE_TEST_FAIL_ERRNO")) out.fail_errno = errno_named(name);
    const char* only = std::getenv("TRESTLE_TEST_FAULT_RANK");
    const char* rank = std::getenv("RANK");
    if (only && (!rank || std::string_view(only) != rank)) {
      out.kill_at = out.fail_at = out.hang_at = 0;
      out.hold_at.clear();
    }
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

Status fault_point(const char* what, const std::string& path) {
  const FaultConfig& c = config();
  if (c.kill_at <= 0 && c.fail_at <= 0 && c.hang_at <= 0 && c.trace_fd < 0) return OkStatus();
  const long long n = ++passed;
  if (c.trace_fd >= 0) {
    const std::string line = std::string(what) + "\n";  // one O_APPEND write per point: lines never interleave
    [[maybe_unused]] const ssize_t written = ::write(c.trace_fd, line.data(), line.size());
  }
  if (n == c.kill_at) ::kill(::getpid(), SIGKILL);
  if (n == c.hang_at)
    for (;;) ::pause();
  if (n == c.fail_at)
    return Status::Error(path + ": " + what + ": " + std::strerror(c.fail_errno) + " (injected fault)");
  return OkStatus();
}

void hold_point(const char* what) {
  const FaultConfig& c = config();
  if (c.hold_at.empty() || c.hold_at != what) return;
  if (c.trace_fd >= 0) {
    const std::string line = "hold " + c.hold_at + "\n";
    [[maybe_unused]] const ssize_t written = ::write(c.trace_fd, line.data(), line.size());
  }
  while (::access(c.hold_file.c_str(), F_OK) != 0) ::usleep(10'000);
}

std::size_t transfer_length(std::size_t length, int fd) {
  const long long cap = config().max_transfer;
  if (cap < 0) return length;
  constexpr long long kBlock = 4096;  // O_DIRECT transfers stay whole blocks
  const bool direct = (::fcntl(fd, F_GETFL) & O_DIRECT) != 0;
  const long long allowed = direct && cap > 0 ? (cap + kBlock - 1) / kBlock * kBlock : cap;
  return std::min(length, static_cast<std::size_t>(allowed));
}

}  // namespace trestle
