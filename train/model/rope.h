// Rotary position embedding: the inverse frequencies of a model (base, and the linear, Llama 3.1 or YaRN scaling its
// spec carries), cos/sin tables for a batch's positions (YaRN's attention factor applied to both), and the rotation of
// query and key heads (the non-interleaved "rotate half" form Megatron-Core and Hugging Face share). Frequencies and
// tables are fp32.
#pragma once

#include <ATen/Tensor.h>

#include "parallel/layout/model_spec.h"

namespace trestle::train {

// RoPE's rule on a model's heads: an even number of rotary dims, at least 2 (kv_channels x rotary_percent); models
// without RoPE (hybrid Mamba stacks) pass.
Status check_rotary_dims(const GptModelSpec& spec);

// [head_dim / 2] fp32: 1 / base^(2i / head_dim), then scaled.
at::Tensor rope_inverse_frequencies(const GptModelSpec& spec);

// Gemma 4's RoPE of heads of head_dim dims: [head_dim / 2] fp32, 1 / base^(2i / head_dim) for the first
// floor(fraction · head_dim / 2) pairs and 0 (no rotation) for the rest, as transformers' "proportional" RoPE; fraction
// 1 is plain RoPE.
at::Tensor proportional_rope_inverse_frequencies(double base, std::int64_t head_dim, double fraction);

struct RopeTables {
  at::Tensor cos;  // [seq, batch, 1, head_dim]
  at::Tensor sin;
};
// What YaRN multiplies the cos and sin tables by (transformers' attention_factor: 0.1 · ln(factor) + 1, or with
// mscale and mscale_all_dim their ratio of such terms); 1 for every other scaling.
double rope_attention_factor(const GptModelSpec& spec);
// What multi-latent attention's softmax scale is multiplied by under YaRN with mscale_all_dim (DeepSeek's
// yarn_get_mscale(factor, mscale_all_dim)²); 1 otherwise.
double yarn_softmax_scale_correction(const GptModelSpec& spec);
// positions [batch, seq] (integer) -> tables for those positions, multiplied by attention_factor.
RopeTables rope_tables(const at::Tensor& inverse_frequencies, const at::Tensor& positions,
                       double attention_factor = 1.0);

// Interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's rotary dims) laid out as evens then odds along the last dim:
// rotating that with apply_rope is the interleaved rotation, its dims in this order (a query and a key so laid out
// have the same dot product).
at::Tensor deinterleave_pairs(const at::Tensor& x);

// x [seq, batch, heads, head_dim] -> x·cos + rotate_half(x)·sin on its first rot_dim dims, rot_dim the tables' width
// (head_dim, or fewer: partial rotary, the rest unchanged), in x's dtype. `fused`: through the fused kernel
// (fused_kernels.h, fp32 arithmetic) where it takes x and the tables need no gradient; else ATen's composite
// (arithmetic in x's dtype).
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables, bool fused = false);

}  // namespace trestle::train
