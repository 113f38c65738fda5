#include "convert/formats/safetensors/mxfp4.h"

#include <gtest/gtest.h>

#include <vector>

#include "ckpt/dtype_cast.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

TEST(Mxfp4, DecodesE2M1) {
  const float expected[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int n = 0; n < 16; ++n) EXPECT_EQ(e2m1_to_float(static_cast<std::uint8_t>(n)), expected[n]) << n;
}

TEST(Mxfp4, UnpacksLowNibbleFirstScalesEachGroupAndTransposes) {
  // One expert, 2 rows, one group of 32 values each: blocks [1, 2, 1, 16], scales [1, 2, 1].
  std::vector<std::byte> blocks(32, std::byte{0});
  blocks[0] = std::byte{0x72};   // row 0: values 0 and 1 are nibbles 2 (1.0) and 7 (6.0)
  blocks[16] = std::byte{0x09};  // row 1: value 0 is nibble 9 (-0.5), value 1 is 0
  const std::vector<std::byte> scales = {std::byte{128}, std::byte{126}};  // 2^1 and 2^-1
  std::vector<std::byte> out(2 * 32 * 2);
  ASSERT_TRUE(dequantize_mxfp4_transposed(blocks, {1, 2, 1, 16}, scales, out).ok());
  std::vector<float> values(64);
  ASSERT_TRUE(cast_elements(DType::kBF16, out, DType::kF32, std::as_writable_bytes(std::span(values))).ok());
  // Transposed to [1, 32, 2]: element (c, r) is row r's value c.
  EXPECT_EQ(values[0], 2.0f);    // (0, 0): 1.0 * 2
  EXPECT_EQ(values[1], -0.25f);  // (0, 1): -0.5 / 2
  EXPECT_EQ(values[2], 12.0f);   // (1, 0): 6.0 * 2
  EXPECT_EQ(values[3], 0.0f);
  EXPECT_EQ(mxfp4_weight_shape({4, 6, 3, 16}), (Shape{4, 96, 6}));
  EXPECT_TRUE(mxfp4_weight_shape({4, 6, 3, 8}).empty());
  EXPECT_TRUE(fails_with(dequantize_mxfp4_transposed(blocks, {1, 2, 1, 16}, std::span(scales).first(1), out),
                         "sizes do not match blocks [1, 2, 1, 16]"));
}

}  // namespace
}  // namespace trestle
