#include "ckpt/torch_tensor.h"

#include <ATen/Functions.h>

#include <string>

namespace trestle {
namespace {

struct Pair {
  DType dtype;
  c10::ScalarType torch;
};

constexpr Pair kPairs[] = {
    {DType::kBool, c10::ScalarType::Bool},
    {DType::kU8, c10::ScalarType::Byte},
    {DType::kI8, c10::ScalarType::Char},
    {DType::kI16, c10::ScalarType::Short},
    {DType::kU16, c10::ScalarType::UInt16},
    {DType::kI32, c10::ScalarType::Int},
    {DType::kU32, c10::ScalarType::UInt32},
    {DType::kI64, c10::ScalarType::Long},
    {DType::kU64, c10::ScalarType::UInt64},
    {DType::kF16, c10::ScalarType::Half},
    {DType::kBF16, c10::ScalarType::BFloat16},
    {DType::kF32, c10::ScalarType::Float},
    {DType::kF64, c10::ScalarType::Double},
    {DType::kF8E4M3, c10::ScalarType::Float8_e4m3fn},
    {DType::kF8E5M2, c10::ScalarType::Float8_e5m2},
};

}  // namespace

c10::ScalarType to_torch_dtype(DType dtype) {
  for (const auto& p : kPairs)
    if (p.dtype == dtype) return p.torch;
  return c10::ScalarType::Undefined;
}

Result<DType> from_torch_dtype(c10::ScalarType type) {
  for (const auto& p : kPairs)
    if (p.torch == type) return p.dtype;
  return Status::Error(std::string("torch dtype ") + c10::toString(type) + " has no Trestle equivalent");
}

at::Tensor as_torch_tensor(ConstTensorView view) {
  auto options = at::TensorOptions().dtype(to_torch_dtype(view.dtype)).device(at::kCPU);
  return at::from_blob(const_cast<std::byte*>(view.data), view.shape, options);
}

Result<TensorView> view_of(const at::Tensor& tensor) {
  if (!tensor.device().is_cpu()) return Status::Error("tensor is on " + tensor.device().str() + ", expected CPU");
  if (!tensor.is_contiguous()) return Status::Error("tensor is not contiguous");
  TRESTLE_ASSIGN_OR_RETURN(DType dtype, from_torch_dtype(tensor.scalar_type()));
  return TensorView{dtype, Shape(tensor.sizes().begin(), tensor.sizes().end()),
                    static_cast<std::byte*>(tensor.data_ptr())};
}

}  // namespace trestle
