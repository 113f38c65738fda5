#include "convert/formats/safetensors/fp8_blocks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ckpt/dtype_cast.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

TEST(Fp8Blocks, DecodesE4M3) {
  EXPECT_EQ(fp8_e4m3fn_to_float(0x38), 1.0f);   // exponent 7 (the bias), no mantissa
  EXPECT_EQ(fp8_e4m3fn_to_float(0xb8), -1.0f);
  EXPECT_EQ(fp8_e4m3fn_to_float(0x7e), 448.0f);  // the largest finite value
  EXPECT_EQ(fp8_e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(fp8_e4m3fn_to_float(0x3c), 1.5f);
  EXPECT_EQ(fp8_e4m3fn_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3fn_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3fn_to_float(0xff)));
}

TEST(Fp8Blocks, ScaleGridRoundsUp) {
  EXPECT_EQ(fp8_scale_shape({576, 7168}, 128, 128), (Shape{5, 56}));  // DeepSeek-V3's kv_a_proj_with_mqa
  EXPECT_EQ(fp8_scale_shape({128, 128}, 128, 128), (Shape{1, 1}));
  EXPECT_TRUE(fp8_scale_shape({4}, 128, 128).empty());
}

TEST(Fp8Blocks, EachBlockTakesItsOwnFactorAndEdgeBlocksArePartial) {
  const Shape shape{3, 5};  // blocks of 2 x 2: a grid of 2 x 3, the last row and column of blocks partial
  std::vector<std::byte> weight(15, std::byte{0x38});  // every element 1.0
  const std::vector<float> scale{1, 2, 3, 4, 5, 6};
  std::vector<std::byte> out(30);
  ASSERT_TRUE(dequantize_fp8_blocks(weight, shape, scale, 2, 2, out).ok());
  std::vector<float> values(15);
  ASSERT_TRUE(cast_elements(DType::kBF16, out, DType::kF32, std::as_writable_bytes(std::span(values))).ok());
  const std::vector<float> expected{1, 1, 2, 2, 3, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6};
  EXPECT_EQ(values, expected);
}

TEST(Fp8Blocks, SizesThatDoNotFitAreErrors) {
  std::vector<std::byte> weight(15), out(30);
  const std::vector<float> short_scale{1, 2};
  EXPECT_TRUE(fails_with(dequantize_fp8_blocks(weight, {3, 5}, short_scale, 2, 2, out),
                         "sizes do not match the weight's shape [3, 5]"));
  const std::vector<float> scale(6, 1.0f);
  std::vector<std::byte> small(10);
  EXPECT_TRUE(fails_with(dequantize_fp8_blocks(weight, {3, 5}, scale, 2, 2, small),
                         "sizes do not match the weight's shape [3, 5]"));
  EXPECT_TRUE(
      fails_with(dequantize_fp8_blocks(weight, {15}, scale, 2, 2, out), "must be 2-D with positive block sizes"));
}

}  // namespace
}  // namespace trestle
