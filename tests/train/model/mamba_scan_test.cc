// Mamba-2's chunked scan against its token-by-token recurrence: outputs and the gradients of x, dt, A, B and C, over
// several chunks with a padded last one, in one chunk, with groups serving several heads, and with decays strong
// enough that e^γ underflows across a chunk; and the first token's output written out by hand.
#include "train/model/mamba_scan.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <string>
#include <tuple>
#include <vector>

namespace trestle::train {
namespace {

struct Inputs {
  at::Tensor x, dt, A, B, C;
  std::vector<at::Tensor> all() const { return {x, dt, A, B, C}; }
};

Inputs random_inputs(std::int64_t b, std::int64_t s, std::int64_t heads, std::int64_t p, std::int64_t groups,
                     std::int64_t n, double decay_scale) {
  Inputs in;
  in.x = at::randn({b, s, heads, p}).requires_grad_(true);
  in.dt = at::softplus(at::randn({b, s, heads})).detach().requires_grad_(true);
  in.A = (-at::rand({heads}) * decay_scale - 0.1).detach().requires_grad_(true);
  in.B = at::randn({b, s, groups, n}).requires_grad_(true);
  in.C = at::randn({b, s, groups, n}).requires_grad_(true);
  return in;
}

TEST(MambaScanTest, ChunkedEqualsTheRecurrenceWithGradients) {
  at::manual_seed(5);
  // (sequence, chunk, groups, decay): several chunks with a padded last one and two heads per group; one chunk; one
  // group for every head with decays that underflow within a chunk.
  for (const auto& [s, chunk, groups, decay] :
       {std::tuple{37, 8, 2, 1.0}, std::tuple{13, 64, 4, 1.0}, std::tuple{40, 16, 1, 30.0}}) {
    SCOPED_TRACE("sequence " + std::to_string(s) + ", chunk " + std::to_string(chunk));
    const Inputs in = random_inputs(2, s, 4, 6, groups, 5, decay);
    const at::Tensor expected = mamba_scan_recurrent(in.x, in.dt, in.A, in.B, in.C);
    const at::Tensor got = mamba_scan(in.x, in.dt, in.A, in.B, in.C, chunk);
    ASSERT_EQ(got.sizes(), expected.sizes());
    EXPECT_LT((got - expected).abs().max().item<double>(), 1e-4 * (1 + expected.abs().max().item<double>()));
    EXPECT_GT(expected.abs().max().item<double>(), 0.1);
    const at::Tensor weights = at::randn(expected.sizes());
    const auto want = torch::autograd::grad({(expected * weights).sum()}, in.all());
    const auto have = torch::autograd::grad({(got * weights).sum()}, in.all());
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("gradient " + std::to_string(i));
      EXPECT_LT((have[i] - want[i]).abs().max().item<double>(), 1e-4 * (1 + want[i].abs().max().item<double>()));
      EXPECT_GT(want[i].abs().max().item<double>(), 0.0);
      EXPECT_FALSE(have[i].isnan().any().item<bool>());
    }
  }
}

TEST(MambaScanTest, TheFirstTwoTokensByHand) {
  // y_1 = (C_1 · B_1) dt_1 x_1; y_2 = (C_2 · B_1) e^{dt_2 A} dt_1 x_1 + (C_2 · B_2) dt_2 x_2.
  const at::Tensor x = at::tensor({3.0f, 4.0f, -1.0f, 2.0f}).view({1, 2, 1, 2});
  const at::Tensor dt = at::tensor({0.5f, 0.25f}).view({1, 2, 1}), A = at::tensor({-2.0f});
  const at::Tensor B = at::tensor({1.0f, 2.0f, 0.0f, 1.0f}).view({1, 2, 1, 2});
  const at::Tensor C = at::tensor({0.5f, -1.0f, 1.0f, 3.0f}).view({1, 2, 1, 2});
  const float decay = std::exp(0.25f * -2.0f);
  const at::Tensor y1 = at::tensor({3.0f, 4.0f}) * (0.5f * -1.5f);
  const at::Tensor y2 = at::tensor({3.0f, 4.0f}) * (0.5f * 7.0f * decay) + at::tensor({-1.0f, 2.0f}) * (0.25f * 3.0f);
  for (std::int64_t chunk : {1, 2, 8}) {
    const at::Tensor y = mamba_scan(x, dt, A, B, C, chunk);
    EXPECT_TRUE(at::allclose(y.flatten(), at::cat({y1, y2}), 1e-5, 1e-6)) << "chunk " << chunk << ": " << y;
  }
}

}  // namespace
}  // namespace trestle::train
