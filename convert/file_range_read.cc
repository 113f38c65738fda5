#include "convert/file_range_read.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace trestle {

Result<std::size_t> read_file_range(const OpenedFile& file, const std::string& path, std::uint64_t offset,
                                    std::uint64_t length, AlignedBuffer& buffer, const std::string& what) {
  constexpr std::uint64_t kChunk = std::uint64_t{8} << 20;  // one pread; the kernel splits it into requests
  const std::uint64_t lead = file.direct ? offset % kIoAlignment : 0;
  const std::uint64_t start = offset - lead;
  const std::uint64_t required = lead + length;
  const std::uint64_t total = file.direct ? align_up(required, kIoAlignment) : required;
  if (buffer.size() < std::max<std::uint64_t>(total, 1)) buffer = AlignedBuffer(std::max<std::uint64_t>(total, 1));
  auto range = [&] { return " (bytes " + std::to_string(offset) + ".." + std::to_string(offset + length) + ")"; };
  std::uint64_t done = 0;
  while (done < total) {
    const std::uint64_t want = std::min(kChunk, total - done);
    const ssize_t n = ::pread(file.fd, buffer.data() + done, want, static_cast<off_t>(start + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Error(path + ": cannot read " + what + range() + ": " + std::strerror(errno));
    }
    done += static_cast<std::uint64_t>(n);
    if (static_cast<std::uint64_t>(n) < want) break;  // end of file
  }
  if (done < required)
    return Status::Error(path + ": " + what + range() + " runs past the end of the file at byte " +
                         std::to_string(start + done));
  return static_cast<std::size_t>(lead);
}

}  // namespace trestle
