// Element-wise conversion between floating dtypes (f64, f32, f16, bf16), rounding to nearest even as torch does.
#pragma once

#include <span>

#include "ckpt/dtype.h"
#include "ckpt/status.h"

namespace trestle {

bool can_cast(DType from, DType to);  // identical dtypes, or both among f64/f32/f16/bf16
// `to` must hold count elements of to_dtype, where count = from.size() / dtype_size(from_dtype).
Status cast_elements(DType from_dtype, std::span<const std::byte> from, DType to_dtype, std::span<std::byte> to);

}  // namespace trestle
