#include "convert/formats/safetensors/fp8_blocks.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ckpt/dtype_cast.h"

namespace trestle {

float fp8_e4m3fn_to_float(std::uint8_t byte) {
  const float sign = (byte & 0x80u) ? -1.0f : 1.0f;
  const int exponent = (byte >> 3) & 0xf;
  const int mantissa = byte & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);  // subnormal
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

Shape fp8_scale_shape(const Shape& weight, std::int64_t block_rows, std::int64_t block_cols) {
  if (weight.size() != 2 || block_rows <= 0 || block_cols <= 0) return {};
  return {(weight[0] + block_rows - 1) / block_rows, (weight[1] + block_cols - 1) / block_cols};
}

Status dequantize_fp8_blocks(std::span<const std::byte> weight, const Shape& shape, std::span<const float> scale,
                             std::int64_t block_rows, std::int64_t block_cols, std::span<std::byte> out) {
  const Shape grid = fp8_scale_shape(shape, block_rows, block_cols);
  if (grid.empty()) return Status::Error("an FP8 block-quantised weight must be 2-D with positive block sizes");
  const std::int64_t rows = shape[0], cols = shape[1];
  if (weight.size() != static_cast<std::size_t>(rows * cols) ||
      scale.size() != static_cast<std::size_t>(grid[0] * grid[1]) || out.size() != weight.size() * 2)
    return Status::Error("FP8 dequantisation: sizes do not match the weight's shape " + to_string(shape));
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[static_cast<std::size_t>(b)] = fp8_e4m3fn_to_float(static_cast<std::uint8_t>(b));
    return v;
  }();
  std::vector<float> row(static_cast<std::size_t>(cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* factors = scale.data() + (r / block_rows) * grid[1];
    const auto* in = reinterpret_cast<const std::uint8_t*>(weight.data()) + r * cols;
    for (std::int64_t c = 0; c < cols; ++c)
      row[static_cast<std::size_t>(c)] = kValues[in[c]] * factors[c / block_cols];
    TRESTLE_RETURN_IF_ERROR(cast_elements(DType::kF32, std::as_bytes(std::span<const float>(row)), DType::kBF16,
                                          out.subspan(static_cast<std::size_t>(r * cols) * 2,
                                                      static_cast<std::size_t>(cols) * 2)));
  }
  return OkStatus();
}

}  // namespace trestle
