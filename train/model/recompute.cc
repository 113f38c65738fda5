#include "train/model/recompute.h"

#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

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

using SharedKv = std::map<bool, std::pair<at::Tensor, at::Tensor>>;

// A context for the recomputed forward: `context` with its own store of shared keys and values (holding `reused`,
// the reusing layer's, where given) and `per_layer_inputs` where defined.
LayerContext context_for_recompute(const LayerContext& context, bool windowed,
                                   const std::pair<at::Tensor, at::Tensor>* reused,
                                   const at::Tensor& per_layer_inputs) {
  LayerContext again = context;
  again.shared_kv = std::make_shared<SharedKv>();
  if (reused) (*again.shared_kv)[windowed] = *reused;
  if (per_layer_inputs.defined()) again.per_layer_inputs = per_layer_inputs;
  return again;
}

at::Tensor detached_like(const at::Tensor& t) { return t.detach().requires_grad_(t.requires_grad()); }

// Inputs {x, per-layer inputs, reused keys, reused values}; outputs {out} or, for a layer whose keys and values later
// layers reuse, {out, keys, values}. What a layer does not have is an empty tensor (a function's inputs must be
// defined). Gemma 4's per-layer inputs (made before the layers, read by each) and its shared keys and values (made by
// one layer, read by later ones) are inputs and outputs of their own: the recomputed forward reads detached copies,
// and their gradients go back through this function's, as the layer input's does.
struct RecomputedLayer : torch::autograd::Function<RecomputedLayer> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& per_layer_inputs,
                               const at::Tensor& k, const at::Tensor& v, const TransformerLayer& layer,
                               const LayerContext& context) {
    ctx->saved_data["layer"] = pointer_value(&layer);
    ctx->saved_data["context"] = pointer_value(&context);
    ctx->save_for_backward({x, per_layer_inputs, k, v});
    at::NoGradGuard no_grad;
    const std::pair<at::Tensor, at::Tensor> reused{k, v};
    const LayerContext run = context_for_recompute(context, layer.windowed, k.numel() > 0 ? &reused : nullptr,
                                                   per_layer_inputs.numel() > 0 ? per_layer_inputs : at::Tensor());
    at::Tensor out = layer.forward(x, run);
    if (!layer.kv_store) return {out};
    const auto& [made_k, made_v] = run.shared_kv->at(layer.windowed);
    // Keys that are the values (Gemma 4's full-attention layers): two outputs of their own all the same.
    return {out, made_k, made_v.is_same(made_k) ? made_v.clone() : made_v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto* layer = from_value<TransformerLayer>(ctx->saved_data["layer"]);
    const auto* context = from_value<LayerContext>(ctx->saved_data["context"]);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0].detach().requires_grad_(true);
    const bool per_layer = saved[1].numel() > 0, reuses = saved[2].numel() > 0;
    const at::Tensor inputs = per_layer ? detached_like(saved[1]) : at::Tensor();
    const std::pair<at::Tensor, at::Tensor> reused =
        reuses ? std::pair{detached_like(saved[2]), detached_like(saved[3])} : std::pair<at::Tensor, at::Tensor>{};
    const LayerContext run = context_for_recompute(*context, layer->windowed, reuses ? &reused : nullptr, inputs);
    variable_list outputs, grads;
    {
      at::AutoGradMode grad_mode(true);
      outputs.push_back(layer->forward(x, run));
    }
    grads.push_back(grad[0]);
    if (layer->kv_store) {  // the gradients the reusing layers gave the stored keys and values
      const auto& [k, v] = run.shared_kv->at(layer->windowed);
      for (std::size_t i = 1; i < 3; ++i) {
        const at::Tensor& made = i == 1 ? k : v;
        if (!grad[i].defined() || !made.requires_grad()) continue;
        outputs.push_back(made);
        grads.push_back(grad[i]);
      }
    }
    torch::autograd::backward(outputs, grads);
    auto grad_of = [](const at::Tensor& t) { return t.defined() && t.requires_grad() ? t.grad() : at::Tensor(); };
    return {x.grad(), grad_of(inputs), grad_of(reused.first), grad_of(reused.second), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor recomputed_layer_forward(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context) {
  const at::Tensor none = at::empty({0}, x.options());
  const at::Tensor inputs = context.per_layer_inputs.defined() ? context.per_layer_inputs : none;
  at::Tensor k = none, v = none;
  if (layer.kv_reuse) std::tie(k, v) = context.shared_kv->at(layer.windowed);
  // The recomputing function's output needs grad only through its input: an input that needs none (a frozen
  // embedding's output under LoRA) is made a leaf that does, or the layer's own trainable parameters would get none.
  const at::Tensor in = at::GradMode::is_enabled() && !x.requires_grad() ? x.detach().requires_grad_(true) : x;
  variable_list out = RecomputedLayer::apply(in, inputs, k, v, layer, context);
  if (layer.kv_store) (*context.shared_kv)[layer.windowed] = {out[1], out[2]};
  return out[0];
}

}  // namespace trestle::train
