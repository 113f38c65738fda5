#include "tools/bench/bench_files.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

namespace trestle::cli {
namespace fs = std::filesystem;

Result<ScratchDir> ScratchDir::create(const std::string& dir) {
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return Status::Error(dir + ": cannot create directory: " + ec.message());
    return ScratchDir(dir, false);
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/trestle-bench-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr)
    return Status::Error(pattern + ": cannot create a temporary directory: " + std::strerror(errno));
  return ScratchDir(pattern, true);
}

ScratchDir::ScratchDir(ScratchDir&& other) noexcept
    : path_(std::move(other.path_)), owned_(other.owned_), made_(std::move(other.made_)) {
  other.path_.clear();
  other.made_.clear();
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  if (owned_ && !path_.empty()) fs::remove_all(path_, ec);
  for (const auto& p : made_) fs::remove_all(p, ec);
}

std::string ScratchDir::fresh(const std::string& name) {
  const std::string p = path_ + "/" + name;
  std::error_code ec;
  fs::remove_all(p, ec);
  if (!owned_) made_.push_back(p);
  return p;
}

namespace {

Status evict_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Error(path + ": cannot open to evict it from the page cache: " + std::strerror(errno));
  Status status;
  if (::fdatasync(fd) != 0) status = Status::Error(path + ": fdatasync failed: " + std::strerror(errno));
  else if (const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); rc != 0)
    status = Status::Error(path + ": posix_fadvise(DONTNEED) failed: " + std::strerror(rc));
  ::close(fd);
  return status;
}

// Calls f(file) for `path` itself or, for a directory, for every regular file under it.
template <typename F>
Status for_each_file(const std::string& path, F f) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return f(path);
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec)) TRESTLE_RETURN_IF_ERROR(f(it->path().string()));
  }
  if (ec) return Status::Error(path + ": cannot list: " + ec.message());
  return OkStatus();
}

Status read_through_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Error(path + ": cannot open to read it into the page cache: " + std::strerror(errno));
  std::vector<char> buffer(std::size_t{8} << 20);
  Status status;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) status = Status::Error(path + ": cannot read: " + std::strerror(errno));
    if (n <= 0) break;
  }
  ::close(fd);
  return status;
}

}  // namespace

Status evict_from_page_cache(const std::string& path) { return for_each_file(path, evict_file); }

Status load_into_page_cache(const std::string& path) { return for_each_file(path, read_through_cache); }

Status sync_file_system(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Error(path + ": cannot open to sync its file system: " + std::strerror(errno));
  const bool synced = ::syncfs(fd) == 0;
  const int error = errno;
  ::close(fd);
  if (!synced) return Status::Error(path + ": syncfs failed: " + std::strerror(error));
  return OkStatus();
}

Result<std::uint64_t> free_bytes(const std::string& path) {
  struct statvfs st {};
  if (::statvfs(path.c_str(), &st) != 0) return Status::Error(path + ": statvfs failed: " + std::strerror(errno));
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

std::uint64_t bytes_on_disk(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return fs::is_regular_file(path, ec) ? fs::file_size(path, ec) : 0;
  std::uint64_t total = 0;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code entry_ec;
    if (it->is_regular_file(entry_ec)) {
      const std::uint64_t size = it->file_size(entry_ec);
      if (!entry_ec) total += size;
    }
  }
  return total;
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return Status::Error(path + ": cannot remove: " + ec.message());
  return OkStatus();
}

}  // namespace trestle::cli
