#include "train/model/fused_linear.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdint>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedLinear : torch::autograd::Function<FusedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, WeightGradSink* sink) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["sink"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(sink));
    return at::linear(x, weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    auto* sink = reinterpret_cast<WeightGradSink*>(static_cast<std::intptr_t>(ctx->saved_data["sink"].toInt()));
    const at::Tensor& g = grad[0];
    at::Tensor grad_x = ctx->needs_input_grad(0) ? at::matmul(g, weight) : at::Tensor();
    at::Tensor g2 = g.reshape({-1, g.size(-1)}), x2 = x.reshape({-1, x.size(-1)});
    {
      at::NoGradGuard no_grad;
      accumulate_weight_grad(sink->main_grad, g2, x2, sink->overwrite);
    }
    sink->overwrite = false;
    if (sink->on_accumulated) sink->on_accumulated();
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void accumulate_weight_grad(at::Tensor& main, const at::Tensor& g2, const at::Tensor& x2, bool overwrite) {
  const bool mixed_gemm = g2.is_cuda() && main.scalar_type() == at::kFloat && g2.scalar_type() == x2.scalar_type() &&
                          g2.scalar_type() != at::kFloat;
  at::Tensor g = g2, x = x2;
  if (!mixed_gemm) {  // each input widened (or narrowed) to the buffer's dtype
    if (g.scalar_type() != main.scalar_type()) g = g.to(main.scalar_type());
    if (x.scalar_type() != main.scalar_type()) x = x.to(main.scalar_type());
  }
  if (mixed_gemm && overwrite) {
    at::mm_out(main, g.t(), x, at::kFloat);
  } else if (mixed_gemm) {
    at::addmm_out(main, main, g.t(), x, at::kFloat);
  } else if (overwrite) {
    at::mm_out(main, g.t(), x);
  } else {
    main.addmm_(g.t(), x);
  }
}

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, WeightGradSink* sink, const at::Tensor& bias) {
  if (sink == nullptr) return at::linear(x, weight, bias);
  at::Tensor y = FusedLinear::apply(x, weight, sink);
  return bias.defined() ? y + bias : y;
}

}  // namespace trestle::train
