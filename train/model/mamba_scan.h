// The selective state-space scan of a Mamba-2 mixer (Dao & Gu, 2024: "SSD"), in LibTorch ops that autograd
// differentiates. Per head, a state S [state, head_dim] starting at zero decays by exp(dt_t · A) and takes in each
// input scaled by its step; each output reads the state through C:
//   S_t = exp(dt_t · A) · S_{t-1} + B_t · (dt_t · x_t)ᵀ,   y_t = Sᵀ_t · C_t   (no D skip term: callers add D · x).
// mamba_scan computes it chunk by chunk (within a chunk as masked attention, the state carried between chunks);
// mamba_scan_recurrent token by token, the plain reference the tests compare with.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace trestle::train {

// x [b, s, heads, head_dim]; dt [b, s, heads] (the step, after softplus: > 0); A [heads] (< 0); B, C
// [b, s, groups, state], each group serving heads / groups consecutive heads. Computed in fp32; returns
// [b, s, heads, head_dim] fp32.
at::Tensor mamba_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                      const at::Tensor& C, std::int64_t chunk = 128);
at::Tensor mamba_scan_recurrent(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                const at::Tensor& C);

}  // namespace trestle::train
