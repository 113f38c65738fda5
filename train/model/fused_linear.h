// A linear layer with Megatron's gradient accumulation fusion: backward adds the weight gradient (gᵀ·x) straight into
// a main-grad buffer by one GEMM with beta = 1 (beta = 0, writing it, on the first micro-batch after the buffer was
// reset), so autograd never allocates the weight's gradient nor adds it in a second pass; then it tells the sink.
// Without a sink it is at::linear.
#pragma once

#include <ATen/Tensor.h>

#include <functional>

namespace trestle::train {

struct WeightGradSink {
  at::Tensor main_grad;                  // shaped as the weight (any floating dtype: inputs are cast to it)
  bool overwrite = false;                // the next accumulation writes main_grad instead of adding to it
  std::function<void()> on_accumulated;  // after each accumulation (the gradient buckets' readiness count)
};

// main (+)= g2ᵀ · x2 (written when `overwrite`), g2 [tokens, out] and x2 [tokens, in] of any floating dtype: on CUDA
// 16-bit inputs go into an fp32 `main` by one GEMM with fp32 accumulation (Megatron's wgrad_gemm_accum_fp32);
// elsewhere they are widened to main's dtype first. `main` may be a view (rows of the buffer).
void accumulate_weight_grad(at::Tensor& main, const at::Tensor& g2, const at::Tensor& x2, bool overwrite);

// x [..., in] · weightᵀ [in, out] (+ bias [out], whose gradient autograd takes) -> [..., out].
at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, WeightGradSink* sink,
                        const at::Tensor& bias = {});

}  // namespace trestle::train
