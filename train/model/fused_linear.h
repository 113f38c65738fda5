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

// x [..., in] · weightᵀ [in, out] (+ bias [out], whose gradient autograd takes) -> [..., out].
at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, WeightGradSink* sink,
                        const at::Tensor& bias = {});

}  // namespace trestle::train
