#include "ckpt/shape.h"

#include <limits>

namespace trestle {

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto extent : shape) n *= extent;
  return n;
}

std::optional<std::uint64_t> checked_nbytes(const Shape& shape, std::size_t element_size) {
  // Keep the result below 2^63 so it also fits the signed offsets used by file APIs.
  constexpr std::uint64_t kLimit = std::numeric_limits<std::int64_t>::max();
  std::uint64_t n = element_size;
  for (auto extent : shape) {
    if (extent < 0) return std::nullopt;
    const auto e = static_cast<std::uint64_t>(extent);
    if (e != 0 && n > kLimit / e) return std::nullopt;
    n *= e;
  }
  return n;
}

std::string to_string(const Shape& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

}  // namespace trestle
