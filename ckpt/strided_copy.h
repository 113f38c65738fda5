// Copying a strided region of elements between two buffers (strides in elements, row-major extents), the trailing
// dimensions that are dense in both copied as one run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ckpt/shape.h"

namespace trestle {

void strided_copy(const std::byte* src, const std::vector<std::int64_t>& src_stride, std::byte* dst,
                  const std::vector<std::int64_t>& dst_stride, const Shape& count, std::size_t element_size);

// Row-major strides of a contiguous tensor of this shape.
std::vector<std::int64_t> contiguous_strides(const Shape& shape);

}  // namespace trestle
