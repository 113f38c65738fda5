// FP8 (e4m3fn) weights quantised in blocks, as DeepSeek-V3's and other FP8 Hugging Face checkpoints store them
// (quantization_config quant_method "fp8", weight_block_size [rows, cols]): a [R, C] weight of float8_e4m3fn and a
// float32 `weight_scale_inv` of [ceil(R / rows), ceil(C / cols)], one factor per block (edge blocks partial).
// Dequantised, element (r, c) is fp8(r, c) · scale(r / rows, c / cols), rounded to bfloat16 (nearest even).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ckpt/shape.h"
#include "ckpt/status.h"

namespace trestle {

// The value of one float8_e4m3fn byte (no infinities; 0x7f / 0xff are NaN).
float fp8_e4m3fn_to_float(std::uint8_t byte);

// The scale grid a [rows, cols] weight has with blocks of block_rows x block_cols.
Shape fp8_scale_shape(const Shape& weight, std::int64_t block_rows, std::int64_t block_cols);

// Dequantises `weight` (shape [R, C], one byte per element) with `scale` (fp8_scale_shape floats) into `out`
// (R · C bfloat16 values). Errors name what does not fit.
Status dequantize_fp8_blocks(std::span<const std::byte> weight, const Shape& shape, std::span<const float> scale,
                             std::int64_t block_rows, std::int64_t block_cols, std::span<std::byte> out);

}  // namespace trestle
