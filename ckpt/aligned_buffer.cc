#include "ckpt/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace trestle {

namespace {

// Large buffers ask for transparent huge pages: an O_DIRECT request over 2 MiB pages needs far fewer DMA segments
// than over 4 KiB pages, which measurably speeds up 4 MiB requests.
constexpr std::size_t kHugePage = std::size_t{2} << 20;

}  // namespace

AlignedBuffer::AlignedBuffer(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  const bool huge = bytes >= kHugePage;
  const std::size_t alignment = huge ? kHugePage : kIoAlignment;
  // aligned_alloc wants a size that is a multiple of the alignment; the tail beyond `bytes` is never exposed.
  const std::size_t allocated = align_up(bytes, alignment);
  data_ = static_cast<std::byte*>(std::aligned_alloc(alignment, allocated));
  if (data_ == nullptr) throw std::bad_alloc();
  if (huge) (void)::madvise(data_, allocated, MADV_HUGEPAGE);  // a hint: without THP the buffer works the same
  std::memset(data_, 0, bytes);
}

std::span<std::byte> AlignedBuffer::first(std::size_t bytes) {
  if (size_ < bytes) {
    *this = AlignedBuffer();  // the old one goes first: growing never holds both
    *this = AlignedBuffer(bytes);
  }
  return {data_, bytes};
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace trestle
