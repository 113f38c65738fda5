// Tensor shapes: row-major extents, with overflow-checked element counts for untrusted input.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trestle {

using Shape = std::vector<std::int64_t>;

// Product of the extents; 1 for a 0-d shape. Callers pass shapes already validated.
std::int64_t numel(const Shape& shape);
// The same for untrusted shapes: nullopt on a negative extent or when numel × element_size overflows.
std::optional<std::uint64_t> checked_nbytes(const Shape& shape, std::size_t element_size);
std::string to_string(const Shape& shape);  // "[4096, 11008]"

}  // namespace trestle
