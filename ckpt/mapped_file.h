// A read-only memory map of a whole file; views into it stay valid while the MappedFile lives. Reading past the end
// of a file that shrank after it was mapped ends the process with exit 1 and a message naming the file (a SIGBUS
// handler), not a bare "Bus error".
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "ckpt/status.h"

namespace trestle {

class MappedFile {
 public:
  // random_access: only scattered small parts will be read through the map, so the kernel reads no further ahead
  // than the pages touched.
  static Result<MappedFile> open(const std::string& path, bool random_access = false);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  std::size_t size() const { return size_; }

 private:
  MappedFile(std::string path, const std::byte* data, std::size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// Tells the kernel the process no longer needs these mapped source bytes (they stay in the page cache), so resident
// memory reflects the working set rather than everything read.
void release_mapped(std::span<const std::byte> bytes);

}  // namespace trestle
