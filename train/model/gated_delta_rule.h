// The gated delta rule of Gated DeltaNet (Yang et al., 2024; Qwen3-Next's linear attention), in LibTorch ops that
// autograd differentiates. Per head, a state S [dk, dv] starting at zero is decayed, corrected towards each value and
// read by each query:
//   S_t = exp(g_t) · S_{t-1} + k_t · u_tᵀ,  u_t = β_t · (v_t − (exp(g_t) · S_{t-1})ᵀ · k_t),  o_t = S_tᵀ · q_t.
// gated_delta_rule computes it chunk by chunk (the chunk's corrections by one unit-triangular solve, the state carried
// between chunks); gated_delta_rule_recurrent token by token, the plain reference the tests compare with.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace trestle::train {

// q, k [b, h, s, dk]; v [b, h, s, dv]; g (log decay, ≤ 0) and beta [b, h, s]. Computed in fp32; the output
// [b, h, s, dv] has v's dtype. q is used as given (callers normalise and scale it).
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, std::int64_t chunk = 64);
at::Tensor gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta);

}  // namespace trestle::train
