// Full activation recompute of one layer (torch.utils.checkpoint's reentrant form in C++): the forward runs without
// keeping activations and saves only the layer's input; the backward runs the layer forward again with autograd on
// and back-propagates through it, accumulating the parameters' gradients and returning the input's. Collectives
// inside the layer run again in the same order on every rank. The layer and context must outlive the backward. Gemma
// 4's per-layer inputs in the context are an input of the recomputed function too (their gradient returned); its KV
// sharing, which ties two layers' recomputes together, is refused before (GptModel::create).
#pragma once

#include <ATen/Tensor.h>

#include "train/model/transformer_layer.h"

namespace trestle::train {

at::Tensor recomputed_layer_forward(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context);

}  // namespace trestle::train
