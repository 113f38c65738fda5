// A non-owning view of a contiguous row-major tensor (dtype, shape, data pointer), free of LibTorch.
// The viewed memory must outlive the view; TensorView may write, ConstTensorView may not.
#pragma once

#include <cstddef>
#include <span>

#include "ckpt/dtype.h"
#include "ckpt/shape.h"

namespace trestle {

template <class Byte>
struct BasicTensorView {
  DType dtype = DType::kF32;
  Shape shape;
  Byte* data = nullptr;

  std::int64_t numel() const { return trestle::numel(shape); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  std::span<Byte> bytes() const { return {data, nbytes()}; }

  operator BasicTensorView<const std::byte>() const { return {dtype, shape, data}; }  // NOLINT: widening
};

using TensorView = BasicTensorView<std::byte>;
using ConstTensorView = BasicTensorView<const std::byte>;

}  // namespace trestle
