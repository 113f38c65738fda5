#include "ckpt/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "ckpt/regular_file.h"

namespace trestle {

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
  return MappedFile(path, static_cast<const std::byte*>(data), size);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

void release_mapped(std::span<const std::byte> bytes) {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(bytes.data()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace trestle
