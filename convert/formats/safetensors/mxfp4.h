// MXFP4-packed weights, as GPT-OSS's release checkpoints store its experts (quantization_config quant_method "mxfp4"):
// `<name>_blocks` uint8 [E, R, G, 16] holds R rows of G · 32 four-bit E2M1 values each (two per byte, the low nibble
// first), `<name>_scales` uint8 [E, R, G] one power-of-two scale per 32 values (2^(s - 127)). Dequantised, the
// [E, R, G · 32] weight is written transposed, [E, G · 32, R], in bfloat16: transformers' layout of the same
// parameter (gate_up_proj [E, H, 2I], down_proj [E, I, H]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ckpt/shape.h"
#include "ckpt/status.h"

namespace trestle {

// The value of one E2M1 nibble (0..15).
float e2m1_to_float(std::uint8_t nibble);

// The dequantised, transposed shape [E, G · 32, R] of blocks shaped [E, R, G, 16]; empty when that is not the shape.
Shape mxfp4_weight_shape(const Shape& blocks);

// Dequantises `blocks` (shape `blocks_shape`) with `scales` ([E, R, G]) into `out` ([E, G · 32, R] bfloat16).
Status dequantize_mxfp4_transposed(std::span<const std::byte> blocks, const Shape& blocks_shape,
                                   std::span<const std::byte> scales, std::span<std::byte> out);

}  // namespace trestle
