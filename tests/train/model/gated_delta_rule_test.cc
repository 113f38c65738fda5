// The chunked gated delta rule against its token-by-token recurrence: outputs and the gradients of q, k, v, g and
// beta, over several chunks with a padded last one, in one chunk, and with decays strong enough that e^γ underflows
// across a chunk; bf16 inputs give a bf16 output computed in fp32.
#include "train/model/gated_delta_rule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <string>
#include <vector>

namespace trestle::train {
namespace {

struct Inputs {
  at::Tensor q, k, v, g, beta;
  std::vector<at::Tensor> all() const { return {q, k, v, g, beta}; }
};

Inputs random_inputs(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t dk, std::int64_t dv,
                     double decay_scale) {
  auto unit = [](const at::Tensor& t) { return t * at::rsqrt(t.pow(2).sum(-1, true) + 1e-6); };
  Inputs in;
  in.q = (unit(at::randn({b, h, s, dk})) / std::sqrt(static_cast<double>(dk))).requires_grad_(true);
  in.k = unit(at::randn({b, h, s, dk})).requires_grad_(true);
  in.v = at::randn({b, h, s, dv}).requires_grad_(true);
  in.g = (-at::rand({b, h, s}) * decay_scale).requires_grad_(true);
  in.beta = at::rand({b, h, s}).requires_grad_(true);
  return in;
}

std::vector<at::Tensor> gradients(const at::Tensor& out, const at::Tensor& weights, const Inputs& in) {
  return torch::autograd::grad({(out * weights).sum()}, in.all());
}

TEST(GatedDeltaRuleTest, ChunkedEqualsTheRecurrenceWithGradients) {
  at::manual_seed(3);
  // (sequence, chunk, decay): several chunks and a padded last one; one chunk; decays that underflow a chunk's span.
  for (const auto& [s, chunk, decay] : {std::tuple{37, 8, 1.0}, std::tuple{13, 64, 1.0}, std::tuple{40, 16, 30.0}}) {
    SCOPED_TRACE("sequence " + std::to_string(s) + ", chunk " + std::to_string(chunk));
    const Inputs in = random_inputs(2, 3, s, 8, 6, decay);
    const at::Tensor expected = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta);
    const at::Tensor got = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, chunk);
    ASSERT_EQ(got.sizes(), expected.sizes());
    EXPECT_LT((got - expected).abs().max().item<double>(), 1e-5);
    EXPECT_GT(expected.abs().max().item<double>(), 0.1);  // not trivially zero
    const at::Tensor weights = at::randn(expected.sizes());
    const auto want = gradients(expected, weights, in), have = gradients(got, weights, in);
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("gradient " + std::to_string(i));
      EXPECT_LT((have[i] - want[i]).abs().max().item<double>(), 1e-4 * (1 + want[i].abs().max().item<double>()));
      EXPECT_GT(want[i].abs().max().item<double>(), 0.0);
      EXPECT_FALSE(have[i].isnan().any().item<bool>());
    }
  }
}

TEST(GatedDeltaRuleTest, TheFirstTokenReadsItsOwnCorrection) {
  // o_1 = β_1 (q_1 · k_1) v_1 from a zero state, whatever the decay.
  const at::Tensor q = at::tensor({1.0f, 2.0f}).view({1, 1, 1, 2}), k = at::tensor({0.5f, -1.0f}).view({1, 1, 1, 2});
  const at::Tensor v = at::tensor({3.0f, 4.0f, 5.0f}).view({1, 1, 1, 3});
  const at::Tensor g = at::full({1, 1, 1}, -0.7f), beta = at::full({1, 1, 1}, 0.25f);
  const at::Tensor o = gated_delta_rule(q, k, v, g, beta, 4);
  EXPECT_TRUE(at::allclose(o.flatten(), at::tensor({3.0f, 4.0f, 5.0f}) * (0.25f * -1.5f)));
}

TEST(GatedDeltaRuleTest, Bf16InputsGiveBf16Outputs) {
  at::manual_seed(4);
  const Inputs in = random_inputs(1, 2, 20, 4, 4, 1.0);
  const at::Tensor expected = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta);
  const at::Tensor got = gated_delta_rule(in.q.to(at::kBFloat16), in.k.to(at::kBFloat16), in.v.to(at::kBFloat16),
                                          in.g, in.beta, 8);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LT((got.to(at::kFloat) - expected).abs().max().item<double>(), 0.05);
}

}  // namespace
}  // namespace trestle::train
