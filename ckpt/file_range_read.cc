#include "ckpt/file_range_read.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckpt/fault_point.h"
#include "ckpt/strided_copy.h"

namespace trestle {

ReadFiles::~ReadFiles() {
  for (auto& [path, file] : files_) ::close(file.fd);
}

Result<OpenedFile> ReadFiles::get(const std::string& path) {
  std::lock_guard lock(mu_);
  if (auto it = files_.find(path); it != files_.end()) return it->second;
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile opened, open_for_io(path, O_RDONLY | O_CLOEXEC, true, "open"));
  files_.emplace(path, opened);
  return opened;
}

Result<std::size_t> read_file_range(const OpenedFile& file, const std::string& path, std::uint64_t offset,
                                    std::uint64_t length, AlignedBuffer& buffer, const std::string& what) {
  constexpr std::uint64_t kChunk = std::uint64_t{8} << 20;  // one pread; the kernel splits it into requests
  const std::uint64_t lead = file.direct ? offset % kIoAlignment : 0;
  const std::uint64_t start = offset - lead;
  const std::uint64_t required = lead + length;
  const std::uint64_t total = file.direct ? align_up(required, kIoAlignment) : required;
  buffer.first(static_cast<std::size_t>(total));
  auto range = [&] { return " (bytes " + std::to_string(offset) + ".." + std::to_string(offset + length) + ")"; };
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
