#include "train/model/recompute.h"

#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <cstdint>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename T>
std::int64_t pointer_value(const T* p) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(p));
}
template <typename T>
const T* from_value(const c10::IValue& v) {
  return reinterpret_cast<const T*>(static_cast<std::intptr_t>(v.toInt()));
}

// Gemma 4's per-layer inputs (made before the layers, read by each) are an input of their own (an empty tensor
// without: a function's inputs must be defined): the recomputed forward reads a detached copy, and its gradient goes
// back through this function's, as the layer input's does.
struct RecomputedLayer : torch::autograd::Function<RecomputedLayer> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& per_layer_inputs,
                            const TransformerLayer& layer, const LayerContext& context) {
    ctx->saved_data["layer"] = pointer_value(&layer);
    ctx->saved_data["context"] = pointer_value(&context);
    ctx->save_for_backward({x, per_layer_inputs});
    at::NoGradGuard no_grad;
    return layer.forward(x, context);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto* layer = from_value<TransformerLayer>(ctx->saved_data["layer"]);
    const auto* context = from_value<LayerContext>(ctx->saved_data["context"]);
    const auto saved = ctx->get_saved_variables();
    at::Tensor x = saved[0].detach().requires_grad_(true);
    const bool inputs = saved[1].numel() > 0;
    LayerContext again = *context;
    if (inputs) again.per_layer_inputs = saved[1].detach().requires_grad_(saved[1].requires_grad());
    at::Tensor out;
    {
      at::AutoGradMode grad_mode(true);
      out = layer->forward(x, again);
    }
    torch::autograd::backward({out}, {grad[0]});
    const at::Tensor inputs_grad = inputs && again.per_layer_inputs.requires_grad()
                                       ? again.per_layer_inputs.grad()
                                       : at::Tensor();
    return {x.grad(), inputs_grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor recomputed_layer_forward(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context) {
  // The recomputing function's output needs grad only through its input: an input that needs none (a frozen
  // embedding's output under LoRA) is made a leaf that does, or the layer's own trainable parameters would get none.
  const at::Tensor inputs =
      context.per_layer_inputs.defined() ? context.per_layer_inputs : at::empty({0}, x.options());
  if (at::GradMode::is_enabled() && !x.requires_grad())
    return RecomputedLayer::apply(x.detach().requires_grad_(true), inputs, layer, context);
  return RecomputedLayer::apply(x, inputs, layer, context);
}

}  // namespace trestle::train
