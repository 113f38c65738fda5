// Causal or masked attention through LibTorch's scaled_dot_product_attention, for queries of `heads` heads and keys
// and values of `groups` heads, each group serving heads / groups consecutive query heads (Megatron's and
// transformers' order). On a GPU the groups go to the fused kernel as they are where one takes them so (enable_gqa:
// cuDNN and Flash, for 16-bit inputs, read a group's keys for each of its query heads, so no expanded copy is made or
// kept for backward); elsewhere, and for fp32 on a GPU (the memory-efficient kernel), they are expanded to every
// query head first.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace trestle::kernels {

// k or v [b, groups, s, d] with each group repeated for its query heads: [b, heads, s, d].
at::Tensor expand_groups(const at::Tensor& t, std::int64_t heads);

// q [b, heads, s, d], k and v [b, groups, s, d]; `allowed` broadcast over [b, heads, s, s] ([s, s] or [b, 1, s, s];
// true: may attend), none: causal. [b, heads, s, d].
at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& allowed, double scale);

// The backend LibTorch picks for grouped_attention's call on these inputs (an at::SDPBackend).
std::int64_t grouped_attention_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& allowed, double scale);

}  // namespace trestle::kernels
