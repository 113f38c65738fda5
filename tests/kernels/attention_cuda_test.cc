// Which of LibTorch's attention backends the model's attention (grouped_attention) gets on a GPU, for its layout of
// queries, keys and values (sequence-major, permuted to [batch, heads or groups, seq, dim]): causal bf16
// attention must run a fused kernel (Flash or cuDNN), windowed attention (a boolean mask) and multi-latent attention
// (two head widths) a fused one too (memory-efficient or cuDNN), never the math fallback. Prints the choices. Skipped,
// saying so, without a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "kernels/grouped_attention.h"

namespace trestle::kernels {
namespace {

std::string backend_name(int64_t choice) {
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::math:
      return "math (the unfused fallback)";
    case at::SDPBackend::flash_attention:
      return "flash";
    case at::SDPBackend::efficient_attention:
      return "memory-efficient";
    case at::SDPBackend::cudnn_attention:
      return "cuDNN";
    case at::SDPBackend::overrideable:
      return "overrideable";
    default:
      return "error (none applies)";
  }
}

// The model's inputs: q, k and v as [seq, batch, heads or groups, dim] permuted, into the model's grouped_attention.
int64_t model_choice(at::ScalarType dtype, int64_t seq, int64_t heads, int64_t groups, int64_t dim, int64_t value_dim,
                     bool windowed) {
  const int64_t batch = 2;
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  auto heads_first = [](const at::Tensor& t) { return t.permute({1, 2, 0, 3}); };
  const at::Tensor q = heads_first(at::randn({seq, batch, heads, dim}, options));
  const at::Tensor k = heads_first(at::randn({seq, batch, groups, dim}, options));
  const at::Tensor v = heads_first(at::randn({seq, batch, groups, value_dim}, options));
  std::optional<at::Tensor> mask;
  if (windowed) {  // key j visible from query i when i - 8 < j <= i, as the model builds it
    const at::Tensor i = at::arange(seq, at::TensorOptions().device(at::kCUDA)).unsqueeze(1);
    const at::Tensor j = at::arange(seq, at::TensorOptions().device(at::kCUDA)).unsqueeze(0);
    mask = (j <= i).logical_and(j > i - 8);
  }
  return grouped_attention_backend(q, k, v, mask, 1.0 / std::sqrt(static_cast<double>(dim)));
}

TEST(AttentionCudaTest, ModelAttentionRunsAFusedBackend) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: attention's CUDA backends are not run";
  struct Case {
    const char* what;
    at::ScalarType dtype;
    int64_t seq, heads, groups, dim, value_dim;
    bool windowed;
  };
  const Case cases[] = {
      {"llama-1b bf16 causal (32 heads, 4 KV, dim 64, seq 2048)", at::kBFloat16, 2048, 32, 4, 64, 64, false},
      {"bf16 causal, dim 128, seq 4096", at::kBFloat16, 4096, 16, 8, 128, 128, false},
      {"bf16 sliding window (mask)", at::kBFloat16, 2048, 32, 4, 64, 64, true},
      {"fp32 causal", at::kFloat, 1024, 8, 2, 64, 64, false},
      // DeepSeek-V3's multi-latent attention: queries and keys of 128 + 64 dims, values of 128; a fused kernel that
      // takes two widths (memory-efficient or cuDNN), not necessarily Flash.
      {"bf16 multi-latent attention (q/k dim 192, v dim 128)", at::kBFloat16, 2048, 16, 16, 192, 128, false}};
  for (const Case& c : cases) {
    const int64_t choice = model_choice(c.dtype, c.seq, c.heads, c.groups, c.dim, c.value_dim, c.windowed);
    std::printf("attention backend for %s: %s\n", c.what, backend_name(choice).c_str());
    EXPECT_NE(static_cast<at::SDPBackend>(choice), at::SDPBackend::math) << c.what;
    EXPECT_NE(static_cast<at::SDPBackend>(choice), at::SDPBackend::error) << c.what;
    if (c.dtype == at::kBFloat16 && !c.windowed && c.dim == c.value_dim) {
      const auto b = static_cast<at::SDPBackend>(choice);
      EXPECT_TRUE(b == at::SDPBackend::flash_attention || b == at::SDPBackend::cudnn_attention) << c.what;
    }
  }
}

}  // namespace
}  // namespace trestle::kernels
