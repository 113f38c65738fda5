#include "ckpt/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace trestle {

const char* file_kind(unsigned mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

Status refuse_checkpoint_link(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return OkStatus();
  return Status::Error(path +
                       ": a symbolic link; a checkpoint's own directories and files are never links, and links are "
                       "not followed");
}

Result<int> open_regular_file(const std::string& path, int flags, int* open_error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | flags);
  if (fd < 0) {
    const int error = errno;
    if (open_error) *open_error = error;
    return Status::Error(path + ": cannot open: " + std::strerror(error));
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    problem = std::string("cannot stat: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    problem = std::string("not a regular file (") + file_kind(st.st_mode) + "); refused without reading it";
  } else if (const int status = ::fcntl(fd, F_GETFL); status < 0 || ::fcntl(fd, F_SETFL, status & ~O_NONBLOCK) != 0) {
    problem = std::string("cannot clear O_NONBLOCK: ") + std::strerror(errno);
  }
  if (problem.empty()) return fd;
  ::close(fd);
  return Status::Error(path + ": " + problem);
}

}  // namespace trestle
