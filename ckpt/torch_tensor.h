// Zero-copy adapters between Trestle tensor views and at::Tensor (the only ckpt header that needs LibTorch).
#pragma once

#include <ATen/Tensor.h>

#include "ckpt/status.h"
#include "ckpt/tensor_view.h"

namespace trestle {

c10::ScalarType to_torch_dtype(DType dtype);
Result<DType> from_torch_dtype(c10::ScalarType type);

// Wraps the view's memory without copying. The tensor must not outlive the memory; a tensor made from a
// ConstTensorView must not be written to.
at::Tensor as_torch_tensor(ConstTensorView view);
// Views a contiguous CPU tensor's memory without copying; fails for other devices, strides or dtypes.
Result<TensorView> view_of(const at::Tensor& tensor);

}  // namespace trestle
