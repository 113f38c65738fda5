#include "ckpt/removed_on_signal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <filesystem>

namespace trestle {
namespace {

// A registered path, read by the signal handler without locks: `state` says whether `path` is complete, and
// `generation` (bumped by every registration) tells the handler that the slot was reused while it copied the path.
struct Slot {
  enum : int { kFree, kWriting, kReady };
  std::atomic<int> state{kFree};
  std::atomic<unsigned long> generation{0};
  pid_t owner = 0;  // the registering process: a child forked without exec leaves its parent's paths alone
  char path[PATH_MAX];
};

std::array<Slot, kMaxRemovedOnSignal> slots;

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kMaxDepth = 16;  // deeper trees are left to the next run's cleanup
constexpr int kMaxPasses = 4;  // a directory another thread is still writing into may need another pass

bool is_dot_or_dotdot(const char* name) {
  return name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'));
}

// Removes `name` under `parent_fd` (a file, or a directory with everything in it) with async-signal-safe calls only;
// symbolic links are removed, never followed.
void remove_tree_at(int parent_fd, const char* name, int depth) {
  if (::unlinkat(parent_fd, name, 0) == 0 || errno == ENOENT) return;
  if (depth >= kMaxDepth) return;
  const int fd = ::openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    if (pass > 0 && ::lseek(fd, 0, SEEK_SET) != 0) break;
    alignas(dirent64) char buffer[1024];  // getdents64 fills it with records laid out as dirent64
    long n;
    while ((n = ::syscall(SYS_getdents64, fd, buffer, sizeof buffer)) > 0) {
      for (long offset = 0; offset < n;) {
        const auto* entry = reinterpret_cast<const dirent64*>(buffer + offset);
        offset += entry->d_reclen;
        if (!is_dot_or_dotdot(entry->d_name)) remove_tree_at(fd, entry->d_name, depth + 1);
      }
    }
    if (::unlinkat(parent_fd, name, AT_REMOVEDIR) == 0 || errno != ENOTEMPTY) break;
  }
  ::close(fd);
}

extern "C" void remove_registered_then_die(int sig) {
  const int saved_errno = errno;
  for (Slot& slot : slots) {
    const unsigned long generation = slot.generation.load(std::memory_order_acquire);
    if (slot.state.load(std::memory_order_acquire) != Slot::kReady) continue;
    const pid_t owner = slot.owner;
    char path[PATH_MAX];
    std::memcpy(path, slot.path, sizeof path);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.state.load(std::memory_order_relaxed) != Slot::kReady ||
        slot.generation.load(std::memory_order_relaxed) != generation)
      continue;  // reused while copied: the new path is a registration made as the process ends
    if (owner != ::getpid()) continue;
    path[sizeof path - 1] = '\0';
    remove_tree_at(AT_FDCWD, path, 0);
  }
  // The default action ends the process with this signal once the handler returns (it stays pending until then).
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(sig, &fallback, nullptr);
  ::raise(sig);
  errno = saved_errno;
}

// Installs the handler for each signal whose action is still the default.
void handle_default_signals() {
  for (const int sig : kSignals) {
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) != 0) continue;
    const bool is_default = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
    if (!is_default) continue;
    struct sigaction action {};
    action.sa_handler = remove_registered_then_die;
    sigemptyset(&action.sa_mask);
    for (const int other : kSignals) sigaddset(&action.sa_mask, other);  // one removal at a time per thread
    ::sigaction(sig, &action, nullptr);
  }
}

}  // namespace

RemovedOnSignal::RemovedOnSignal(const std::string& given) {
  std::error_code ec;
  const std::string path = given.empty() ? given : std::filesystem::absolute(given, ec).string();  // cwd may change
  if (ec || path.empty() || path.size() >= PATH_MAX) return;
  for (int i = 0; i < kMaxRemovedOnSignal; ++i) {
    Slot& slot = slots[static_cast<std::size_t>(i)];
    int expected = Slot::kFree;
    if (!slot.state.compare_exchange_strong(expected, Slot::kWriting, std::memory_order_acquire)) continue;
    slot.generation.fetch_add(1, std::memory_order_relaxed);
    slot.owner = ::getpid();
    std::memcpy(slot.path, path.c_str(), path.size() + 1);
    slot.state.store(Slot::kReady, std::memory_order_release);
    slot_ = i;
    handle_default_signals();
    return;
  }
}

RemovedOnSignal& RemovedOnSignal::operator=(RemovedOnSignal&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

void RemovedOnSignal::release() {
  if (slot_ < 0) return;
  slots[static_cast<std::size_t>(slot_)].state.store(Slot::kFree, std::memory_order_release);
  slot_ = -1;
}

}  // namespace trestle
