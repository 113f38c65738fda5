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

struct RecomputedLayer : torch::autograd::Function<RecomputedLayer> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TransformerLayer& layer,
                            const LayerContext& context) {
    ctx->saved_data["layer"] = pointer_value(&layer);
    ctx->saved_data["context"] = pointer_value(&context);
    ctx->save_for_backward({x});
    at::NoGradGuard no_grad;
    return layer.forward(x, context);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto* layer = from_value<TransformerLayer>(ctx->saved_data["layer"]);
    const auto* context = from_value<LayerContext>(ctx->saved_data["context"]);
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor out;
    {
      at::AutoGradMode grad_mode(true);
      out = layer->forward(x, *context);
    }
    torch::autograd::backward({out}, {grad[0]});
    return {x.grad(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor recomputed_layer_forward(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context) {
  // The recomputing function's output needs grad only through its input: an input that needs none (a frozen
  // embedding's output under LoRA) is made a leaf that does, or the layer's own trainable parameters would get none.
  if (at::GradMode::is_enabled() && !x.requires_grad())
    return RecomputedLayer::apply(x.detach().requires_grad_(true), layer, context);
  return RecomputedLayer::apply(x, layer, context);
}

}  // namespace trestle::train
