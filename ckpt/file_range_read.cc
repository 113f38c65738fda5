#include "ckpt/file_range_read.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckpt/fault_point.h"
#include "ckpt/regular_file.h"
#include "ckpt/strided_copy.h"

namespace trestle {

ReadFiles::~ReadFiles() {
  for (auto& [path, file] : files_) {
    ::close(file.fd);
    if (file.cached_fd >= 0) ::close(file.cached_fd);
  }
}

namespace {

// A buffered descriptor of the file open at `direct_fd` (same device and inode, so a rename between the two opens
// cannot swap the file), or -1.
int open_buffered_twin(const std::string& path, int direct_fd) {
  const auto opened = open_regular_file(path);
  if (!opened.ok()) return -1;
  const int fd = *opened;
  struct stat a{}, b{};
  if (::fstat(direct_fd, &a) != 0 || ::fstat(fd, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

Result<OpenedFile> ReadFiles::get(const std::string& path) {
  std::lock_guard lock(mu_);
  if (auto it = files_.find(path); it != files_.end()) return it->second;
  TRESTLE_ASSIGN_OR_RETURN(OpenedFile opened, open_for_io(path, O_RDONLY | O_CLOEXEC, true, "open"));
  if (opened.direct) opened.cached_fd = open_buffered_twin(path, opened.fd);
  files_.emplace(path, opened);
  return opened;
}

bool range_in_page_cache(int fd, std::uint64_t offset, std::uint64_t length) {
  if (length == 0) return true;
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t start = offset - offset % page;
  const std::uint64_t span = offset + length - start;
  void* map = ::mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
  if (map == MAP_FAILED) return false;
  std::vector<unsigned char> resident((span + page - 1) / page);
  const bool known = ::mincore(map, span, resident.data()) == 0;
  ::munmap(map, span);
  return known && std::all_of(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
}

namespace {

// Reads exactly [offset, offset + length) through the buffered descriptor into `at`; false when it fell short (the
// caller then reads the range with O_DIRECT, whose errors it reports).
bool read_cached(int fd, std::uint64_t offset, std::uint64_t length, std::byte* at) {
  std::uint64_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd, at + done, transfer_length(length - done, fd), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::uint64_t>(n);
  }
  return true;
}

}  // namespace

Result<std::size_t> read_file_range(const OpenedFile& file, const std::string& path, std::uint64_t offset,
                                    std::uint64_t length, AlignedBuffer& buffer, const std::string& what) {
  constexpr std::uint64_t kChunk = std::uint64_t{8} << 20;  // one pread; the kernel splits it into requests
  const std::uint64_t lead = file.direct ? offset % kIoAlignment : 0;
  const std::uint64_t start = offset - lead;
  const std::uint64_t required = lead + length;
  const std::uint64_t total = file.direct ? align_up(required, kIoAlignment) : required;
  buffer.first(static_cast<std::size_t>(total));
  auto range = [&] { return " (bytes " + std::to_string(offset) + ".." + std::to_string(offset + length) + ")"; };
  // The page cache holds the range (the file was just written or read): copy it from there, not the disk.
  if (file.direct && file.cached_fd >= 0 && range_in_page_cache(file.cached_fd, offset, length) &&
      read_cached(file.cached_fd, offset, length, buffer.data() + lead))
    return static_cast<std::size_t>(lead);
  std::uint64_t done = 0;
  while (done < total) {
    const std::uint64_t want = std::min(kChunk, total - done);
    const ssize_t n =
        ::pread(file.fd, buffer.data() + done, transfer_length(want, file.fd), static_cast<off_t>(start + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Error(path + ": cannot read " + what + range() + ": " + std::strerror(errno));
    }
    if (n == 0) break;  // end of file (a shorter count is not: the next call goes on)
    done += static_cast<std::uint64_t>(n);
  }
  if (done < required)
    return Status::Error(path + ": " + what + range() + " runs past the end of the file at byte " +
                         std::to_string(start + done));
  return static_cast<std::size_t>(lead);
}

std::uint64_t strided_span_bytes(const Shape& count, const std::vector<std::int64_t>& stride,
                                 std::size_t element_size) {
  std::int64_t last = 0;
  for (std::size_t d = 0; d < count.size(); ++d) {
    if (count[d] == 0) return 0;
    last += (count[d] - 1) * stride[d];
  }
  return static_cast<std::uint64_t>(last + 1) * element_size;
}

Status copy_strided_from_file(const OpenedFile& file, const std::string& path, std::uint64_t at,
                              const std::vector<std::int64_t>& src_stride, std::byte* destination,
                              const std::vector<std::int64_t>& dst_stride, const Shape& count, std::size_t element_size,
                              AlignedBuffer& buffer, const std::string& what) {
  const std::uint64_t span = strided_span_bytes(count, src_stride, element_size);
  if (span == 0) return OkStatus();
  TRESTLE_ASSIGN_OR_RETURN(const std::size_t lead, read_file_range(file, path, at, span, buffer, what));
  strided_copy(buffer.data() + lead, src_stride, destination, dst_stride, count, element_size);
  return OkStatus();
}

}  // namespace trestle
