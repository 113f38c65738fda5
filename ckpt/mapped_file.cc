#include "ckpt/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>

#include "ckpt/regular_file.h"

namespace trestle {
namespace {

// Reading a map past the end of a file that shrank after it was mapped (a dataset re-preprocessed while a job trains
// on it, a source truncated during a conversion) raises SIGBUS, which kills the process without a word. The maps
// are registered here, and a SIGBUS handler that finds the faulting address in one of them says which file it was and
// exits 1; a fault anywhere else goes to the handler that was there before (by default: the process dies of it).
struct MapSlot {
  std::atomic<std::uintptr_t> begin{0};  // 0: free; 1: being filled
  std::atomic<std::uintptr_t> end{0};
  char path[480] = {};
};
constexpr std::size_t kMapSlots = 1024;  // beyond that, maps go unnamed (the fault then kills as before)
MapSlot map_slots[kMapSlots];
struct sigaction previous_sigbus {};

void write_text(const char* text) {
  for (std::size_t left = std::strlen(text); left > 0;) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<std::size_t>(n);
  }
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const MapSlot& slot : map_slots) {
    const std::uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin > 1 && address >= begin && address < slot.end.load(std::memory_order_relaxed)) {
      write_text("trestle: ");
      write_text(slot.path);
      write_text(
          ": the file shrank (or its storage failed) while it was read through a memory map (SIGBUS); "
          "stopping. Was it replaced or truncated while in use?\n");
      ::_exit(1);
    }
  }
  // Not ours: as if this handler had never been installed.
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(signal, info, context);
  } else if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(signal);
  } else {
    ::sigaction(SIGBUS, &previous_sigbus, nullptr);  // returning re-runs the access, which then meets the default
  }
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

void register_map(const std::byte* data, std::size_t size, const std::string& path) {
  install_sigbus_handler();
  for (MapSlot& slot : map_slots) {
    std::uintptr_t free = 0;
    if (!slot.begin.compare_exchange_strong(free, 1, std::memory_order_acquire)) continue;
    const std::size_t length = std::min(path.size(), sizeof slot.path - 1);
    std::memcpy(slot.path, path.data(), length);
    slot.path[length] = '\0';
    slot.end.store(reinterpret_cast<std::uintptr_t>(data) + size, std::memory_order_relaxed);
    slot.begin.store(reinterpret_cast<std::uintptr_t>(data), std::memory_order_release);
    return;
  }
}

void unregister_map(const std::byte* data) {
  for (MapSlot& slot : map_slots) {
    std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(data);
    if (slot.begin.compare_exchange_strong(begin, 0, std::memory_order_acq_rel)) return;
  }
}

}  // namespace

Result<MappedFile> MappedFile::open(const std::string& path, bool random_access) {
  TRESTLE_ASSIGN_OR_RETURN(const int fd, open_regular_file(path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int stat_errno = errno;
    ::close(fd);
    return Status::Error(path + ": cannot stat: " + std::strerror(stat_errno));
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return MappedFile(path, nullptr, 0);
  }
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (data == MAP_FAILED) return Status::Error(path + ": cannot mmap: " + std::strerror(map_errno));
  if (random_access) ::madvise(data, size, MADV_RANDOM);  // advice only: failure changes nothing
  register_map(static_cast<const std::byte*>(data), size, path);
  return MappedFile(path, static_cast<const std::byte*>(data), size);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) {
      unregister_map(data_);
      ::munmap(const_cast<std::byte*>(data_), size_);
    }
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (!data_) return;
  unregister_map(data_);
  ::munmap(const_cast<std::byte*>(data_), size_);
}

void release_mapped(std::span<const std::byte> bytes) {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(bytes.data()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace trestle
