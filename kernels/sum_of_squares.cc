#include "kernels/sum_of_squares.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/cpu_table.h"
#include "kernels/kernel_dtype.h"

namespace trestle::kernels {

at::Tensor sum_of_squares(const at::Tensor& t) {
  const at::ScalarType type = t.scalar_type();
  if (t.is_cpu() && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf)) {
    const at::Tensor x = t.contiguous();
    return at::scalar_tensor(cpu_table().sum_of_squares(dtype_of(type), x.const_data_ptr(), x.numel()),
                             at::TensorOptions().dtype(at::kDouble));
  }
  return sum_of_squares_widened(t);
}

at::Tensor sum_of_squares_widened(const at::Tensor& t) {
  constexpr std::int64_t kChunk = std::int64_t{1} << 22;
  const at::Tensor flat = t.reshape(-1);
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  for (std::int64_t start = 0; start < flat.numel(); start += kChunk) {
    const at::Tensor piece = flat.narrow(0, start, std::min(kChunk, flat.numel() - start)).to(at::kDouble);
    total += at::dot(piece, piece);
  }
  return total;
}

}  // namespace trestle::kernels
