#include "ckpt/recorded_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "ckpt/fault_point.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace {

constexpr std::size_t kCopyBytes = std::size_t{8} << 20;

std::string os_error(const std::string& path, const std::string& what) {
  return path + ": " + what + ": " + std::strerror(errno);
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

struct HashState {
  XXH3_state_t* state = XXH3_createState();
  HashState() { XXH3_64bits_reset(state); }
  ~HashState() { XXH3_freeState(state); }
};

// Reads `in` to its end, hashing it and (when out >= 0) writing it to `out`.
Result<RecordedFile> stream(int in, const std::string& in_path, int out, const std::string& out_path) {
  std::vector<std::byte> buffer(kCopyBytes);
  HashState hash;
  RecordedFile file;
  for (;;) {
    const ssize_t n = ::read(in, buffer.data(), transfer_length(buffer.size(), in));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Error(os_error(in_path, "read failed"));
    if (n == 0) break;
    XXH3_64bits_update(hash.state, buffer.data(), static_cast<std::size_t>(n));
    file.bytes += static_cast<std::uint64_t>(n);
    for (ssize_t done = 0; out >= 0 && done < n;) {
      const ssize_t w = ::write(out, buffer.data() + done, transfer_length(static_cast<std::size_t>(n - done), out));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return Status::Error(os_error(out_path, "write failed"));
      if (w == 0) {
        const std::uint64_t at = file.bytes - static_cast<std::uint64_t>(n - done);
        return Status::Error(out_path + ": write failed: nothing written at byte " + std::to_string(at));
      }
      done += w;
    }
  }
  file.xxh3 = XXH3_64bits_digest(hash.state);
  return file;
}

}  // namespace

Status check_recorded_file_name(const std::string& name, const std::string& where) {
  auto bad = [&](const std::string& why) { return Status::Error(where + ": file name '" + name + "' " + why); };
  if (name.empty() || name.front() == '/') return bad("must be a relative path");
  std::size_t begin = 0;
  while (begin <= name.size()) {
    const std::size_t end = std::min(name.find('/', begin), name.size());
    const std::string part = name.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") return bad("must be made of plain names (no '', '.' or '..')");
    begin = end + 1;
  }
  return OkStatus();
}

Result<RecordedFile> copy_recorded_file(const std::string& source, const std::string& destination) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(destination).parent_path(), ec);
  if (ec) return Status::Error(destination + ": cannot create its directory: " + ec.message());
  TRESTLE_ASSIGN_OR_RETURN(const int source_fd, open_regular_file(source));
  Fd in{source_fd};
  Fd out{::open(destination.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644)};
  if (out.fd < 0) return Status::Error(os_error(destination, "cannot create"));
  TRESTLE_ASSIGN_OR_RETURN(const RecordedFile file, stream(in.fd, source, out.fd, destination));
  TRESTLE_RETURN_IF_ERROR(fault_point("copy", destination));
  if (::fsync(out.fd) != 0) return Status::Error(os_error(destination, "fsync failed"));
  const std::string parent = std::filesystem::path(destination).parent_path().string();
  Fd dir{::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir.fd < 0 || ::fsync(dir.fd) != 0) return Status::Error(os_error(parent, "cannot sync directory"));
  return file;
}

Result<RecordedFile> digest_recorded_file(const std::string& path) {
  auto opened = open_regular_file(path, O_NOFOLLOW);
  if (!opened.ok()) return Status::Error(opened.status().message() + " (a checkpoint's files are never links)");
  Fd in{*opened};
  return stream(in.fd, path, -1, "");
}

}  // namespace trestle
