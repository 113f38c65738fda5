// grouped_attention: query head h reads key/value group h / (heads / groups), causal or by the mask given, against
// attention written out from its scores; on a GPU (when there is one) its grouped kernels equal the CPU's expanded
// ones, forward and gradients.
#include "kernels/grouped_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace trestle::kernels {
namespace {

// softmax(q·kᵀ·scale, masked) · v, head by head, each with its own group's keys and values.
at::Tensor written_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                       double scale) {
  const int64_t heads = q.size(1), per_group = heads / k.size(1);
  std::vector<at::Tensor> out;
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor kh = k.select(1, h / per_group), vh = v.select(1, h / per_group);
    at::Tensor scores = at::matmul(q.select(1, h), kh.transpose(-2, -1)) * scale;
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    out.push_back(at::matmul(at::softmax(scores, -1), vh));
  }
  return at::stack(out, 1);
}

struct Inputs {
  at::Tensor q, k, v;
};

// The model's layout: [seq, batch, heads or groups, dim] permuted to [batch, heads or groups, seq, dim].
Inputs random_inputs(int64_t seq, int64_t heads, int64_t groups, int64_t dim, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  auto heads_first = [](const at::Tensor& t) { return t.permute({1, 2, 0, 3}); };
  return {heads_first(at::randn({seq, 2, heads, dim}, options)), heads_first(at::randn({seq, 2, groups, dim}, options)),
          heads_first(at::randn({seq, 2, groups, dim}, options))};
}

TEST(GroupedAttentionTest, EachHeadReadsItsGroupCausallyOrByTheMask) {
  at::manual_seed(3);
  const int64_t seq = 24;
  const at::Tensor causal = at::ones({seq, seq}, at::kBool).tril();
  const at::Tensor i = at::arange(seq).unsqueeze(1), j = at::arange(seq).unsqueeze(0);
  const at::Tensor window = (j <= i).logical_and(j > i - 5);
  for (const auto& [heads, groups] : {std::pair<int64_t, int64_t>{6, 2}, {4, 4}, {8, 1}}) {
    const Inputs in = random_inputs(seq, heads, groups, 16, at::kDouble);
    EXPECT_TRUE(at::allclose(grouped_attention(in.q, in.k, in.v, std::nullopt, 0.3),
                             written_out(in.q, in.k, in.v, causal, 0.3), 1e-10, 1e-12))
        << heads << " heads, " << groups << " groups, causal";
    EXPECT_TRUE(at::allclose(grouped_attention(in.q, in.k, in.v, window, 0.3),
                             written_out(in.q, in.k, in.v, window, 0.3), 1e-10, 1e-12))
        << heads << " heads, " << groups << " groups, windowed";
  }
}

TEST(GroupedAttentionTest, ExpandGroupsRepeatsEachGroupForItsHeads) {
  const at::Tensor k = at::arange(2 * 3 * 4 * 5, at::kFloat).view({2, 3, 4, 5});
  const at::Tensor expanded = expand_groups(k, 6);
  ASSERT_EQ(expanded.sizes(), (at::IntArrayRef{2, 6, 4, 5}));
  for (int64_t h = 0; h < 6; ++h) EXPECT_TRUE(at::equal(expanded.select(1, h), k.select(1, h / 2))) << h;
}

TEST(GroupedAttentionCudaTest, GroupedKernelsEqualTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: the grouped CUDA kernels are not run";
  at::manual_seed(5);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const int64_t seq = 256;
    const Inputs cpu = random_inputs(seq, 8, 2, 64, dtype);
    const at::Tensor i = at::arange(seq).unsqueeze(1), j = at::arange(seq).unsqueeze(0);
    for (const bool windowed : {false, true}) {
      const std::optional<at::Tensor> mask =
          windowed ? std::optional<at::Tensor>((j <= i).logical_and(j > i - 32)) : std::nullopt;
      auto run = [&](const at::Device device) {
        std::vector<at::Tensor> leaves;
        for (const at::Tensor& t : {cpu.q, cpu.k, cpu.v})
          leaves.push_back(t.detach().to(at::kFloat).to(device).to(dtype).requires_grad_());
        const std::optional<at::Tensor> m = mask ? std::optional<at::Tensor>(mask->to(device)) : std::nullopt;
        const at::Tensor out = grouped_attention(leaves[0], leaves[1], leaves[2], m, 0.125);
        out.to(at::kFloat).pow(2).sum().backward();
        std::vector<at::Tensor> results{out.detach().to(at::kCPU, at::kFloat)};
        for (const at::Tensor& leaf : leaves) results.push_back(leaf.grad().to(at::kCPU, at::kFloat));
        return results;
      };
      const auto on_cpu = run(at::kCPU), on_gpu = run(at::kCUDA);
      const double tolerance = dtype == at::kFloat ? 1e-4 : 5e-2;
      const char* names[] = {"output", "dq", "dk", "dv"};
      for (std::size_t n = 0; n < on_cpu.size(); ++n) {
        const double scale = on_cpu[n].abs().max().item<double>();
        EXPECT_LE((on_gpu[n] - on_cpu[n]).abs().max().item<double>(), tolerance * scale)
            << names[n] << ", " << at::toString(dtype) << (windowed ? ", windowed" : ", causal");
      }
    }
  }
}

}  // namespace
}  // namespace trestle::kernels
