#include "kernels/kernel_dtype.h"

#include <c10/util/Exception.h>

namespace trestle::kernels {

cpu::Dtype dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return cpu::Dtype::kFloat;
    case at::kBFloat16:
      return cpu::Dtype::kBFloat16;
    case at::kHalf:
      return cpu::Dtype::kHalf;
    default:
      TORCH_CHECK(false, "the fused kernels take float, bfloat16 or half tensors, not ", type);
  }
}

}  // namespace trestle::kernels
