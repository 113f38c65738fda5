#include "ckpt/strided_copy.h"

#include <cstring>

namespace trestle {

std::vector<std::int64_t> contiguous_strides(const Shape& shape) {
  std::vector<std::int64_t> stride(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i];
  }
  return stride;
}

namespace {

void copy_dim(const std::byte* src, const std::vector<std::int64_t>& ss, std::byte* dst,
              const std::vector<std::int64_t>& ds, const Shape& count, std::size_t es, std::size_t dim,
              std::size_t run_dims, std::size_t run_bytes) {
  if (dim == run_dims) {
    std::memcpy(dst, src, run_bytes);
    return;
  }
  for (std::int64_t i = 0; i < count[dim]; ++i)
    copy_dim(src + i * ss[dim] * static_cast<std::int64_t>(es), ss, dst + i * ds[dim] * static_cast<std::int64_t>(es),
             ds, count, es, dim + 1, run_dims, run_bytes);
}

}  // namespace

void strided_copy(const std::byte* src, const std::vector<std::int64_t>& src_stride, std::byte* dst,
                  const std::vector<std::int64_t>& dst_stride, const Shape& count, std::size_t element_size) {
  for (std::int64_t c : count)
    if (c == 0) return;
  // Trailing dimensions dense in both source and destination are copied as one run.
  std::size_t run_dims = count.size();
  std::int64_t run = 1;
  while (run_dims > 0 && src_stride[run_dims - 1] == run && dst_stride[run_dims - 1] == run) {
    run *= count[run_dims - 1];
    --run_dims;
  }
  copy_dim(src, src_stride, dst, dst_stride, count, element_size, 0, run_dims,
           static_cast<std::size_t>(run) * element_size);
}

}  // namespace trestle
