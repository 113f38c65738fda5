// diff_checkpoints on two in-memory sources that differ in one element: values compared with NaN equal to NaN and
// +0 to -0 (yet reported as differing in bits), and an infinity or NaN against another value never within a tolerance.
#include "convert/checkpoint_diff.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "convert/sources/canonical_source.h"

namespace trestle {
namespace {

// One f32 tensor "w" of shape [4, 8] held in memory.
class MemorySource : public CanonicalSource {
 public:
  explicit MemorySource(std::vector<float> values) : values_(std::move(values)) {
    tensors_.push_back(LayoutTensor{"w", DType::kF32, Shape{4, 8}});
  }
  std::string description() const override { return "memory"; }
  Status read(const std::string&, const Piece& piece, std::span<std::byte> out) const override {
    // Row slices of the whole width, as diff_checkpoints asks for.
    const std::int64_t first = piece.box.offset[0] * 8;
    std::memcpy(out.data(), values_.data() + first, out.size());
    return OkStatus();
  }

 private:
  std::vector<float> values_;
};

std::vector<float> base() {
  std::vector<float> v(32);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i) - 3.0f;
  return v;
}

TensorDiff diff_with(float a, float b, CheckpointDiff* whole = nullptr) {
  std::vector<float> x = base(), y = base();
  x[13] = a;
  y[13] = b;
  auto diff = diff_checkpoints(MemorySource(x), MemorySource(y));
  EXPECT_TRUE(diff.ok()) << diff.status().message();
  if (whole) *whole = *diff;
  return diff->tensors.at(0);
}

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(CheckpointDiff, InfinityAgainstAFiniteValueIsNeverWithinATolerance) {
  CheckpointDiff whole;
  const TensorDiff t = diff_with(1.5f, kInf, &whole);
  EXPECT_EQ(t.kind, TensorDiff::Kind::kDifferent);
  EXPECT_EQ(t.differing, 1);
  EXPECT_EQ(t.non_finite, 1);
  EXPECT_EQ(t.max_abs, std::numeric_limits<double>::infinity());
  EXPECT_EQ(t.max_rel, std::numeric_limits<double>::infinity());  // was 0: inf / inf is NaN, which max dropped
  EXPECT_FALSE(whole.within(1e300, 0));
  EXPECT_FALSE(whole.within(0, 10));
  EXPECT_FALSE(whole.within(std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()));
}

TEST(CheckpointDiff, PlusAgainstMinusInfinityAndNanAgainstANumberAreNeverWithinATolerance) {
  for (auto [a, b] : {std::pair{kInf, -kInf}, std::pair{std::nanf(""), 2.0f}, std::pair{-kInf, 0.0f}}) {
    CheckpointDiff whole;
    const TensorDiff t = diff_with(a, b, &whole);
    EXPECT_EQ(t.kind, TensorDiff::Kind::kDifferent) << a << " vs " << b;
    EXPECT_EQ(t.non_finite, 1) << a << " vs " << b;
    EXPECT_EQ(t.max_rel, std::numeric_limits<double>::infinity()) << a << " vs " << b;
    EXPECT_FALSE(whole.within(1e300, 1e300)) << a << " vs " << b;
  }
}

TEST(CheckpointDiff, FiniteDifferencesStayWithinLooseTolerances) {
  CheckpointDiff whole;
  const TensorDiff t = diff_with(1.0f, 1.5f, &whole);
  EXPECT_EQ(t.non_finite, 0);
  EXPECT_DOUBLE_EQ(t.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(t.max_rel, 0.5 / 1.5);
  EXPECT_TRUE(whole.within(0.5, 0));
  EXPECT_TRUE(whole.within(0, 0.5));
  EXPECT_FALSE(whole.within(0.25, 0.25));
}

TEST(CheckpointDiff, EqualValuesInOtherBitsAreEqualButNotBitEqual) {
  const float nan_a = std::bit_cast<float>(std::uint32_t{0x7fc00000});
  const float nan_b = std::bit_cast<float>(std::uint32_t{0x7fc00001});
  for (auto [a, b] : {std::pair{0.0f, -0.0f}, std::pair{nan_a, nan_b}}) {
    CheckpointDiff whole;
    const TensorDiff t = diff_with(a, b, &whole);
    EXPECT_EQ(t.kind, TensorDiff::Kind::kEqual);
    EXPECT_EQ(t.differing, 0);
    EXPECT_EQ(t.bits_differing, 1);
    EXPECT_FALSE(t.bit_equal());
    EXPECT_TRUE(whole.identical());
    EXPECT_FALSE(whole.bit_identical());
  }
  CheckpointDiff whole;
  const TensorDiff same = diff_with(nan_a, nan_a, &whole);  // the same NaN, byte for byte
  EXPECT_TRUE(same.bit_equal());
  EXPECT_TRUE(whole.bit_identical());
}

}  // namespace
}  // namespace trestle
