// A page-aligned (4096) byte buffer, zero-filled once when created so its pages are resident: I/O staging that is
// allocated once and reused. Movable, not copyable. Allocation failure throws std::bad_alloc, as operator new does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace trestle {

inline constexpr std::size_t kIoAlignment = 4096;  // O_DIRECT offsets, lengths and addresses are multiples of this

constexpr std::uint64_t align_down(std::uint64_t value, std::uint64_t alignment) {
  return value / alignment * alignment;
}
constexpr std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return align_down(value + alignment - 1, alignment);
}

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_, size_}; }
  // The first `bytes` of the buffer, replacing it with a larger one first when it is smaller (a reused buffer that
  // grows to the largest size asked for; the contents are not kept).
  std::span<std::byte> first(std::size_t bytes);
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace trestle
