// The RMSNorm CPU reference against LibTorch's arithmetic on the same inputs.
#include "kernels/rmsnorm.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace trestle::kernels {
namespace {

TEST(RmsNormReference, MatchesTorchFormula) {
  at::manual_seed(7);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 64}, {5, 1000}, {0, 8}}) {
    const at::Tensor x = at::randn({rows, cols}, at::kFloat) * 3.0;
    const at::Tensor w = at::randn({cols}, at::kFloat);
    at::Tensor y = at::empty_like(x);
    rmsnorm_forward_reference(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, cols, 1e-5f);
    const at::Tensor xd = x.to(at::kDouble);
    const at::Tensor expected = (xd * at::rsqrt(xd.pow(2).mean({-1}, true) + 1e-5) * w.to(at::kDouble)).to(at::kFloat);
    EXPECT_TRUE(at::allclose(y, expected, 1e-6, 1e-6)) << rows << "x" << cols;
  }
}

TEST(RmsNormReference, ScalesByWeightPerColumn) {
  const float x[4] = {1, 1, 1, 1};  // rms 1 -> y = weight / sqrt(1 + eps)
  const float w[4] = {1, 2, 3, 4};
  float y[4];
  rmsnorm_forward_reference(x, w, y, 1, 4, 0.f);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(y[i], w[i]);
}

}  // namespace
}  // namespace trestle::kernels
