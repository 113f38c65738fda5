#include "convert/formats/safetensors/mxfp4.h"

#include <array>
#include <cmath>
#include <vector>

#include "ckpt/dtype_cast.h"

namespace trestle {

float e2m1_to_float(std::uint8_t nibble) {
  static constexpr std::array<float, 8> kMagnitude = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitude[nibble & 0x7u];
  return (nibble & 0x8u) ? -magnitude : magnitude;
}

Shape mxfp4_weight_shape(const Shape& blocks) {
  if (blocks.size() != 4 || blocks[3] != 16 || blocks[0] <= 0 || blocks[1] <= 0 || blocks[2] <= 0) return {};
  return {blocks[0], blocks[2] * 32, blocks[1]};
}

Status dequantize_mxfp4_transposed(std::span<const std::byte> blocks, const Shape& blocks_shape,
                                   std::span<const std::byte> scales, std::span<std::byte> out) {
  const Shape shape = mxfp4_weight_shape(blocks_shape);
  if (shape.empty()) return Status::Error("MXFP4 blocks must be [E, R, G, 16], not " + to_string(blocks_shape));
  const std::int64_t experts = blocks_shape[0], rows = blocks_shape[1], groups = blocks_shape[2];
  const std::int64_t cols = groups * 32;
  if (blocks.size() != static_cast<std::size_t>(experts * rows * groups * 16) ||
      scales.size() != static_cast<std::size_t>(experts * rows * groups) ||
      out.size() != static_cast<std::size_t>(experts * rows * cols) * 2)
    return Status::Error("MXFP4 dequantisation: sizes do not match blocks " + to_string(blocks_shape));
  std::vector<float> values(static_cast<std::size_t>(rows * cols));  // one expert, [R, cols]
  std::vector<float> column(static_cast<std::size_t>(rows));
  const auto* in = reinterpret_cast<const std::uint8_t*>(blocks.data());
  const auto* scale = reinterpret_cast<const std::uint8_t*>(scales.data());
  for (std::int64_t e = 0; e < experts; ++e) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t g = 0; g < groups; ++g) {
        const std::int64_t block = (e * rows + r) * groups + g;
        const float factor = std::ldexp(1.0f, static_cast<int>(scale[block]) - 127);
        float* dst = values.data() + r * cols + g * 32;
        for (int b = 0; b < 16; ++b) {
          const std::uint8_t byte = in[block * 16 + b];
          dst[2 * b] = e2m1_to_float(byte & 0xfu) * factor;
          dst[2 * b + 1] = e2m1_to_float(byte >> 4) * factor;
        }
      }
    // Transposed: output row c holds column c of every row r.
    for (std::int64_t c = 0; c < cols; ++c) {
      for (std::int64_t r = 0; r < rows; ++r) column[static_cast<std::size_t>(r)] = values[static_cast<std::size_t>(r * cols + c)];
      TRESTLE_RETURN_IF_ERROR(cast_elements(DType::kF32, std::as_bytes(std::span<const float>(column)), DType::kBF16,
                                            out.subspan(static_cast<std::size_t>((e * cols + c) * rows) * 2,
                                                        static_cast<std::size_t>(rows) * 2)));
    }
  }
  return OkStatus();
}

}  // namespace trestle
